"""Rewards: a rule-based function over decoded text, or a reward model's score.

- `resolve_reward_fn` turns ``rl.reward.function`` (``builtin:NAME`` or
  ``module:function``) into a ``(prompt, response, ground_truth) -> float`` callable,
  by import and attribute lookup only (never eval).
- `score_sequences` decodes each row's response and puts the function's score on the
  last response token (``token_level_scores``, the layout of `shardwise.rl.workers`).
- `RewardModelWorker` scores rows with a sharded sequence-classification model
  (``rl.reward.model``): the head's output at the last real token of each row.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from shardwise.config.schema import Config
from shardwise.data.tasks import BUILTIN_PREFIX, BUILTIN_TASKS, get_builtin_task
from shardwise.distributed.runtime import Runtime
from shardwise.engine.infer import (
    InferEngine,
    default_position_ids,
    forward_by_micro_batch,
)
from shardwise.errors import ConfigError, ShardwiseError, did_you_mean
from shardwise.models.loading import load_hf_config
from shardwise.rl.batch import Batch

__all__ = ["RewardFn", "RewardFunctionError", "RewardModelWorker", "decode_responses", "resolve_reward_fn",
           "score_sequences"]

RewardFn = Callable[[str, str, str], float]
"""``(prompt, response_text, ground_truth) -> reward``."""

_KEY = "rl.reward.function"
_FORMS = "builtin:NAME or module:function (e.g. builtin:arithmetic or my_rewards:score)"


class RewardFunctionError(ShardwiseError, RuntimeError):
    """A reward function raised, or returned something that is not a finite number."""


# ---------------------------------------------------------------------- resolving


def resolve_reward_fn(spec: str, key: str = _KEY) -> RewardFn:
    """The reward function named by `spec` (the value of config key `key`, by default
    ``rl.reward.function``).

    - ``builtin:NAME``: the scorer of the built-in task NAME (`shardwise.data.tasks`);
    - ``module:function``: ``function`` (a dotted attribute path is allowed, e.g.
      ``mod:Scorer.score``) of ``module``, imported with the current working directory
      and ``PYTHONPATH``'s entries on ``sys.path`` for the duration of the import.

    Raises ConfigError on `key` for a malformed spec, an unknown
    builtin, a module that is missing or fails to import, a missing attribute (with the
    nearest names) and a value that is not callable with three arguments.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(key, f"{spec!r} names no reward function", f"use {_FORMS}")
    spec = spec.strip()
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_TASKS:
            raise ConfigError(key, f"unknown built-in task {name!r}",
                              did_you_mean(name, BUILTIN_TASKS, prefix=BUILTIN_PREFIX))
        return get_builtin_task(name).score
    module_name, _, attr_path = spec.partition(":")
    if not (_dotted_name(module_name) and _dotted_name(attr_path)):
        raise ConfigError(key, f"{spec!r} is not of the form {_FORMS}", "write module:function, with a dotted "
                          "module path and a function name, or builtin:NAME")
    module = _import(module_name, key)
    obj: object = module
    for i, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            owner = module_name + "".join(f".{p}" for p in attr_path.split(".")[:i])
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(key, f"{owner} has no attribute {part!r}",
                              did_you_mean(part, names) or f"define {part}(prompt, response, ground_truth)")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(key, f"{spec} is a {type(obj).__name__}, not a function",
                          "point it at a function (prompt, response, ground_truth) -> float")
    try:
        inspect.signature(obj).bind("", "", "")
    except TypeError as e:
        raise ConfigError(key, f"{spec} cannot be called with (prompt, response, ground_truth): {e}",
                          "give it the signature (prompt: str, response: str, ground_truth: str) -> float") from None
    except ValueError:  # no signature to inspect (some builtins): find out at call time
        pass
    return obj  # type: ignore[return-value]


def _dotted_name(text: str) -> bool:
    """``a`` or ``a.b.c`` of Python identifiers (so no code, no second colon)."""
    return bool(text) and all(part.isidentifier() for part in text.split("."))


@contextlib.contextmanager
def _import_path() -> Iterator[None]:
    """The working directory and PYTHONPATH's entries on sys.path, removed again after."""
    wanted = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    added = [p for p in dict.fromkeys(wanted) if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


def _import(module_name: str, key: str):
    with _import_path():
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                raise ConfigError(key, f"no module named {missing!r} (looked in the working directory "
                                  f"{os.getcwd()!r}, PYTHONPATH and the installed packages)",
                                  f"run from the folder that holds {module_name.split('.')[0]}.py, or add "
                                  "that folder to PYTHONPATH") from None
            raise ConfigError(key, f"importing {module_name!r} failed: {e}",
                              "install what the module imports") from e
        except Exception as e:  # the module's own code raised while being imported
            raise ConfigError(key, f"importing {module_name!r} failed: {type(e).__name__}: {e}",
                              "fix the module so that it imports cleanly") from e


# ---------------------------------------------------------------------- scoring text


def _describe(fn: Callable) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


def _short(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _call(fn: RewardFn, prompt: str, response: str, truth: str, row: int) -> float:
    where = f"row {row} (prompt {_short(prompt)})"
    try:
        value = fn(prompt, response, truth)
    except Exception as e:
        raise RewardFunctionError(f"reward function {_describe(fn)} raised {type(e).__name__}: {e} on {where}, "
                                  f"response {_short(response)}") from e
    if not isinstance(value, numbers.Real):  # bool and numpy scalars included
        hint = " (convert it with .item())" if hasattr(value, "item") else ""
        raise RewardFunctionError(f"reward function {_describe(fn)} returned {type(value).__name__} "
                                  f"{_short(repr(value))} on {where}; it must return a float{hint}")
    value = float(value)
    if not math.isfinite(value):
        raise RewardFunctionError(f"reward function {_describe(fn)} returned {value} on {where}; "
                                  "rewards must be finite")
    return value


def decode_responses(batch: Batch, tokenizer) -> tuple[list[str], list[int | None]]:
    """Each row's response text and the column of its last response token (None for a
    row without one). The text is the ``response_mask`` tokens of ``input_ids`` up to (not
    including) the first EOS, decoded without special tokens."""
    ids = batch.tensors["input_ids"].cpu()
    mask = batch.tensors["response_mask"].cpu().bool()
    if mask.shape != ids.shape:
        raise ValueError(f"response_mask {tuple(mask.shape)} must have the shape of input_ids {tuple(ids.shape)}")
    eos = tokenizer.eos_token_id
    token_lists, last = [], []
    for row in range(ids.shape[0]):
        where = mask[row].nonzero().flatten()
        tokens = ids[row, where].tolist()
        if eos is not None and eos in tokens:
            tokens = tokens[:tokens.index(eos)]
        token_lists.append(tokens)
        last.append(int(where[-1]) if len(where) else None)
    texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True) if token_lists else []
    return texts, last


def score_sequences(batch: Batch, tokenizer, fn: RewardFn) -> Batch:
    """Score each row's response text with `fn`; not collective (any rows, any process).

    `batch`: ``input_ids`` and ``response_mask`` ``(B, T)``, arrays ``prompt`` and
    ``ground_truth`` (str). The response text is the row's ``response_mask`` tokens up
    to (not including) the first EOS, decoded with `tokenizer` without special tokens;
    ``fn(prompt, response_text, ground_truth)`` must return a finite real number.

    Returns a batch with tensor ``token_level_scores`` ``(B, T)`` fp32 (the row's score
    at its last response token, 0 elsewhere), array ``response_text`` and
    ``meta["metrics"]``: "reward/score_mean", "reward/score_min", "reward/score_max" over
    all rows, and "reward/empty_responses", the rows without a response token (scored,
    but their score has no token to sit on). Raises `RewardFunctionError` naming the
    function and the row's prompt when `fn` raises or returns a non-finite or
    non-number value.
    """
    data = batch.select(tensor_keys=["input_ids", "response_mask"], array_keys=["prompt", "ground_truth"],
                        meta_keys=[])
    ids = data.tensors["input_ids"]
    texts, last = decode_responses(data, tokenizer)
    prompts, truths = data.arrays["prompt"], data.arrays["ground_truth"]
    scores = torch.zeros(ids.shape, dtype=torch.float32)
    row_scores = []
    for row, text in enumerate(texts):
        s = _call(fn, str(prompts[row]), text, str(truths[row]), row)
        row_scores.append(s)
        if last[row] is not None:
            scores[row, last[row]] = s
    metrics: dict[str, float] = {"reward/empty_responses": float(sum(p is None for p in last))}
    if row_scores:
        metrics |= {"reward/score_mean": sum(row_scores) / len(row_scores),
                    "reward/score_min": min(row_scores), "reward/score_max": max(row_scores)}
    return Batch.from_dict(tensors={"token_level_scores": scores.to(batch.tensors["input_ids"].device)},
                           arrays={"response_text": texts}, meta={"metrics": metrics})


# ---------------------------------------------------------------------- reward model


class RewardModelWorker:
    """A sharded sequence-classification model (one output) over ``rl.reward.model``.

    Built like the InferEngine of the actor's config with ``model.path`` replaced by
    ``rl.reward.model`` (``model.config``, ``model.tokenizer`` and ``model.freeze`` of the
    actor do not apply). Collective: every rank calls `compute_rm_score` with its rows.
    """

    def __init__(self, cfg: Config, runtime: Runtime):
        path = cfg.rl.reward.model
        if path is None:
            raise ConfigError("rl.reward.model", "no reward model given",
                              "set it to a local folder written by save_pretrained of a sequence-classification model")
        if not (Path(path) / "config.json").is_file():
            raise ConfigError("rl.reward.model", f"{path!r} holds no config.json",
                              "point it at a folder written by save_pretrained of a sequence-classification model")
        model = cfg.model.model_copy(update={"path": path, "config": None, "tokenizer": None, "freeze": []})
        rm_cfg = cfg.model_copy(update={"model": model})
        # HF's sequence-classification forward refuses batches without a pad id; its own
        # pooling (rightmost non-pad id) is not used (see compute_rm_score).
        pad = load_hf_config(model).get_text_config().pad_token_id
        self.cfg = rm_cfg
        self.runtime = runtime
        self.engine = InferEngine(rm_cfg, runtime, task="sequence_classification", num_labels=1,
                                  pad_token_id=0 if pad is None else pad)
        head = getattr(self.engine.model, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ConfigError("rl.reward.model", f"{path!r} loads as {type(self.engine.model).__name__}, "
                              "which has no `score` head", "use a decoder model with a *ForSequenceClassification class")
        self._head = head

    @torch.no_grad()
    def compute_rm_score(self, batch: Batch) -> Batch:
        """Scores of this rank's rows: tensor ``rm_scores`` ``(B,)`` fp32.

        `batch`: ``input_ids``, ``attention_mask`` (and ``position_ids``, else
        `default_position_ids`) ``(B, T)``; every row needs a real token. The score is
        the head's output at the row's last real token (the last 1 of
        ``attention_mask``), whatever padding surrounds it. HF's own pooling takes the
        rightmost token whose id differs from the pad id, which is the wrong token when
        a real token has the pad id (tokenizers with pad == eos), so the per-token head
        output is read instead. ``train.micro_batch_size`` rows per forward.
        """
        keys = ["input_ids", "attention_mask"] + (["position_ids"] if "position_ids" in batch.tensors else [])
        data = batch.select(tensor_keys=keys, array_keys=[], meta_keys=[])
        ids, mask = data.tensors["input_ids"], data.tensors["attention_mask"]
        if ids.dim() != 2 or mask.shape != ids.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be "
                             "(batch, seq)")
        real = mask.bool()
        if real.numel() and not real.any(-1).all():
            raise ValueError(f"rows {(~real.any(-1)).nonzero().flatten().tolist()} have no real token "
                             "(attention_mask all 0)")
        self.engine.model.eval()

        def run(ids, mask, pos):
            last = mask.shape[1] - 1 - mask.bool().flip(-1).int().argmax(-1)  # the last 1 of each row
            per_token = self._per_token(ids, mask, pos)
            return {"rm_scores": per_token.gather(1, last[:, None])}

        scores = forward_by_micro_batch(run, ids, mask, data.tensors.get("position_ids"),
                                        self.cfg.train.micro_batch_size, self.runtime.device)["rm_scores"]
        return Batch(tensors={"rm_scores": scores[:, 0]})

    def _per_token(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """The head's output at every position, ``(b, T)`` fp32 (read by a forward hook on
        the head, since the model returns only its pooled output)."""
        seen: list[torch.Tensor] = []
        handle = self._head.register_forward_hook(lambda _mod, _args, out: seen.append(out))
        try:
            self.engine.model(input_ids=ids, attention_mask=mask,
                              position_ids=default_position_ids(mask) if pos is None else pos, use_cache=False)
        finally:
            handle.remove()
        assert len(seen) == 1, f"the score head ran {len(seen)} times in one forward"
        return seen[0][..., 0].float()
