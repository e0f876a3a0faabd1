"""A job for `shardwise.distributed.launch.launch_torchrun` that reports the mesh of each rank.

``python -m mesh_job OUT_DIR FSDP_SIZE``: every rank builds the mesh shardwise builds for
``parallel.sharding_strategy=hybrid_shard`` and ``parallel.fsdp_size=FSDP_SIZE`` (the
config's own `mesh_spec` and `build_mesh`) and writes ``OUT_DIR/rank<r>.json``: its node
(torchrun's GROUP_RANK) and the global ranks of its shard and replicate groups.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from shardwise.config.schema import ParallelConfig
from shardwise.config.validate import mesh_spec
from shardwise.distributed import launch
from shardwise.distributed.mesh import build_mesh
from shardwise.distributed.runtime import init_distributed, teardown


def main(out_dir: str, fsdp_size: int) -> int:
    launch.die_with_parent()
    try:
        runtime = init_distributed(timeout_s=60)
        spec = mesh_spec(ParallelConfig(sharding_strategy="hybrid_shard", fsdp_size=fsdp_size), runtime.world_size)
        mesh = build_mesh(spec, "cpu")
        groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in spec.dim_names}
        report = {"rank": runtime.rank, "node": int(os.environ["GROUP_RANK"]), **groups}
        (Path(out_dir) / f"rank{runtime.rank}.json").write_text(json.dumps(report))
        teardown()
    except BaseException as e:  # noqa: BLE001 - the rank side of the launcher's contract
        launch.rank_failed(e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
