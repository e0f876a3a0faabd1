"""The plan's communication figures (`shardwise.fsdp.comm`) equal the bytes FSDP2 and
Ulysses move in a real run: 4 gloo ranks train one step of each named configuration
with torch.distributed's collectives wrapped, and every call of the step is counted by
kind and by the module that issued it.

The counted functions are the ones torch 2.13's FSDP2 calls
(`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`: `dist.all_gather_single`,
`dist.reduce_scatter_single`, and `dist.all_reduce` for HSDP) and Ulysses'
`dist.all_to_all`; a call from any other module must be one of the engine's scalars.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from dist.common import make_global_batch, micro_batches_of
from dist.launcher import run_ranks

from shardwise.config import load_config
from shardwise.config.validate import check_sft_batch, mesh_spec
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.comm import KINDS, step_comm

WORLD = 4
# Odd sizes on purpose: vocab 66 and intermediate 70 rows do not split over 4 ranks, so
# FSDP pads them (to 68 and 72 rows) and the padding is part of what is compared.
BASE = ["model.config={model_type: qwen3, hidden_size: 32, intermediate_size: 70, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, vocab_size: 66, "
        "max_position_embeddings: 64, tie_word_embeddings: false}",
        "train.micro_batch_size=2", "train.global_batch_size=8", "data.max_length=12"]
SEQ = 12  # make_global_batch's rows: every row data.max_length tokens, as the plan assumes

CONFIGS: dict[str, list[str]] = {
    "full_shard": [],
    "shard_grad_op": ["parallel.sharding_strategy=shard_grad_op"],
    "reshard_int_2": ["fsdp.reshard_after_forward=2"],
    "hsdp_2x2": ["parallel.fsdp_size=2"],
    "fp32_lm_head": ["fsdp.module_precision={lm_head: fp32}"],
    "accumulation_2": ["train.global_batch_size=16"],
    # layer 0 and the embeddings frozen: layer 0's output needs no gradient, so its
    # backward (all-gather included) never runs and it reduces nothing
    "frozen_first_layer": ["model.freeze=[model.embed_tokens, model.layers.0]"],
    # only lm_head trains: no layer runs backward; the root's implicit prefetch still
    # all-gathers the last layer, never the first
    "frozen_all_but_head": ["model.freeze=[model.embed_tokens, model.layers, model.norm]"],
    "no_shard": ["parallel.sharding_strategy=no_shard"],
    # adapters (fp32 in a bf16-storage model) train, the base weights are frozen: the
    # layers gather base + adapters in bf16 and reduce only the adapters
    "lora": ["model.dtype=bf16", "model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8",
             "model.lora.target_modules=[q_proj, v_proj]"],
    "ulysses_2_recompute": ["parallel.ulysses_size=2", "fsdp.recompute.modules=[model.layers.{*}]"],
    "offload_fp32": ["fsdp.offload.enabled=true", "fsdp.mixed_precision.param_dtype=fp32"],
}

_COUNTED = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
            "all_reduce": "all_reduce", "all_to_all": "all_to_all"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buffer_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """The full buffer of one call: all-gather output, reduce-scatter input, the
    all-reduce tensor, the all-to-all's input chunks."""
    if name == "all_gather_single":
        return _nbytes(kwargs.get("output_tensor", args[0] if args else None))
    if name == "reduce_scatter_single":
        return _nbytes(kwargs["input"] if "input" in kwargs else args[1])
    if name == "all_reduce":
        return _nbytes(kwargs.get("tensor", args[0] if args else None))
    inputs = kwargs.get("input_tensor_list", args[1] if len(args) > 1 else None)
    return sum(_nbytes(t) for t in inputs)


@contextlib.contextmanager
def counting(log: list[tuple[str, str, int]]) -> Iterator[None]:
    """Append (kind, calling module, buffer bytes) for every call of the counted functions."""
    saved = {name: getattr(dist, name) for name in _COUNTED}

    def wrapped(name, fn):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "?")
            log.append((_COUNTED[name], caller, _buffer_bytes(name, args, kwargs)))
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrapped(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def count_steps(rank: int, world: int, configs: dict[str, list[str]]) -> dict:
    """Rank body: for each config, a TrainEngine, one warm-up step, then one counted step.
    Returns {name: {"fsdp": {kind: bytes}, "other": [(kind, module, bytes)]}}."""
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    out = {}
    for name, overrides in configs.items():
        cfg = load_config(None, [*BASE, *overrides])
        engine = TrainEngine(cfg, runtime)
        micro = cfg.train.micro_batch_size
        log: list[tuple[str, str, int]] = []
        for step in range(2):
            rows = make_global_batch(step, cfg.train.global_batch_size, seq=SEQ)
            mbs = micro_batches_of(rows, engine.dp_rank, engine.dp_size, micro)
            tokens = int(sum((r["labels"] != -100).sum() for r in rows))
            with counting(log) if step == 1 else contextlib.nullcontext():
                engine.train_step(mbs, tokens)
        ours = {k: 0 for k in KINDS}
        other = []
        for kind, module, nbytes in log:
            if module.startswith("torch.distributed.fsdp") or module == "shardwise.distributed.ulysses":
                ours[kind] += nbytes
            else:
                other.append((kind, module, nbytes))
        out[name] = {"fsdp": ours, "other": other}
        del engine
    teardown()
    return out


def planned(overrides: list[str]) -> dict[str, int]:
    cfg = load_config(None, [*BASE, *overrides])
    spec = mesh_spec(cfg.parallel, WORLD)
    model, plan = plan_for(cfg, spec)
    comm = step_comm(model, plan, spec, accumulation=check_sft_batch(cfg.train, spec.dp_size),
                     micro_batch_size=cfg.train.micro_batch_size, max_length=cfg.data.max_length, gpus_per_node=8)
    return comm.bytes_per_step()


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_ranks(count_steps, WORLD, CONFIGS, timeout=240)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_bytes_equal_measured_bytes(measured: list[dict], name: str) -> None:
    want = planned(CONFIGS[name])
    for rank, got in enumerate(measured):
        assert got[name]["fsdp"] == want, f"rank {rank}: measured {got[name]['fsdp']} != planned {want}"
    # nothing else moved but the engine's scalars (loss: 8 bytes, squared grad norm: 4)
    for got in measured:
        assert all(n <= 8 and module == "shardwise.engine.train" for _, module, n in got[name]["other"]), \
            got[name]["other"]
    # the row exercises what it names
    if name == "hsdp_2x2":
        assert want["all_reduce"] > 0
    if name.startswith("ulysses"):
        assert want["all_to_all"] > 0
