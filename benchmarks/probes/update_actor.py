"""The actor's update on recorded batches, in one process: its time, cProfile or torch.profiler.

    OMP_NUM_THREADS=1 python benchmarks/probes/update_actor.py time|cprof|tprof [KEY=VALUE ...]

Environment: CFG (the RL config, default examples/grpo_long.yaml), BD (the run folder whose
``batches/`` a run with ``rl.record_batches`` wrote, default /tmp/prof_long), B0 / B1 (the
steps, default 2-12). results/update_profile/README.md has the commands and what they showed.
"""

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

from shardwise.config import load_config  # noqa: E402
from shardwise.data.batch import Batch  # noqa: E402
from shardwise.distributed.runtime import init_distributed  # noqa: E402
from shardwise.rl.workers.actor import ActorWorker  # noqa: E402

torch.set_num_threads(1)
runtime = init_distributed(timeout_s=60)
cfg = load_config(os.environ.get("CFG", "examples/grpo_long.yaml"),
                  ["rl.actor.off_policy.correction=tis", "rl.async.enabled=true", "rl.async.generator_ranks=1",
                   *sys.argv[2:]])
actor = ActorWorker(cfg, runtime)
BD = os.environ.get("BD", "/tmp/prof_long")
batches = [Batch.from_bytes(open(f"{BD}/batches/step_{i:08d}.batch", "rb").read())
           for i in range(int(os.environ.get("B0", "2")), int(os.environ.get("B1", "13")))]
print({k: tuple(v.shape) for k, v in batches[0].tensors.items()})


def run() -> list[float]:
    ts = []
    for b in batches:
        t = time.perf_counter()
        actor.update_actor(b)
        ts.append(time.perf_counter() - t)
    return ts


run()
mode = sys.argv[1]
if mode == "time":
    for _ in range(3):
        ts = run()
        print("update s mean", sum(ts) / len(ts))
elif mode == "cprof":
    pr = cProfile.Profile()
    pr.enable()
    run()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
elif mode == "tprof":
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        run()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
