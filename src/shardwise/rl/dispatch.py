"""How the single controller sends data to a worker group and collects the results.

A worker method declares its rule with `register`; a worker group (`shardwise.rl.cluster`)
looks the rule up, splits the arguments with `split_arguments`, calls the method on its
workers and joins the results with `collect_results`. The rules:

- ONE_TO_ALL: every worker gets the same arguments (init, checkpoint, export);
- DP_COMPUTE: every `Batch` argument is cut into one chunk per data-parallel rank (padded
  to a multiple of the dp size first, unless the method says ``pad=False``); workers
  that are sequence-parallel peers share a dp rank and get the same chunk, and only one
  of them (``collects``) returns. The returned batches are concatenated in dp order and
  the padding rows are dropped, so the caller gets one row per input row, in order.
  ``collect="first"`` returns the first collecting worker's result instead (for methods
  whose workers already agreed on the result, e.g. all-reduced metrics); "all" the list;
- ALL_TO_ALL: every argument is a list with one entry per worker; worker i gets entry i;
  all results come back as a list;
- RANK_ZERO: only worker 0 is called, its result comes back.

These functions are pure (no Ray), so the rules are tested without a cluster.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from shardwise.data.batch import Batch

__all__ = ["Dispatch", "DispatchRule", "Layout", "collect_results", "dispatch_rule", "register",
           "split_arguments"]

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__shardwise_dispatch__"
Collect = Literal["concat", "first", "all"]


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DispatchRule:
    mode: Dispatch
    collect: Collect
    pad: bool


def register(mode: Dispatch, collect: Collect | None = None, pad: bool = True) -> Callable[[F], F]:
    """Mark a worker method with its dispatch rule.

    `collect` (DP_COMPUTE only) defaults to "concat"; ONE_TO_ALL and ALL_TO_ALL return
    every worker's result ("all"), RANK_ZERO worker 0's ("first"). ``pad=False`` makes a
    DP_COMPUTE call with rows that do not divide by the dp size an error instead of
    padding (for updates, where a duplicated row would count twice).
    """
    if not isinstance(mode, Dispatch):
        raise TypeError(f"register: mode must be a Dispatch, got {mode!r}")
    default = {Dispatch.DP_COMPUTE: "concat", Dispatch.RANK_ZERO: "first"}.get(mode, "all")
    rule = DispatchRule(mode, collect or default, pad)
    if rule.collect not in ("concat", "first", "all"):
        raise ValueError(f"register: collect must be concat, first or all, got {rule.collect!r}")
    if rule.collect == "concat" and mode is not Dispatch.DP_COMPUTE:
        raise ValueError(f"register: collect='concat' needs DP_COMPUTE, not {mode.name}")

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, rule)
        return fn

    return mark


def dispatch_rule(cls: type, name: str) -> DispatchRule | None:
    """The rule of method `name` of worker class `cls`, or None if it has none."""
    return getattr(getattr(cls, name, None), _ATTR, None)


@dataclass(frozen=True)
class Layout:
    """Where each worker of a group sits: its data-parallel rank, and whether it returns
    results for that rank (one worker per dp rank does; its sequence-parallel peers not)."""

    dp_ranks: tuple[int, ...]
    collects: tuple[bool, ...]

    @classmethod
    def data_parallel(cls, world_size: int) -> Layout:
        return cls(tuple(range(world_size)), (True,) * world_size)

    def __post_init__(self) -> None:
        if len(self.dp_ranks) != len(self.collects) or not self.dp_ranks:
            raise ValueError("Layout needs one dp rank and one collects flag per worker")
        dp = self.dp_size
        if sorted(set(self.dp_ranks)) != list(range(dp)):
            raise ValueError(f"dp ranks {self.dp_ranks} must cover 0..{dp - 1}")
        for r in range(dp):
            n = sum(1 for d, c in zip(self.dp_ranks, self.collects) if d == r and c)
            if n != 1:
                raise ValueError(f"dp rank {r} has {n} collecting workers; exactly one must collect")

    @property
    def world_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def dp_size(self) -> int:
        return max(self.dp_ranks) + 1


Call = tuple[tuple[Any, ...], dict[str, Any]]


def split_arguments(rule: DispatchRule, layout: Layout, name: str, args: Sequence[Any],
                    kwargs: dict[str, Any]) -> tuple[list[Call | None], int]:
    """Per-worker ``(args, kwargs)`` (None: that worker is not called) and the number of
    padding rows a DP_COMPUTE split added."""
    n = layout.world_size
    if rule.mode is Dispatch.ONE_TO_ALL:
        return [(tuple(args), dict(kwargs))] * n, 0
    if rule.mode is Dispatch.RANK_ZERO:
        return [(tuple(args), dict(kwargs))] + [None] * (n - 1), 0
    if rule.mode is Dispatch.ALL_TO_ALL:
        for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
            if not isinstance(value, (list, tuple)) or len(value) != n:
                raise ValueError(f"{name} is ALL_TO_ALL: {where} must be a list with one entry per "
                                 f"worker ({n})")
        return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(n)], 0
    # DP_COMPUTE
    dp = layout.dp_size
    pads = set()

    def chunks(value: Any, where: str) -> list[Any]:
        if not isinstance(value, Batch):
            return [value] * dp
        if not rule.pad and len(value) % dp:
            raise ValueError(f"{name}: {where} has {len(value)} rows, which do not divide into "
                             f"{dp} data-parallel ranks; make the rows a multiple of {dp}")
        padded, pad = value.pad_to_divisor(dp) if len(value) else (value, 0)
        pads.add(pad)
        return padded.chunk(dp) if len(padded) else [padded] * dp

    split_args = [chunks(a, f"argument {i}") for i, a in enumerate(args)]
    split_kwargs = {k: chunks(v, k) for k, v in kwargs.items()}
    if len(pads) > 1:
        raise ValueError(f"{name}: the Batch arguments have different numbers of rows")
    calls = [(tuple(a[d] for a in split_args), {k: v[d] for k, v in split_kwargs.items()})
             for d in layout.dp_ranks]
    return calls, pads.pop() if pads else 0


def collect_results(rule: DispatchRule, layout: Layout, name: str, results: list[Any], pad: int) -> Any:
    """Join the workers' results (a list with None for workers not called)."""
    if rule.mode is not Dispatch.DP_COMPUTE:
        return results[0] if rule.collect == "first" else results
    by_dp: list[Any] = [None] * layout.dp_size
    for d, collects, r in zip(layout.dp_ranks, layout.collects, results):
        if collects:
            by_dp[d] = r
    if rule.collect == "first":
        return by_dp[0]
    if rule.collect == "all":
        return by_dp
    if not all(isinstance(r, Batch) for r in by_dp):
        kinds = sorted({type(r).__name__ for r in by_dp})
        raise TypeError(f"{name} is DP_COMPUTE with collect='concat' and must return a Batch, got {kinds}")
    return Batch.concat(by_dp).unpad(pad)
