"""InferEngine (fsdp2_infer): forward-only passes of the sharded model, and the per-token
log-probability computation every engine shares (`compute_log_probs`).

The log-prob convention (used by the InferEngine, the RL actor on the TrainEngine's model,
the reference policy and the losses; one function computes it):

- A row is one full sequence, ``input_ids`` ``(batch, seq)`` int64 = prompt + response.
  Padding may sit on either side: left-padded prompts (what batched generation produces)
  followed by right-padded responses, i.e. ``[pad* prompt response pad*]``, or plain right
  padding. ``attention_mask`` ``(batch, seq)`` is 1 on real tokens and 0 on padding.
- Position ids default to the count of real tokens before each token,
  ``clamp(cumsum(attention_mask) - 1, min=0)``, so a real token gets the same position
  (and the same log-prob) wherever the padding puts it. Pass ``position_ids`` explicitly
  for other layouts (e.g. packed rows).
- ``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` for ``t >= 1``: the
  output is aligned with ``input_ids`` (same shape, ``(batch, seq)``, fp32), so a mask
  aligned with ``input_ids`` (``response_mask``, 1 on response tokens) selects response
  tokens directly. Position 0 has no prediction and is 0.
- ``entropy[:, t]`` is the entropy (nats) of the predictive distribution at the step that
  produced token ``t``, i.e. of ``softmax(logits[:, t - 1])``; ``entropy[:, 0] = 0``.
- `InferEngine.log_probs` sets both to exactly 0 where ``response_mask`` is 0 (by
  selection, not multiplication, so a NaN at a padded position cannot leak through).
- With ``chunk_tokens`` (``train.chunked_loss``) the same numbers come from the LM head
  run over chunks of tokens (`shardwise.models.chunked_head`): the ``(batch, seq, vocab)``
  logits are never formed, in forward or backward; only the order of fp32 sums differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.config.schema import Config
from shardwise.config.validate import mesh_spec
from shardwise.data.collate import IGNORE_INDEX
from shardwise.distributed import ulysses
from shardwise.distributed.mesh import build_mesh
from shardwise.distributed.runtime import Runtime
from shardwise.engine import packing
from shardwise.engine.losses import loss_chunk_tokens
from shardwise.fsdp.build import build_sharded_model
from shardwise.fsdp.plan import ShardingPlan
from shardwise.models import chunked_head, vision

log = logging.getLogger(__name__)

__all__ = ["InferEngine", "compute_log_probs", "default_position_ids", "forward_by_micro_batch",
           "log_probs_from_logits"]


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row: ``(batch, seq)`` int64.

    Left padding gets position 0 (it is masked anyway); the first real token is 0.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def log_probs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor,
                          with_entropy: bool = False) -> dict[str, torch.Tensor]:
    """Next-token log-probs (and entropies) from logits, aligned with `input_ids`.

    logits ``(batch, seq, vocab)`` any float dtype, input_ids ``(batch, seq)`` int64.
    Returns ``log_probs`` ``(batch, seq)`` fp32 with ``log_probs[:, t] = log
    softmax(logits[:, t - 1])[input_ids[:, t]]`` and ``log_probs[:, 0] = 0``; with
    `with_entropy`, ``entropy`` ``(batch, seq)`` fp32 in nats, ``entropy[:, 0] = 0``.
    Differentiable. Computed in fp32 without materialising a second ``(batch, seq, vocab)``
    log-softmax tensor (logsumexp + gather).
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)} "
                         "(expected (batch, seq, vocab) and (batch, seq))")
    pred = logits[:, :-1, :].float()
    lse = torch.logsumexp(pred, dim=-1)
    target = pred.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = {"log_probs": F.pad(target - lse, (1, 0))}
    if with_entropy:
        # entr(p) = -p ln p, and 0 at p = 0 (a -inf logit gives no NaN).
        entropy = torch.special.entr(torch.softmax(pred, dim=-1)).sum(-1)
        out["entropy"] = F.pad(entropy, (1, 0))
    return out


def compute_log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None,
                      with_entropy: bool = False, temperature: float = 1.0,
                      chunk_tokens: int | None = None, layout: str = "padded", sp_group=None,
                      **images: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward of `model` and its per-token log-probs, in the module's convention.

    input_ids, attention_mask ``(batch, seq)`` on the model's compute device; position_ids
    default to `default_position_ids(attention_mask)`. Returns ``log_probs`` (and
    ``entropy`` with `with_entropy`), ``(batch, seq)`` fp32, aligned with input_ids, 0 at
    position 0, NOT masked (callers apply their response mask). Runs under whatever grad
    mode the caller set: the RL actor calls it with grad on the TrainEngine's model; the
    InferEngine under ``torch.no_grad()``. `temperature` divides the logits first: the RL
    roles score sequences under the distribution the rollout sampled from.

    `chunk_tokens` (see `shardwise.engine.losses.loss_chunk_tokens`): None computes the
    full logits and `log_probs_from_logits`; a number runs the LM head, the log-softmax and
    the entropy over chunks of that many tokens (all rows together), recomputed in
    backward, so no ``(batch, seq, vocab)`` tensor is formed. Same contract, same values
    up to the order of fp32 sums.

    `images`: a VL batch's ``pixel_values`` / ``image_grid_thw``
    (`shardwise.models.vision.forward_kwargs`); the model then derives its own (3-D)
    positions and `position_ids` is not used.

    `layout` (`shardwise.engine.packing`): "padded" runs the rows as they are; "packed"
    runs their real tokens as one row (``rl.packing``), "compact" each row's real tokens
    right-padded to the longest (token-budget micro-batches); both give the results back
    in the rows' layout, 0 on padding. Text rows only.

    `sp_group` (``parallel.ulysses_size`` > 1, the model's attention routed through Ulysses):
    the packed rows are split over the sequence-parallel group, each rank running its slice
    (`shardwise.distributed.ulysses.packed_forward`); every rank of the group gets the whole
    result. Collective over the group; packed layout only.
    """
    if sp_group is not None:
        if layout != "packed" or images:
            raise ValueError("compute_log_probs: Ulysses sequence parallel runs packed text rows only")
        lay = packing.compact(input_ids, attention_mask, position_ids, packed=True)
        res = ulysses.packed_forward(model, lay.input_ids, lay.position_ids, sp_group,
                                     _next_token_terms(with_entropy, temperature, chunk_tokens))
        # position t's terms are of the token it predicts (t + 1): align them with input_ids
        return {k: lay.unpack(F.pad(v[:, :-1], (1, 0))) for k, v in res.items()}
    if layout != "padded":
        if images:
            raise ValueError(f"compute_log_probs: layout {layout!r} takes text rows only, not images")
        lay = packing.compact(input_ids, attention_mask, position_ids, packed=layout == "packed")
        res = compute_log_probs(model, lay.input_ids, lay.attention_mask, lay.position_ids, with_entropy,
                                temperature, chunk_tokens)
        return {k: lay.unpack(v) for k, v in res.items()}
    if images:
        position_ids = None
        if "mm_token_type_ids" not in images:
            images = vision.with_token_types(model, input_ids, images)
    elif position_ids is None:
        position_ids = default_position_ids(attention_mask)
    pos = {} if position_ids is None else {"position_ids": position_ids}
    if chunk_tokens is not None:
        # position t predicts input_ids[t + 1]; the last position predicts nothing
        targets = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)
        res = chunked_head.per_token_log_probs(model, targets, chunk_tokens, temperature=temperature,
                                               with_entropy=with_entropy, input_ids=input_ids,
                                               attention_mask=attention_mask, **pos, **images)
        return {k: F.pad(v[:, :-1], (1, 0)) for k, v in res.items()}
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **pos, **images)
    logits = out.logits if temperature == 1.0 else out.logits / temperature
    return log_probs_from_logits(logits, input_ids, with_entropy)


def _next_token_terms(with_entropy: bool, temperature: float, chunk_tokens: int | None):
    """``fn(model, ids, pos, targets)`` for `ulysses.packed_forward`: the log-prob of each
    position's target (0 where it is -100) and, `with_entropy`, the entropy of its
    distribution, at `temperature`, full logits or the chunked head."""
    def fn(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        if chunk_tokens is not None:
            return chunked_head.per_token_log_probs(model, targets, chunk_tokens, temperature=temperature,
                                                    with_entropy=with_entropy, input_ids=ids, position_ids=pos)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        pred = (logits if temperature == 1.0 else logits / temperature).float()
        lse = torch.logsumexp(pred, dim=-1)
        picked = pred.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        out = {"log_probs": (picked - lse).masked_fill(targets == IGNORE_INDEX, 0.0)}
        if with_entropy:
            out["entropy"] = torch.special.entr(torch.softmax(pred, dim=-1)).sum(-1)
        return out
    return fn


class InferEngine:
    """The sharded model, built like the TrainEngine's (same plan, same weights), in eval
    mode and without an optimizer; every call runs under ``torch.no_grad()``.

    Inputs are this rank's rows (``(batch, seq)`` int64 tensors on any device); results come
    back on the device of `input_ids`. Every call is collective: all ranks of the mesh call
    it, each with its own rows (their numbers may differ, zero included).
    """

    def __init__(self, cfg: Config, runtime: Runtime, task: str = "causal_lm",
                 planned: tuple[nn.Module, ShardingPlan] | None = None, **config_extra):
        """`planned`: the meta model and plan a job's prepare step built for this config
        (see `shardwise.fsdp.build.build_sharded_model`)."""
        self.cfg = cfg
        self.runtime = runtime
        self.task = task
        self.spec = mesh_spec(cfg.parallel, runtime.world_size)
        self.mesh = build_mesh(self.spec, runtime.device.type)
        self.model, self.plan = build_sharded_model(cfg, runtime, self.spec, self.mesh, task, planned,
                                                    **config_extra)
        # Ulysses: `log_probs` splits packed rows over the sequence-parallel group
        self.sp_group = None
        if self.spec.ulysses > 1:
            self.sp_group = ulysses.sp_group(self.spec.ulysses, runtime.device.type)
            ulysses.enable(self.model, self.sp_group)
        self.model.eval()
        # `log_probs` runs the LM head over chunks of this many tokens (train.chunked_loss);
        # None: full logits. Other tasks (a reward head) have no LM head to chunk.
        self.chunk_tokens = loss_chunk_tokens(cfg.train.chunked_loss) if task == "causal_lm" else None
        if self.chunk_tokens is not None:
            chunked_head.check_model(self.model)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor | None = None,
               micro_batch_size: int | None = None) -> torch.Tensor:
        """The model's logits, ``(batch, seq, vocab)`` fp32.

        position_ids default to `default_position_ids(attention_mask)`.
        """
        if self.sp_group is not None:
            raise ValueError("InferEngine.logits does not split sequences (Ulysses); use log_probs")

        def run(ids, mask, pos):
            if pos is None:
                pos = default_position_ids(mask)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
            return {"logits": out.logits.float()}

        self.model.eval()
        return forward_by_micro_batch(run, input_ids, attention_mask, position_ids, micro_batch_size,
                                      self.runtime.device)["logits"]

    @torch.no_grad()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                  micro_batch_size: int | None = None, with_entropy: bool = False,
                  position_ids: torch.Tensor | None = None, layout: str = "padded",
                  max_tokens_per_micro_batch: int | None = None) -> dict[str, torch.Tensor]:
        """Per-token log-probs of the response tokens (see the module docstring).

        input_ids, attention_mask, response_mask ``(batch, seq)``; response_mask is 1 on
        response tokens, aligned with input_ids, never on position 0 or on padding.
        Returns ``{"log_probs": (batch, seq) fp32}`` plus ``"entropy"`` with
        `with_entropy`; both exactly 0 where response_mask is 0. Rows are run
        `micro_batch_size` at a time (default: all at once); the result is the same.
        With ``train.chunked_loss`` the LM head runs over chunks of tokens (`compute_log_probs`).
        `layout` "packed" runs each micro-batch's real tokens as one row, "compact" each
        row's right-padded to the micro-batch's longest (`shardwise.engine.packing`);
        `max_tokens_per_micro_batch` makes the micro-batches by a token budget instead of
        a row count (the rows' order is kept in the result). Same results either way up
        to the order of fp32 sums.
        """
        if response_mask.shape != input_ids.shape:
            raise ValueError(f"response_mask {tuple(response_mask.shape)} must have the shape of "
                             f"input_ids {tuple(input_ids.shape)}")
        keep = response_mask.bool()
        if keep.numel() and keep[:, 0].any():
            raise ValueError("response_mask marks position 0, which no token predicts; a response "
                             "needs at least one prompt token (e.g. <bos>) before it")
        if (keep & ~attention_mask.bool()).any():
            raise ValueError("response_mask marks padding (attention_mask == 0)")

        if layout not in packing.LAYOUTS:
            raise ValueError(f"layout must be one of {packing.LAYOUTS}, got {layout!r}")
        if self.sp_group is not None and layout != "packed":
            raise ValueError("InferEngine.log_probs: under Ulysses sequence parallel the rows run packed "
                             "(layout='packed')")

        def run(ids, mask, pos):
            return compute_log_probs(self.model, ids, mask, pos, with_entropy, chunk_tokens=self.chunk_tokens,
                                     layout=layout, sp_group=self.sp_group)

        self.model.eval()
        groups = None
        if max_tokens_per_micro_batch is not None:
            groups = packing.micro_batch_rows(attention_mask.sum(-1).tolist(), 1, max_tokens_per_micro_batch,
                                              layout == "packed", "max_tokens_per_micro_batch")
        out = forward_by_micro_batch(run, input_ids, attention_mask, position_ids, micro_batch_size,
                                     self.runtime.device, groups=groups)
        drop = ~keep.to(out["log_probs"].device)
        return {k: v.masked_fill(drop, 0.0) for k, v in out.items()}


def forward_by_micro_batch(fn: Callable[..., dict[str, torch.Tensor]], input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
                           micro_batch_size: int | None, device: torch.device,
                           images: dict[str, torch.Tensor] | None = None,
                           vl_config=None, groups: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Run `fn(ids, mask, pos)` (one forward of a sharded model, returning ``(rows, ...)``
    tensors) over micro-batches of rows and put the results back in the rows' order.
    Collective: every rank runs the same number of forwards (each forward all-gathers
    parameters), padding with a throw-away one-row forward where it has fewer micro-batches
    than the busiest rank, so ranks may hold different numbers of rows, zero included.
    Results come back on the device of `input_ids`.

    The micro-batches: `groups` (the rows of each, by index, every row in exactly one:
    `shardwise.engine.packing.micro_batch_rows`, e.g. by a token budget), else runs of
    `micro_batch_size` rows, else (None) all rows in one forward with no agreement between
    ranks. A throw-away forward takes one row of the rows' width (one as long as this
    rank's longest real row with `groups`, which keep within a budget).

    VL models: `images` holds the rows' ``pixel_values`` ``(B, N, D)`` and
    ``image_grid_thw`` ``(B, 3)``; each micro-batch's go to `fn` as keyword arguments,
    flattened (`shardwise.models.vision.forward_kwargs`), and with `vl_config` (the model's
    HF config) a throw-away forward carries a one-token image (`vision.dummy_image`)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have the shape of "
                         f"input_ids {tuple(input_ids.shape)}")
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must have the shape of "
                         f"input_ids {tuple(input_ids.shape)}")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
    rows, seq = input_ids.shape
    dummy_len = seq
    if groups is not None:
        if sorted(i for g in groups for i in g) != list(range(rows)):
            raise ValueError(f"forward_by_micro_batch: groups {groups} do not hold each of the {rows} rows once")
        dummy_len = int(attention_mask.sum(-1).max()) if rows else 1
    elif micro_batch_size is not None:
        groups = [list(range(i, min(i + micro_batch_size, rows))) for i in range(0, rows, micro_batch_size)]
    n_local = len(groups) if groups is not None else int(rows > 0)
    # every rank's rows empty: still one (throw-away) forward, for shapes
    n_all = max(agreed_count(n_local, device) if groups is not None else 1, 1)

    chunks: list[dict[str, torch.Tensor]] = []
    template = None
    for i in range(n_all):
        if i < n_local:
            index = (torch.tensor(groups[i], dtype=torch.long, device=input_ids.device) if groups is not None
                     else slice(None))
            pos = position_ids[index].to(device) if position_ids is not None else None
            extra = vision.forward_kwargs({k: v[index].to(device) for k, v in (images or {}).items()})
            chunks.append(fn(input_ids[index].to(device), attention_mask[index].to(device), pos, **extra))
        elif vl_config is not None:
            d = vision.dummy_image(vl_config, seq, device)
            template = fn(d.pop("input_ids"), d.pop("attention_mask"), None, **d)
        else:
            dummy = torch.zeros((1, max(dummy_len, 1)), dtype=torch.long, device=device)
            template = fn(dummy, torch.ones_like(dummy), None)
    if not chunks:
        assert template is not None
        return {k: v.new_zeros((0, seq, *v.shape[2:])).to(input_ids.device) for k, v in template.items()}
    out = {k: torch.cat([c[k] for c in chunks]).to(input_ids.device) for k in chunks[0]}
    if groups is None:
        return out
    back = torch.empty(rows, dtype=torch.long)
    back[torch.tensor([i for g in groups for i in g], dtype=torch.long)] = torch.arange(rows)
    return {k: v[back.to(v.device)] for k, v in out.items()}


def agreed_count(n_local: int, device: torch.device) -> int:
    """The most of `n_local` over all ranks (one all-reduce): how many forwards each runs."""
    n = torch.tensor(n_local, dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n)
