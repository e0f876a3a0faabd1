"""Meta model -> plan -> fully_shard -> materialise -> weights from rank 0."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.schema import Config
from shardwise.config.validate import MeshSpec
from shardwise.distributed.runtime import Runtime
from shardwise.errors import ConfigError
from shardwise.fsdp.apply import apply_plan
from shardwise.fsdp.plan import ShardingPlan, build_plan, warn_plan
from shardwise.models import lora
from shardwise.models.loading import (
    build_full_model,
    build_meta_model,
    check_weight_shapes,
    freeze,
    load_full_weights,
)
from shardwise.models.patches import patch_model


def plan_for(cfg: Config, spec: MeshSpec, task: str = "causal_lm", **config_extra) -> tuple[nn.Module, ShardingPlan]:
    """The meta model (with its LoRA adapters, frozen as configured) and its plan; no
    process group needed."""
    model = patch_model(build_meta_model(cfg.model, task, **config_extra), cfg)
    if cfg.model.path is not None:
        check_weight_shapes(model, cfg.model.path)
    config = lora.inject(model, cfg.model.lora)
    if config is not None:
        _check_lora(model, config, cfg, task)
    freeze(model, cfg.model.freeze)
    return model, build_plan(model, cfg, spec)


def _check_lora(model: nn.Module, config, cfg: Config, task: str) -> None:
    """Settings that cannot work with LoRA adapters, refused before anything runs."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_path = next((n for n, m in model.named_modules() if head is not None and (m is head or
                      getattr(m, "base_layer", None) is head)), None)
    if cfg.train.chunked_loss.enabled and head_path in set(config.target_modules):
        raise ConfigError("model.lora.target_modules", f"an adapter on the output head {head_path!r} and "
                          "train.chunked_loss (which reads the head's weight directly) do not combine",
                          f"leave {head_path} out (all-linear does), or set train.chunked_loss.enabled=false")
    if task != "causal_lm" and not config.modules_to_save:
        raise ConfigError("model.lora.modules_to_save", f"model.task {task} has a new head that LoRA would leave "
                          "frozen at its random init", "add the head, e.g. modules_to_save: [classifier]")


def build_sharded_model(cfg: Config, runtime: Runtime, spec: MeshSpec, mesh, task: str = "causal_lm",
                        planned: tuple[nn.Module, ShardingPlan] | None = None,
                        **config_extra) -> tuple[nn.Module, ShardingPlan]:
    """The sharded model with real weights on `runtime.device`, and the plan it followed.

    `planned`: the meta model and plan of `plan_for` for this config and mesh, when a job's
    prepare step built them already (used up here: `fully_shard` changes the model in
    place). Only rank 0 builds or reads the full weights; the other ranks receive their
    shards.
    """
    model, plan = planned if planned is not None else plan_for(cfg, spec, task, **config_extra)
    warn_plan(plan, runtime.is_main)
    apply_plan(model, plan, mesh, pin_memory=cfg.fsdp.offload.pin_memory)
    # CPU offload: FSDP keeps the parameter shards in host memory (pinned with
    # `pin_memory`) and moves each unit to the compute device in its forward.
    model.to_empty(device="cpu" if cfg.fsdp.offload.enabled else runtime.device)
    full = build_full(cfg, task, **config_extra) if runtime.is_main else None
    # Loaded while every tensor is on one device (torch's full-state-dict loading refuses a
    # mix); the broadcasts themselves run on the process group's device.
    load_full_weights(model, full, runtime.device)
    if cfg.fsdp.offload.enabled:
        # Everything FSDP does not manage (buffers such as rotary inv_freq, the parameters
        # of ignored modules) is used by forwards on the compute device as it is.
        _outside_fsdp_to(model, runtime.device)
    del full
    _retie(model)
    return model, plan


def build_full(cfg: Config, task: str = "causal_lm", **config_extra) -> nn.Module:
    """The whole model on CPU as a run starts it: weights (`model.path` or a seeded init),
    patches, LoRA adapters (seeded from run.seed + 1, or read from ``model.lora.path``)."""
    model = patch_model(build_full_model(cfg.model, cfg.run.seed, task, **config_extra), cfg)
    lora.inject(model, cfg.model.lora, seed=cfg.run.seed + 1)
    freeze(model, cfg.model.freeze)
    return model


def _outside_fsdp_to(model: nn.Module, device: torch.device) -> None:
    """Move every buffer and every parameter that is not an FSDP shard (not a DTensor) of
    the materialised `model` to `device` (a no-op when they are there already)."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.device != device:
                setattr(module, name, buf.to(device))
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor) and param.device != device:
                setattr(module, name, nn.Parameter(param.to(device), requires_grad=param.requires_grad))


def _retie(model: nn.Module) -> None:
    """Tied input/output embeddings must still be one parameter after materialisation."""
    try:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return
    if getattr(model.config, "tie_word_embeddings", False) and emb is not None and head is not None:
        assert head.weight is emb.weight, "tied embeddings came apart during sharding"
