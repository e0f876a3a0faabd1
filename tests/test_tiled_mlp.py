"""Tiled MLP (`shardwise.fsdp.tiled`): the tiled module computes what the plain one does
(output, input and parameter gradients) and keeps only its input for backward. Which
modules the plan tiles. Training parity under FSDP is in tests/test_parity.py
(rows tiled_mlp*).

Tolerance: tiling changes only how the matmuls are blocked and the order in which the
slices' parameter gradients are summed, a few ulps of fp32 (observed <= 1e-6 here).
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist.common import TINY_LLAMA, TINY_QWEN3
from torch import nn

from shardwise.config import load_config
from shardwise.config.validate import mesh_spec
from shardwise.errors import ConfigError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.plan import build_plan
from shardwise.fsdp.tiled import tiled_forward

HIDDEN, INTER = 32, 96


def mlp_pair(shards: int) -> tuple[nn.Module, nn.Module]:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    torch.manual_seed(0)
    plain = Qwen3MLP(Qwen3Config(hidden_size=HIDDEN, intermediate_size=INTER))
    tiled = copy.deepcopy(plain)
    tiled.forward = tiled_forward(tiled, shards, "mlp")
    return plain, tiled


def run(mod: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    x = x.detach().clone().requires_grad_()
    out = mod(x)
    out.backward(grad)
    return out.detach(), x.grad, [p.grad.clone() for p in mod.parameters()]


@pytest.mark.parametrize("shape,shards", [
    ((2, 12, HIDDEN), 4),   # even slices
    ((2, 10, HIDDEN), 4),   # uneven: 3, 3, 3, 1
    ((1, 3, HIDDEN), 8),    # more slices than tokens
    ((13, HIDDEN), 3),      # packed (tokens, hidden)
    ((2, 2, 5, HIDDEN), 2),  # extra leading dims
])
def test_tiled_equals_plain(shape, shards):
    plain, tiled = mlp_pair(shards)
    torch.manual_seed(1)
    x, g = torch.randn(shape), torch.randn(shape)
    out_p, gx_p, gp_p = run(plain, x, g)
    out_t, gx_t, gp_t = run(tiled, x, g)
    torch.testing.assert_close(out_t, out_p, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx_t, gx_p, rtol=0, atol=1e-6)
    for a, b in zip(gp_t, gp_p):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_input_without_grad_still_trains_the_parameters():
    plain, tiled = mlp_pair(4)
    x = torch.randn(2, 12, HIDDEN)  # e.g. the output of frozen layers
    out = tiled(x)
    assert out.requires_grad
    out.sum().backward()
    plain(x).sum().backward()
    for a, b in zip(tiled.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=2e-6)


def test_without_grad_it_runs_slice_by_slice():
    plain, tiled = mlp_pair(4)
    x = torch.randn(2, 12, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), plain(x), rtol=0, atol=1e-6)


def saved_bytes(mod: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the non-parameter tensors autograd saves for backward (by storage)."""
    params = {p.untyped_storage().data_ptr() for p in mod.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mod(x)
    return sum(seen.values())


def test_tiled_keeps_only_its_input_for_backward():
    plain, tiled = mlp_pair(4)
    x = torch.randn(2, 64, HIDDEN, requires_grad=True)
    x_bytes = x.numel() * 4
    assert saved_bytes(tiled, x) == x_bytes
    # plain Qwen3MLP saves x, gate, up, act(gate) and act(gate) * up: 4 x (2, 64, 96) + x
    assert saved_bytes(plain, x) == x_bytes + 4 * 2 * 64 * INTER * 4


def test_a_call_that_is_not_one_tensor_is_an_error():
    _, tiled = mlp_pair(2)
    with pytest.raises(TypeError, match="tiled MLP 'mlp': expects forward\\(x\\) with one tensor"):
        tiled(torch.randn(2, 4, HIDDEN), torch.randn(2))


@pytest.mark.parametrize("base,cls", [(TINY_QWEN3, "Qwen3MLP"), (TINY_LLAMA, "LlamaMLP")])
def test_plan_tiles_every_mlp_by_default(base, cls):
    cfg = load_config(None, [base, "fsdp.tiled_mlp.enabled=true", "fsdp.tiled_mlp.shards=3"])
    model, plan = plan_for(cfg, mesh_spec(cfg.parallel, 2))
    assert plan.tiled_mlp == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert {type(model.get_submodule(p)).__name__ for p in plan.tiled_mlp} == {cls}
    assert plan.to_json()["tiled_mlp"] == {"modules": plan.tiled_mlp, "shards": 3}


def test_plan_tiles_the_named_modules_only_when_enabled():
    cfg = load_config(None, [TINY_QWEN3, "fsdp.tiled_mlp.enabled=true", "fsdp.tiled_mlp.modules=[model.layers.{1}.mlp]"])
    assert plan_for(cfg, mesh_spec(cfg.parallel, 1))[1].tiled_mlp == ["model.layers.1.mlp"]
    off = load_config(None, [TINY_QWEN3, "fsdp.tiled_mlp.modules=[model.layers.{1}.mlp]"])
    assert plan_for(off, mesh_spec(off.parallel, 1))[1].tiled_mlp == []


def test_a_model_without_mlp_classes_needs_named_modules():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ffn = nn.Linear(4, 4)

    model = nn.Sequential(Block(), Block())
    cfg = load_config(None, [TINY_QWEN3, "fsdp.tiled_mlp.enabled=true", "fsdp.wrap.classes=[Block]"])
    with pytest.raises(ConfigError, match="fsdp.tiled_mlp.modules.*no module of this model has a class name "
                                          "ending in MLP"):
        build_plan(model, cfg, mesh_spec(cfg.parallel, 1))
    cfg = load_config(None, [TINY_QWEN3, "fsdp.tiled_mlp.enabled=true", "fsdp.wrap.classes=[Block]",
                             "fsdp.tiled_mlp.modules=[{*}.ffn]"])
    assert build_plan(model, cfg, mesh_spec(cfg.parallel, 1)).tiled_mlp == ["0.ffn", "1.ffn"]
