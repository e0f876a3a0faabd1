"""Generation: prompts in, sampled responses (and their log-probs) out, by an engine chosen
by name (``hf``, ``vllm``; `GENERATORS`); the evaluation every job runs builds on it (`shardwise.engine.evaluate`).

Used by `shardwise infer`, the held-out evaluation of every job, and the RL rollout.

The layout (``B`` rows, ``P`` prompt width, ``R`` = ``max_new_tokens``, ``T = P + R``):

- prompts (`prompt_batch` -> ``generate_sequences``): tensors ``prompt_ids`` ``(B, P)``
  int64, LEFT-padded with the pad id, and ``prompt_mask`` ``(B, P)`` int64 (1 on real
  tokens); arrays ``prompt`` (str), ``ground_truth`` (str), ``uid`` (group id, str);
  meta ``seed`` (int, sampling seed of this call) and optionally ``greedy`` (bool);
  optionally array ``sample_key`` (str, see below) and array ``row_key`` (str: a row's
  identity over the calls of a session, see below).
- sequences (``generate_sequences`` ->): the prompt part plus ``input_ids`` ``(B, T)``
  (prompt left-padded, response right-padded to exactly ``R`` with the pad id),
  ``attention_mask`` ``(B, T)``, ``position_ids`` ``(B, T)`` (=
  `shardwise.engine.infer.default_position_ids`), ``response_mask`` ``(B, T)`` int64
  (1 on generated tokens up to and including the first EOS), ``responses`` ``(B, R)``
  and ``rollout_log_probs`` ``(B, T)`` fp32 (aligned like
  `shardwise.engine.infer.compute_log_probs`, 0 outside ``response_mask``).

Generating on a sharded model: each forward of an FSDP unit normally all-gathers its
parameters, so every rank would have to run the same number of forwards. Decoding lengths
differ per rank (rows stop at EOS), so `HFGenerator` gathers every unit ONCE per call
(`shardwise.fsdp.gather.gathered_for_generation`): the forwards inside issue no collective
and each rank decodes as many steps as its own rows need. A multi-turn rollout holds one
`GenerationEngine.rollout_session` over its turns: one gather for all of them. While
gathered, HF generate skips FSDP's per-unit forward hooks, which have nothing left to do
(`shardwise.fsdp.gather.fsdp_hooks_skipped`).

Per-row seeds: when the prompts carry the array ``sample_key`` (the RL controller sets
``"{uid}/{j}"``, the j-th sample of prompt group uid; the held-out pass@k batch too), every
engine samples row i from a generator of its own seeded `row_seed` ``(meta["seed"],
sample_key[i])``: a row's tokens depend on its prompt, its key, the call's seed and the
weights, not on the rank that generates it, its position in the batch or which other rows
share the batch (up to the kernels' rounding of the logits, which a batch's shape can
change). The HF engine draws each row's token itself (`RowSampler`: temperature, top-p,
one uniform per row and step by inverse CDF); vLLM gets the row's seed as the request's
seed. Without ``sample_key`` a call is seeded per rank (`sampling_seed`), as before.

Rows that end early leave the HF engine's batch: for text prompts, greedy or seeded per
row, it decodes with a loop of its own (`HFGenerator._decode_ragged`: HF's forwards and
position ids, the model's own KV cache) that drops each row, and its cache, once it has
written its EOS; HF ``generate`` (still used for images and per-rank sampling) decodes
finished rows until the longest ends.

Multi-turn rollouts continue rows instead of re-reading them: inside a
`GenerationEngine.rollout_session` the HF engine keeps, for each row that ends (by its
``arrays["row_key"]``, a row's identity across the session's calls, else its
``sample_key``), the keys and values its tokens left in every attention layer's cache
(`preallocated_cache`: a buffer per layer, written in place). The next
turn's call for that key (its prompt: the conversation so far, the row's turn and the
tool's answer appended) forwards only what follows the longest prefix it shares with the
kept tokens, after those keys and values, instead of the whole conversation. Keys and
values depend only on the tokens before them (causal attention, the same position ids),
so the forwards see the same values up to the kernels' rounding for other shapes: the
rollout log-probs are those of the sampled tokens, as without it (the module's other
rounding caveats). Nothing is kept outside a session (the weights may change between
calls), of a row whose `RowEnd` said its conversation ends (a turn without a tool call),
or for a model with other than plain attention layers (sliding windows, linear
attention).

Rows that end early: an engine that `reports_ended_rows` takes ``on_row_end(i, tokens)``
in ``generate_sequences`` and calls it, from inside the call, as soon as row i has written
its EOS (`tokens`: its generated ids through that EOS, exactly the row's response), while
the other rows still generate; a multi-turn rollout sends that row's tool calls then. The
HF engine calls it as the row ends in its own loop (under HF ``generate``, from a stopping
criterion that never stops anything: `RowEnds`), vLLM as each request finishes. It changes
no token and no log-prob.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteriaList,
)

from shardwise.config.schema import SamplingConfig
from shardwise.data.batch import Batch
from shardwise.data.encode import encode_prompt, prompt_text
from shardwise.data.tokenizer import pad_token_id
from shardwise.distributed import ulysses
from shardwise.distributed.runtime import Runtime
from shardwise.engine.infer import default_position_ids
from shardwise.engine.kv_cache import PreallocatedLayer, preallocated_cache
from shardwise.engine.row_sampling import RowEnds, RowSampler
from shardwise.errors import ConfigError, did_you_mean
from shardwise.fsdp.gather import fsdp_hooks_skipped, gathered_for_generation
from shardwise.models import vision
from shardwise.models.vision import VisionInputs, forward_kwargs, vision_token_ids

__all__ = ["GENERATORS", "GenerationEngine", "HFGenerator", "PreallocatedLayer", "RowEnd", "RowEnds", "RowSampler", "SamplingCall", "assemble_sequences",
           "build_generator", "common_prefix", "generate_on_ranks", "left_pad", "preallocated_cache", "prompt_batch", "row_seed",
           "sample_keys", "sampling_call", "sampling_seed"]


RowEnd = Callable[[int, list[int]], "bool | None"]
"""``on_row_end(i, tokens)``: row i of a ``generate_sequences`` call wrote its EOS; `tokens`
are its generated ids through it (see the module docstring). It may return False: the
row's conversation ends there, so an engine keeps nothing of it for a later call."""


class GenerationEngine(abc.ABC):
    """Generates responses to prompts in the layout of the module docstring.

    Both methods are collective: every rank calls them, each with its own rows.
    """

    reports_ended_rows: bool = False
    """True for an engine whose ``generate_sequences(prompts, on_row_end=...)`` calls
    `on_row_end` (a `RowEnd`) for each row as soon as it wrote its EOS, while the others
    still generate (at most once per row; not for a row cut by ``max_new_tokens``)."""

    shares_model_parameters: bool = False
    """True for an engine that generates with the actor's own parameters (nothing to sync)."""
    takes_adapters: bool = False
    """True for an engine that holds a LoRA actor's base once and takes its adapters alone
    (`sync_adapter`); otherwise a LoRA actor's weights come merged through `sync_weights`."""

    @abc.abstractmethod
    def generate_sequences(self, prompts: Batch) -> Batch:
        """This rank's prompts (any number of rows, 0 included) -> their sequences.

        `prompts` holds ``prompt_ids`` / ``prompt_mask`` ``(B, P)`` int64 (left-padded),
        the arrays ``prompt``, ``ground_truth``, ``uid`` and meta ``seed`` (int) and
        optionally ``greedy`` (bool). The result keeps all of these and adds
        ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask`` ``(B, P+R)``,
        ``responses`` ``(B, R)`` int64 and ``rollout_log_probs`` ``(B, P+R)`` fp32, on CPU.
        """

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Bring the engine's weights up to date with the actor's.

        `named_tensors` yields ``(HF parameter name, full tensor)`` pairs. Engines with
        their own copy of the weights (e.g. vLLM) load them here; an engine that shares the
        trained model's parameters (`HFGenerator`) has nothing to do.
        """

    def sync_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's LoRA adapter with `named_tensors` (PEFT adapter-file names,
        full tensors); only for an engine that `takes_adapters`."""
        raise NotImplementedError(f"{type(self).__name__} takes no adapters")

    def request_session(self, greedy: bool = False) -> Any:
        """A session that takes requests one at a time and gives each back as it ends, not
        collective (`shardwise.engine.vllm_engine.RequestSession`: ``add``, ``step``,
        ``unfinished``; a context manager): what the multi-turn loop runs without a turn
        barrier. None (here): this engine generates only in ``generate_sequences`` calls."""
        return None

    def rollout_session(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the engine is called several times in a row with nothing else
        using the model between the calls (a multi-turn rollout's turns): an engine may set
        up once what each call would (`HFGenerator`: the all-gather of every unit). Collective
        on entry and exit like ``generate_sequences``: every rank enters and leaves it.
        Nothing by default."""
        return contextlib.nullcontext()

    def shutdown(self) -> None:  # noqa: B027 - optional for engines: nothing by default
        """Release what the engine holds beside the model (an engine of its own). Collective:
        every rank calls it, before the process group goes, on success paths only (a failed
        rank leaves at once, and a collective would wait for it). Nothing by default."""


def left_pad(rows: Sequence[Sequence[int]], pad: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as ``(ids, mask)`` ``(B, W)`` int64, left-padded with `pad` to the
    longest row (at least `width`, and at least 1 column), mask 1 on real tokens."""
    width = max([len(r) for r in rows] + [width or 1])
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def prompt_batch(tokenizer, records: list[dict[str, Any]], max_length: int, uids: list[str],
                 vision: VisionInputs | None = None, tools: list[dict] | None = None) -> Batch:
    """The input of `GenerationEngine.generate_sequences`: left-padded ``prompt_ids`` /
    ``prompt_mask`` and the arrays ``prompt`` (the text asked: a chat prompt as its template
    renders it), ``ground_truth`` ("" where a record has no response), ``data_source`` and
    ``extra_info`` (None where a record has none; what verl-form reward functions receive)
    and ``uid``. Prompts are tokenized like SFT prompts (at most `max_length`; chat messages
    through the tokenizer's template, `shardwise.data.encode.encode_prompt`).
    With `vision` (a VL model) each record's ``image`` becomes the prompt's image tokens
    and the row tensors ``pixel_values`` / ``image_grid_thw`` (`shardwise.models.vision`).
    `tools` (OpenAI function schemas) go to the chat template with each prompt."""
    prefix = vision.prompt_prefix if vision is not None else ()
    ids = [encode_prompt(tokenizer, r["prompt"], max_length, prefix, where=r.get("where", "prompt"), tools=tools).ids
           for r in records]
    prompt_ids, prompt_mask = left_pad(ids, pad_token_id(tokenizer))  # no records: a (0, 1) batch
    tensors = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
    if vision is not None:
        tensors.update(vision.encode_rows([r["image"] for r in records]))
    return Batch.from_dict(tensors,
                           {"prompt": [prompt_text(tokenizer, r["prompt"], r.get("where", "prompt"), tools) for r in records],
                            "ground_truth": ["" if r.get("response") is None else str(r["response"])
                                             for r in records],
                            "data_source": [r.get("data_source") for r in records],
                            "extra_info": [r.get("extra_info") for r in records],
                            "uid": uids})


def sampling_seed(seed: int, rank: int) -> int:
    """The torch seed of one rank's sampling for the call seeded `seed`: a fixed, well-mixed
    function of both (numpy's SeedSequence), so ranks draw independent streams."""
    state = np.random.SeedSequence([seed % 2**64, rank]).generate_state(1, np.uint64)[0]
    return int(state) % 2**63


def row_seed(seed: int, key: str) -> int:
    """The sampling seed of the row keyed `key` (``arrays["sample_key"]``) in the call seeded
    `seed`: a fixed, well-mixed function of both (numpy's SeedSequence over the seed and a
    64-bit BLAKE2 digest of the key), the same on every rank and in every engine."""
    digest = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
    state = np.random.SeedSequence([int(seed) % 2**64, digest]).generate_state(1, np.uint64)[0]
    return int(state) % 2**63


def sample_keys(uids: Sequence[str], n: int) -> list[str]:
    """``arrays["sample_key"]`` of a batch whose rows are `uids` each repeated `n` times
    (interleaved, `Batch.repeat`): ``"{uid}/{j}"``, j the sample's index in its group."""
    return [f"{u}/{j}" for u in uids for j in range(n)]


@dataclass
class _Kept:
    """A row's tokens that went through the model (its prompt's real ones and its turn up to,
    not including, the last token sampled) and the keys / values they left in each layer,
    ``(heads, len(ids), dim)``."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of the token sequences `a` and `b`."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _takes(model: nn.Module, name: str) -> bool:
    """Whether `model`'s forward takes the keyword `name`."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """model.eval() for the block; then every submodule's own training flag is restored."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def _own_generation_config(model: nn.Module) -> Iterator[None]:
    """HF fills every unset generation option from ``model.generation_config`` (e.g. a
    checkpoint's generation_config.json: Qwen3 ships temperature 0.6, top_k 20); with a
    blank one for the call, sampling is set by ``rl.rollout`` alone and the recorded
    log-probs describe the distribution actually sampled from."""
    previous = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = previous


@dataclass(frozen=True)
class SamplingCall:
    """What one ``generate_sequences`` call asks of an engine, read and checked once for
    every engine: the prompts, greedy or not, R and the call's seed."""

    ids: torch.Tensor
    """``(B, P)`` int64, left-padded."""
    mask: torch.Tensor
    """``(B, P)`` int64, 1 on real tokens."""
    greedy: bool
    """The engine's temperature is 0, or ``meta["greedy"]``."""
    max_new_tokens: int
    """R: ``meta["max_new_tokens"]`` or the engine's setting."""
    seed: int
    """``meta["seed"]`` (0 when greedy and absent)."""
    keys: tuple[str, ...] | None = None
    """``arrays["sample_key"]`` (one str per row) when the prompts carry it: each row then
    samples with `row_seed` ``(seed, key)``."""


def sampling_call(prompts: Batch, cfg: SamplingConfig) -> SamplingCall:
    """The prompts' layout checked and the call's settings read (ValueError naming what
    is wrong); sampling needs ``meta["seed"]``."""
    ids, mask = _check_prompts(prompts)
    greedy = cfg.temperature == 0 or bool(prompts.meta.get("greedy", False))
    if not greedy and not isinstance(prompts.meta.get("seed"), int):
        raise ValueError("generate_sequences: sampling needs meta['seed'] (an int, the seed "
                         f"of this call); got {prompts.meta.get('seed')!r}")
    keys = None
    if "sample_key" in prompts.arrays:
        keys = tuple(prompts.arrays["sample_key"].tolist())
        bad = next((k for k in keys if not isinstance(k, str)), None)
        if bad is not None:
            raise ValueError(f"generate_sequences: arrays['sample_key'] must hold one str per row; got {bad!r}")
    return SamplingCall(ids, mask, greedy, int(prompts.meta.get("max_new_tokens", cfg.max_new_tokens)),
                        int(prompts.meta.get("seed", 0)), keys)


def _check_prompts(prompts: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    for key in ("prompt_ids", "prompt_mask"):
        if key not in prompts.tensors:
            raise ValueError(f"generate_sequences: prompts have no tensor {key!r} "
                             f"(present: {sorted(prompts.tensors)}); see shardwise.rl.workers for the layout")
    ids, mask = prompts.tensors["prompt_ids"], prompts.tensors["prompt_mask"]
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"generate_sequences: prompt_ids {tuple(ids.shape)} and prompt_mask "
                         f"{tuple(mask.shape)} must both be (batch, prompt_len)")
    if len(ids):
        m = mask.bool()
        if (m[:, :-1] & ~m[:, 1:]).any():
            raise ValueError("generate_sequences: prompt_mask has padding after a real token; "
                             "prompts must be LEFT-padded")
        if not m.any(-1).all():
            raise ValueError("generate_sequences: a prompt has no real token (prompt_mask all 0)")
    return ids.long(), mask.long()


class HFGenerator(GenerationEngine):
    """Sampling with HF ``generate`` on an FSDP2 model, all units gathered once per call.

    `model` is the sharded causal LM (``TrainEngine.model`` or ``InferEngine.model``),
    shared, not copied: every call samples from its current weights. `pad_id` / `eos_id`
    are the tokenizer's.
    """

    shares_model_parameters = True
    reports_ended_rows = True

    def __init__(self, model: nn.Module, cfg: SamplingConfig, runtime: Runtime, pad_id: int, eos_id: int):
        self.model = model
        self.cfg = cfg
        self.runtime = runtime
        self.pad_id = int(pad_id)
        self.eos_id = int(eos_id)
        self.seed_rank = runtime.rank
        """The rank the sampling seed mixes in: sequence-parallel peers, which get the same
        prompts, set their group's data-parallel rank so they draw the same samples."""
        self._held = 0
        """Depth of `rollout_session` blocks: inside one, the units stay gathered."""
        self._kept: dict[str, _Kept] | None = None
        """Inside a session: each ended row's tokens and cache by its row key (module docstring)."""
        self.keep_rows = True
        """False: every turn of a session forwards its whole prompt (nothing kept)."""
        self.reused_tokens = 0
        """Prompt tokens the session's calls did not forward again (kept from an earlier turn)."""

    @contextlib.contextmanager
    def rollout_session(self) -> Iterator[None]:
        """Every unit gathered ONCE for the whole block (`gathered_for_generation`), so the
        ``generate_sequences`` calls inside (one per turn of a multi-turn rollout) all-gather
        nothing. The model's parameters must not change inside (no optimizer step)."""
        if self._held:
            yield
            return
        with gathered_for_generation(self.model):
            self._held += 1
            self._kept = {}
            try:
                yield
            finally:
                self._held -= 1
                self._kept = None

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: the engine samples with the model's own parameters. The iterable
        is not consumed, so a lazy one (gathering full tensors on demand) costs nothing."""
        del named_tensors

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch, on_row_end: RowEnd | None = None) -> Batch:
        """See `GenerationEngine.generate_sequences`; `on_row_end` (a `RowEnd`) is called
        for each row as it writes its EOS, from inside the decoding loop (`_decode_ragged`,
        or HF ``generate``'s `RowEnds`).

        Sampling follows the engine's settings: temperature (0, or ``meta["greedy"]``:
        greedy), top_p, no top-k, exactly ``max_new_tokens`` (or ``meta["max_new_tokens"]``)
        = R response columns (right-padded with the pad id after the first EOS, which is
        kept). Seeded by
        `sampling_seed` ``(meta["seed"], rank)``, or with ``arrays["sample_key"]`` row by
        row (`row_seed` ``(meta["seed"], sample_key)``, `RowSampler`; see the module
        docstring): a fixed seed gives the same output, and the global RNG state is left
        as it was.

        ``rollout_log_probs[:, t]`` is ``log softmax(logits / temperature)`` of the
        sampled token t at the step that produced it (temperature 1 when greedy), aligned
        with ``input_ids`` like `shardwise.engine.infer.compute_log_probs` and 0 outside
        ``response_mask``. Top-p truncation is not in it: it is the temperature-scaled
        model distribution, what the actor's log-prob recomputation measures.

        Collective (the all-gather of `gathered_for_generation`; none inside a
        `rollout_session`, which gathered once): every rank calls it.
        """
        call = sampling_call(prompts, self.cfg)
        ids, mask, greedy, r = call.ids, call.mask, call.greedy, call.max_new_tokens
        temperature = 1.0 if greedy else float(self.cfg.temperature)

        with contextlib.nullcontext() if self._held else gathered_for_generation(self.model):
            if len(ids):
                images = forward_kwargs(prompts.tensors)
                keys = None if greedy else call.keys
                row_keys = (tuple(str(k) for k in prompts.arrays["row_key"].tolist())
                            if "row_key" in prompts.arrays else call.keys)
                seqs, log_probs = self._generate(ids, mask, greedy, temperature, call.seed, r, images, keys,
                                                 on_row_end, row_keys)
            else:  # nothing to generate; the gather above still matched the other ranks'
                seqs = torch.empty((0, r), dtype=torch.long)
                log_probs = torch.empty((0, r), dtype=torch.float32)
        return self._assemble(prompts, ids, mask, seqs, log_probs, r)

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, greedy: bool, temperature: float,
                  seed: int, max_new_tokens: int,
                  images: dict[str, torch.Tensor] | None = None,
                  keys: Sequence[str] | None = None,
                  on_row_end: RowEnd | None = None,
                  row_keys: Sequence[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Generated tokens ``(B, L)`` (L <= R: HF stops when every row has hit EOS) and
        their log-probs ``(B, L)`` fp32 under logits / temperature, both on CPU. `images`:
        a VL prompt batch's ``pixel_values`` / ``image_grid_thw`` (`forward_kwargs`).
        `keys` (sampling only): each row drawn by `RowSampler` with `row_seed` ``(seed, key)``.
        `on_row_end`: told of each row as it ends (`RowEnds`). `row_keys`: what a session
        keeps rows by (``arrays["row_key"]``, else the sample keys), greedy or not."""
        cfg = self.cfg
        device = self.runtime.device
        # HF's default top_k=50 would truncate what the rollout claims to sample: 0 turns it off.
        # Greedy gets no sampling options (HF warns about those it would ignore); neither does
        # per-row sampling, whose RowSampler draws the token that HF then picks greedily.
        per_row = keys is not None and not greedy
        sampling = {} if greedy or per_row else {"temperature": temperature, "top_p": float(cfg.top_p), "top_k": 0}
        processors = LogitsProcessorList(
            [RowSampler([row_seed(seed, k) for k in keys], temperature, float(cfg.top_p), ids.shape[1],
                        max_new_tokens)] if per_row and keys is not None else [])
        gen_cfg = GenerationConfig(
            do_sample=not greedy and not per_row,
            **sampling,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            # A VL model never writes its vision tokens (each would call for an image).
            suppress_tokens=vision_token_ids(getattr(self.model, "config", None)) or None,
        )
        rng_devices = [torch.cuda.current_device()] if device.type == "cuda" else []
        # the units are gathered (the caller's block): FSDP's per-forward hooks have nothing
        # to do but cost every decoding step (skipped only where that changes no forward)
        hooks_off = contextlib.nullcontext() if images else fsdp_hooks_skipped(self.model)
        with torch.random.fork_rng(devices=rng_devices), _eval_mode(self.model), \
                _own_generation_config(self.model), ulysses.whole_sequences(self.model), hooks_off:
            s = sampling_seed(int(seed), self.seed_rank)
            torch.default_generator.manual_seed(s)
            if device.type == "cuda":
                torch.cuda.manual_seed(s)  # this device only: fork_rng restores only it
            if not images and (greedy or per_row) and gen_cfg.suppress_tokens is None:
                sampler = processors[0] if per_row else None
                return self._decode_ragged(ids.to(device), mask.to(device), temperature, max_new_tokens, sampler,
                                           on_row_end, row_keys)
            # HF derives position ids as cumsum(mask) - 1 (0 on left padding) and adds one per
            # step: default_position_ids of the final attention_mask, which the log-prob
            # recomputation uses.
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                generation_config=gen_cfg, synced_gpus=False, logits_processor=processors,
                stopping_criteria=StoppingCriteriaList(
                    [RowEnds(on_row_end, self.eos_id, ids.shape[1], len(ids))] if on_row_end is not None else []),
                **vision.with_token_types(self.model, ids.to(device), {k: v.to(device) for k, v in (images or {}).items()}),
            )
        p = ids.shape[1]
        gen = out.sequences[:, p:]
        steps = [F.log_softmax(logits.float() / temperature, dim=-1)
                 .gather(-1, gen[:, i:i + 1]).squeeze(-1)
                 for i, logits in enumerate(out.logits)]
        assert len(steps) == gen.shape[1], "one logits row per generated token"
        log_probs = torch.stack(steps, dim=1) if steps else gen.new_zeros(gen.shape, dtype=torch.float32)
        return gen.cpu(), log_probs.float().cpu()

    def _decode_ragged(self, ids: torch.Tensor, mask: torch.Tensor, temperature: float, max_new_tokens: int,
                       sampler: RowSampler | None, on_row_end: RowEnd | None,
                       row_keys: Sequence[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`_generate`'s tokens and log-probs for text prompts, greedy or drawn by `sampler`
        (per-row seeds), by a decoding loop of its own that drops each row from the batch
        (and from the KV cache) once it has written its EOS: HF ``generate`` decodes finished
        rows until the longest ends, which on answers of uneven length is most of its work.
        The same forwards as HF's (position ids cumsum(mask) - 1, 0 on the padding, one more
        per step; the model's own cache) on fewer rows: a row's tokens are those HF would
        pick, its log-probs equal up to the kernels' rounding for a smaller batch (the
        module docstring). A cache that cannot drop rows keeps them (their tokens are
        ignored). Inside a session, with `row_keys`, rows continue from what an earlier
        turn kept (`_prefill`) and leave their own behind as they end."""
        rows, width = ids.shape
        gen = torch.full((rows, max_new_tokens), self.pad_id, dtype=torch.long, device=ids.device)
        log_probs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=ids.device)
        live = torch.arange(rows, device=ids.device)  # the original row of each batch row
        done = torch.zeros(rows, dtype=torch.bool, device=ids.device)  # by batch row (when rows are kept)
        am = mask.clone()
        position = default_position_ids(am)  # HF's: cumsum(mask) - 1, 0 on the left padding
        uniforms = None if sampler is None else sampler.uniforms.to(ids.device)
        # the prompt's forward scores its last position only, as HF generate's does
        keep_last = {"logits_to_keep": 1} if _takes(self.model, "logits_to_keep") else {}
        # inside a session, with keys to keep rows by and a cache that can hold them: the
        # rows' real tokens (what each continues from, and what it leaves behind)
        kept = self._kept if self.keep_rows and row_keys is not None and len(row_keys) == rows else None
        cache = preallocated_cache(self.model, width + max_new_tokens) if kept is not None else None
        fed = [ids[i][mask[i].bool()] for i in range(rows)] if cache is not None else None
        if fed is not None:
            out, am, last = self._prefill(cache, fed, row_keys, max_new_tokens, keep_last)
        else:
            out = self.model(input_ids=ids, attention_mask=am, position_ids=position, use_cache=True, **keep_last)
            last = position[:, -1]
        cache = out.past_key_values
        steps = 0
        for t in range(max_new_tokens):
            logits = out.logits[:, -1, :].float()
            if sampler is None or uniforms is None:
                token = logits.argmax(-1)
            else:
                token = sampler.draw(logits, uniforms[live, t])
            token = token.masked_fill(done, self.pad_id)
            gen[live, t] = token
            log_probs[live, t] = F.log_softmax(logits / temperature, dim=-1).gather(-1, token[:, None]).squeeze(-1)
            steps = t + 1
            ended = (token == self.eos_id) & ~done
            ends = ended.nonzero().flatten().tolist() if bool(ended.any()) else []
            last_turn: set[int] = set()  # rows whose conversation ends here (`RowEnd` said so)
            if on_row_end is not None:
                for i in ends:
                    r = int(live[i])
                    if on_row_end(r, gen[r, :steps].tolist()) is False:
                        last_turn.add(i)
            if fed is not None:  # each ended row's fed tokens and their keys / values, for its next turn
                for i in ends:
                    if i in last_turn:
                        continue
                    r, cols = int(live[i]), am[i].bool()
                    kept[row_keys[r]] = _Kept(
                        fed[r].tolist() + gen[r, :t].tolist(),
                        [(layer.keys[i][:, cols], layer.values[i][:, cols]) for layer in cache.layers])
            done |= ended
            if bool(done.all()) or steps == max_new_tokens:
                break
            if bool(ended.any()):
                keep = (~done).nonzero().flatten()
                try:
                    cache.batch_select_indices(keep)
                except (AttributeError, NotImplementedError, TypeError):  # this cache keeps its rows
                    pass
                else:
                    live, token, am, last, done = live[keep], token[keep], am[keep], last[keep], done[keep]
            am = torch.cat([am, am.new_ones((len(am), 1))], dim=1)
            last = last + 1
            out = self.model(input_ids=token[:, None], attention_mask=am, position_ids=last[:, None],
                             past_key_values=cache, use_cache=True)
        return gen[:, :steps].cpu(), log_probs[:, :steps].cpu()

    def _prefill(self, cache: DynamicCache, fed: list[torch.Tensor], row_keys: Sequence[str],
                 max_new_tokens: int, keep_last: dict[str, int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The prompts' forward into `cache` (all `PreallocatedLayer`), each row after the
        longest prefix of its real tokens `fed[i]` that the session kept for its key (at
        least its last token forwarded): the kept keys / values left-padded to the longest
        kept part ``C``, the rest left-padded to ``S`` after them, the 2-D mask ``(B, C + S)``
        with both paddings 0, each token at its position in the row. Returns the model's
        output, that mask and each row's last position."""
        rows = len(fed)
        kept = self._kept or {}
        device = fed[0].device
        use = []
        for i in range(rows):
            k = kept.get(row_keys[i])
            n = 0 if k is None else min(common_prefix(k.ids, fed[i].tolist()), len(fed[i]) - 1)
            use.append((k, n))
        c = max(n for _, n in use)
        s = max(len(fed[i]) - use[i][1] for i in range(rows))
        self.reused_tokens += sum(n for _, n in use)
        for layer in cache.layers:
            layer.capacity = c + s + max_new_tokens
        past = torch.zeros((rows, c), dtype=torch.long, device=device)
        new = torch.full((rows, s), self.pad_id, dtype=torch.long, device=device)
        new_mask = torch.zeros((rows, s), dtype=torch.long, device=device)
        for i, (_, n) in enumerate(use):
            rest = fed[i][n:]
            new[i, s - len(rest):] = rest
            new_mask[i, s - len(rest):] = 1
            if n:
                past[i, c - n:] = 1
        am = torch.cat([past, new_mask], dim=1)
        position = default_position_ids(am)[:, c:]
        if c:
            for li, layer in enumerate(cache.layers):
                ref_k, ref_v = next(k.layers[li] for k, n in use if n)
                keys = ref_k.new_zeros((rows, ref_k.shape[0], c, ref_k.shape[-1]), device=device)
                values = ref_v.new_zeros((rows, ref_v.shape[0], c, ref_v.shape[-1]), device=device)
                for i, (k, n) in enumerate(use):
                    if n:
                        keys[i, :, c - n:] = k.layers[li][0][:, :n]
                        values[i, :, c - n:] = k.layers[li][1][:, :n]
                assert isinstance(layer, PreallocatedLayer)
                layer.start(keys, values)
        out = self.model(input_ids=new, attention_mask=am, position_ids=position, past_key_values=cache,
                         use_cache=True, **keep_last)
        return out, am, position[:, -1]

    def _assemble(self, prompts: Batch, ids: torch.Tensor, mask: torch.Tensor, gen: torch.Tensor,
                  gen_log_probs: torch.Tensor, r: int) -> Batch:
        """The output batch: prompt part + responses padded to exactly R columns."""
        rows = ids.shape[0]
        width = gen.shape[1]
        assert width <= r, f"generate returned {width} tokens, more than max_new_tokens={r}"
        responses = torch.full((rows, r), self.pad_id, dtype=torch.long)
        responses[:, :width] = gen
        lp = torch.zeros((rows, r), dtype=torch.float32)
        lp[:, :width] = gen_log_probs
        produced = torch.zeros((rows, r), dtype=torch.bool)
        produced[:, :width] = True
        return assemble_sequences(prompts, ids, mask, responses, lp, produced, self.pad_id, self.eos_id)


def assemble_sequences(prompts: Batch, ids: torch.Tensor, mask: torch.Tensor, responses: torch.Tensor,
                       log_probs: torch.Tensor, produced: torch.Tensor, pad_id: int, eos_id: int) -> Batch:
    """The output batch of every engine (the module docstring's layout) from the prompts
    (`ids`, `mask` ``(B, P)``) and the engine's generated tokens ``(B, R)`` with their
    log-probs, `produced` marking the positions the engine actually generated: everything
    after a row's first EOS (which is kept) becomes the pad id with log-prob 0."""
    is_eos = (responses == eos_id) & produced
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    keep = produced & ~after_eos
    responses = responses.masked_fill(~keep, pad_id)
    log_probs = log_probs.masked_fill(~keep, 0.0)

    response_mask = torch.cat([torch.zeros_like(mask), keep.long()], dim=1)
    attention_mask = torch.cat([mask, keep.long()], dim=1)
    tensors = {k: v.cpu() for k, v in prompts.tensors.items()}
    tensors.update(
        input_ids=torch.cat([ids.cpu(), responses], dim=1),
        attention_mask=attention_mask,
        position_ids=default_position_ids(attention_mask),
        response_mask=response_mask,
        responses=responses,
        rollout_log_probs=torch.cat([torch.zeros(mask.shape, dtype=torch.float32), log_probs], dim=1),
    )
    return Batch(tensors=tensors, arrays=dict(prompts.arrays), meta=copy.deepcopy(prompts.meta))


# ------------------------------------------------------------------ the registry

GENERATORS: dict[str, type[GenerationEngine] | str] = {
    "hf": HFGenerator,
    # imported when first chosen: it imports this module, and vLLM only when an engine starts
    "vllm": "shardwise.engine.vllm_engine:VLLMGenerator",
}
"""Generation engines by the name ``rl.rollout.engine`` / ``infer.engine`` gives (a class,
or ``"module:Class"`` imported when first chosen)."""


def build_generator(name: str, model: nn.Module, sampling: SamplingConfig, runtime: Runtime, pad_id: int,
                    eos_id: int, key: str = "rl.rollout.engine",
                    compute_dtype: str | None = None) -> GenerationEngine:
    """The engine called `name` over `model` (the sharded causal LM it generates with, or
    whose weights it keeps a copy of). `compute_dtype` (the trainer's
    ``fsdp.mixed_precision.param_dtype``) is what ``vllm.dtype: auto`` becomes, so the
    engine samples at the precision the actor scores its log-probs in."""
    if name not in GENERATORS:
        raise ConfigError(key, f"{name!r} is not an available generation engine",
                          did_you_mean(name, GENERATORS) or "use hf")
    engine = GENERATORS[name]
    if isinstance(engine, str):
        module, _, cls = engine.partition(":")
        engine = GENERATORS[name] = getattr(importlib.import_module(module), cls)
    if sampling.vllm.dtype == "auto" and compute_dtype is not None:
        sampling = sampling.model_copy(update={"vllm": sampling.vllm.model_copy(update={"dtype": compute_dtype})})
    return engine(model, sampling, runtime, pad_id, eos_id)


# ------------------------------------------------------------------ on ranks, and scoring


def generate_on_ranks(generator: GenerationEngine, prompts: Batch) -> Batch:
    """Generate `prompts` (the same batch on every rank) with each data-parallel rank taking
    a contiguous slice of the rows; every rank returns all sequences, in row order.
    Collective over the default process group."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    per = -(-len(prompts) // world)
    mine = prompts[min(len(prompts), rank * per):min(len(prompts), (rank + 1) * per)]
    out = generator.generate_sequences(mine)
    if world == 1:
        return out
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, out.to_bytes())  # bytes of our own processes (safetensors + JSON)
    batches = [Batch.from_bytes(p) for p in parts]
    return Batch.concat([b for b in batches if len(b)]) if any(len(b) for b in batches) else out


PromptBatchFn = Callable[[list[dict[str, Any]], list[str]], Batch]
"""(records, uids) -> the prompt batch of those records (default: `prompt_batch`; a
multi-turn rollout's prompts are rendered with the tools, `shardwise.agents.loop`)."""
