"""What running a user's reward function in a contained child costs (issue 30, 4.4).

A step's rows are scored in one round trip to the child (`shardwise.data.rewards.
ContainedReward`); this measures, for a trivial function (so the figure is the overhead
alone), the seconds per step in-process and contained for a few batch sizes, the child's
start (once per job, overlapped with Ray's start in `shardwise rl`) and its stop:

    PYTHONPATH=src python benchmarks/contained_reward.py [--repeats 20]

Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from shardwise.data.rewards import ContainedReward, _call, resolve_reward_fn

SOURCE = "def score(prompt, response, ground_truth):\n    return float(response == ground_truth)\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "bench_reward.py").write_text(SOURCE)
        os.chdir(folder)
        sys.path.insert(0, folder)
        fn = resolve_reward_fn("bench_reward:score")
        contained = ContainedReward(fn, "bench_reward:score")
        t0 = time.perf_counter()
        contained.start()
        contained._child._wait_ready()
        start_s = time.perf_counter() - t0
        print(f"child start (import of shardwise.contained, reward_row and the function): {start_s * 1e3:.0f} ms")
        print(f"{'rows per step':>14} {'in-process ms':>14} {'contained ms':>13} {'overhead ms':>12} {'per row us':>11}")
        for n in (8, 64, 512, 4096):
            rows = [(f"{i}+{i}=", str(2 * i), str(2 * i), None, None) for i in range(n)]
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                here = [_call(fn, p, r, t, i, s, x, 60.0) for i, (p, r, t, s, x) in enumerate(rows)]
            here_s = (time.perf_counter() - t0) / args.repeats
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                there = contained.score_rows(rows, 60.0)
            there_s = (time.perf_counter() - t0) / args.repeats
            assert here == there
            print(f"{n:>14} {here_s * 1e3:>14.2f} {there_s * 1e3:>13.2f} {(there_s - here_s) * 1e3:>12.2f} "
                  f"{(there_s - here_s) / n * 1e6:>11.1f}")
        t0 = time.perf_counter()
        contained.close()
        print(f"child stop (SIGKILL of its tree, /proc walks): {(time.perf_counter() - t0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
