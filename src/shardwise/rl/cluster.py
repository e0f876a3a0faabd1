"""Worker groups on Ray: N Ray actors forming one torch.distributed group.

`RayWorkerGroup(worker_cls, world_size, *args, **kwargs)` reserves a placement group of
``world_size`` bundles (1 CPU each, plus 1 GPU each where GPUs exist), starts one Ray
actor per bundle, makes them ranks 0..N-1 of a process group (gloo on CPU, nccl on GPU;
rank 0's node address and a free port there are the rendezvous) and builds
``worker_cls(*args, runtime=runtime, **kwargs)`` in each. Colocated roles are one worker
class holding several roles per rank (the hybrid engine: actor + rollout + reference in
one process, sharing devices); a separate role is another group.

On a cluster of several nodes the bundles are packed (Ray's PACK: as few nodes as hold
them); a group that does not fit on one node spans several, and ranks are numbered node by
node (`rank_bundles`): consecutive ranks share a node, rank 0 is on the controller's node
when a bundle landed there. ``group.places`` says where each rank runs (node id, IP, pid).

Calling ``group.method(...)`` on a method marked with `shardwise.rl.dispatch.register`
splits the arguments by the method's rule, runs it on the workers in parallel and joins
the results. When a worker raises, the group is shut down (its peers may be blocked in a
collective and would otherwise wait for the process-group timeout) and the error is
re-raised in the controller as one `WorkerError` naming the rank and its node. A rank
whose process or node died is reported as such: when a peer's collective fails first
(its connection to the dead rank broke), the group waits up to `PEER_LOSS_GRACE_S` for
Ray to declare the death, so the line names the lost node rather than the survivor.

With ``log_dir``, each rank's stderr (other libraries' warnings, a crash's last words)
goes to ``log_dir/<name>-rank<i>.log`` on the rank's node, and its shardwise log lines
to the console (`shardwise.telemetry.logs`).

`init_ray` starts a local Ray with enough CPUs for the groups (`ray_cpus`), or joins the
cluster at ``RAY_ADDRESS`` when that is set. `init_ray_while` starts the local Ray while
other work (the controller's imports) runs beside it: Ray's head starts, no worker does
until a group asks for one (`RayWorkerGroup`).
"""

from __future__ import annotations

import abc
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from shardwise.config.schema import Config
from shardwise.config.validate import rl_train_ranks
from shardwise.distributed.launch import kill_tree
from shardwise.distributed.runtime import init_distributed, teardown
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.rl.dispatch import (
    Layout,
    collect_results,
    dispatch_rule,
    split_arguments,
)
from shardwise.telemetry.logs import capture_worker_stderr, console_logger

log = logging.getLogger(__name__)

__all__ = ["Pending", "RankPlace", "RayWorkerGroup", "WorkerError", "gpus_for", "init_ray", "init_ray_while",
           "rank_bundles", "ray_cpus", "shutdown_ray", "worker_groups"]

T = TypeVar("T")

# Variables every worker process gets (the driver's values win where set).
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               # the controller shows the progress; weight-loading bars from every worker are noise
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
# Passed on only where the driver sets them: which network interface the process group's
# sockets use on nodes with several (the same name must exist on every node).
_WORKER_ENV_IF_SET = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

PEER_LOSS_GRACE_S = 45.0
"""How long a group whose rank failed on a broken connection waits for Ray to say whether
a peer's process or node died (Ray declares a node dead after its health checks miss:
about 15 s with Ray's defaults), so the error names the lost rank, not the survivor."""

_LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
"""Ray's system config for the local Ray `init_ray` starts (checked on ray 2.60): by default
the raylet starts one idle worker process per logical CPU when the first driver connects.
None is started here before a worker group asks for its actors: with `init_ray_while` the
driver connects while the job's checks still run, and a failed check must leave no worker
behind (nor spend CPU the checks need; the actors start their own processes either way)."""

SETUP_NOTE_S = 15.0
"""After this many seconds without the placement group's resources, say what it waits for."""


class WorkerError(RuntimeError):
    """A worker method raised, or a worker was lost; the message carries the worker's
    group, rank, node and error."""


@dataclass(frozen=True)
class RankPlace:
    """Where one rank of a group runs."""

    rank: int
    node_id: str
    """Ray's node id (hex), as `ray list nodes` shows it."""
    ip: str
    """The node's address (rank 0's is the process group's rendezvous)."""
    hostname: str
    pid: int
    """The rank's process on that node."""
    interface: str | None = None
    """The network interface its gloo sockets use (``GLOO_SOCKET_IFNAME``): the driver's
    value, else the one holding the node's address; None: gloo's own choice."""

    def where(self) -> str:
        return f"node {self.ip}, id {self.node_id[:8]}"


def rank_bundles(bundle_nodes: Mapping[int, str], first_node: str | None = None) -> list[int]:
    """The placement-group bundle each rank gets, given the node each bundle landed on:
    ranks are numbered node by node, so consecutive ranks share a node (what a sharding
    plan expects of neighbours), in bundle order within a node. Nodes come in the order of
    their first bundle, `first_node` (the controller's) first when it holds any.

    >>> rank_bundles({0: "b", 1: "a", 2: "b", 3: "a"}, first_node="a")
    [1, 3, 0, 2]
    """
    order: dict[str, list[int]] = {}
    if first_node is not None and first_node in bundle_nodes.values():
        order[first_node] = []
    for b in sorted(bundle_nodes):
        order.setdefault(bundle_nodes[b], []).append(b)
    return [b for bundles in order.values() for b in bundles]


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_of(ip: str) -> str | None:
    """The name of this machine's network interface holding the IPv4 address `ip`, or None
    (another address family, or not a local address)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is a declared dependency of the rl extra
        raise ConfigError("rl", "Ray is not installed", "pip install 'shardwise[rl]'") from e
    return ray


RAY_PROBE_S = 5.0
"""How long `check_ray_address` waits for the cluster named by ``RAY_ADDRESS`` to answer."""


def check_ray_address(timeout_s: float = RAY_PROBE_S) -> None:
    """ConfigError naming ``RAY_ADDRESS`` when it is ``host:port`` (or ``ray://host:port``)
    and nothing accepts a connection there within `timeout_s`: Ray itself would retry for
    minutes without a word. Other forms (auto, local) are Ray's to resolve."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError("RAY_ADDRESS", f"nothing answers at {address!r} ({e.strerror or type(e).__name__})",
                          "start the cluster there (ray start --head --port PORT), or unset RAY_ADDRESS to "
                          "run a local one") from None


def worker_groups(cfg: Config) -> dict[str, list[str]]:
    """Worker groups this config needs, name -> roles. "rl" is the hybrid engine (actor +
    rollout [+ reference]); the critic and the reward model join it when colocated."""
    groups: dict[str, list[str]] = {"rl": ["actor", "rollout"]}
    if cfg.rl.reference.enabled:
        groups["rl"].append("ref")
    if cfg.rl.critic.enabled:
        groups["rl" if cfg.rl.critic.colocated else "critic"] = \
            groups.get("rl" if cfg.rl.critic.colocated else "critic", []) + ["critic"]
    if cfg.rl.reward.model is not None:
        name = "rl" if cfg.rl.reward.colocated else "reward"
        groups[name] = groups.get(name, []) + ["reward_model"]
    return groups


def ray_cpus(cfg: Config, world_size: int) -> int:
    """The logical CPUs the worker groups of an RL run on `world_size` ranks reserve, one per
    rank of each group: with rl.async the training ranks in each training group
    (`worker_groups` without the rollout) and the generator's ranks once."""
    train = rl_train_ranks(cfg, world_size)
    return train * len(worker_groups(cfg)) + (world_size - train)


def init_ray_while(work: Callable[[], T], num_cpus: int) -> tuple[T, float]:
    """`work()` in a thread while a local Ray starts in this thread (`init_ray`); returns
    what `work` returned and the seconds Ray's start went on after `work` was done (0.0 when
    it was up first), or raises what `work` raised, once both are done (Ray stays up either
    way: the caller stops it, `shutdown_ray`). Called from the main thread, before anything
    of Ray's exists, with ``RAY_ADDRESS`` unset (a cluster is joined after the checks).

    ray.init runs in the main thread, `work` beside it: the other way round (ray.init in a
    thread while the main thread imported torch and transformers) ray.init waited for its
    GCS until it gave up after 60 s (ray 2.60). Starting Ray's head is mostly waiting for
    its processes, so the imports of `work` take most of the GIL meanwhile."""
    assert threading.current_thread() is threading.main_thread() and not os.environ.get("RAY_ADDRESS")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            outcome["error"] = e
        outcome["done"] = time.monotonic()

    thread = threading.Thread(target=run, name="shardwise-imports", daemon=True)
    thread.start()
    try:
        init_ray(num_cpus)
    finally:
        up = time.monotonic()
        thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"], max(up - outcome["done"], 0.0)


def init_ray(num_cpus: int | None = None, env: Mapping[str, str] | None = None) -> None:
    """Start (or join) Ray once per process.

    With ``RAY_ADDRESS`` set, join that cluster; otherwise start a local one with
    ``max(num_cpus, os.cpu_count())`` logical CPUs (a worker reserves one logical CPU,
    so 4 workers can share 2 cores). The driver's ``sys.path`` and working directory are
    handed to the workers through PYTHONPATH so they import the same code.
    """
    ray = _ray()
    if ray.is_initialized():
        return
    env_vars = {k: os.environ.get(k, v) for k, v in _WORKER_ENV.items()}
    env_vars |= {k: os.environ[k] for k in _WORKER_ENV_IF_SET if os.environ.get(k)}
    # and the working directory, where the job's prepare step found the user's modules
    # (rl.tools, rl.environment: the workers import them again), whatever sys.path[0] is
    paths = [p for p in [*sys.path, os.getcwd()] if p and os.path.isdir(p)]
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env_vars.update(env or {})
    runtime_env = {"env_vars": env_vars}
    # ray.init replaces the driver's SIGTERM handler with its own, which ends the process
    # by SIGABRT with a C++ stack dump: the caller's (SIGTERM stops the run like Ctrl-C,
    # exit 143, naming the last checkpoint) is put back.
    main = threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if main else None
    try:
        if os.environ.get("RAY_ADDRESS"):
            address = os.environ["RAY_ADDRESS"]
            try:
                ray.init(address=address, runtime_env=runtime_env, log_to_driver=True, configure_logging=False)
            except ConnectionError as e:  # it answered `check_ray_address`, then refused this process
                raise ConfigError("RAY_ADDRESS", f"the Ray cluster at {address!r} did not let this process join "
                                  f"({e})", "a cluster started with token authentication (`ray start` says so) "
                                  "needs RAY_AUTH_MODE=token here too, and its token in RAY_AUTH_TOKEN or "
                                  "~/.ray/auth_token") from e
        else:
            cpus = max(num_cpus or 1, os.cpu_count() or 1)
            # address="local": without it Ray joins the cluster last started on this machine
            # (`ray start`, recorded under its temp dir) and refuses num_cpus there.
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=runtime_env,
                     log_to_driver=True, configure_logging=False, _system_config=_LOCAL_SYSTEM_CONFIG)
    finally:
        if main and term is not None:
            signal.signal(signal.SIGTERM, term)


def gpus_for(ranks: int) -> bool:
    """Whether the Ray cluster has a GPU for each of `ranks` ranks (groups that share the
    cluster decide together: one group taking the GPUs would leave another waiting)."""
    return _ray().cluster_resources().get("GPU", 0) >= ranks


_RAY_PROGRAMS = ("raylet", "gcs_server")
"""Ray's core programs; its agents and workers are Python scripts under ray/, and its actors
rename themselves ``ray::<class>``."""


def _is_ray_process(cmdline: str) -> bool:
    """Ray's own processes only, by their program or script (among the first arguments): the
    caller's other children are left alone, also when an argument holds a path under ray/
    (a multiprocessing forkserver started after `import ray` carries sys.path in its code
    argument, and that holds ray/thirdparty_files)."""
    for arg in cmdline.split()[:3]:
        if arg.startswith("ray::") or os.path.basename(arg) in _RAY_PROGRAMS:
            return True
        if "/ray/" in arg and arg.endswith(".py"):
            return True
    return False


def shutdown_ray(restore_signals: bool = True) -> None:
    """Stop Ray and everything it started for this driver, surviving more signals: while
    it stops, a second Ctrl-C / SIGTERM only says it is stopping (interrupted, Ray's
    shutdown crashed the process by SIGSEGV and left its agents running), a third kills
    the processes left, by pid. Whatever of Ray's this process started that is still there
    after the shutdown is killed too. With `restore_signals` False (a run already interrupted)
    that handling stays for the rest of the process: the signals only say it is ending."""
    ray = sys.modules.get("ray")  # never imported (rl.backend local, or no Ray installed): nothing to stop
    if ray is None or not ray.is_initialized():
        return
    if threading.current_thread() is not threading.main_thread():
        ray.shutdown()
        return
    seen: list[int] = []

    def on_signal(signum, _frame):
        seen.append(signum)
        if len(seen) == 1:
            print("\nshardwise: stopping Ray's processes; signal once more to kill them", file=sys.stderr)
            return
        kill_tree(os.getpid(), only=_is_ray_process)
        os._exit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.shutdown()
        kill_tree(os.getpid(), only=_is_ray_process)  # an agent Ray's shutdown did not reach
    finally:
        # Set again either way: Ray's C++ core resets the process's signal dispositions on
        # shutdown behind Python's back (a later SIGTERM then killed the process by default).
        for sig, handler in previous.items():
            signal.signal(sig, handler if restore_signals else on_signal)


def host_rank(rank: int, world_size: int, addr: str, port: int, local_rank: int, node: str,
              console: Any, worker_cls: type, args: tuple, kwargs: dict) -> Any:
    """In a worker process: the torch.distributed environment of `rank`, its log lines
    (``[rank R node N]``; shardwise's also to `console`, the stream on the original stderr),
    the process group, then ``worker_cls(*args, runtime=..., **kwargs)``, returned."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": addr,
                       "MASTER_PORT": str(port), "LOCAL_RANK": str(local_rank)})
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = f"[rank {rank} node {node}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt)
    if console is not None:
        console_logger(console, fmt, level)
    runtime = init_distributed()
    return worker_cls(*args, runtime=runtime, **kwargs)


class _RankHost:
    """The Ray actor behind one rank: sets the torch.distributed environment, starts the
    process group and hosts the worker object."""

    def __init__(self, log_path: str | None = None) -> None:
        self.worker: Any = None
        # vLLM's, torch's and Ray's warnings go to the rank's file under run.dir/logs/; the
        # console (Ray forwards this process's stderr there) keeps shardwise's lines
        self.console = capture_worker_stderr(log_path) if log_path else None

    def where(self) -> tuple[str, str, str, int, str | None]:
        """This process's node id, node address, host name, pid and gloo interface.

        gloo binds its sockets to the address the host name resolves to, which is often a
        loopback address (``127.0.1.1 host`` in /etc/hosts): peers on other nodes could not
        reach it. Unless the driver chose one, the interface holding the node's address is
        set here, before the process group exists."""
        import ray

        ip = ray.util.get_node_ip_address()
        if not os.environ.get("GLOO_SOCKET_IFNAME"):
            name = interface_of(ip)
            if name is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = name
        return ray.get_runtime_context().get_node_id(), ip, socket.gethostname(), os.getpid(), \
            os.environ.get("GLOO_SOCKET_IFNAME")

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address (the one its peers on other nodes reach, not 127.0.0.1) and a
        port free on every interface of it."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, rank: int, world_size: int, addr: str, port: int, worker_cls: type,
              args: tuple, kwargs: dict) -> None:
        import ray

        gpus = ray.get_gpu_ids()
        node = ray.get_runtime_context().get_node_id()[:8]
        self.worker = host_rank(rank, world_size, addr, port, 0 if gpus else rank, node, self.console,
                                worker_cls, args, kwargs)

    def execute(self, method: str, args: tuple, kwargs: dict) -> tuple[Any, float]:
        """The method's result and the seconds it ran here (the rest of the caller's wait is
        moving data and scheduling)."""
        t0 = time.perf_counter()
        result = getattr(self.worker, method)(*args, **kwargs)
        return result, time.perf_counter() - t0

    def teardown(self) -> None:
        close = getattr(self.worker, "close", None)
        if callable(close):
            close()
        teardown()


class WorkerGroup(abc.ABC):
    """What the controller sees of a worker group, on Ray (`RayWorkerGroup`) or in forked
    processes on this machine (`shardwise.rl.local.LocalWorkerGroup`): calling registered
    worker methods (``group.method(...)``, `call`, `submit`), where each rank runs and the
    data-parallel layout. A subclass starts a method on a rank (`_start`), waits for
    started ones (`_wait`, `_ready`) and shuts the group down."""

    worker_cls: type
    world_size: int
    name: str
    places: list[RankPlace]
    log_paths: list[str | None]
    layout: Layout
    dispatch_s: float
    _alive: bool

    def _set_layout(self, sp: int) -> None:
        # Every worker is its own data-parallel rank, or with Ulysses (`sp` > 1) the sp
        # consecutive ranks of a group share one: they get the same rows, the first returns.
        if sp == 1:
            self.layout = Layout.data_parallel(self.world_size)
        else:
            self.layout = Layout(tuple(r // sp for r in range(self.world_size)),
                                 tuple(r % sp == 0 for r in range(self.world_size)))

    def describe_places(self) -> str:
        """Which ranks run on which node, e.g. ``ranks 0-1 on node 10.0.0.1, id 1a2b3c4d``."""
        by_node: dict[str, list[RankPlace]] = {}
        for p in self.places:
            by_node.setdefault(p.node_id, []).append(p)
        parts = []
        for ps in by_node.values():
            ranks = f"rank {ps[0].rank}" if len(ps) == 1 else f"ranks {ps[0].rank}-{ps[-1].rank}"
            parts.append(f"{ranks} on {ps[0].where()}")
        return "; ".join(parts)

    def places_dict(self) -> list[dict[str, Any]]:
        """`places` as JSON-ready dicts."""
        return [asdict(p) for p in self.places]

    # -- calling worker methods
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        rule = dispatch_rule(self.worker_cls, name)
        if rule is None:
            raise AttributeError(f"{self.worker_cls.__name__}.{name} is not a worker method registered "
                                 "with shardwise.rl.dispatch.register")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, *args, **kwargs)

        call.__name__ = name
        return call

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run the worker method `name` on the ranks and wait for its joined result (no
        bound but the workers' own: a lost rank still ends it, see `_wait`)."""
        pending = self.submit(name, *args, **kwargs)
        pending.blocking = True
        return pending.result()

    def submit(self, name: str, *args: Any, **kwargs: Any) -> Pending:
        """Start the worker method `name` on the ranks (split by its dispatch rule) without
        waiting; `Pending.result` joins it. A rank runs its calls one at a time, in the order
        they were submitted."""
        rule = dispatch_rule(self.worker_cls, name)
        if rule is None:
            raise AttributeError(f"{self.worker_cls.__name__}.{name} has no dispatch rule")
        if not self._alive:
            raise WorkerError(f"worker group {self.name!r} was shut down")
        t0 = time.perf_counter()
        calls, pad = split_arguments(rule, self.layout, name, args, kwargs)
        futures = {i: self._start(i, name, c) for i, c in enumerate(calls) if c is not None}
        return Pending(self, name, rule, futures, pad, t0, time.perf_counter() - t0)

    @abc.abstractmethod
    def _start(self, rank: int, method: str, call: tuple[tuple, dict]) -> Any:
        """Start `method` with ``call`` (args, kwargs) on `rank`; a handle `_wait` takes."""

    @abc.abstractmethod
    def _wait(self, futures: Mapping[int, Any], what: str, timeout: float | None = None) -> list[Any]:
        """The ``(result, seconds)`` of `futures` (rank -> handle), in the mapping's order;
        on the first failure the group is shut down and one `WorkerError` raised."""

    @abc.abstractmethod
    def _ready(self, futures: Mapping[int, Any]) -> bool:
        """Whether every handle of `futures` has its answer (without waiting)."""

    @abc.abstractmethod
    def shutdown(self, graceful: bool = True) -> None:
        """End the group's processes (graceful: their teardown first); a second call does nothing."""

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(graceful=exc[0] is None)


class RayWorkerGroup(WorkerGroup):
    """`world_size` Ray actors, each hosting ``worker_cls(*args, runtime=..., **kwargs)``
    as one rank of a fresh process group. See the module docstring."""

    def __init__(self, worker_cls: type, world_size: int, *args: Any, name: str = "workers",
                 use_gpu: bool | None = None, setup_timeout_s: float = 900.0, sp: int = 1,
                 log_dir: str | os.PathLike[str] | None = None, **kwargs: Any):
        ray = _ray()
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.worker_cls = worker_cls
        self.world_size = world_size
        self.name = name
        self.places: list[RankPlace] = []
        """Where each rank runs, by rank."""
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) >= world_size
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK", name=name)
        try:
            self._wait_for_resources(bundle, setup_timeout_s)
            bundles = rank_bundles(placement_group_table(self._pg)["bundles_to_node_id"],
                                   ray.get_runtime_context().get_node_id())
        except BaseException:
            remove_placement_group(self._pg)
            raise
        host = ray.remote(_RankHost)
        self.log_paths = [None if log_dir is None else os.path.join(log_dir, f"{name}-rank{i}.log")
                          for i in range(world_size)]
        """Where each rank's stderr goes (other libraries' warnings, a crash's last words)."""
        self._actors = [
            host.options(num_cpus=1, num_gpus=1 if use_gpu else 0, name=f"{name}-rank{i}-{os.getpid()}",
                         scheduling_strategy=PlacementGroupSchedulingStrategy(
                             self._pg, placement_group_bundle_index=bundles[i])).remote(self.log_paths[i])
            for i in range(world_size)
        ]
        self._alive = True
        self.dispatch_s = 0.0
        """Seconds of this group's calls spent outside the workers' methods (splitting and
        joining batches, moving them to and from the workers, Ray scheduling), summed."""
        try:
            where = self._wait({i: a.where.remote() for i, a in enumerate(self._actors)}, "start",
                               timeout=setup_timeout_s)
            self.places = [RankPlace(i, *w) for i, w in enumerate(where)]
            log.info("worker group %s: %s", name, self.describe_places())
            addr, port = self._wait({0: self._actors[0].rendezvous_address.remote()}, "start",
                                    timeout=setup_timeout_s)[0]
            self._wait({i: a.setup.remote(i, world_size, addr, port, worker_cls, args, kwargs)
                        for i, a in enumerate(self._actors)}, "setup", timeout=setup_timeout_s)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self._set_layout(sp)

    def _wait_for_resources(self, bundle: dict[str, int], timeout_s: float) -> None:
        """Until the placement group is reserved; says once what it waits for when that takes
        longer than `SETUP_NOTE_S` (a cluster too small waits silently otherwise)."""
        ray = _ray()
        if ray.wait([self._pg.ready()], timeout=min(SETUP_NOTE_S, timeout_s))[0]:
            return
        have = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        need = ", ".join(f"{v * self.world_size} {k}" for k, v in bundle.items())
        waiting = (f"worker group {self.name}: waiting for {need} (1 CPU{' + 1 GPU' if 'GPU' in bundle else ''} "
                   f"per rank); the cluster has {', '.join(f'{have.get(k, 0):g} {k}' for k in bundle)} in "
                   f"{nodes} node(s)")
        log.warning("%s", waiting)
        if not ray.wait([self._pg.ready()], timeout=max(timeout_s - SETUP_NOTE_S, 0.0))[0]:
            raise WorkerError(f"{waiting}, and gave up after {timeout_s:g} s (add nodes, or lower --nproc)")

    def _start(self, rank: int, method: str, call: tuple[tuple, dict]) -> Any:
        return self._actors[rank].execute.remote(method, *call)

    def _ready(self, futures: Mapping[int, Any]) -> bool:
        refs = list(futures.values())
        return len(_ray().wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def _wait(self, futures: Mapping[int, Any], what: str, timeout: float | None = None) -> list[Any]:
        """The results of `futures` (rank -> object ref), in the mapping's order; on the
        first failure shut the group down and raise (see the module docstring).

        Some failures are only symptoms: a rank whose collective broke (a peer's connection
        closed) and Ray's "actor unavailable" (the connection to a rank's process closed;
        the process or its node may be gone). After one, the group keeps watching, up to
        `PEER_LOSS_GRACE_S`, for Ray to declare a node of the group dead or a rank's
        process died, and names that; failing which, the symptom."""
        ray = _ray()
        rank_of = {f: r for r, f in futures.items()}
        pending = list(futures.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        symptom: tuple[int, BaseException] | None = None
        symptom_since = 0.0
        while pending or (symptom is not None and _is_unavailable(symptom[1])):
            now = time.monotonic()
            wait_s = None if deadline is None else max(deadline - now, 0.0)
            if symptom is not None:
                lost = self._ranks_on_dead_node()
                if lost is not None:
                    self.shutdown(graceful=False)
                    raise self._node_lost(what, *lost) from symptom[1]
                if now - symptom_since > PEER_LOSS_GRACE_S:
                    break
                wait_s = 1.0 if wait_s is None else min(wait_s, 1.0)
                if not pending:
                    time.sleep(wait_s)
                    continue
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    silent = sorted(rank_of[f] for f in pending)
                    self.shutdown(graceful=False)
                    ranks = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
                    raise WorkerError(f"worker group {self.name!r}: {what} did not finish in {timeout:g} s "
                                      f"({ranks} did not answer)")
                continue
            try:
                ray.get(ready[0])
            except Exception as e:
                rank = rank_of[ready[0]]
                cause = getattr(e, "cause", None) or e
                if _is_unavailable(e) or (not _is_death(e) and _lost_peer(cause)):
                    # The unavailable rank is the likelier culprit than a broken collective.
                    if symptom is None or (_is_unavailable(e) and not _is_unavailable(symptom[1])):
                        symptom = (rank, e)
                        symptom_since = symptom_since or time.monotonic()
                    continue
                if symptom is not None and not _is_death(e):
                    continue  # another survivor's error: the cause is still to come
                self.shutdown(graceful=False)
                if isinstance(cause, ShardwiseError):
                    # The user's mistake, found in a worker: the same one line and exit
                    # status as when the controller finds it (the traceback stays on `e`).
                    raise cause from e
                lost = self._ranks_on_dead_node() if _is_death(e) else None
                raise (self._node_lost(what, *lost) if lost else self._failure(what, rank, e)) from e
        if symptom is not None:  # the broken collective was a rank's own, or Ray never said more
            self.shutdown(graceful=False)
            raise self._failure(what, *symptom) from symptom[1]
        return ray.get(list(futures.values()))

    def _ranks_on_dead_node(self) -> tuple[list[int], RankPlace, dict[str, Any]] | None:
        """The ranks on the first node of this group that Ray holds dead (with the first
        rank's place and Ray's record of the node), or None."""
        ray = _ray()
        try:
            dead = {n.get("NodeID"): n for n in ray.nodes() if not n.get("Alive")}
        except Exception:  # noqa: BLE001 - the GCS itself may be gone; then nothing more is known
            return None
        for p in self.places:
            if p.node_id in dead:
                return [q.rank for q in self.places if q.node_id == p.node_id], p, dead[p.node_id]
        return None

    def _node_lost(self, what: str, ranks: list[int], place: RankPlace, node: dict[str, Any]) -> WorkerError:
        reason = " ".join(str(node.get("DeathReasonMessage") or "no reason given").split())
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return WorkerError(f"worker group {self.name!r} lost {which} in {what}: its node {place.ip} "
                           f"(id {place.node_id}) left the Ray cluster ({reason})")

    def _failure(self, what: str, rank: int, e: BaseException) -> WorkerError:
        """One line for the failure of `rank` in `what`: a lost process, or the worker's
        own error, with the rank's node."""
        place = self.places[rank] if rank < len(self.places) else None
        if _is_death(e):
            where = f" (pid {place.pid} on {place.where()})" if place is not None else ""
            log = self.log_paths[rank] if rank < len(self.log_paths) else None
            return WorkerError(f"worker group {self.name!r} lost rank {rank} in {what}: its process{where} "
                               f"{'stopped answering' if _is_unavailable(e) else 'died'} ({_ray_reason(e)})"
                               + (f"; its output: {log}" if log else ""))
        cause = getattr(e, "cause", None) or e
        where = f" (rank {rank} ran on {place.where()})" if place is not None else ""
        return WorkerError(f"{self.name}.{what} failed on rank {rank}: {type(cause).__name__}: {cause}{where}")

    def shutdown(self, graceful: bool = True) -> None:
        """Tear down the process group (graceful) and release actors and the placement group."""
        if not getattr(self, "_alive", False):
            return
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        self._alive = False
        if graceful:
            try:
                ray.get([a.teardown.remote() for a in self._actors], timeout=120)
            except Exception as e:  # the actors are killed below either way
                log.warning("worker group %s: teardown failed: %s", self.name, e)
        for a in self._actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self._pg)


class Pending:
    """A worker method started on a group's ranks (`WorkerGroup.submit`); `result`
    waits for it and joins the ranks' results as `WorkerGroup.call` does."""

    def __init__(self, group: WorkerGroup, name: str, rule: Any, futures: dict[int, Any], pad: Any,
                 t0: float, split_s: float):
        self.group, self.name, self._rule, self._futures, self._pad = group, name, rule, futures, pad
        self._t0, self._split_s = t0, split_s
        self.blocking = False
        """Waited for right after it started (`RayWorkerGroup.call`)."""
        self._done = False
        self._value: Any = None

    def ready(self) -> bool:
        """Whether every rank has answered (without waiting)."""
        return self._done or self.group._ready(self._futures)

    def result(self, timeout_s: float | None = None, what: str | None = None) -> Any:
        """The joined result. A rank that raised or was lost, or (with `timeout_s`) ranks
        that did not answer within `timeout_s` seconds, end in one `WorkerError` naming the
        group, `what` the ranks were doing (default: the method) and the ranks; the group is
        shut down first (see `RayWorkerGroup._wait`). A second call returns the same result."""
        if self._done:
            return self._value
        g = self.group
        if not g._alive:  # its actors are gone: nothing would ever answer
            raise WorkerError(f"worker group {g.name!r} was shut down before {what or self.name} finished")
        done = g._wait(self._futures, what or self.name, timeout=timeout_s)
        t1 = time.perf_counter()
        results: list[Any] = [None] * g.world_size
        for i, (r, _) in zip(self._futures, done):
            results[i] = r
        self._value = collect_results(self._rule, g.layout, self.name, results, self._pad)
        if self.blocking:  # all but the slowest rank's method: moving data and scheduling
            g.dispatch_s += time.perf_counter() - self._t0 - max((s for _, s in done), default=0.0)
        else:  # started ahead: its wait held other work too; the split and the join are the dispatch
            g.dispatch_s += self._split_s + time.perf_counter() - t1
        self._done = True
        return self._value


def _is_death(e: BaseException) -> bool:
    """Ray says the actor (its process, or its node) is gone."""
    from ray.exceptions import NodeDiedError, RayActorError

    return isinstance(e, (RayActorError, NodeDiedError))


# What a collective raises when a peer's process is gone: gloo's and NCCL's words for a
# connection that closed under it.
_PEER_LOSS_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                    "econnreset", "epipe", "remote process exited", "socket closed")


def _is_unavailable(e: BaseException) -> bool:
    """Ray lost the connection to the actor and does not know yet whether it died."""
    from ray.exceptions import ActorUnavailableError

    return isinstance(e, ActorUnavailableError)


def _lost_peer(cause: BaseException) -> bool:
    text = str(cause).lower()
    return any(w in text for w in _PEER_LOSS_WORDS)


def _ray_reason(e: BaseException) -> str:
    """The first line of Ray's (many-line) error message that says why."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    reasons = [x for x in lines[1:] if ":" not in x.split()[0]] or lines[:1]
    return reasons[-1] if reasons else type(e).__name__
