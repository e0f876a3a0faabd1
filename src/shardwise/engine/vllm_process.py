"""What vLLM 0.32 does to the process that builds an in-process engine
(`shardwise.engine.vllm_engine`), and what this module does about it:

- it seeds python, numpy and torch (all devices) at start-up: the RNG states are saved and
  put back around construction and every generation;
- its CPU worker replaces ``torch.set_num_threads`` with a no-op (meant for its own
  OpenMP binding, which only its multiprocess executor does): the real function and the
  thread count are put back;
- it ``gc.freeze()``s the heap at start-up: undone;
- its shutdown destroys the default process group: `VLLMGenerator.shutdown` lets it
  destroy its own groups only, so the trainer's group outlives the engine;
- environment variables other than ``VLLM_*`` that it sets at start-up (e.g.
  ``TORCHINDUCTOR_COMPILE_THREADS=1``) are put back.

And the patches that make it fit this project on CPU (`plain_cpu_gemm`, `eager_rank_count`,
`cpu_shm_ident`). Context managers and functions only; nothing runs at import.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

__all__ = ["contained_startup", "cpu_shm_ident", "default_group_kept", "eager_rank_count", "kept_rng_states",
           "plain_cpu_gemm", "quiet_import", "torchrun_env"]


@contextlib.contextmanager
def kept_rng_states() -> Iterator[None]:
    """Put back python, numpy and torch (CPU and current CUDA device) RNG states on exit."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


@contextlib.contextmanager
def contained_startup() -> Iterator[None]:
    """Undo vLLM's start-up changes to this process (see this module's docstring)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    environ = dict(os.environ)
    # Start-up time: vLLM runs several full garbage collections while it starts (memory
    # profiling), each walking the whole heap of torch, transformers and vLLM's modules
    # (about a second each on a busy CPU); with what exists frozen they walk vLLM's new
    # objects only. Unfrozen below, so later collections see everything again.
    gc.freeze()
    try:
        with kept_rng_states():
            yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        gc.unfreeze()
        for key in set(os.environ) - set(environ):
            if not key.startswith("VLLM_"):
                del os.environ[key]
        for key, value in environ.items():
            if not key.startswith("VLLM_") and os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def plain_cpu_gemm() -> Iterator[bool]:
    """While open, vLLM's CPU linear layers keep their weight parameter and compute with
    ``torch.nn.functional.linear`` on it (see `shardwise.engine.vllm_engine`'s docstring); yields whether the
    switch took (False: this vLLM has no ``dispatch_cpu_unquantized_gemm``, checked on
    0.32, and its own packing stays). Opened around the engine's construction and every
    ``reload_weights`` on CPU (a reload re-runs the layers' post-processing)."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:  # pragma: no cover - another vLLM layout
        yield False
        return
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:  # pragma: no cover - another vLLM version
        yield False
        return

    def plain(layer: nn.Module, remove_weight: bool) -> None:
        if getattr(layer, "weight", None) is None or layer.weight.ndim != 2:
            original(layer, remove_weight)  # not a linear layer (MoE experts, convolutions)
            return
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain
    try:
        yield True
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


def eager_rank_count() -> None:
    """On CPU: vLLM's sampler counts the rank of each sampled token's log-prob with a
    function it compiles (``torch.compile``, inductor: C++ code built by the compiler) on
    the first generation that asks for log-probs, about 10 s of the first RL step on a busy
    CPU; that rank is never read here. The same count, eager, in its place (a compare and a
    sum over ``(tokens, vocab)``; the compiled kernel only saves that temporary's memory,
    which matters on a GPU, not at this project's CPU sizes). Checked on vLLM 0.32."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:  # pragma: no cover - another vLLM layout
        return
    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = _count_greater_or_equal


def _count_greater_or_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x` ``(rows, n)``, how many entries are >= the row's value in `values` ``(rows, 1)``."""
    return (x >= values).sum(-1)


@contextlib.contextmanager
def default_group_kept() -> Iterator[None]:
    """vLLM's teardown calls ``dist.destroy_process_group()`` on the default group: skip that
    one call (its own groups are destroyed as usual)."""
    real = dist.destroy_process_group

    def destroy(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None
        return real(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = real


@contextlib.contextmanager
def cpu_shm_ident(ident: str) -> Iterator[None]:
    """Name vLLM's CPU shared-memory segments (TP all-reduce) after `ident`.

    The CPU worker names them from ``VLLM_DIST_IDENT``, which it sets from the init method
    just before making its groups; with the external launcher that is ``env://``, the same
    for every engine on the machine, and the segments (``/dev/shm/<ident>-tp:0-[0-1]-cpushm_<i>``,
    created with O_EXCL and never unlinked by vLLM) of an earlier or concurrent engine make
    the next one fail with ``create shm in SHMManager failed. errno: 17``. The ident is
    set between the two."""
    try:
        from vllm.v1.worker import cpu_worker
    except ImportError:  # not the CPU build
        yield
        return
    real = cpu_worker.init_worker_distributed_environment

    def init(*args, **kwargs):
        os.environ["VLLM_DIST_IDENT"] = ident
        return real(*args, **kwargs)

    cpu_worker.init_worker_distributed_environment = init
    try:
        yield
    finally:
        cpu_worker.init_worker_distributed_environment = real


@contextlib.contextmanager
def torchrun_env(rank: int, local_rank: int) -> Iterator[None]:
    """The external launcher reads RANK / LOCAL_RANK (and, to make a group, MASTER_*) from
    the environment; a process whose group was made without them gets them for the call."""
    wanted = {"RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    saved = {k: os.environ.get(k) for k in wanted}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """vLLM's import-time warnings (e.g. "Triton is installed, but doesn't include CPU
    backend") would print around a one-line error in the launching process
    (`check_supported`): its ``vllm`` logger and ``VLLM_LOGGING_LEVEL`` are at ERROR for the
    import and put back after, so ranks started later log as configured."""
    before = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    vllm_log = logging.getLogger("vllm")  # when the process configured logging first, vLLM leaves its own alone
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_log.setLevel(level)
        if before is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
