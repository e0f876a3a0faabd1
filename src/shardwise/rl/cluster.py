"""Worker groups on Ray: N Ray actors forming one torch.distributed group.

`RayWorkerGroup(worker_cls, world_size, *args, **kwargs)` reserves a placement group of
``world_size`` bundles (1 CPU each, plus 1 GPU each where GPUs exist), starts one Ray
actor per bundle, makes them ranks 0..N-1 of a process group (gloo on CPU, nccl on GPU;
rank 0's node address and a free port there are the rendezvous) and builds
``worker_cls(*args, runtime=runtime, **kwargs)`` in each. Colocated roles are one worker
class holding several roles per rank (the hybrid engine: actor + rollout + reference in
one process, sharing devices); a separate role is another group.

Calling ``group.method(...)`` on a method marked with `shardwise.rl.dispatch.register`
splits the arguments by the method's rule, runs it on the workers in parallel and joins
the results. When a worker raises, the group is shut down (its peers may be blocked in a
collective and would otherwise wait for the process-group timeout) and the error is
re-raised in the controller.

`init_ray` starts a local Ray with enough CPUs for the groups, or joins the cluster at
``RAY_ADDRESS`` when that is set.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from shardwise.distributed.launch import kill_tree
from shardwise.distributed.runtime import free_port, init_distributed, teardown
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.rl.dispatch import (
    Layout,
    collect_results,
    dispatch_rule,
    split_arguments,
)

log = logging.getLogger(__name__)

__all__ = ["RayWorkerGroup", "WorkerError", "init_ray", "shutdown_ray"]

# Variables every worker process gets (the driver's values win where set).
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               # the controller shows the progress; weight-loading bars from every worker are noise
               "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class WorkerError(RuntimeError):
    """A worker method raised; the message carries the worker's rank and error."""


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


def init_ray(num_cpus: int | None = None, env: Mapping[str, str] | None = None) -> None:
    """Start (or join) Ray once per process.

    With ``RAY_ADDRESS`` set, join that cluster; otherwise start a local one with
    ``max(num_cpus, os.cpu_count())`` logical CPUs (a worker reserves one logical CPU,
    so 4 workers can share 2 cores). The driver's ``sys.path`` is handed to the workers
    through PYTHONPATH so they import the same code.
    """
    ray = _ray()
    if ray.is_initialized():
        return
    env_vars = {k: os.environ.get(k, v) for k, v in _WORKER_ENV.items()}
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env_vars.update(env or {})
    runtime_env = {"env_vars": env_vars}
    # ray.init replaces the driver's SIGTERM handler with its own, which ends the process
    # by SIGABRT with a C++ stack dump: the caller's (SIGTERM stops the run like Ctrl-C,
    # exit 143, naming the last checkpoint) is put back.
    main = threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if main else None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
    else:
        cpus = max(num_cpus or 1, os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=runtime_env, log_to_driver=True,
                 configure_logging=False)
    if main and term is not None:
        signal.signal(signal.SIGTERM, term)


def shutdown_ray(restore_signals: bool = True) -> None:
    """Stop Ray and everything it started for this driver, surviving more signals: while
    it stops, a second Ctrl-C / SIGTERM only says it is stopping (interrupted, Ray's
    shutdown crashed the process by SIGSEGV and left its agents running), a third kills
    the processes left, by pid. Whatever this process started that is still there after
    the shutdown is killed too. With `restore_signals` False (a run already interrupted)
    that handling stays for the rest of the process: the signals only say it is ending."""
    ray = _ray()
    if not ray.is_initialized():
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
        kill_tree(os.getpid())
        os._exit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.shutdown()
        kill_tree(os.getpid())  # an agent Ray's shutdown did not reach
    finally:
        # Set again either way: Ray's C++ core resets the process's signal dispositions on
        # shutdown behind Python's back (a later SIGTERM then killed the process by default).
        for sig, handler in previous.items():
            signal.signal(sig, handler if restore_signals else on_signal)


class _RankHost:
    """The Ray actor behind one rank: sets the torch.distributed environment, starts the
    process group and hosts the worker object."""

    def __init__(self) -> None:
        self.worker: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, rank: int, world_size: int, addr: str, port: int, worker_cls: type,
              args: tuple, kwargs: dict) -> None:
        import ray

        gpus = ray.get_gpu_ids()
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": addr,
                           "MASTER_PORT": str(port), "LOCAL_RANK": "0" if gpus else str(rank)})
        logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                            format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        runtime = init_distributed()
        self.worker = worker_cls(*args, runtime=runtime, **kwargs)

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


class RayWorkerGroup:
    """`world_size` Ray actors, each hosting ``worker_cls(*args, runtime=..., **kwargs)``
    as one rank of a fresh process group. See the module docstring."""

    def __init__(self, worker_cls: type, world_size: int, *args: Any, name: str = "workers",
                 use_gpu: bool | None = None, setup_timeout_s: float = 900.0, sp: int = 1, **kwargs: Any):
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.worker_cls = worker_cls
        self.world_size = world_size
        self.name = name
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) >= world_size
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK", name=name)
        try:
            ray.get(self._pg.ready(), timeout=setup_timeout_s)
        except Exception:
            remove_placement_group(self._pg)
            raise
        host = ray.remote(_RankHost)
        self._actors = [
            host.options(num_cpus=1, num_gpus=1 if use_gpu else 0, name=f"{name}-rank{i}-{os.getpid()}",
                         scheduling_strategy=PlacementGroupSchedulingStrategy(
                             self._pg, placement_group_bundle_index=i)).remote()
            for i in range(world_size)
        ]
        self._alive = True
        self.dispatch_s = 0.0
        """Seconds of this group's calls spent outside the workers' methods (splitting and
        joining batches, moving them to and from the workers, Ray scheduling), summed."""
        try:
            addr, port = ray.get(self._actors[0].rendezvous_address.remote(), timeout=setup_timeout_s)
            self._wait([a.setup.remote(i, world_size, addr, port, worker_cls, args, kwargs)
                        for i, a in enumerate(self._actors)], "setup", timeout=setup_timeout_s)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        # Every worker is its own data-parallel rank, or with Ulysses (`sp` > 1) the sp
        # consecutive ranks of a group share one: they get the same rows, the first returns.
        if sp == 1:
            self.layout = Layout.data_parallel(world_size)
        else:
            self.layout = Layout(tuple(r // sp for r in range(world_size)),
                                 tuple(r % sp == 0 for r in range(world_size)))

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
        rule = dispatch_rule(self.worker_cls, name)
        if rule is None:
            raise AttributeError(f"{self.worker_cls.__name__}.{name} has no dispatch rule")
        if not self._alive:
            raise WorkerError(f"worker group {self.name!r} was shut down")
        t0 = time.perf_counter()
        calls, pad = split_arguments(rule, self.layout, name, args, kwargs)
        futures = {i: self._actors[i].execute.remote(name, *c) for i, c in enumerate(calls) if c is not None}
        done = self._wait(list(futures.values()), name)
        results: list[Any] = [None] * self.world_size
        for i, (r, _) in zip(futures, done):
            results[i] = r
        out = collect_results(rule, self.layout, name, results, pad)
        self.dispatch_s += time.perf_counter() - t0 - max((s for _, s in done), default=0.0)
        return out

    def _wait(self, futures: list, what: str, timeout: float | None = None) -> list[Any]:
        """All results in order; on the first failure shut the group down and raise."""
        ray = _ray()
        index = {f: i for i, f in enumerate(futures)}
        pending = list(futures)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                self.shutdown(graceful=False)
                raise WorkerError(f"{self.name}.{what} did not finish in {timeout} s")
            try:
                ray.get(ready[0])
            except Exception as e:
                rank = index[ready[0]]
                self.shutdown(graceful=False)
                cause = getattr(e, "cause", None) or e
                if isinstance(cause, ShardwiseError):
                    # The user's mistake, found in a worker: the same one line and exit
                    # status as when the controller finds it (the traceback stays on `e`).
                    raise cause from e
                raise WorkerError(f"{self.name}.{what} failed on rank {rank}: {type(cause).__name__}: "
                                  f"{cause}") from e
        return ray.get(futures)

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

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(graceful=exc[0] is None)
