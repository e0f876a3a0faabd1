"""torchrun as `shardwise.distributed.launch` runs it: ``python -m shardwise.distributed.torchrun
<torchrun arguments>``.

The same launcher (`torch.distributed.run`), with three differences: it dies with the
process that started it; its own logging and its multi-line failure report stay off the
terminal (the `shardwise` process prints one line instead, from the ranks' error files)
unless ``SHARDWISE_DEBUG=1``; and a rank that died without writing an error file (killed
by a signal, out of memory) is described in ``launcher.json`` of the error folder.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from shardwise.distributed.launch import (
    ERROR_DIR_ENV,
    LAUNCHER_FILE,
    debug_enabled,
    describe_exit,
    die_with_parent,
)


def main(argv: list[str]) -> int:
    die_with_parent()
    if not debug_enabled():
        # torchrun's modules set their loggers' levels one by one when imported.
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
                logging.getLogger(name).setLevel(logging.CRITICAL)

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        folder = os.environ.get(ERROR_DIR_ENV)
        if folder and not (Path(folder) / f"rank{rank}.json").exists():
            note = {"rank": rank, "type": "ProcessExit", "message": describe_exit(failure.exitcode),
                    "user": False, "traceback": str(e), "time": time.time()}
            (Path(folder) / LAUNCHER_FILE).write_text(json.dumps(note))
        if debug_enabled():
            print(str(e), file=sys.stderr)
        code = failure.exitcode
        return code if code > 0 else 128 - code
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
