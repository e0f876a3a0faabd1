"""The device mesh: pure shape arithmetic (`mesh_spec`) and its construction (`build_mesh`).

Dims are named: `replicate` (HSDP / no_shard replicas), `shard` (FSDP shard group).
full_shard / shard_grad_op with fsdp_size auto, 1 or >= world: 1-D (shard,) (seed 001).
1 < fsdp_size < world, or hybrid_shard: 2-D (replicate, shard) = (world/fsdp_size, fsdp_size).
no_shard: 2-D (replicate, shard) = (world, 1): every rank keeps whole parameters and
gradients are all-reduced (DDP semantics).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardwise.config.schema import ParallelConfig
from shardwise.errors import ConfigError


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


def mesh_spec(parallel: ParallelConfig, world_size: int) -> MeshSpec:
    """Shape of the mesh for this config and world size. Raises ConfigError if sizes clash."""
    if world_size < 1:
        raise ConfigError("world_size", f"must be >= 1, got {world_size}")
    uly = parallel.ulysses_size
    if world_size % uly:
        raise ConfigError("parallel.ulysses_size", f"{uly} does not divide the world size {world_size}",
                          f"use one of {_divisors(world_size)}")
    strategy = parallel.sharding_strategy
    size = parallel.fsdp_size
    if strategy == "no_shard":
        return MeshSpec(world_size, world_size, 1, uly, strategy)
    if size == "auto" or size >= world_size or (size == 1 and strategy != "hybrid_shard"):
        # seed 001: fsdp_size >= world or <= 1 means one FSDP group over all ranks.
        if strategy == "hybrid_shard" and world_size > 1:
            raise ConfigError("parallel.fsdp_size", f"hybrid_shard needs fsdp_size < world size ({world_size})",
                              f"use one of {_divisors(world_size)[:-1]}")
        return MeshSpec(world_size, 1, world_size, uly, strategy)
    if world_size % size:
        raise ConfigError("parallel.fsdp_size", f"{size} does not divide the world size {world_size}",
                          f"use one of {_divisors(world_size)} or auto")
    return MeshSpec(world_size, world_size // size, size, uly, strategy)


def build_mesh(spec: MeshSpec, device_type: str):
    """The torch DeviceMesh for a spec (needs an initialised process group)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, spec.shape, mesh_dim_names=spec.dim_names)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
