"""Tiled MLP (``fsdp.tiled_mlp``): run a position-wise
module (an MLP) over its input in `shards` slices of the sequence and keep only the
input for backward.

An MLP of hidden size H and intermediate size I saves about 3 x I activations per token
for backward (gate, up, act(gate) * up), 3 x I / H times its input; for long sequences that
is the largest activation of a decoder layer. Tiled, the forward runs each slice under
``no_grad`` and saves nothing but the input; backward recomputes one slice at a time with
grad and back-propagates it, so at most one slice's intermediates exist at once, in forward
and in backward. The cost: the MLP's forward runs twice (as with recompute).

Only modules whose output at a position depends on their input at that position alone may
be tiled (an MLP, not attention). The module must take one tensor ``(..., seq, hidden)``
(or ``(tokens, hidden)``) and return one tensor of the same leading shape.

Under FSDP2 the module lives inside a unit whose parameters are unsharded during the unit's
forward and backward, so the recomputation in backward uses the gathered parameters and the
gradients it accumulates into them are what the unit's reduce-scatter sends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["apply_tiled_mlp", "tiled_forward"]


class _TiledFunction(torch.autograd.Function):
    """out = cat(fn(x_i)) over the slices x_i of x; backward recomputes slice by slice.

    Backward accumulates the module's parameter gradients itself (``torch.autograd.backward``
    of each recomputed slice), the way reentrant activation checkpointing does. The
    parameters are passed as inputs only so that the output requires grad when they do
    (an input that needs no grad, e.g. below frozen layers); their returned grads are None.
    """

    @staticmethod
    def forward(ctx, fn: Callable[[torch.Tensor], torch.Tensor], shards: int, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.num_params = len(params)
        ctx.fn, ctx.shards = fn, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(part) for part in _split(x, shards)], dim=_seq_dim(x))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        dim = _seq_dim(x)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        start = 0
        for part, grad_part in zip(_split(x, ctx.shards), _split(grad_out, ctx.shards)):
            part = part.detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                out = ctx.fn(part)
            if out.requires_grad:
                torch.autograd.backward(out, grad_part)
            n = part.shape[dim]
            if grad_x is not None:
                grad_x.narrow(dim, start, n).copy_(part.grad if part.grad is not None else torch.zeros_like(part))
            start += n
        return (None, None, grad_x) + (None,) * ctx.num_params


def _seq_dim(x: torch.Tensor) -> int:
    return x.dim() - 2


def _split(x: torch.Tensor, shards: int) -> tuple[torch.Tensor, ...]:
    return torch.chunk(x, shards, dim=_seq_dim(x))


def tiled_forward(module: nn.Module, shards: int, name: str = "module"):
    """`module`'s forward wrapped to run over `shards` slices of the sequence (the dimension
    before the last). Without grad it runs slice by slice and concatenates (no
    recomputation)."""
    forward = module.forward
    if shards < 1:
        raise ValueError(f"tiled_forward: shards must be >= 1, got {shards}")

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            raise TypeError(f"tiled MLP {name!r}: expects forward(x) with one tensor (..., seq, hidden); got "
                            f"{len(args)} positional and {sorted(kwargs)} keyword arguments. Tile only "
                            "position-wise modules that take one tensor (fsdp.tiled_mlp.modules)")
        x = args[0]
        if shards == 1 or x.shape[_seq_dim(x)] <= 1:
            return forward(x)
        if not torch.is_grad_enabled():
            return torch.cat([forward(part) for part in _split(x, shards)], dim=_seq_dim(x))
        params = [p for p in module.parameters() if p.requires_grad]
        return _TiledFunction.apply(forward, shards, x, *params)

    run.__shardwise_tiled__ = shards  # type: ignore[attr-defined]
    return run


def apply_tiled_mlp(model: nn.Module, paths: list[str], shards: int) -> None:
    """Tile the forward of each module in `paths` in place (module names, and so state-dict
    keys and FSDP unit paths, stay as they are)."""
    for path in paths:
        mod = model.get_submodule(path)
        mod.forward = tiled_forward(mod, shards, path)
