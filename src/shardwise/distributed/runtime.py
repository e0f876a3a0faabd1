"""Process group set-up and teardown, device choice and seeding.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); with none
it runs as a single process (rank 0 of 1) and still creates a 1-rank group so that the same
code paths (DTensor, DCP) are used. gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from shardwise.errors import ConfigError


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment, or (0, 1, 0).

    A WORLD_SIZE that is not a positive integer is a ConfigError naming the variable.
    """
    values = {}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        text = os.environ.get(var)
        if text is not None and not text.isdigit():
            raise ConfigError(var, f"environment variable is {text!r}, not a non-negative integer")
        values[var] = None if text is None else int(text)
    if values["WORLD_SIZE"] == 0:
        raise ConfigError("WORLD_SIZE", "environment variable is 0, not a positive integer")
    if values["WORLD_SIZE"] is None:
        return 0, 1, 0
    rank = values["RANK"] or 0
    return rank, values["WORLD_SIZE"], values["LOCAL_RANK"] if values["LOCAL_RANK"] is not None else rank


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def init_distributed(timeout_s: float | None = None) -> Runtime:
    """Create (or adopt) the default process group and pick this rank's device."""
    rank, world, local_rank = env_world()
    if accelerator_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if timeout_s is None:
        timeout_s = float(os.environ.get("SHARDWISE_PG_TIMEOUT_S", 600))
    if not dist.is_initialized():
        # A process alone (no launcher's environment) rendezvous with itself in memory: no
        # port to race for, and nothing left in os.environ for the processes it starts.
        alone = world == 1 and "MASTER_ADDR" not in os.environ
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), store=dist.HashStore() if alone else None,
                                device_id=device if backend == "nccl" else None)
    else:
        backend = dist.get_backend()
    return Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   device=device, backend=backend)


def teardown(graceful: bool = True) -> None:
    """Destroy the default group if this process made one (safe to call twice).

    `graceful`: wait for every rank first (a barrier), so no rank leaves while a peer still
    needs it. On an error path pass False: the peers may be in another collective, or dead,
    and a barrier would wait for them until the process group's timeout.
    """
    if not dist.is_initialized():
        return
    try:
        if graceful:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) identically on every rank."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
