"""Jobs on several machines (`shardwise train --nnodes N`), with "nodes" that are separate
launcher processes on 127.0.0.1: the same losses as one node of the same world size, exact
resume across node counts, a failure or a killed node ending every node in seconds with
one line, a node that never comes, the run folder's lock per job, and bad flags.

Each "node" is a real `shardwise train` process with its own torchrun and error folder; the
nodes of a job meet at a free port (static rendezvous at node 0, or c10d).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, SRC_DIR, Background, _process_tree, alive, at_once, free_port, run_cli

SFT = str(REPO_ROOT / "examples" / "sft_arithmetic.yaml")
TRAIN = [SFT, TINY_QWEN3, "data.max_length=16", "train.micro_batch_size=4", "train.log_every=1",
         # A constant rate: a run of 2 steps and one of 4 take the same steps (cosine's depend on max_steps).
         "train.scheduler.name=constant", "train.scheduler.warmup_steps=0",
         "checkpoint.every_steps=2", "checkpoint.async=false", "checkpoint.export_hf=false"]


def one_line(res: subprocess.CompletedProcess, code: int) -> str:
    """The single `shardwise:` line of a failed command (asserted to be the only one)."""
    report = f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-3000:]}\n--- stderr ---\n{res.stderr[-3000:]}"
    assert res.returncode == code, report
    assert "Traceback" not in res.stderr, report
    lines = [x for x in res.stderr.splitlines() if x.startswith("shardwise: ")]
    assert len(lines) == 1, report
    return lines[0]


def static(node: int, nodes: int, port: int, host: str = "127.0.0.1") -> list[str]:
    return ["--nnodes", str(nodes), "--node-rank", str(node), "--master-addr", host, "--master-port", str(port)]


def run_nodes(nodes: int, nproc: int, run_dir: Path, *overrides: str, c10d: bool = False,
              timeout: float = 240, hosts: tuple[str, ...] = ("127.0.0.1",)) -> list[subprocess.CompletedProcess]:
    """`shardwise train` on `nodes` local "nodes" of `nproc` ranks each, side by side; node i
    names the rendezvous host `hosts[i % len(hosts)]`."""
    port = free_port()

    def node(i: int) -> subprocess.CompletedProcess:
        host = hosts[i % len(hosts)]
        where = (["--nnodes", str(nodes), "--rdzv-endpoint", f"{host}:{port}"] if c10d
                 else static(i, nodes, port, host))
        return run_cli(["train", *TRAIN, "--nproc", str(nproc), *where, f"run.dir={run_dir}", *overrides],
                       timeout=timeout)

    results = at_once(*(lambda i=i: node(i) for i in range(nodes)))
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    return results


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # not the evaluation's lines


# ------------------------------------------------------------ same losses, resume


def test_two_nodes_of_either_rendezvous_train_like_one_and_resume_exactly_on_one(tmp_path):
    # Same world size (2), same data order, same mesh (FSDP over 2 ranks): the losses are
    # bitwise those of one node, whether the 2 ranks share a machine or not.
    # - static: the nodes name node 0 differently (127.0.0.1, localhost): one job all the
    #   same, which shares the run folder's lock.
    # - c10d: the nodes are numbered as they arrive, so global rank 0 may be on either: the
    #   job's metrics still come from it, the lock is taken once.
    # (A third node adds nothing here that two do not: it cost ~60 s of CPU per run.)
    reference, split, c10d = tmp_path / "one_node", tmp_path / "two_nodes", tmp_path / "two_nodes_c10d"
    batch = ["train.global_batch_size=8"]
    at_once(lambda: run_nodes(1, 2, reference, *batch, "train.max_steps=4"),
            lambda: run_nodes(2, 1, split, *batch, "train.max_steps=2", hosts=("127.0.0.1", "localhost")),
            lambda: run_nodes(2, 1, c10d, *batch, "train.max_steps=2", c10d=True))
    ref = losses(reference)
    assert sorted(ref) == [1, 2, 3, 4]
    assert losses(split) == {1: ref[1], 2: ref[2]} == losses(c10d)
    assert (split / "checkpoints" / "step_00000002" / "COMMITTED").is_file()
    # The 2-node job's checkpoint, resumed by one node of 2 ranks: steps 3 and 4 as if
    # the job had never stopped.
    run_nodes(1, 2, split, *batch, "train.max_steps=4")
    assert losses(split) == ref
    print(f"\nlosses: one node {ref}; two nodes (1-2) then one node (3-4) {losses(split)}; "
          f"two nodes by c10d {losses(c10d)}")


def test_hsdp_shards_within_nodes_and_replicates_across_them(tmp_path):
    # 2 nodes of 2 ranks, c10d (nodes numbered as they arrive), parallel.fsdp_size=2 (the
    # per-node rank count): each shard group is one node's ranks, each replicate group
    # takes one rank of every node. The mesh of every rank, as shardwise builds it.
    from shardwise.distributed.launch import launch_torchrun
    from shardwise.distributed.nodes import Nodes

    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests" / "dist"), str(SRC_DIR)])}
    port = free_port()
    results = at_once(*(lambda: launch_torchrun(2, [str(tmp_path), "2"], env=env, module="mesh_job",
                                                nodes=Nodes(2, None, f"127.0.0.1:{port}", "c10d", 60))
                        for _ in range(2)))
    assert [r.returncode for r in results] == [0, 0], [r.failure for r in results]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    node_of = {r["rank"]: r["node"] for r in ranks}
    for r in ranks:
        assert r["shard"] == [q for q in range(4) if node_of[q] == r["node"]], ranks
        assert len(r["replicate"]) == 2 and {node_of[q] for q in r["replicate"]} == {0, 1}, ranks


# ------------------------------------------------------------ failures across nodes


def test_a_failing_rank_on_one_node_names_the_cause_on_every_node():
    # Rank 1 (node 1) raises while rank 0 (node 0) waits in a barrier: node 0's rank sees
    # only a closed gloo connection, and its launcher prints node 1's error, read from the
    # rendezvous store, instead.
    from shardwise.distributed.launch import launch_torchrun
    from shardwise.distributed.nodes import Nodes

    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests" / "dist"), str(SRC_DIR)])}
    port = free_port()
    t0 = time.monotonic()
    node0, node1 = at_once(*(lambda i=i: launch_torchrun(
        1, ["internal", "1"], env=env, module="fault_job",
        nodes=Nodes(2, i, f"127.0.0.1:{port}", "static", 60)) for i in range(2)))
    elapsed = time.monotonic() - t0
    assert node1.failure is not None and node1.failure.line() == "rank 1 failed: RuntimeError: injected failure"
    assert node0.failure is not None and node0.failure.remote, node0.failure
    assert node0.failure.line() == "the job failed on node 1: rank 1 failed: RuntimeError: injected failure"
    assert node0.returncode == 1 and node1.returncode == 1
    assert elapsed < 60, elapsed  # rank 0 waited in a barrier with a 600 s timeout


class Node(Background):
    """One node of a `shardwise train` job in the background, in a session of its own."""

    def __init__(self, tmp_path: Path, node: int, nodes: int, port: int, *overrides: str):
        super().__init__(["train", *TRAIN, "--nproc", "1", *static(node, nodes, port), *overrides],
                         tmp_path / f"node{node}.txt", env={"PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("victim,sig", [
    (1, signal.SIGKILL),  # kill -9 of node 1's shardwise: nothing of it speaks, node 0's store lives on
    (0, signal.SIGTERM),  # node 0 stops (and says so), taking the rendezvous store with it
], ids=["kill_9_node_1", "sigterm_node_0"])
def test_a_node_that_ends_ends_the_others_in_seconds(victim, sig, tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    job = ["train.global_batch_size=8", "train.max_steps=100000", "checkpoint.every_steps=0", f"run.dir={run_dir}"]
    nodes = [Node(tmp_path, i, 2, port, *job) for i in range(2)]
    doomed, survivor = nodes[victim], nodes[1 - victim]
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline, nodes[0].output() + nodes[1].output()
            assert all(n.proc.poll() is None for n in nodes), nodes[0].output() + nodes[1].output()
            time.sleep(0.2)
        pids = _process_tree(doomed.proc.pid)  # shardwise, torchrun, the rank
        assert len(pids) >= 3, pids
        t0 = time.monotonic()
        os.kill(doomed.proc.pid, sig)
        survivor.proc.wait(timeout=60)
        ended = time.monotonic() - t0
        out = survivor.output()
        lines = [x for x in out.splitlines() if x.startswith("shardwise: ")]
        assert survivor.proc.returncode == 1, out
        assert len(lines) == 1, out
        assert lines[0].startswith(f"shardwise: the job failed on another node: rank {1 - victim} lost a peer"), out
        assert "Traceback" not in out and "[c10d]" not in out and "frame #" not in out, out
        doomed.proc.wait(timeout=60)
        assert not alive(pids[1:]), pids
        if sig == signal.SIGTERM:
            said = [x for x in doomed.output().splitlines() if x.startswith("shardwise: ")]
            assert doomed.proc.returncode == 143 and len(said) == 1 and "interrupted by SIGTERM" in said[0], said
        print(f"\nnode {1 - victim} ended {ended:.1f} s after {sig.name} to node {victim}: {lines[0]}")
        assert ended < 60, ended  # seconds, not the process group's 600 s timeout (a loaded CI machine: 60)
    finally:
        for n in nodes:
            n.close()


def test_a_node_that_never_comes_fails_in_bounded_time_naming_the_endpoint(tmp_path):
    # Node 1 alone: torchrun's store client retries node 0, whose C++ logs (an error with a
    # C++ stack per try) must not reach the terminal: the whole of stderr is one line.
    port = free_port()
    t0 = time.monotonic()
    res = run_cli(["train", *TRAIN, "--nproc", "1", *static(1, 2, port), "--rdzv-timeout", "3",
                   f"run.dir={tmp_path / 'run'}", "train.global_batch_size=8"], timeout=120)
    line = one_line(res, 1)
    said = [x for x in res.stderr.strip().splitlines() if x.strip() and not x.startswith("shardwise launch:")]
    assert said == [line], res.stderr
    assert f"did not meet at the rendezvous 127.0.0.1:{port} within 3 s" in line, line
    assert time.monotonic() - t0 < 90


# torch's own words when its timeout comes first; the wrapper's bound (--rdzv-timeout + 2 s
# from the launch) comes first where starting the wrapper took more than 3 s (a loaded machine)
@pytest.mark.parametrize("backend,rank,words", [
    ("static", 0, ["1/2 clients joined", "this node hosts the rendezvous"]),  # node 1 never came
    ("c10d", None, ["RendezvousTimeoutError", "this node hosts the rendezvous"]),
])
def test_a_lone_node_of_either_rendezvous_fails_in_bounded_time(backend, rank, words):
    from shardwise.distributed.launch import RENDEZVOUS_FAILED, launch_torchrun
    from shardwise.distributed.nodes import Nodes

    endpoint = f"127.0.0.1:{free_port()}"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests" / "dist"), str(SRC_DIR)])}
    t0 = time.monotonic()
    res = launch_torchrun(1, ["internal", "1"], env=env, module="fault_job", nodes=Nodes(2, rank, endpoint, backend, 3))
    assert res.returncode == 1 and res.failure is not None and res.failure.type == RENDEZVOUS_FAILED, res
    line = res.failure.line()
    assert line.startswith(f"the job's 2 nodes did not meet at the rendezvous {endpoint} within 3 s"), line
    assert any(w in line for w in words), line
    assert "another program" not in line, line
    assert time.monotonic() - t0 < 60


def test_a_node_pointed_at_a_port_another_program_holds_fails_in_bounded_time():
    # The port is held by a program that takes connections and never answers (no rendezvous
    # store): torchrun's store client waited on it for as long as it lived. The node ends
    # while the program still holds the port, with the line of a rendezvous that failed.
    from shardwise.distributed.launch import RENDEZVOUS_FAILED, launch_torchrun
    from shardwise.distributed.nodes import Nodes, rendezvous_bound_s

    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests" / "dist"), str(SRC_DIR)])}
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        endpoint = f"127.0.0.1:{squatter.getsockname()[1]}"
        gone = threading.Event()  # the program gives the port up at last (a node that waits on it fails)
        timer = threading.Timer(150, lambda: (gone.set(), squatter.close()))
        timer.start()
        try:
            res = launch_torchrun(1, ["internal", "1"], env=env, module="fault_job",
                                  nodes=Nodes(2, 1, endpoint, "static", 1))
        finally:
            timer.cancel()
        assert not gone.is_set(), res
    assert res.returncode == 1 and res.failure is not None and res.failure.type == RENDEZVOUS_FAILED, res
    line = res.failure.line()
    assert line.startswith(f"the job's 2 nodes did not meet at the rendezvous {endpoint} within 1 s"), line
    assert "takes connections but did not answer as the job's rendezvous" in line, line
    assert "is another program listening on that port?" in line, line
    # issue 50: the bound is the bound, --rdzv-timeout + 2 s from torchrun's launch (it was a
    # tenth more + 10 s from its start: --rdzv-timeout 40 ended after 60 s); the line names it
    assert "within --rdzv-timeout 1 s (+2 s)" in line, line
    assert rendezvous_bound_s(40) == 42


# ------------------------------------------------------------ the lock, bad flags


def test_the_run_dir_lock_is_per_job_not_per_node(tmp_path):
    from shardwise.errors import ConfigError
    from shardwise.jobs.rundir import RunDirLock

    job = "rendezvous 127.0.0.1:29500 of 2 nodes"
    holder = RunDirLock(tmp_path, "shardwise train a.yaml --node-rank 0", job).acquire()
    try:
        peer = RunDirLock(tmp_path, "shardwise train a.yaml --node-rank 1", job)
        peer.check_free()
        assert peer.acquire().peer_holder is not None and peer.peer_holder["job"] == job
        peer.release()
        for other in ("rendezvous 127.0.0.1:29501 of 2 nodes", None):
            with pytest.raises(ConfigError) as e:
                RunDirLock(tmp_path, "shardwise train b.yaml", other).acquire()
            text = str(e.value)
            assert "in use by another shardwise job" in text and f"the {job}" in text, text
            assert "the lock is per job" in text, text
    finally:
        holder.release()
    RunDirLock(tmp_path, "shardwise train b.yaml", None).acquire().release()  # free again


def test_nodes_naming_the_rendezvous_host_differently_are_one_job(tmp_path):
    # localhost and 127.0.0.1 are one host: the nodes' keys name one job (the lock shares),
    # while another port or node count is another job (refused).
    from shardwise.distributed.nodes import nodes_from_args, same_job
    from shardwise.errors import ConfigError
    from shardwise.jobs.rundir import RunDirLock

    def job(host: str, port: int = 29500, count: int = 2) -> str:
        return nodes_from_args(count, 0, host, port, None, None).job

    assert same_job(job("127.0.0.1"), job("localhost")) and same_job(job("localhost"), job("127.0.0.1"))
    assert same_job(job("127.0.0.1"), job("127.0.0.1"))
    assert not same_job(job("127.0.0.1"), job("localhost", port=29501))
    assert not same_job(job("127.0.0.1"), job("localhost", count=3))
    assert not same_job(job("127.0.0.1"), None) and not same_job(None, None)
    holder = RunDirLock(tmp_path, "shardwise train a.yaml --node-rank 0", job("127.0.0.1")).acquire()
    try:
        peer = RunDirLock(tmp_path, "shardwise train a.yaml --node-rank 1", job("localhost"))
        peer.check_free()
        assert peer.acquire().peer_holder is not None
        peer.release()
        with pytest.raises(ConfigError, match="in use by another shardwise job"):
            RunDirLock(tmp_path, "shardwise train b.yaml", job("localhost", port=29501)).acquire()
    finally:
        holder.release()


BAD_FLAGS = {
    # name: (flags, words in the line)
    "node_rank_too_big": (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
                          ["--node-rank", "2 is outside [0, 2)"]),
    "node_rank_negative": (["--nnodes", "3", "--node-rank", "-1", "--master-addr", "127.0.0.1"],
                           ["--node-rank", "-1 is outside [0, 3)"]),
    "nowhere_to_meet": (["--nnodes", "2", "--node-rank", "0"], ["--nnodes", "--master-addr", "--rdzv-endpoint"]),
    "no_node_rank": (["--nnodes", "2", "--master-addr", "127.0.0.1"], ["--node-rank", "is needed"]),
    "endpoint_without_port": (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1"], ["--rdzv-endpoint", "HOST:PORT"]),
    "two_places": (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--master-addr", "h", "--node-rank", "0"],
                   ["--rdzv-endpoint", "--master-addr"]),
}


@pytest.mark.parametrize("command", ["train", "infer"])
@pytest.mark.parametrize("name", list(BAD_FLAGS))
def test_bad_node_flags_exit_2_with_one_line_before_anything_starts(name, command, tmp_path, capsys):
    from shardwise.cli import main

    flags, words = BAD_FLAGS[name]
    config = SFT if command == "train" else str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")
    code = main([command, config, "--nproc", "1", *flags, f"run.dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("shardwise: "), err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "run").exists()


def test_bad_node_rank_through_the_real_command(tmp_path):
    res = run_cli(["train", SFT, "--nproc", "1", "--nnodes", "2", "--node-rank", "5", "--master-addr", "127.0.0.1",
                   f"run.dir={tmp_path / 'run'}"], timeout=120)
    assert "--node-rank" in one_line(res, 2)
    assert not (tmp_path / "run").exists()
