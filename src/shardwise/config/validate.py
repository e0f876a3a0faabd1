"""Rules that need the world size, in one place: the mesh's shape, batch sizes, and how an
RL step's rows split over ranks. Pure arithmetic (no process group): every job's `prepare`
runs them in the launching process, before any process starts.

The mesh (`mesh_spec`): dims are named ``replicate`` (HSDP / no_shard replicas) and
``shard`` (the FSDP shard group). full_shard / shard_grad_op with fsdp_size auto, 1 or
>= world: 1-D (shard,). 1 < fsdp_size < world, or hybrid_shard: 2-D (replicate, shard) =
(world/fsdp_size, fsdp_size). no_shard: 2-D (replicate, shard) = (world, 1): every rank
keeps whole parameters and gradients are all-reduced (DDP semantics). Ulysses sequence
parallel: blocks of ``ulysses_size`` ranks share rows, so the data-parallel size is
world / ulysses_size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shardwise.config.schema import Config, ParallelConfig, SamplingConfig, TrainConfig
from shardwise.errors import ConfigError, short_repr

__all__ = ["MeshSpec", "check_rl_rows", "check_tools_kwargs", "check_sft_batch", "mesh_spec", "rl_train_ranks", "rl_update_groups"]


@dataclass(frozen=True)
class MeshSpec:
    world_size: int
    replicate: int
    shard: int
    ulysses: int
    strategy: str

    @property
    def dim_names(self) -> tuple[str, ...]:
        return ("shard",) if self.replicate == 1 and self.strategy != "no_shard" else ("replicate", "shard")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.shard,) if len(self.dim_names) == 1 else (self.replicate, self.shard)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (sequence-parallel peers share a sample)."""
        return self.world_size // self.ulysses

    def to_json(self) -> dict:
        d = asdict(self)
        d["dim_names"] = list(self.dim_names)
        d["shape"] = list(self.shape)
        d["dp_size"] = self.dp_size
        return d


def mesh_spec(parallel: ParallelConfig, world_size: int, ranks: str | None = None) -> MeshSpec:
    """Shape of the mesh for this config and world size. Raises ConfigError if sizes clash;
    `ranks` names the ranks in its message (default: "the world size N")."""
    if world_size < 1:
        raise ConfigError("world_size", f"must be >= 1, got {world_size}")
    uly = parallel.ulysses_size
    if world_size % uly:
        raise ConfigError("parallel.ulysses_size", f"{uly} does not divide {ranks or f'the world size {world_size}'}",
                          f"use one of {_divisors(world_size)}")
    strategy = parallel.sharding_strategy
    size = parallel.fsdp_size
    if strategy == "no_shard":
        return MeshSpec(world_size, world_size, 1, uly, strategy)
    if size == "auto" or size >= world_size or (size == 1 and strategy != "hybrid_shard"):
        # fsdp_size >= world or <= 1: one FSDP group over all ranks.
        if strategy == "hybrid_shard" and world_size > 1:
            raise ConfigError("parallel.fsdp_size", f"hybrid_shard needs fsdp_size < world size ({world_size})",
                              f"use one of {_divisors(world_size)[:-1]}")
        return MeshSpec(world_size, 1, world_size, uly, strategy)
    if world_size % size:
        raise ConfigError("parallel.fsdp_size", f"{size} does not divide the world size {world_size}",
                          f"use one of {_divisors(world_size)} or auto")
    return MeshSpec(world_size, world_size // size, size, uly, strategy)


def check_sft_batch(train: TrainConfig, dp_size: int) -> int:
    """Gradient-accumulation steps per optimizer step (global = micro x accumulation x
    data-parallel size); ConfigError on train.global_batch_size if the sizes do not fit."""
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step:
        lo = max(per_step, train.global_batch_size // per_step * per_step)
        raise ConfigError(
            "train.global_batch_size",
            f"{train.global_batch_size} is not a multiple of micro_batch_size x data-parallel size "
            f"({train.micro_batch_size} x {dp_size} = {per_step})",
            f"try {lo} or {lo + per_step}",
        )
    return train.global_batch_size // per_step


def check_rl_rows(cfg: Config, dp_size: int) -> int:
    """Rows of one RL step (prompts x rl.rollout.n); they must split evenly over the
    data-parallel ranks, and each rank's share into rl.actor.ppo_mini_batches."""
    rl = cfg.rl
    rows = cfg.train.global_batch_size * rl.rollout.n
    if rows % dp_size:
        raise ConfigError("train.global_batch_size",
                          f"{cfg.train.global_batch_size} prompts x rl.rollout.n={rl.rollout.n} = {rows} rows "
                          f"do not split over {dp_size} data-parallel ranks",
                          f"make prompts x n a multiple of {dp_size}")
    if (rows // dp_size) % rl.actor.ppo_mini_batches:
        raise ConfigError("rl.actor.ppo_mini_batches",
                          f"{rl.actor.ppo_mini_batches} does not divide the {rows // dp_size} rows of each rank",
                          "pick a divisor of (global_batch_size x n / ranks)")
    return rows


def rl_train_ranks(cfg: Config, world_size: int) -> int:
    """The ranks an RL run trains on: all `world_size`, or with ``rl.async`` the
    ``world_size - generator_ranks`` the generator group leaves (ConfigError naming
    rl.async.generator_ranks when it leaves none)."""
    a = cfg.rl.async_
    if not a.enabled:
        return world_size
    if a.generator_ranks >= world_size:
        most = world_size - 1
        raise ConfigError("rl.async.generator_ranks",
                          f"{a.generator_ranks} generator rank(s) leave none of the {world_size} to train on",
                          f"set it to at most {most}" if most >= 1 else
                          "run with --nproc 2 or more (one rank trains, one generates), or set rl.async.enabled=false")
    return world_size - a.generator_ranks


def rl_update_groups(groups: int, n: int, dp_size: int, mini_batches: int) -> int:
    """How many of `groups` groups (prompts of `n` rows each) an RL update takes when
    rl.filter_groups left fewer than a full step: the most whose rows split evenly over the
    `dp_size` data-parallel ranks and each rank's share into `mini_batches` equal
    mini-batches, what `check_rl_rows` asks of a full step (a duplicated row would count
    twice in the loss, so rows are never padded). A multiple of
    ``dp_size x mini_batches / gcd(n, dp_size x mini_batches)`` groups, i.e. every count
    when `n` is a multiple of dp_size x mini_batches; the groups beyond it leave the step
    like the filtered ones. 0: no update this step."""
    parts = dp_size * mini_batches
    unit = parts // math.gcd(n, parts)
    return groups // unit * unit


def check_generation_engine(sampling: SamplingConfig, world_size: int, key: str) -> None:
    """The vllm engine's tensor-parallel groups tile the ranks: tensor_parallel_size must
    divide the world size (`key` is ``rl.rollout`` or ``infer``)."""
    if sampling.engine != "vllm":
        return
    tp = sampling.vllm.tensor_parallel_size
    if world_size % tp:
        raise ConfigError(f"{key}.vllm.tensor_parallel_size",
                          f"{tp} does not divide the {world_size} ranks (one vLLM engine per {tp} consecutive ranks)",
                          f"pick one of {_divisors(world_size)}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tools_kwargs(records: Sequence[dict[str, Any]], key: str, config_key: str, source_key: str) -> None:
    """Each record's value at the dotted `key` (``<section>.multi_turn.tools_kwargs_key``,
    looked up in the record as the rollout looks it up) is absent or ``{tool name:
    {argument: value}}``; anything else (a column holding text, a list, a tool's entry that
    is not a mapping) would be ignored on every call, so it is a ConfigError naming
    `config_key`, the row of `source_key` and what it holds."""
    for i, record in enumerate(records):
        value: Any = record
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            continue  # absent in this record: no per-row arguments
        where = record.get("where") or f"{source_key} row {i}"
        if not isinstance(value, dict):
            raise ConfigError(config_key, f"{key!r} holds {type(value).__name__} {short_repr(value)} in {where}, "
                              "not a mapping {tool name: {argument: value}}",
                              "point it at such a column (e.g. extra_info.tools_kwargs), or set it to '' for none")
        bad = next(((k, v) for k, v in value.items() if not isinstance(v, dict)), None)
        if bad is not None:
            raise ConfigError(config_key, f"{key!r} in {where} gives tool {short_repr(bad[0])} "
                              f"{type(bad[1]).__name__} {short_repr(bad[1])}, not a mapping {{argument: value}}",
                              "give each tool's arguments as an object")
