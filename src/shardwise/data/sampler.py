"""Which examples each optimizer step sees, independent of the number of processes.

Every rank runs the same `GlobalBatchSampler` and gets the indices of the *whole* global
batch for the step; `rank_share` then takes this rank's contiguous slice and
`micro_batches` splits it for gradient accumulation. So a 1-process run and an N-process
run train on the same examples at every step, which is what the sharded-vs-unsharded
parity tests compare.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch

from shardwise.errors import DataError

T = TypeVar("T")


class GlobalBatchSampler:
    """Yields, per optimizer step, the list of example indices of the global batch.

    Epoch e visits ``torch.randperm(num_examples, generator=manual_seed(seed + e))``
    (``range(num_examples)`` when `shuffle` is False) in consecutive slices of
    `global_batch_size`; iteration goes on across epochs forever. With `drop_last` the
    tail of an epoch shorter than a global batch is skipped; without it, it is yielded as
    a shorter final batch.

    The state is ``{"epoch", "position"}``: the epoch and the offset in its permutation of
    the next batch. `state_dict` taken after a batch was received and loaded into a new
    sampler (same arguments) makes it yield exactly the batches that would have followed.
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if num_examples < 1:
            raise DataError("the data source has no examples")
        if drop_last and num_examples < global_batch_size:
            raise DataError(
                f"the data source has {num_examples} examples, fewer than one global batch "
                f"({global_batch_size}); lower the global batch size or add data"
            )
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0

    @property
    def steps_per_epoch(self) -> int:
        """Global batches (optimizer steps) per pass over the data."""
        full, rest = divmod(self.num_examples, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch `epoch` visits the examples."""
        if not self.shuffle:
            return list(range(self.num_examples))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_examples, generator=gen).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order(self.epoch)
        while True:
            remaining = self.num_examples - self.position
            if remaining <= 0 or (self.drop_last and remaining < self.global_batch_size):
                self.epoch += 1
                self.position = 0
                order = self.epoch_order(self.epoch)
                continue
            batch = order[self.position : self.position + self.global_batch_size]
            # Advance before yielding, so a state_dict taken after receiving this batch
            # points at the next one.
            self.position += len(batch)
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_examples:
            raise DataError(
                f"sampler state {state} does not fit a data source of {self.num_examples} examples"
            )
        self.epoch, self.position = epoch, position


def rank_share(indices: Sequence[T], dp_rank: int, dp_size: int) -> list[T]:
    """This data-parallel rank's contiguous slice of a global batch:
    ``indices[r*k:(r+1)*k]`` with ``k = len(indices) / dp_size``.

    Raises `DataError` (a ValueError) when the batch does not divide evenly.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    if len(indices) % dp_size:
        raise DataError(
            f"a global batch of {len(indices)} examples does not split evenly over "
            f"{dp_size} data-parallel ranks; make the global batch size a multiple of {dp_size}"
        )
    k = len(indices) // dp_size
    return list(indices[dp_rank * k : (dp_rank + 1) * k])


def micro_batches(indices: Sequence[T], micro_batch_size: int) -> list[list[T]]:
    """Consecutive chunks of `micro_batch_size`; the last one is shorter when the size
    does not divide (the loss normalisation by the global token count keeps that exact)."""
    if micro_batch_size < 1:
        raise DataError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(indices[i : i + micro_batch_size]) for i in range(0, len(indices), micro_batch_size)]


def token_budget_micro_batches(indices: Sequence[T], lengths: Sequence[int], budget: int, packed: bool = False,
                               key: str = "train.max_tokens_per_micro_batch") -> list[list[T]]:
    """`indices` (rows of lengths `lengths`, in tokens) split into micro-batches of at most
    `budget` tokens each, the work balanced between them.

    A micro-batch's tokens are what its tensors hold: rows x its longest row when rows are
    padded, the sum of its rows' lengths when `packed`. Rows go longest first, each to the
    micro-batch with the least tokens it still fits in (a new one when none has room), so
    few micro-batches hold about equal work; each keeps its rows in `indices`' order and
    the micro-batches come longest-first. The loss is the same for any split: the engine
    normalises by the global batch's loss tokens. DataError naming `key` when a row is
    longer than `budget`.
    """
    if budget < 1:
        raise DataError(f"{key}: must be >= 1, got {budget}")
    if len(indices) != len(lengths):
        raise DataError(f"token_budget_micro_batches: {len(indices)} rows but {len(lengths)} lengths")
    order = sorted(range(len(indices)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > budget:
        raise DataError(f"{key}: a row of {lengths[order[0]]} tokens does not fit a budget of {budget} tokens; "
                        f"raise it to at least {lengths[order[0]]}")
    bins: list[list[int]] = []
    cost: list[int] = []  # tokens each micro-batch holds
    for i in order:
        n = lengths[i]
        best = None
        for b, rows in enumerate(bins):
            grown = cost[b] + n if packed else lengths[rows[0]] * (len(rows) + 1)  # rows[0]: its longest
            if grown <= budget and (best is None or cost[b] < cost[best]):
                best = b
        if best is None:
            bins.append([i])
            cost.append(n)
        else:
            bins[best].append(i)
            cost[best] = cost[best] + n if packed else lengths[bins[best][0]] * len(bins[best])
    return [[indices[i] for i in sorted(rows)] for rows in bins]
