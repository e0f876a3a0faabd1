"""`shardwise plan`: a config's sharding plan before any process group exists (meta device,
no weights), with its step's communication and, on a hardware profile, the projected step
time; at one world size, or one row per world size of a scan.

The plan is `shardwise.fsdp.build.plan_for`'s, the communication `shardwise.fsdp.comm`'s
and the projection `shardwise.fsdp.projection`'s; the text is `shardwise.jobs.report`'s.
"""

from __future__ import annotations

import json

from torch import nn

from shardwise.config.schema import Config
from shardwise.config.validate import check_rl_rows, check_sft_batch, mesh_spec, rl_train_ranks
from shardwise.distributed.runtime import env_world
from shardwise.errors import ConfigError
from shardwise.fsdp.build import plan_for
from shardwise.fsdp.comm import step_comm
from shardwise.fsdp.plan import ShardingPlan
from shardwise.fsdp.projection import Hardware, Projection, load_hardware, profiles, project
from shardwise.jobs import report
from shardwise.rl.async_trainer import async_worker_groups

__all__ = ["plan_at", "rl_groups", "show"]


def show(cfg: Config, world_size: int | None = None, config_ranks: int | None = None, *,
         hardware: str | None = None, gpus_per_node: int | None = None, mfu: float | None = None,
         scan: str | None = None, rl: bool = False, as_json: bool = False) -> None:
    """Print the plan of `cfg` at `world_size` ranks (default: the device count of the
    config's file, `config_ranks`, else torchrun's WORLD_SIZE, else 1) as a table, or JSON
    with `as_json`; projected on the `hardware` profile (a name of `profiles()` or a profile
    file) when one is given. `scan`: comma-separated world sizes, one projected row each,
    instead. `rl`: `cfg` is for `shardwise rl` (its batch rules; no step to project); a
    config that sets any ``rl`` key is taken as one without it (the SFT rules refused every
    example RL config: global_batch_size counts prompts there)."""
    rl = rl or "rl" in cfg.model_fields_set
    hw = load_hardware(hardware) if hardware is not None else None
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError("--mfu", f"{mfu} is not a fraction in (0, 1]", "e.g. --mfu 0.35")
    if (mfu is not None or scan is not None) and hw is None:
        raise ConfigError("--hardware", "--mfu and --scan project a step time and need a hardware profile",
                          f"add --hardware {' | '.join(profiles())} or a profile file")
    gpus_per_node = gpus_per_node if gpus_per_node is not None else (hw.gpus_per_node if hw is not None else 8)
    if gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"{gpus_per_node} is not a positive number of GPUs", "e.g. 8")
    if scan is not None:
        _scan(cfg, _scan_sizes(scan), hw, gpus_per_node, mfu, rl, as_json)
        return
    world = world_size if world_size is not None else config_ranks or env_world()[1]
    _, plan, projection = plan_at(cfg, world, hw, gpus_per_node, mfu=mfu, rl=rl)
    groups = rl_groups(cfg, world) if rl and cfg.rl.async_.enabled else None
    if as_json:
        out = plan.to_json()
        if projection is not None:
            out["projection"] = projection.to_json()
        if groups is not None:
            out["worker_groups"] = groups
        print(json.dumps(out, indent=2))
        return
    if groups is not None:
        print("rl.async: " + "; ".join(f"worker group {g['name']} ({', '.join(g['roles'])}) on {g['ranks']} "
                                       f"rank{'s' * (g['ranks'] > 1)}" for g in groups)
              + "; the plan below is the training group's")
    print(report.format_plan(plan))
    if projection is not None:
        print("\n" + report.format_projection(projection, hw))
    if rl and cfg.model.lora.enabled and cfg.rl.reference.enabled:
        print("rl: the reference policy is the actor with its LoRA adapters disabled (no reference model in memory)"
              if groups is None or cfg.rl.async_.reference_on == "actor" else
              "rl: the reference policy is the base model (the actor with its LoRA adapters disabled); the generator "
              "ranks hold a copy of it for their share of its forwards")
    if rl and cfg.model.lora.enabled and groups is not None:
        print("rl.async: the generator ranks hold the whole policy, the LoRA adapters merged into the base at "
              "every push")


def rl_groups(cfg: Config, world: int) -> list[dict]:
    """The worker groups of an asynchronous RL run on `world` ranks: name, roles, ranks
    (the training groups on the ranks the generator group leaves)."""
    train = rl_train_ranks(cfg, world)
    return [{"name": name, "roles": roles, "ranks": world - train if name == "gen" else train}
            for name, roles in async_worker_groups(cfg).items()]


def plan_at(cfg: Config, world: int, hw: Hardware | None, gpus_per_node: int, *, mfu: float | None = None,
            rl: bool = False, accumulation: int | None = None
            ) -> tuple[nn.Module, ShardingPlan, Projection | None]:
    """(meta model, plan with its step's communication, projection on `hw` or None) at
    `world` ranks. `accumulation`: micro-batches per step to keep (a scan keeps each rank's
    step), instead of the config's global batch. An `rl` plan has no step communication."""
    spec = mesh_spec(cfg.parallel, rl_train_ranks(cfg, world) if rl else world)
    if hw is not None and world > gpus_per_node and world % gpus_per_node:
        raise ConfigError("--world-size", f"{world} ranks do not fill whole nodes of {gpus_per_node} GPUs",
                          f"use a multiple of {gpus_per_node}, or set --gpus-per-node")
    if rl:  # an RL config: global_batch_size counts prompts, micro_batch_size rows per forward
        check_rl_rows(cfg, spec.dp_size)
    elif accumulation is None:
        accumulation = check_sft_batch(cfg.train, spec.dp_size)
    model, plan = plan_for(cfg, spec, cfg.model.task)
    if rl:  # an RL step's micro-batches follow its rollouts: no step shape to count
        if hw is not None:
            raise ConfigError("--hardware", "the step-time projection covers SFT configs, not --rl ones")
        return model, plan, None
    plan.comm = step_comm(model, plan, spec, accumulation=accumulation, micro_batch_size=cfg.train.micro_batch_size,
                          max_length=cfg.data.max_length, gpus_per_node=gpus_per_node)
    return model, plan, (project(model, plan, plan.comm, hw, mfu) if hw is not None else None)


def _scan_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise ConfigError("--scan", f"{text!r} is not a comma-separated list of world sizes", "e.g. --scan 8,64,512")
    return sizes


def _scan(cfg: Config, sizes: list[int], hw: Hardware, gpus_per_node: int, mfu: float | None, rl: bool,
          as_json: bool) -> None:
    """One projected row per world size; each rank keeps the step of the first size
    (micro-batches per step), so the global batch grows with the data-parallel size."""
    accumulation = check_sft_batch(cfg.train, mesh_spec(cfg.parallel, sizes[0]).dp_size)
    rows = [(world, *plan_at(cfg, world, hw, gpus_per_node, mfu=mfu, rl=rl, accumulation=accumulation)[1:])
            for world in sizes]
    if as_json:
        print(json.dumps({"hardware": hw.name, "scan": [
            {"world_size": w, "mesh": p.mesh.to_json(), "comm_bytes_per_step": p.comm.bytes_per_step(),
             "projection": pr.to_json()} for w, p, pr in rows]}, indent=2))
        return
    print(report.format_scan(rows, hw, accumulation, cfg.train.micro_batch_size))
