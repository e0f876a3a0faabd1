"""Meta model -> plan -> fully_shard -> materialise -> weights from rank 0."""

from __future__ import annotations

from torch import nn

from shardwise.config.schema import Config
from shardwise.config.validate import MeshSpec
from shardwise.distributed.runtime import Runtime
from shardwise.fsdp.apply import apply_plan
from shardwise.fsdp.plan import ShardingPlan, build_plan, warn_plan
from shardwise.models.loading import (
    build_full_model,
    build_meta_model,
    freeze,
    load_full_weights,
)
from shardwise.models.patches import patch_model


def plan_for(cfg: Config, spec: MeshSpec, task: str = "causal_lm", **config_extra) -> tuple[nn.Module, ShardingPlan]:
    """The meta model (frozen as configured) and its plan; no process group needed."""
    model = patch_model(build_meta_model(cfg.model, task, **config_extra), cfg)
    freeze(model, cfg.model.freeze)
    return model, build_plan(model, cfg, spec)


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
    model.to_empty(device="cpu" if cfg.fsdp.offload.enabled else runtime.device)
    full = patch_model(build_full_model(cfg.model, cfg.run.seed, task, **config_extra), cfg) if runtime.is_main else None
    load_full_weights(model, full, runtime.device)
    del full
    _retie(model)
    return model, plan


def _retie(model: nn.Module) -> None:
    """Tied input/output embeddings must still be one parameter after materialisation."""
    try:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return
    if getattr(model.config, "tie_word_embeddings", False) and emb is not None and head is not None:
        assert head.weight is emb.weight, "tied embeddings came apart during sharding"
