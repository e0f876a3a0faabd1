"""A job for `shardwise.distributed.launch.launch_torchrun` in which one rank fails.

``python -m fault_job MODE FAILING_RANK``: every rank starts the process group; the
failing rank raises (MODE ``internal``: a RuntimeError, ``user``: a ConfigError; ``kill``:
it kills itself with SIGKILL instead) while the
others wait in a barrier it never reaches. The rank side uses the same calls as
`shardwise.cli` (`die_with_parent`, `rank_failed`), so the job must end in seconds with
one line, never at the process group's timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch.distributed as dist

from shardwise.distributed import launch
from shardwise.distributed.runtime import init_distributed, teardown
from shardwise.errors import ConfigError


def main(mode: str, failing_rank: int) -> int:
    launch.die_with_parent()
    runtime = init_distributed(timeout_s=600)  # the job must not rely on this timeout
    try:
        if runtime.rank == failing_rank:
            time.sleep(1.0)  # the peers are inside the barrier by now
            if mode == "user":
                raise ConfigError("data.source", "injected user error", "a hint")
            if mode == "kill":  # no word: the peers see only a closed connection
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure")
        dist.barrier()
        teardown()
    except BaseException as e:  # noqa: BLE001 - the rank side of the launcher's contract
        launch.rank_failed(e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
