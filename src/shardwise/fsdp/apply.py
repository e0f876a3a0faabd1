"""Execute a ShardingPlan: the only place that calls `fully_shard`.

`apply_plan` is the recipe, top to bottom:
  1. layered precision casts (modules kept at their own dtype, parameters and buffers)
  2. tiled MLP forwards, then activation recompute wrappers
  3. torch.compile of each compiled unit's forward (around the recompute wrapper, inside
     the FSDP hooks `fully_shard` adds next: torchtitan's order)
  4. inner units, bottom-up, then the root
  5. explicit forward / backward prefetch
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.checkpoint import checkpoint

from shardwise.config.dtypes import to_torch_dtype
from shardwise.fsdp.plan import ShardingPlan, Unit, is_under
from shardwise.fsdp.tiled import apply_tiled_mlp


def apply_plan(model: nn.Module, plan: ShardingPlan, mesh, *, pin_memory: bool = True) -> nn.Module:
    """Shard `model` in place as `plan` says; returns the model (its root is an FSDPModule)."""
    cast_layered_precision(model, plan)
    apply_tiled_mlp(model, plan.tiled_mlp, plan.tiled_mlp_shards)
    apply_recompute(model, plan.recompute, plan.use_reentrant)
    apply_compile(model, plan.compiled)
    ignored = ignored_parameters(model, plan.ignored)
    for unit in plan.units:
        shard_unit(model, unit, mesh, ignored, pin_memory=pin_memory)
    wire_prefetch(model, plan)
    return model


def cast_layered_precision(model: nn.Module, plan: ShardingPlan) -> None:
    """Keep each `module_precision` module's parameters at its storage dtype and buffers at
    its dtype (an fp32 norm inside a bf16 model keeps fp32 weights and stats)."""
    storage = {u.path: u.storage_dtype for u in plan.units}
    for path, dtype in plan.buffer_casts.items():
        mod = model.get_submodule(path)
        buf_dtype = to_torch_dtype(dtype)
        param_dtype = to_torch_dtype(storage.get(path, plan.model_dtype))
        if path not in storage:  # no parameters of its own unit: it lives in an enclosing unit
            param_dtype = None
        for sub in mod.modules():
            for name, b in list(sub._buffers.items()):
                if b is not None and b.is_floating_point():
                    sub._buffers[name] = b.to(buf_dtype)
            if param_dtype is not None:
                for name, p in list(sub._parameters.items()):
                    if p is not None and p.dtype != param_dtype:
                        sub._parameters[name] = nn.Parameter(p.to(param_dtype), requires_grad=p.requires_grad)


def apply_recompute(model: nn.Module, paths: list[str], use_reentrant: bool) -> None:
    """Activation checkpointing of each module's forward, without changing module names
    (so state-dict keys and FSDP unit paths stay the HF ones)."""
    for path in paths:
        mod = model.get_submodule(path)
        mod.forward = _checkpointed(mod.forward, use_reentrant)


def _checkpointed(forward, use_reentrant: bool):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if not use_reentrant:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        # The reentrant variant takes positional tensors only: pass kwargs positionally.
        keys = list(kwargs)

        def positional(*flat):
            n = len(flat) - len(keys)
            return forward(*flat[:n], **dict(zip(keys, flat[n:])))

        return checkpoint(positional, *args, *[kwargs[k] for k in keys], use_reentrant=True)

    return run


def apply_compile(model: nn.Module, paths: list[str]) -> None:
    """torch.compile each module's forward in place, keeping module names (state-dict keys
    and FSDP unit paths stay the HF ones).

    Only `forward` is replaced, not the module: `fully_shard` (called after this) hooks the
    module's `__call__`, so its all-gather / reshard hooks run eagerly around the compiled
    code, the effect torchtitan gets by compiling each block before `fully_shard`. A
    recompute wrapper installed before is compiled with the forward (dynamo traces
    non-reentrant checkpointing as one region it recomputes in backward).

    `dynamic=None` (automatic): the first call compiles for its shapes, the first call with
    another sequence length or batch size recompiles once with those sizes symbolic, and
    that graph serves every later length. `fullgraph=False`: a unit around something dynamo
    cannot trace (a nested FSDP unit's hooks, the tiled MLP's autograd function) runs in
    pieces instead of failing.

    Calls with a KV cache (HF decoding: `past_key_values` set) run the eager forward: each
    layer's cache update bakes its `layer_idx` and the cache's state into the graph, so
    decoding would compile about two graphs per layer and exhaust dynamo's recompile limit
    (8 per code object, shared by all layers and by the training graphs).
    """
    for path in paths:
        mod = model.get_submodule(path)
        mod.forward = _compiled(mod.forward)


def _compiled(forward):
    compiled = torch.compile(forward, fullgraph=False, dynamic=None)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if kwargs.get("past_key_values") is not None:
            return forward(*args, **kwargs)
        return compiled(*args, **kwargs)

    run.compiled_forward = compiled
    return run


def ignored_parameters(model: nn.Module, ignored: list[str]) -> set[nn.Parameter]:
    return {p for name, p in model.named_parameters() if any(is_under(name, ig) for ig in ignored)}


def offload_policy(enabled: bool, pin_memory: bool) -> OffloadPolicy:
    """CPUOffloadPolicy, pinning only where an accelerator exists (pinning fails on CPU)."""
    if not enabled:
        return OffloadPolicy()
    can_pin = torch.cuda.is_available()
    if pin_memory and not can_pin:
        warnings.warn("fsdp.offload.pin_memory ignored: no accelerator, host memory cannot be pinned",
                      stacklevel=2)
    return CPUOffloadPolicy(pin_memory=pin_memory and can_pin)


def mp_policy(unit: Unit) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=to_torch_dtype(unit.param_dtype),
        reduce_dtype=to_torch_dtype(unit.reduce_dtype),
        output_dtype=to_torch_dtype(unit.output_dtype),
        cast_forward_inputs=unit.cast_forward_inputs,
    )


def shard_unit(model: nn.Module, unit: Unit, mesh, ignored: set[nn.Parameter], *, pin_memory: bool) -> None:
    module = model.get_submodule(unit.path) if unit.path else model
    fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=unit.reshard_after_forward,
        mp_policy=mp_policy(unit),
        offload_policy=offload_policy(unit.offload, pin_memory),
        ignored_params=ignored or None,
    )


def wire_prefetch(model: nn.Module, plan: ShardingPlan) -> None:
    for unit in plan.units:
        if not unit.path:
            continue
        mod = model.get_submodule(unit.path)
        assert isinstance(mod, FSDPModule)
        if unit.prefetch_forward:
            mod.set_modules_to_forward_prefetch([model.get_submodule(p) for p in unit.prefetch_forward])
        if unit.prefetch_backward:
            mod.set_modules_to_backward_prefetch([model.get_submodule(p) for p in unit.prefetch_backward])
