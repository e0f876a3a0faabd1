"""Tests of the multi-process harness itself (tests/dist/launcher.py).

Each failure mode the harness promises to turn into a fast, readable AssertionError is
provoked for real: a raising rank, a rank that dies, a collective that never completes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, free_port, run_cli, run_ranks, run_torchrun

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "SHARDWISE_TEST_MARK")


# ---------------------------------------------------------------- rank bodies
# (module level: a spawned process imports them by name)


def _all_reduce_body(rank: int, world_size: int, scale: float) -> dict:
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    total = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(total)
    return {
        "rank": rank,
        "pid": os.getpid(),
        "sum": total,
        "mine": torch.arange(rank + 1, dtype=torch.int64),  # differs per rank: proves the order
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "threads": torch.get_num_threads(),
        "nested": [("a", 1), {"b": None, "c": 2.5}],
    }


def _own_init_body(rank: int, world_size: int) -> list:
    assert not dist.is_initialized(), "init_pg=False must leave process-group setup to fn"
    dist.init_process_group("gloo")  # env:// from the variables the harness set, like torchrun
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, f"r{rank}")
    dist.destroy_process_group()
    return gathered


def _raise_on_rank1_body(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("bad shard size on rank one")
    print(f"rank {rank} finished its work", flush=True)
    return rank


def _exit_on_rank1_body(rank: int, world_size: int) -> int:
    if rank == 1:
        print("rank 1 is about to os._exit(3)", flush=True)
        os._exit(3)
    return rank


def _skip_barrier_body(rank: int, world_size: int, pid_file: str) -> None:
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    if rank == 0:
        print("rank 0 enters the barrier", flush=True)
        dist.barrier()
        return None
    # Rank 1 skips the collective and stays alive (busy elsewhere), with a child of its own.
    child = subprocess.Popen(["sleep", "300"])
    with open(pid_file, "a") as f:
        f.write(f"{child.pid}\n")
    print("rank 1 skipped the barrier", flush=True)
    time.sleep(600)
    return None


class _NotAllowed:
    pass


def _bad_return_body(rank: int, world_size: int) -> object:
    return _NotAllowed()


# --------------------------------------------------------------------- helpers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")  # a zombie is dead, only not yet reaped by its parent


def _assert_all_dead(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == [], f"processes left running among {pids}"


# ----------------------------------------------------------------------- tests


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_ranks(_all_reduce_body, world_size, 0.5, init_pg=True,
                        env={"SHARDWISE_TEST_MARK": "seen"}, timeout=120)
    assert len(results) == world_size
    expected_sum = torch.full((3,), 0.5 * world_size * (world_size + 1) / 2)
    ports = set()
    pids = set()
    for rank, res in enumerate(results):
        assert res["rank"] == rank
        assert torch.equal(res["mine"], torch.arange(rank + 1, dtype=torch.int64))
        assert res["sum"].dtype == torch.float32
        assert torch.equal(res["sum"], expected_sum)
        env = res["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] == "1" and res["threads"] == 1
        assert env["SHARDWISE_TEST_MARK"] == "seen"
        assert res["nested"] == [("a", 1), {"b": None, "c": 2.5}]
        ports.add(env["MASTER_PORT"])
        pids.add(res["pid"])
    assert len(ports) == 1
    assert len(pids) == world_size and os.getpid() not in pids  # real, separate processes


def test_fn_can_set_up_its_own_process_group() -> None:
    results = run_ranks(_own_init_body, 2, timeout=120)
    assert results == [["r0", "r1"], ["r0", "r1"]]


def test_rank_exception_is_reported_with_rank_and_traceback() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_raise_on_rank1_body, 2, init_pg=True, timeout=120)
    message = str(info.value)
    assert "rank 1 raised ValueError" in message
    assert "bad shard size on rank one" in message
    assert "Traceback (most recent call last)" in message
    assert "_raise_on_rank1_body" in message
    assert "rank 0 finished its work" in message  # other ranks' log tails are included
    assert "rank 0 raised" not in message


def test_hung_collective_fails_within_timeout_and_kills_everything(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_skip_barrier_body, 2, str(pid_file), init_pg=True, timeout=15)
    elapsed = time.monotonic() - start
    assert elapsed < 40, f"run_ranks took {elapsed:.1f} s to give up (timeout was 15 s)"
    message = str(info.value)
    assert "timed out after 15.0 s; ranks [0, 1] had not finished" in message
    assert "rank 0 enters the barrier" in message and "rank 1 skipped the barrier" in message
    assert "in barrier" in message  # rank 0's stack dump shows where it hung
    pids = [int(line) for line in pid_file.read_text().split()]
    assert len(pids) == 3  # two ranks and rank 1's child
    _assert_all_dead(pids)


def test_child_dying_without_result_reports_exit_code() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_exit_on_rank1_body, 2, timeout=120)
    message = str(info.value)
    assert "rank 1 died without a result, exit code 3" in message
    assert "rank 1 is about to os._exit(3)" in message
    assert "rank 0: returned, exit code 0" in message


def test_unloadable_return_value_is_a_rank_error() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_bad_return_body, 1, timeout=120)
    message = str(info.value)
    assert "rank 0 raised" in message and "weights_only" in message


def test_non_module_level_fn_is_rejected_before_spawning() -> None:
    with pytest.raises(TypeError, match="module-level"):
        run_ranks(lambda rank, world_size: rank, 2)


def test_run_torchrun_collects_every_rank_output(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text(
        "import os, sys\n"
        "print(f\"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "
        "threads={os.environ['OMP_NUM_THREADS']} arg={sys.argv[1]}\")\n"
    )
    proc = run_torchrun([str(script), "xyz"], nproc=2, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"hello from rank {rank} of 2 threads=1 arg=xyz" in proc.stdout


def test_run_torchrun_timeout_kills_the_workers(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, sys, time\n"
        f"open(os.path.join({str(pid_dir)!r}, str(os.getpid())), 'w').close()\n"
        "print(f\"rank {os.environ['RANK']} hanging\", flush=True)\n"
        "time.sleep(600)\n"
    )
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_torchrun([str(script)], nproc=2, timeout=10)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "timed out after 10.0 s" in message
    pids = [int(p.name) for p in pid_dir.iterdir()]
    assert len(pids) == 2, f"workers did not start within the timeout: {message}"
    assert "rank 0 hanging" in message and "rank 1 hanging" in message
    _assert_all_dead(pids)


def test_a_forked_command_is_the_command_a_fresh_process_runs(tmp_path: Path) -> None:
    """`run_cli` forks its commands from a server that imported shardwise once; a command so
    started answers what `python -m shardwise.cli` answers (status, stdout, stderr), in its
    working directory (a user module there is importable), with the environment given. The
    ranks torchrun forks (`launch.fork_ranks`: no GPU here) write what fresh ranks write."""
    (tmp_path / "cfg.yaml").write_text("train:\n  max_stepz: 3\n")
    (tmp_path / "scorer.py").write_text("import os\n"
                                        "def score(prompt, response, ground_truth):\n"
                                        "    return float(os.environ['SCORE'])\n")
    cases = [["plan", "cfg.yaml"], ["--help"], ["config", "--only", "train.max_steps"]]
    for argv in cases:
        forked, fresh = (run_cli(argv, timeout=120, cwd=tmp_path, env={"SCORE": "1"}, fresh=f) for f in (False, True))
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr), argv
    assert "max_stepz" in run_cli(cases[0], timeout=60, cwd=tmp_path).stderr
    written = []
    for fresh_ranks in ("0", "1"):
        out = tmp_path / f"gen{fresh_ranks}.jsonl"
        res = run_cli(["infer", str(REPO_ROOT / "examples" / "infer_arithmetic.yaml"), "--nproc", "2",
                       "model.path=null", TINY_QWEN3, "infer.num_prompts=4", "infer.max_new_tokens=2",
                       "infer.reward=scorer:score", f"infer.output={out}", f"run.dir={tmp_path / ('run' + fresh_ranks)}"],
                      timeout=300, cwd=tmp_path, env={"SCORE": "0.5", "SHARDWISE_FRESH_RANKS": fresh_ranks})
        assert res.returncode == 0, res.stderr[-3000:]
        written.append(out.read_text())
    assert [json.loads(x)["score"] for x in written[0].splitlines()] == [0.5] * 4
    assert written[0] == written[1]


def test_run_cli_runs_the_shardwise_cli_from_any_directory(tmp_path: Path) -> None:
    proc = run_cli(["--help"], timeout=60, cwd=tmp_path, fresh=True)  # src/ reaches the child via PYTHONPATH
    assert proc.args == [sys.executable, "-m", "shardwise.cli", "--help"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage" in (proc.stdout + proc.stderr).lower()
