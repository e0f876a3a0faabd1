"""Vision-language models (Qwen2.5-VL, Qwen3-VL): images in, text out.

A VL model is an HF causal LM with an image encoder (the vision tower) in front of its
language model. shardwise trains and samples one image per example:

- The image is read from a local file named in the record (``data.image_key``, a path
  relative to the data file) or, for a built-in task, made in memory; it is resized to a
  square of ``data.image_size`` pixels and turned into patches by the model's own image
  processor (transformers' PIL Qwen2-VL processor, built locally from the model's vision
  config: patch size, merge size, temporal patch size). Every image of a job has the same
  size, so its patches are one row-aligned tensor: ``pixel_values`` ``(B, N, D)`` fp32
  and ``image_grid_thw`` ``(B, 3)`` int64 ride in batches like any other per-row tensor.
- The prompt becomes ``[bos] <vision_start> <image_pad> x n <vision_end> prompt``, the ids
  taken from the model's config (``vision_start_token_id``, ``image_token_id``,
  ``vision_end_token_id``); n = N / merge_size^2. The image tokens take no loss.
- Forward: `forward_kwargs` flattens the patches to the ``(B * N, D)`` the model takes,
  and position ids are left to the model (its 3-D rotary positions come from the image
  grid and the attention mask).
- Every forward of a sharded VL model must run its vision units, or the ranks' parameter
  all-gathers would not pair: a throw-away pass (a rank with fewer micro-batches) carries
  a one-token image too (`dummy_image`).

The vision tower's units do not cast their floating inputs to the compute dtype by
default (``fsdp.mixed_precision.cast_vision_inputs``, seed 001's "vision encoder disables
cast_forward_inputs"): its rotary cos / sin stay fp32.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from shardwise.data.tokenizer import BUILTIN_VOCAB_SIZE, CHAR_VOCAB, CHAR_VOCAB_SIZE, ROLE_TOKENS
from shardwise.errors import ConfigError, DataError

__all__ = [
    "VisionInputs",
    "dummy_image",
    "forward_kwargs",
    "is_vision_language",
    "resolve_images",
    "vision_token_ids",
    "vision_tower_path",
    "vl_config",
    "with_token_types",
]

IMAGE_KEYS = ("pixel_values", "image_grid_thw")
"""The per-row batch tensors of a VL batch."""

_TOKEN_KEYS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def is_vision_language(hf_config) -> bool:
    """True for a config with a vision tower and an image token (Qwen2-VL family)."""
    return getattr(hf_config, "vision_config", None) is not None and getattr(hf_config, "image_token_id", None) is not None


def vl_config(model: nn.Module):
    """The HF config of `model` when it is a vision-language model (its forwards carry
    images, and throw-away passes a `dummy_image`); None otherwise."""
    config = getattr(model, "config", None)
    return config if config is not None and is_vision_language(config) else None


def vision_token_ids(hf_config) -> list[int]:
    """The ids of a VL config's vision tokens (start, image, end, and video if any); [] for a
    text model. Generation suppresses them: a generated image token would need an image."""
    if hf_config is None or not is_vision_language(hf_config):
        return []
    keys = (*_TOKEN_KEYS, "video_token_id")
    return sorted({int(getattr(hf_config, k)) for k in keys if getattr(hf_config, k, None) is not None})


def vision_tower_path(model: nn.Module) -> str | None:
    """The module path of the model's vision tower (``model.visual`` for Qwen2.5-VL), or None."""
    for prefix, owner in (("model.", getattr(model, "model", None)), ("", model)):
        if owner is None:
            continue
        for name in _TOWER_NAMES:
            if isinstance(getattr(owner, name, None), nn.Module):
                return prefix + name
    return None


def forward_kwargs(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image arguments of a VL forward from a batch's row-aligned tensors: the
    ``(B, N, D)`` patches flattened to ``(B * N, D)`` and the ``(B, 3)`` grid; {} for a
    text batch."""
    if "pixel_values" not in tensors:
        return {}
    pv = tensors["pixel_values"]
    return {"pixel_values": pv.reshape(-1, pv.shape[-1]), "image_grid_thw": tensors["image_grid_thw"]}


def with_token_types(model: nn.Module, input_ids: torch.Tensor, images: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`images` plus ``mm_token_type_ids`` (1 at the image tokens of `input_ids`, else 0),
    which Qwen3-VL needs to place its 3-D rotary positions (what its processor returns
    beside ``input_ids``); `images` unchanged when empty."""
    if not images:
        return images
    image_id = int(model.config.image_token_id)
    return {**images, "mm_token_type_ids": (input_ids == image_id).to(torch.int32)}


def dummy_image(hf_config, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Inputs of a throw-away forward of a VL model: one row of `seq` tokens (at least 1)
    whose first token is the image token, and one black image of the smallest grid (one
    merged patch). Runs every vision unit, as the real rows on the other ranks do."""
    v = hf_config.vision_config
    m, p, t = v.spatial_merge_size, v.patch_size, v.temporal_patch_size
    c = getattr(v, "in_channels", getattr(v, "in_chans", 3))
    ids = torch.zeros((1, max(seq, 1)), dtype=torch.long, device=device)
    ids[0, 0] = int(hf_config.image_token_id)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.zeros((m * m, c * t * p * p), dtype=torch.float32, device=device),
            "image_grid_thw": torch.tensor([[1, m, m]], dtype=torch.long, device=device),
            "mm_token_type_ids": (ids == int(hf_config.image_token_id)).to(torch.int32)}


def _check_size(size: int, unit: int) -> None:
    if size % unit:
        raise ConfigError("data.image_size", f"{size} pixels is not a multiple of patch_size x spatial_merge_size "
                          f"= {unit}", f"use {max(unit, round(size / unit) * unit)}")


@dataclass
class VisionInputs:
    """Images -> patches and prompt tokens for one VL model at one image size."""

    hf_config: Any
    image_size: int

    def __post_init__(self) -> None:

        v = self.hf_config.vision_config
        self.merge = int(v.spatial_merge_size)
        _check_size(self.image_size, int(v.patch_size) * self.merge)
        area = self.image_size * self.image_size
        self.processor = Qwen2VLImageProcessorPil(
            patch_size=int(v.patch_size), merge_size=self.merge, temporal_patch_size=int(v.temporal_patch_size),
            size={"shortest_edge": area, "longest_edge": area})
        side = self.image_size // int(v.patch_size)
        self.patches = side * side
        self.tokens = self.patches // (self.merge * self.merge)
        start, image, end = (int(getattr(self.hf_config, k)) for k in _TOKEN_KEYS)
        self.prompt_prefix = [start] + [image] * self.tokens + [end]
        """The tokens standing for one image in a prompt."""

    def check_tokenizer(self, tokenizer) -> None:
        """The config's vision token ids must fit the embedding and must not be ordinary
        tokens of `tokenizer` (None: the built-in character tokenizer a job builds, whose
        ids below `BUILTIN_VOCAB_SIZE` are all characters, its special tokens or its role
        markers)."""
        vocab = int(self.hf_config.get_text_config().vocab_size)
        size = BUILTIN_VOCAB_SIZE if tokenizer is None else len(tokenizer)
        special = set() if tokenizer is None else (set(getattr(tokenizer, "all_special_ids", []))
                                                   | set(getattr(tokenizer, "added_tokens_decoder", {})))
        names = {i: t for t, i in CHAR_VOCAB.items()} | {CHAR_VOCAB_SIZE + i: t for i, t in enumerate(ROLE_TOKENS)}
        for key in _TOKEN_KEYS:
            tid = int(getattr(self.hf_config, key))
            if tid >= vocab:
                raise ConfigError(f"model.config.{key}", f"{tid} is outside the vocabulary ({vocab} tokens)",
                                  f"use an id in [{size}, {vocab})")
            if tid < size and tid not in special:
                token = names[tid] if tokenizer is None else tokenizer.convert_ids_to_tokens(tid)
                raise ConfigError(f"model.config.{key}", f"{tid} is the tokenizer's token {token!r}, not a vision "
                                  "token", f"use an id past the tokenizer's {size} tokens (below {vocab}), or "
                                  "the tokenizer's own vision token")

    def encode(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One image (a PIL image or a file path) -> patches ``(N, D)`` fp32 and grid ``(3,)``."""
        img = _open(image).convert("RGB").resize((self.image_size, self.image_size))
        out = self.processor(images=[img], return_tensors="pt")
        pv, grid = out["pixel_values"].float(), out["image_grid_thw"][0].long()
        assert pv.shape[0] == self.patches, (pv.shape, self.patches)
        return pv, grid

    def encode_rows(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """``pixel_values`` ``(B, N, D)`` and ``image_grid_thw`` ``(B, 3)`` of one image per row."""
        if not images:
            v = self.hf_config.vision_config
            d = 3 * int(v.temporal_patch_size) * int(v.patch_size) ** 2
            return {"pixel_values": torch.zeros((0, self.patches, d)), "image_grid_thw": torch.zeros((0, 3), dtype=torch.long)}
        pairs = [self.encode(im) for im in images]
        return {"pixel_values": torch.stack([p for p, _ in pairs]), "image_grid_thw": torch.stack([g for _, g in pairs])}

    def save(self, folder: str | Path) -> None:
        """The image processor's preprocessor_config.json, so the folder loads with it."""
        self.processor.save_pretrained(str(folder))


MAX_IMAGE_PIXELS = 89_478_485
"""The largest image shardwise decodes (PIL's own bomb limit; a 20000 x 20000 PNG is 400 M)."""


def _readable_image(path: Path) -> str | None:
    """Why `path` cannot be read as an image without decoding it (None: it can): only a
    regular file is opened (a FIFO would block the job), and its header's size must stay
    within `MAX_IMAGE_PIXELS` (a decompression bomb)."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    try:
        with Image.open(path) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                return f"{w} x {h} pixels, more than the {MAX_IMAGE_PIXELS:,} shardwise decodes"
            im.verify()
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _open(image: Any):
    if isinstance(image, Image.Image):
        return image
    problem = _readable_image(Path(image))
    if problem is not None:
        raise DataError(f"cannot read image {str(image)!r}: {problem}")
    try:
        with Image.open(image) as im:
            im.load()
            return im.copy()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read image {str(image)!r}: {e}") from None


def resolve_images(records: list[dict[str, Any]], key: str, source: str) -> None:
    """Every record's image (``records[i][key]``): a path relative to the data file's folder
    is made absolute, and each file is opened once (its header), so a missing or broken
    image is a one-line error before any process starts. In-memory images (built-in tasks)
    are left as they are. Raises ConfigError on ``data.image_key``."""
    base = Path(source).parent
    for i, r in enumerate(records):
        value = r.get(key)
        if value is None:
            raise ConfigError("data.image_key", f"record {i} of {source!r} has no {key!r} (a VL model needs one "
                              "image per example)", f"add {key!r} to every record, or set data.image_key")
        if isinstance(value, Image.Image):
            continue
        if not isinstance(value, str):
            raise ConfigError("data.image_key", f"record {i}'s {key!r} is a {type(value).__name__}, not a path",
                              "write the image file's path, relative to the data file")
        path = Path(value) if Path(value).is_absolute() else base / value
        problem = _readable_image(path)
        if problem is not None:
            raise ConfigError("data.image_key", f"record {i}'s image {str(path)!r} cannot be read ({problem})",
                              "point it at a PNG / JPEG file")
        r[key] = str(path)
