"""Dispatch rules: pure split/collect tables, then a real 2-worker Ray group whose workers
form one gloo process group."""

from __future__ import annotations

import pytest
import torch

from shardwise.data.batch import Batch
from shardwise.rl.dispatch import (
    Dispatch,
    Layout,
    collect_results,
    dispatch_rule,
    register,
    split_arguments,
)


def rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n, dtype=torch.float32).unsqueeze(1)},
                           {"name": [f"r{i}" for i in range(n)]})


class EchoWorker:
    """A worker whose methods show what each rank received."""

    def __init__(self, offset: float, runtime):
        self.runtime = runtime
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def hello(self, word: str) -> str:
        return f"{word} from {self.runtime.rank}/{self.runtime.world_size}"

    @register(Dispatch.DP_COMPUTE)
    def double(self, batch: Batch) -> Batch:
        out = Batch.from_dict({"y": batch.tensors["x"] * 2 + self.offset,
                               "rank": torch.full((len(batch),), self.runtime.rank)},
                              {"name": batch.arrays["name"]})
        return out

    @register(Dispatch.DP_COMPUTE, collect="first", pad=False)
    def global_sum(self, batch: Batch) -> float:
        import torch.distributed as dist

        s = batch.tensors["x"].sum().double()
        dist.all_reduce(s)  # the workers really form one process group
        return float(s)

    @register(Dispatch.ALL_TO_ALL)
    def times(self, k: int) -> int:
        return k * (self.runtime.rank + 1)

    @register(Dispatch.RANK_ZERO)
    def whoami(self) -> int:
        return self.runtime.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep_on(self, rank: int, seconds: float) -> int:
        import time
        if self.runtime.rank == rank:
            time.sleep(seconds)
        return self.runtime.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        import torch.distributed as dist

        if self.runtime.rank == rank:
            raise RuntimeError("boom")
        dist.barrier()  # the peer would wait here forever without the group's failure handling
        return 0


# ----------------------------------------------------------------- pure rules


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 19])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_dp_compute_round_trip(n, dp):
    rule = dispatch_rule(EchoWorker, "double")
    layout = Layout.data_parallel(dp)
    calls, pad = split_arguments(rule, layout, "double", (rows(n),), {})
    assert pad == -n % dp and len(calls) == dp
    assert len({len(c[0][0]) for c in calls}) == 1  # equal chunks
    results = [c[0][0] for c in calls]  # identity "method"
    out = collect_results(rule, layout, "double", results, pad)
    assert out.tensors["x"].flatten().tolist() == list(range(n))
    assert list(out.arrays["name"]) == [f"r{i}" for i in range(n)]


def test_sequence_parallel_peers_share_a_chunk_and_one_returns():
    layout = Layout(dp_ranks=(0, 0, 1, 1), collects=(True, False, True, False))
    rule = dispatch_rule(EchoWorker, "double")
    calls, pad = split_arguments(rule, layout, "double", (rows(5),), {})
    got = [c[0][0].tensors["x"].flatten().tolist() for c in calls]
    assert got[0] == got[1] == [0, 1, 2] and got[2] == got[3] == [3, 4, 0]
    results = [c[0][0] if i % 2 == 0 else None for i, c in enumerate(calls)]
    out = collect_results(rule, layout, "double", results, pad)
    assert out.tensors["x"].flatten().tolist() == [0, 1, 2, 3, 4]


def test_no_pad_rule_rejects_rows_that_do_not_divide():
    rule = dispatch_rule(EchoWorker, "global_sum")
    with pytest.raises(ValueError, match="do not divide into 2 data-parallel ranks"):
        split_arguments(rule, Layout.data_parallel(2), "global_sum", (rows(3),), {})


def test_other_rules():
    layout = Layout.data_parallel(3)
    one = dispatch_rule(EchoWorker, "hello")
    calls, _ = split_arguments(one, layout, "hello", ("hi",), {})
    assert calls == [(("hi",), {})] * 3
    a2a = dispatch_rule(EchoWorker, "times")
    calls, _ = split_arguments(a2a, layout, "times", ([1, 2, 3],), {})
    assert [c[0] for c in calls] == [(1,), (2,), (3,)]
    with pytest.raises(ValueError, match="one entry per worker"):
        split_arguments(a2a, layout, "times", ([1, 2],), {})
    zero = dispatch_rule(EchoWorker, "whoami")
    calls, _ = split_arguments(zero, layout, "whoami", (), {})
    assert calls[1:] == [None, None]
    assert collect_results(zero, layout, "whoami", [7, None, None], 0) == 7
    with pytest.raises(ValueError, match="exactly one must collect"):
        Layout(dp_ranks=(0, 0), collects=(True, True))
    with pytest.raises(ValueError, match="needs DP_COMPUTE"):
        register(Dispatch.ONE_TO_ALL, collect="concat")


# ----------------------------------------------------------------- a real Ray group


@pytest.fixture(scope="module")
def ray_group():
    pytest.importorskip("ray")
    from shardwise.rl.cluster import RayWorkerGroup, init_ray, shutdown_ray

    init_ray(num_cpus=4)
    group = RayWorkerGroup(EchoWorker, 2, 0.5, name="echo")
    yield group
    group.shutdown()
    shutdown_ray()


def test_ray_group_dispatch_keeps_order_and_length(ray_group):
    assert ray_group.hello("hi") == ["hi from 0/2", "hi from 1/2"]
    for n in (1, 3, 10):
        out = ray_group.double(rows(n))
        assert len(out) == n
        assert out.tensors["y"].flatten().tolist() == [2 * i + 0.5 for i in range(n)]
        assert list(out.arrays["name"]) == [f"r{i}" for i in range(n)]
        half = (n + 1) // 2  # rank 0 got the first ceil(n/2) rows (after padding to even)
        assert out.tensors["rank"].tolist() == [0] * half + [1] * (n - half)
    assert ray_group.global_sum(rows(10)) == float(sum(range(10)))
    assert ray_group.times([10, 20]) == [10, 40]
    assert ray_group.whoami() == 0
    with pytest.raises(AttributeError, match="not a worker method"):
        _ = ray_group.offset


def test_ray_group_failure_raises_instead_of_hanging():
    pytest.importorskip("ray")
    from shardwise.rl.cluster import RayWorkerGroup, WorkerError, init_ray

    init_ray(num_cpus=4)
    group = RayWorkerGroup(EchoWorker, 2, 0.0, name="failing")
    with pytest.raises(WorkerError, match="rank 1: RuntimeError: boom"):
        group.fail_on(1)
    with pytest.raises(WorkerError, match="shut down"):
        group.hello("again")


def test_submitted_calls_join_like_call_and_a_timeout_names_the_silent_rank(ray_group):
    pytest.importorskip("ray")
    from shardwise.rl.cluster import RayWorkerGroup, WorkerError

    first, second = ray_group.submit("double", rows(3)), ray_group.submit("hello", "hi")
    assert second.result(30) == ["hi from 0/2", "hi from 1/2"]  # a rank runs its calls in order
    assert first.ready() and first.result(30).tensors["y"].flatten().tolist() == [0.5, 2.5, 4.5]
    slow = RayWorkerGroup(EchoWorker, 2, 0.0, name="slow")
    pending = slow.submit("sleep_on", 1, 60.0)
    with pytest.raises(WorkerError) as e:
        pending.result(1.0, what="sleeping for the test")
    assert str(e.value) == "worker group 'slow': sleeping for the test did not finish in 1 s (rank 1 did not answer)"
    with pytest.raises(WorkerError, match="shut down"):
        slow.hello("again")


JOIN_SCRIPT = """
import os, ray
from shardwise.rl.cluster import RayWorkerGroup, init_ray
from test_rl_dispatch import EchoWorker, rows
init_ray()
group = RayWorkerGroup(EchoWorker, 2, 0.5, name="joined")
out = group.double(rows(3))
print("gcs", ray.get_runtime_context().gcs_address)
print("hello", group.hello("hi"))
print("rows", out.tensors["y"].flatten().tolist())
group.shutdown()
"""


def test_ray_address_joins_an_existing_cluster():
    """With RAY_ADDRESS set, the worker group lands on that cluster (a head started here
    with `ray start --head --block`, stopped afterwards and its process group killed)."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from dist.launcher import REPO_ROOT, free_port

    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).parent / "ray"
    import tempfile

    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must stay under 108 bytes
    # token auth off for this throw-away local head (and its client): no token file to manage
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", f"--temp-dir={temp_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        pythonpath = os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT / "tests"), env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-c", JOIN_SCRIPT], capture_output=True, text=True, timeout=180,
                              env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "PYTHONPATH": pythonpath})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.splitlines()[0].endswith(f":{port}"), proc.stdout  # the head we started
        assert "hello ['hi from 0/2', 'hi from 1/2']" in proc.stdout
        assert "rows [0.5, 2.5, 4.5]" in proc.stdout
    finally:
        # SIGTERM to `ray start` alone: it stops the head's processes and exits (~4 s). Sent
        # to the whole group, the head's children die first and `ray start` does not exit.
        head.terminate()
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # anything of the head still in its group
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)
