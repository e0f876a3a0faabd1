"""Whether N local processes fit this machine, said before any of them starts.

`shardwise train|infer|rl --nproc N` starts N processes on this machine. Before they
start, the launcher says how many processes share each CPU core and how much host
memory each rank will hold, and refuses (exit 2, one line) a count whose ranks cannot
fit in the memory available: 64 ranks of a tiny model on a 2-core, 24 GB machine sat at
step 0 for minutes without a word.

The memory of a rank is a lower bound, so that only what clearly cannot fit is refused:
the plan's bytes per rank (parameters, gradients and AdamW state of the largest rank;
host memory when there is no GPU or with CPU offload) plus `RUNTIME_BYTES_PER_RANK`,
what a rank holds before its model (Python, torch, transformers, the process group).
Activations, a reference policy or a critic come on top and are not counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shardwise.errors import ConfigError

__all__ = ["RUNTIME_BYTES_PER_RANK", "Capacity", "available_memory", "check_capacity", "check_nproc", "check_plan",
           "cpu_cores"]

RUNTIME_BYTES_PER_RANK = 256 * 2**20
"""Host memory a rank holds besides its share of the model (bytes). Measured: a rank of
the tiny SFT example (torch 2.13 CPU, transformers 5.19, gloo, 2 ranks) holds ~290 MiB of
its own pages (USS) and ~340 MiB counting its share of the shared ones (PSS); this is a
lower bound of that."""
CROWDED_PER_CORE = 4
"""More processes than this per CPU core: the start-up line says steps will be slow."""


def check_nproc(nproc: int | None, flag: str = "--nproc") -> None:
    """ConfigError on `flag` when a process count was given and is not positive."""
    if nproc is not None and nproc < 1:
        raise ConfigError(flag, f"{nproc} is not a positive number of processes", f"e.g. {flag} 1 or {flag} 2")


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask; the machine's count elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def available_memory() -> int | None:
    """Host memory available to new processes (bytes: the kernel's MemAvailable in
    /proc/meminfo), or None where there is no such file (then nothing is refused)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


@dataclass(frozen=True)
class Capacity:
    """N processes on this machine: cores, memory per rank, memory available."""

    nproc: int
    cores: int
    plan_bytes: int
    """Host bytes of the plan per rank (largest rank): parameters, gradients, optimizer state."""
    available: int | None
    """Host memory available (bytes), None if unknown."""
    on_device: bool = False
    """The plan's bytes live in accelerator memory (not counted in host memory)."""

    @property
    def per_rank(self) -> int:
        return RUNTIME_BYTES_PER_RANK + (0 if self.on_device else self.plan_bytes)

    @property
    def total(self) -> int:
        return self.nproc * self.per_rank

    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def most(self) -> int:
        """The most processes that would fit the available memory (at least 0), taking the
        plan's bytes of all ranks together as fixed (FSDP shards them: fewer ranks hold
        more each)."""
        if self.available is None:
            return self.nproc
        plan_all = 0 if self.on_device else self.nproc * self.plan_bytes
        return max(0, (self.available - plan_all) // RUNTIME_BYTES_PER_RANK)

    def breakdown(self) -> str:
        plan = "plan on the GPU" if self.on_device else f"{_gib(self.plan_bytes)} of the plan"
        return f"{_gib(self.per_rank)} per rank: {plan} + ~{_gib(RUNTIME_BYTES_PER_RANK)} of runtime"

    def line(self) -> str:
        """The start-up line: processes per core and memory per rank."""
        per_core = self.nproc / self.cores
        text = (f"shardwise launch: {self.nproc} process{'es' if self.nproc != 1 else ''} on {self.cores} CPU "
                f"core{'s' if self.cores != 1 else ''} ({per_core:.3g} per core); at least {self.breakdown()}, "
                f"{_gib(self.total)} in all")
        text += f" of {_gib(self.available)} available" if self.available is not None else ""
        if per_core > CROWDED_PER_CORE:
            text += f"; more than {CROWDED_PER_CORE} processes per core: expect slow steps"
        return text


def check_capacity(nproc: int, plan_bytes: int, on_device: bool = False,
                   available: int | None = None) -> Capacity:
    """The `Capacity` of `nproc` ranks holding `plan_bytes` each; ConfigError on ``--nproc``
    when they clearly cannot fit in the host memory available (`available`: measured now
    when not given)."""
    cap = Capacity(nproc, cpu_cores(), plan_bytes, available if available is not None else available_memory(),
                   on_device)
    if not cap.fits():
        most = cap.most()
        if most >= 1:
            hint = f"use at most --nproc {most}"
        else:
            hint = (f"the model's parameters, gradients and AdamW state alone need {_gib(nproc * plan_bytes)}: "
                    "a smaller model, model.lora.enabled=true, or a machine with more memory")
        raise ConfigError("--nproc", f"{nproc} processes need at least {_gib(cap.total)} of host memory "
                          f"({cap.breakdown()}), but {_gib(cap.available)} is available", hint)
    return cap


def check_plan(nproc: int, plan, offload: bool) -> Capacity:
    """`check_capacity` for `nproc` ranks of a job whose `ShardingPlan` is `plan` (None:
    the runtime alone); its bytes are host memory without a GPU or with `offload`."""
    plan_bytes = max(r["total"] for r in plan.memory_per_rank_bytes) if plan is not None else 0
    return check_capacity(nproc, plan_bytes, on_device=not offload and torch.cuda.is_available())
