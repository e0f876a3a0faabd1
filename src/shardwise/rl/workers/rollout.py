"""Rollout: sampling responses for a batch of prompts (the ``generate_sequences`` role).

`RolloutEngine` is the interface the controller drives; `HFRollout` implements it with HF
``generate`` on the actor's own FSDP2-sharded model, so it always samples from the current
weights (there is no second copy to keep in sync).

Generation on a sharded model: each forward of an FSDP unit normally all-gathers its
parameters, so every rank would have to run the same number of forwards. Decoding lengths
differ per rank (rows stop at EOS), so `gathered_for_generation` all-gathers every unit
ONCE up front and keeps the parameters unsharded while generating: the forwards inside
issue no collective and each rank decodes as many steps as its own rows need.

The output follows the rollout batch layout of `shardwise.rl.workers`.
"""

from __future__ import annotations

import abc
import contextlib
import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardwise.config.schema import RolloutConfig
from shardwise.distributed.runtime import Runtime
from shardwise.engine.infer import default_position_ids
from shardwise.rl.batch import Batch

__all__ = ["HFRollout", "RolloutEngine", "gathered_for_generation", "prompt_batch", "sampling_seed"]


class RolloutEngine(abc.ABC):
    """Generates responses to prompts; see `shardwise.rl.workers` for the batch layout.

    Both methods are collective: every rank calls them, each with its own rows.
    """

    shares_actor_parameters: bool = False
    """True for an engine that generates with the actor's own parameters (nothing to sync)."""

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
        their own copy of the weights (e.g. vLLM, a later issue) load them here; an engine
        that shares the actor's parameters (`HFRollout`) has nothing to do.
        """


def prompt_batch(tokenizer, records: list[dict[str, Any]], max_length: int, uids: list[str]) -> Batch:
    """The input of `RolloutEngine.generate_sequences`: left-padded ``prompt_ids`` /
    ``prompt_mask`` and the arrays ``prompt``, ``ground_truth`` ("" where a record has no
    response) and ``uid``. Prompts are tokenized like SFT prompts (at most `max_length`)."""
    from shardwise.data.collate import tokenize_prompt

    ids = [tokenize_prompt(tokenizer, r["prompt"], max_length) for r in records]
    width = max((len(x) for x in ids), default=1)  # no records: a (0, 1) batch
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        prompt_ids[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
        prompt_mask[i, width - len(x):] = 1
    return Batch.from_dict({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask},
                           {"prompt": [r["prompt"] for r in records],
                            "ground_truth": ["" if r.get("response") is None else str(r["response"])
                                             for r in records],
                            "uid": uids})


# ------------------------------------------------------------------ FSDP2 gathering


@dataclass
class _SavedReshard:
    """One FSDP state's reshard-after-forward setting, as torch stores it."""

    state: Any  # torch's FSDPState (private type)
    auto: bool | None
    """``FSDPState._auto_reshard_after_forward``: True when fully_shard got no explicit
    value, so the root's lazy init turns resharding off for the root."""
    post_forward: list[Any]
    """Per param group ``post_forward_mesh_info``: None (keep after forward), the group's
    own mesh info (reshard, ``True``) or a smaller mesh (an int setting)."""
    was_root: bool | None
    """``FSDPState._is_root``: None until the first forward's lazy init."""


def _fsdp_states(model: nn.Module) -> list[tuple[FSDPModule, Any]]:
    """(module, state) per distinct FSDP state under `model`, in module order.

    A grouped ``fully_shard([a, b])`` gives one state for several modules; it appears once.
    """
    out: list[tuple[FSDPModule, Any]] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                out.append((module, state))
    return out


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module) -> Iterator[None]:
    """Keep every FSDP unit of `model` unsharded for the duration of the block.

    Collective on entry: each unit all-gathers its parameters once (all ranks must enter,
    also a rank with nothing to generate). Inside, forwards issue no collective, so ranks
    may run different numbers of them (each its own decoding steps). Use it for forward-only
    work (under ``torch.no_grad()``); a backward inside is not supported. The full
    parameters of every unit are held at once: memory per rank is the whole model in the
    units' compute dtype (``fsdp.mixed_precision.param_dtype``).

    On exit (no collective) every unit is resharded and its reshard-after-forward setting
    restored exactly as it was (bool, int, and the root's own False), including the case
    where the model's first forward, and so torch's lazy root set-up, ran inside.
    `model` is the root of the FSDP tree (e.g. ``TrainEngine.model``).
    """
    states = _fsdp_states(model)
    saved = [
        _SavedReshard(state=state, auto=state._auto_reshard_after_forward,
                      post_forward=[g.post_forward_mesh_info for g in state._fsdp_param_groups],
                      was_root=state._is_root)
        for _, state in states
    ]
    try:
        # Unshard before turning resharding off: a unit left "sharded post forward" (an int
        # setting, after a no-grad forward) all-gathers over the mesh in post_forward_mesh_info.
        for module, _ in states:
            module.unshard()
        for module, _ in states:
            # Forwards now find their unit unsharded (no all-gather) and keep it (no free).
            module.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for module, _ in states:
            module.reshard()  # outside forward: frees the full parameters, no collective
        for s in saved:
            s.state._auto_reshard_after_forward = s.auto
            for group, info in zip(s.state._fsdp_param_groups, s.post_forward, strict=True):
                group.post_forward_mesh_info = info
            if s.was_root is None and s.state._is_root and s.auto:
                # The first forward ran inside the block, where resharding was off, so torch's
                # lazy init skipped its one change: an automatic root keeps its parameters.
                for group in s.state._fsdp_param_groups:
                    group.post_forward_mesh_info = None


# ------------------------------------------------------------------ HF generate


def sampling_seed(seed: int, rank: int) -> int:
    """The torch seed of one rank's sampling for the call seeded `seed`: a fixed, well-mixed
    function of both (numpy's SeedSequence), so ranks draw independent streams."""
    state = np.random.SeedSequence([seed % 2**64, rank]).generate_state(1, np.uint64)[0]
    return int(state) % 2**63


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
    from transformers import GenerationConfig

    previous = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = previous


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


class HFRollout(RolloutEngine):
    """Sampling with HF ``generate`` on the actor's FSDP2 model, all units gathered once.

    `model` is the actor's sharded causal LM (``TrainEngine.model``), shared, not copied:
    every call samples from its current weights. `pad_id` / `eos_id` are the tokenizer's.
    """

    shares_actor_parameters = True

    def __init__(self, model: nn.Module, cfg: RolloutConfig, runtime: Runtime, pad_id: int, eos_id: int):
        self.model = model
        self.cfg = cfg
        self.runtime = runtime
        self.pad_id = int(pad_id)
        self.eos_id = int(eos_id)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: the engine samples with the actor's own parameters. The iterable
        is not consumed, so a lazy one (gathering full tensors on demand) costs nothing."""
        del named_tensors

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch) -> Batch:
        """See `RolloutEngine.generate_sequences`.

        Sampling follows ``rl.rollout``: temperature (0, or ``meta["greedy"]``: greedy),
        top_p, no top-k, exactly ``max_new_tokens`` = R response columns (right-padded
        with the pad id after the first EOS, which is kept). Seeded by
        `sampling_seed` ``(meta["seed"], rank)``: a fixed seed gives the same output, and
        the global RNG state is left as it was.

        ``rollout_log_probs[:, t]`` is ``log softmax(logits / temperature)`` of the
        sampled token t at the step that produced it (temperature 1 when greedy), aligned
        with ``input_ids`` like `shardwise.engine.infer.compute_log_probs` and 0 outside
        ``response_mask``. Top-p truncation is not in it: it is the temperature-scaled
        model distribution, what the actor's log-prob recomputation measures.

        Collective (the all-gather of `gathered_for_generation`): every rank calls it.
        """
        ids, mask = _check_prompts(prompts)
        cfg = self.cfg
        greedy = cfg.temperature == 0 or bool(prompts.meta.get("greedy", False))
        if not greedy and not isinstance(prompts.meta.get("seed"), int):
            raise ValueError("generate_sequences: sampling needs meta['seed'] (an int, the seed "
                             f"of this call); got {prompts.meta.get('seed')!r}")
        rows, r = len(ids), cfg.max_new_tokens
        temperature = 1.0 if greedy else float(cfg.temperature)

        with gathered_for_generation(self.model):
            if rows:
                seqs, log_probs = self._generate(ids, mask, greedy, temperature,
                                                 prompts.meta.get("seed", 0))
            else:  # nothing to generate; the gather above still matched the other ranks'
                seqs = torch.empty((0, r), dtype=torch.long)
                log_probs = torch.empty((0, r), dtype=torch.float32)
        return self._assemble(prompts, ids, mask, seqs, log_probs)

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, greedy: bool, temperature: float,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Generated tokens ``(B, L)`` (L <= R: HF stops when every row has hit EOS) and
        their log-probs ``(B, L)`` fp32 under logits / temperature, both on CPU."""
        from transformers import GenerationConfig

        cfg = self.cfg
        device = self.runtime.device
        # HF's default top_k=50 would truncate what the rollout claims to sample: 0 turns it off.
        # Greedy gets no sampling options (HF warns about those it would ignore).
        sampling = {} if greedy else {"temperature": temperature, "top_p": float(cfg.top_p), "top_k": 0}
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            **sampling,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
        rng_devices = [torch.cuda.current_device()] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), _eval_mode(self.model), \
                _own_generation_config(self.model):
            s = sampling_seed(int(seed), self.runtime.rank)
            torch.default_generator.manual_seed(s)
            if device.type == "cuda":
                torch.cuda.manual_seed(s)  # this device only: fork_rng restores only it
            # HF derives position ids as cumsum(mask) - 1 (0 on left padding) and adds one per
            # step: default_position_ids of the final attention_mask, which the log-prob
            # recomputation uses.
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                generation_config=gen_cfg, synced_gpus=False,
            )
        p = ids.shape[1]
        gen = out.sequences[:, p:]
        steps = [F.log_softmax(logits.float() / temperature, dim=-1)
                 .gather(-1, gen[:, i:i + 1]).squeeze(-1)
                 for i, logits in enumerate(out.logits)]
        assert len(steps) == gen.shape[1], "one logits row per generated token"
        log_probs = torch.stack(steps, dim=1) if steps else gen.new_zeros(gen.shape, dtype=torch.float32)
        return gen.cpu(), log_probs.float().cpu()

    def _assemble(self, prompts: Batch, ids: torch.Tensor, mask: torch.Tensor, gen: torch.Tensor,
                  gen_log_probs: torch.Tensor) -> Batch:
        """The output batch: prompt part + responses padded to exactly R columns."""
        rows, r = ids.shape[0], self.cfg.max_new_tokens
        width = gen.shape[1]
        assert width <= r, f"generate returned {width} tokens, more than max_new_tokens={r}"
        responses = torch.full((rows, r), self.pad_id, dtype=torch.long)
        responses[:, :width] = gen
        lp = torch.zeros((rows, r), dtype=torch.float32)
        lp[:, :width] = gen_log_probs
        produced = torch.zeros((rows, r), dtype=torch.bool)
        produced[:, :width] = True
        is_eos = (responses == self.eos_id) & produced
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
        keep = produced & ~after_eos
        responses = responses.masked_fill(~keep, self.pad_id)
        lp = lp.masked_fill(~keep, 0.0)

        response_mask = torch.cat([torch.zeros_like(mask), keep.long()], dim=1)
        attention_mask = torch.cat([mask, keep.long()], dim=1)
        tensors = {k: v.cpu() for k, v in prompts.tensors.items()}
        tensors.update(
            input_ids=torch.cat([ids.cpu(), responses], dim=1),
            attention_mask=attention_mask,
            position_ids=default_position_ids(attention_mask),
            response_mask=response_mask,
            responses=responses,
            rollout_log_probs=torch.cat([torch.zeros(mask.shape, dtype=torch.float32), lp], dim=1),
        )
        return Batch(tensors=tensors, arrays=dict(prompts.arrays), meta=copy.deepcopy(prompts.meta))
