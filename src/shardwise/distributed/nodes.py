"""Where the launchers of a multi-node job meet (`Nodes`): the multi-node flags of
`shardwise train|infer` read into one (`nodes_from_args`), the ranks each node starts, the
run folder's job key compared across the names of one host (`same_job`), and how long a
node's torchrun may wait for the others (`rendezvous_bound_s`). Used by the launching side
(`shardwise.distributed.launch`, which re-exports these names) and the torchrun wrapper.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Literal

from shardwise.errors import ConfigError

RDZV_TIMEOUT_S = 300
"""Seconds a node waits at the rendezvous for the job's other nodes (``--rdzv-timeout``):
long enough for nodes started by hand or by a scheduler minutes apart, short enough that a
node that never comes ends the others with one line naming the endpoint."""
RDZV_MARGIN_S = 2.0
"""Beyond ``--rdzv-timeout``, how long a node's torchrun may go without starting its ranks
before it ends itself (`rendezvous_bound_s`): room for torch's own timeouts, which start a
moment after the wrapper's and name what was missing, to come first (issue 50: a margin of
a tenth plus 10 s made ``--rdzv-timeout 40`` end after 60 s)."""
MASTER_PORT = 29500
"""torchrun's default ``--master-port``."""


@dataclass(frozen=True)
class Nodes:
    """Where this node's launcher meets the other nodes of a multi-node job.

    ``static`` (``--master-addr``/``--master-port``): node `rank` 0 hosts the rendezvous
    store at `endpoint`, every node names its rank. ``c10d`` (``--rdzv-endpoint``): the
    store's host is the machine at `endpoint`, nodes are numbered in the order they arrive.
    Either way node g runs global ranks g * nproc .. g * nproc + nproc - 1, so a mesh whose
    ``parallel.fsdp_size`` is the per-node rank count shards within nodes and replicates
    (HSDP) across them.
    """

    count: int
    rank: int | None
    """This node's rank (static); None with c10d, where arrival order numbers the nodes."""
    endpoint: str
    """HOST:PORT of the rendezvous."""
    backend: Literal["static", "c10d"]
    timeout_s: int
    """Seconds to wait for the other nodes at the rendezvous."""

    @property
    def job(self) -> str:
        """What the nodes of one job, and only they, have in common: the key of the run
        folder's lock (`shardwise.jobs.rundir`), compared with `same_job` (nodes may name
        the rendezvous host differently)."""
        return f"rendezvous {self.endpoint} of {self.count} nodes"

    def torchrun_args(self) -> list[str]:
        if self.backend == "static":
            host, port = self.endpoint.rsplit(":", 1)
            return [f"--nnodes={self.count}", f"--node-rank={self.rank}", f"--master-addr={host}",
                    f"--master-port={port}", f"--rdzv-conf=timeout={self.timeout_s}"]
        return [f"--nnodes={self.count}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-conf=join_timeout={self.timeout_s},read_timeout={self.timeout_s}"]


def nodes_from_args(nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None,
                    rdzv_endpoint: str | None, rdzv_timeout_s: int | None) -> Nodes | None:
    """The multi-node flags of `shardwise train|infer` as `Nodes`, or None for a job on
    this machine alone. A ConfigError names the flag (exit status 2, before anything starts)."""
    count = 1 if nnodes is None else nnodes
    if count < 1:
        raise ConfigError("--nnodes", f"{count} is not a positive number of nodes", "e.g. --nnodes 2")
    if node_rank is not None and not 0 <= node_rank < count:
        raise ConfigError("--node-rank", f"{node_rank} is outside [0, {count}) for --nnodes {count}",
                          f"the first node is 0, the last {count - 1}")
    timeout = RDZV_TIMEOUT_S if rdzv_timeout_s is None else rdzv_timeout_s
    if timeout < 1:
        raise ConfigError("--rdzv-timeout", f"{timeout} is not a positive number of seconds")
    if master_addr is not None and rdzv_endpoint is not None:
        raise ConfigError("--rdzv-endpoint", "is given with --master-addr: the nodes meet at one of them",
                          "--master-addr HOST --master-port PORT --node-rank I, or --rdzv-endpoint HOST:PORT")
    if master_port is not None and master_addr is None:
        raise ConfigError("--master-port", "is given without --master-addr",
                          "add --master-addr HOST (node 0's address)")
    if master_addr is None and rdzv_endpoint is None:
        if count > 1:
            raise ConfigError("--nnodes", f"{count} nodes need a place to meet: --master-addr HOST (node 0's "
                              "address, with --node-rank and --master-port) or --rdzv-endpoint HOST:PORT",
                              "the same on every node")
        return None
    if master_addr is not None:
        if node_rank is None:
            if count > 1:
                raise ConfigError("--node-rank", "is needed with --master-addr",
                                  f"0 on the node at {master_addr}, 1 to {count - 1} on the others")
            node_rank = 0
        port = MASTER_PORT if master_port is None else master_port
        _check_port("--master-port", port)
        return Nodes(count, node_rank, f"{master_addr}:{port}", "static", timeout)
    host, _, port_text = rdzv_endpoint.rpartition(":")
    if not host or not port_text.isdigit():
        raise ConfigError("--rdzv-endpoint", f"{rdzv_endpoint!r} is not HOST:PORT", "e.g. --rdzv-endpoint node0:29400")
    _check_port("--rdzv-endpoint", int(port_text))
    return Nodes(count, None, rdzv_endpoint, "c10d", timeout)


def ranks_per_node(nproc: int | None, config_ranks: int | None, nodes: Nodes | None) -> int | None:
    """The ranks to start on this node: ``--nproc``; without it, the device count of the
    config's file (a dialect's, over all nodes), or None (no launch: this process runs)."""
    if nodes is None or nproc is not None:
        return nproc or config_ranks
    if config_ranks and config_ranks % nodes.count == 0:
        return config_ranks // nodes.count
    raise ConfigError("--nproc", f"is needed with --nnodes {nodes.count}: the number of ranks on each node",
                      "e.g. --nproc 8 on a node of 8 GPUs")


_JOB_KEY = re.compile(r"rendezvous \[?(?P<host>.+?)\]?:(?P<port>\d+) of (?P<count>\d+) nodes")
"""`Nodes.job`, read back."""


def same_job(a: str | None, b: str | None) -> bool:
    """Two `Nodes.job` keys are one job's: the same node count and port, and hosts that
    are one machine here (the same name, or names that resolve to a common address:
    ``localhost`` and ``127.0.0.1``; every loopback address is this machine)."""
    if a is None or b is None:
        return False
    if a == b:
        return True
    ka, kb = _JOB_KEY.fullmatch(a), _JOB_KEY.fullmatch(b)
    if ka is None or kb is None or (ka["port"], ka["count"]) != (kb["port"], kb["count"]):
        return False
    return bool(host_addresses(ka["host"]) & host_addresses(kb["host"]))


def host_addresses(host: str) -> set[str]:
    """The addresses `host` resolves to on this machine, every loopback address as
    ``"loopback"``; ``{host}`` when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return {host}
    out = set()
    for *_, sockaddr in infos:
        try:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        except ValueError:
            continue
        out.add("loopback" if ip.is_loopback else str(ip))
    return out or {host}


def rendezvous_bound_s(timeout_s: float) -> float:
    """Seconds a node's torchrun may wait to meet the other nodes before it gives up itself,
    counted from its start (`RDZV_SINCE_ENV`; torch's own timeouts, shortened by the seconds
    the wrapper took to start, end at ``timeout_s`` from there).
    torch bounds most of the rendezvous by ``--rdzv-timeout``, but not all of it: a store
    client connected to a program that squats the port and never answers waits as long as
    that program lives. The torchrun wrapper ends the node after this long without a rank
    (`shardwise.distributed.torchrun`); the margin (`RDZV_MARGIN_S`) leaves torch's own
    timeouts, which name what was missing, to come first."""
    return timeout_s + RDZV_MARGIN_S


def _check_port(flag: str, port: int) -> None:
    if not 0 < port < 65536:
        raise ConfigError(flag, f"port {port} is not in 1 .. 65535")
