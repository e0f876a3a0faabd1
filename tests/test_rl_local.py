"""rl.backend local: worker groups of processes forked from the controller, no Ray.

One script (a fresh controller process, as `shardwise rl` is: the ranks are forked from
it) puts `LocalWorkerGroup` through `test_rl_dispatch`'s worker: the dispatch rules over a
real gloo group, calls submitted ahead answering in order, a rank's error, the user's
mistake found in a rank, a rank that does not answer in time, a rank killed mid-call while
its peer waits in a collective (the dead one is named, not the survivor), and nothing
left behind, all with Ray's import failing (as where it is not installed). The CLI runs on this backend in the rest of the suite (auto picks it here);
`tests/test_rl_trainer.py` checks a run resumed on Ray against one on this backend.
"""

from __future__ import annotations

import json
from pathlib import Path

from dist.launcher import alive, run_python

SCRIPT = r"""
import json, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from test_rl_dispatch import EchoWorker, rows
from shardwise.errors import ConfigError
from shardwise.rl.cluster import WorkerError
from shardwise.rl import local
from shardwise.rl.dispatch import Dispatch, register
from shardwise.rl.cluster import shutdown_ray

sys.modules["ray"] = None  # this backend runs where Ray is not installed: importing it now fails

class Picky(EchoWorker):
    @register(Dispatch.ONE_TO_ALL)
    def check(self) -> None:
        raise ConfigError("rl.rollout.n", "must be 2 here", "2")

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def late_sum(self) -> float:
        import torch, torch.distributed as dist
        if self.runtime.rank == 1:
            time.sleep(60)
        s = torch.ones(1)
        dist.all_reduce(s)  # rank 0 waits here for rank 1
        return float(s)


out = {}
local.start_pool(2)
g = local.LocalWorkerGroup(EchoWorker, 2, 0.5, name="echo", log_dir=sys.argv[2])
out["hello"] = g.hello("hi")
d = g.double(rows(3))
out["double"] = [d.tensors["y"].flatten().tolist(), list(d.arrays["name"]), d.tensors["rank"].tolist()]
out["sum"] = g.global_sum(rows(10))
out["times"], out["zero"] = g.times([10, 20]), g.whoami()
first, second = g.submit("double", rows(3)), g.submit("hello", "again")
out["second"] = second.result(30)
out["first"] = [first.ready(), first.result(30).tensors["y"].flatten().tolist()]
out["pids"] = [p.pid for p in g.places]
out["where"] = g.describe_places()
g.shutdown()

def error(fn):
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, str(e), type(e.__cause__).__name__, str(e.__cause__)[-300:]]
    return None

g = local.LocalWorkerGroup(EchoWorker, 2, 0.0, name="failing")
out["raised"] = error(lambda: g.fail_on(1))
out["after"] = error(lambda: g.hello("again"))
out["pids"] += [p.pid for p in g.places]
g = local.LocalWorkerGroup(Picky, 2, 0.0, name="picky")
out["config"] = error(g.check)
out["pids"] += [p.pid for p in g.places]
g = local.LocalWorkerGroup(EchoWorker, 2, 0.0, name="slow")
out["timeout"] = error(lambda: g.submit("sleep_on", 1, 60.0).result(1.0, what="sleeping for the test"))
out["pids"] += [p.pid for p in g.places]
# rank 1 killed while rank 0 waits for it in a collective: the dead rank is named
g = local.LocalWorkerGroup(Picky, 2, 0.0, name="pair", log_dir=sys.argv[2])
pids = g.pid()
pending = g.submit("late_sum")
time.sleep(0.5)
os.kill(pids[1], signal.SIGKILL)
t0 = time.monotonic()
out["killed"] = error(lambda: pending.result(60))
out["killed_s"] = time.monotonic() - t0
out["pids"] += pids
local.stop_pool()
shutdown_ray()  # what the controller does on its way out, whichever backend ran
print(json.dumps(out))
"""


def test_local_groups_dispatch_fail_in_one_line_and_leave_nothing(tmp_path):
    res = run_python(["-c", SCRIPT, str(Path(__file__).parent), str(tmp_path)], timeout=180,
                     env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["hello"] == ["hi from 0/2", "hi from 1/2"]
    assert out["double"] == [[0.5, 2.5, 4.5], ["r0", "r1", "r2"], [0, 0, 1]]
    assert out["sum"] == 45.0 and out["times"] == [10, 40] and out["zero"] == 0
    assert out["second"] == ["again from 0/2", "again from 1/2"]  # a rank runs its calls in order
    assert out["first"] == [True, [0.5, 2.5, 4.5]]
    assert out["where"] == "ranks 0-1 on node 127.0.0.1, id local"
    kind, line, cause, trace = out["raised"]
    assert kind == "WorkerError" and line.startswith("failing.fail_on failed on rank 1: RuntimeError: boom"), line
    assert cause == "RemoteTraceback" and "raise RuntimeError(\"boom\")" in trace  # the rank's traceback is kept
    assert out["after"][:2] == ["WorkerError", "worker group 'failing' was shut down"]
    # the user's mistake found in a rank: the controller raises it as it is (one line, exit 2)
    assert out["config"][:2] == ["ConfigError", "config error at 'rl.rollout.n': must be 2 here (2)"], out["config"]
    assert out["timeout"][1] == ("worker group 'slow': sleeping for the test did not finish in 1 s "
                                 "(rank 1 did not answer)")
    kind, line, _, _ = out["killed"]
    assert kind == "WorkerError" and line.startswith("worker group 'pair' lost rank 1 in late_sum: its process (pid "), line
    assert "died (killed by SIGKILL); its output: " in line and line.endswith("pair-rank1.log"), line
    assert out["killed_s"] < 10  # seconds for a dead process, not the process group's timeout
    assert not alive(out["pids"]), alive(out["pids"])
