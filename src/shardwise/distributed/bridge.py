"""The weight bridge: the actor group's new weights to the generator group, over a process
group of their own (asynchronous RL).

The actor group and the generator group are separate torch.distributed worlds (each its
own Ray worker group). `WeightBridge` joins the actor's rank 0 (bridge rank 0, the root)
and every generator rank (generator rank r is bridge rank 1 + r) in one more group: a
``TCPStore`` served by the root and a ``ProcessGroupGloo`` on CPU or ``ProcessGroupNCCL``
on CUDA (the public classes; the trainers' own default groups are not touched).

One push (`WeightBridge.send`, root only, returns at once; a background thread does the
rest, so the actor's next update is not blocked):

1. the root announces push n in the store (key ``push/<n>`` = the version; ``stop`` when
   it closes): a receiver idles on the store, never inside a collective, so a long
   training step is no timeout; it tells its optional `on_announce` callback (the
   generator then knows the actor has finished the update, before the tensors arrive);
2. broadcast of the header's length (int64 ``(1,)``), then of the header: UTF-8 JSON as a
   uint8 tensor (version, names, shapes, dtypes by name, and where each tensor sits in
   which bucket). Never pickle: a receiver reads data, never code;
3. one broadcast per bucket: small tensors packed into a flat uint8 buffer of at most
   `bucket_bytes`, each at an offset aligned to `ALIGN` bytes; a tensor of `ALONE_BYTES` or
   more is a bucket of its own, broadcast from its own memory (0: one bucket per tensor);
4. each receiver marks push n done in the store (``got/<n>/<rank>``) and hands
   ``(version, {name: tensor})`` to its `on_weights` callback; the tensors are views into
   the push's own buffers (nothing is shared with the next push).

No wait without a bound: the join, each push and each broadcast within ``timeout_s``. A
failure is kept and raised as one `BridgeError` line naming the bridge, the version and the
side that did not answer: on the root at the next `send` or at `close`; on a receiver by
whoever checks `WeightBridge.error` (the generator, at its next call).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["ALIGN", "BridgeError", "WeightBridge", "bucket_layout", "decode_header", "encode_header",
           "open_store", "unpack_bucket"]

log = logging.getLogger(__name__)

ALIGN = 16
"""Byte alignment of each tensor inside a bucket (a dtype view needs an aligned offset)."""

ALONE_BYTES = 2**20
"""A tensor this large is a bucket of its own: a broadcast of its own bytes costs less than
copying it into a shared buffer (packing pays for small tensors: one message, not many)."""

POLL_S = 0.02
"""How often an idle receiver looks for the next push announced in the store."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}
"""The dtypes a push may carry, by the name the header gives them."""

GRACE_S = 30.0
"""The bridge's process group gives up this long after our own waits would have."""

_STOP = "stop"


class BridgeError(RuntimeError):
    """A join or push of the weight bridge failed or did not finish in time (one line)."""


def side(rank: int) -> str:
    """Who bridge rank `rank` is: the actor group's rank 0, or generator rank ``rank - 1``."""
    return "the actor group (bridge rank 0)" if rank == 0 else f"generator rank {rank - 1}"


def _sides(ranks: Sequence[int]) -> str:
    if not ranks:
        return "no rank"
    if all(r > 0 for r in ranks):
        gens = ", ".join(str(r - 1) for r in ranks)
        return f"generator rank{'s' if len(ranks) > 1 else ''} {gens}"
    return ", ".join(side(r) for r in ranks)


# ------------------------------------------------------------------ header and buckets


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits in a push."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    """Byte offset inside the bucket (a multiple of `ALIGN`)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_layout(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[Slot], list[int]]:
    """The slot of each tensor and the size in bytes of each bucket: consecutive small
    tensors share a bucket while it stays within `bucket_bytes`; a tensor of `ALONE_BYTES`
    or more (or of `bucket_bytes`) goes alone, sent from its own memory; 0: one bucket per
    tensor."""
    slots: list[Slot] = []
    sizes: list[int] = []
    shared = False  # whether the last bucket takes more tensors
    for name, t in named:
        if t.dtype not in _DTYPES.values():
            raise ValueError(f"weight bridge: {name} is {t.dtype}, which a push does not carry")
        nbytes = t.numel() * t.element_size()
        alone = bucket_bytes <= 0 or nbytes >= min(bucket_bytes, ALONE_BYTES)
        start = _aligned(sizes[-1]) if sizes else 0
        if alone or not shared or start + nbytes > bucket_bytes:
            sizes.append(0)
            start = 0
        shared = not alone
        slots.append(Slot(name, tuple(t.shape), t.dtype, len(sizes) - 1, start))
        sizes[-1] = start + nbytes
    return slots, sizes


def encode_header(version: int, slots: Sequence[Slot], sizes: Sequence[int]) -> torch.Tensor:
    """The push's header as a uint8 tensor ``(n,)``: UTF-8 JSON."""
    head = {"version": int(version), "names": [s.name for s in slots], "shapes": [list(s.shape) for s in slots],
            "dtypes": [str(s.dtype).removeprefix("torch.") for s in slots],
            "buckets": [s.bucket for s in slots], "offsets": [s.offset for s in slots], "sizes": list(sizes)}
    raw = json.dumps(head, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_header(data: torch.Tensor) -> tuple[int, list[Slot], list[int]]:
    """(version, slots, bucket sizes) of a header tensor; ValueError when it is not one."""
    try:
        head = json.loads(bytes(data.cpu().numpy().tobytes()).decode())
        n = len(head["names"])
        fields = [head[k] for k in ("shapes", "dtypes", "buckets", "offsets")]
        if any(len(f) != n for f in fields):
            raise ValueError("fields of different lengths")
        slots = [Slot(str(name), tuple(int(x) for x in shape), _DTYPES[dtype], int(b), int(o))
                 for name, shape, dtype, b, o in zip(head["names"], *fields)]
        sizes = [int(s) for s in head["sizes"]]
        version = int(head["version"])
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"weight bridge: a push header that is not one ({type(e).__name__}: {e})") from None
    for s in slots:
        if not 0 <= s.bucket < len(sizes) or s.offset % ALIGN or s.offset + s.nbytes > sizes[s.bucket]:
            raise ValueError(f"weight bridge: header places {s.name} outside its bucket")
    return version, slots, sizes


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], slots: Sequence[Slot], sizes: Sequence[int],
                bucket: int, device: torch.device) -> torch.Tensor:
    """Bucket `bucket`'s flat uint8 buffer ``(sizes[bucket],)`` on `device` (a tensor alone
    in its bucket: its own bytes, no copy)."""
    mine = [(t, s) for (_, t), s in zip(named, slots) if s.bucket == bucket]
    if len(mine) == 1 and mine[0][1].offset == 0 and mine[0][1].nbytes == sizes[bucket]:
        t = mine[0][0].detach().to(device)
        return t.contiguous().reshape(-1).view(torch.uint8)
    buf = torch.empty(sizes[bucket], dtype=torch.uint8, device=device)  # alignment gaps: never read
    for (_, t), s in zip(named, slots):
        if s.bucket == bucket and s.nbytes:
            buf[s.offset:s.offset + s.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def unpack_bucket(buf: torch.Tensor, slots: Sequence[Slot], bucket: int) -> dict[str, torch.Tensor]:
    """The tensors of bucket `bucket` as views into `buf`."""
    out = {}
    for s in slots:
        if s.bucket == bucket:
            out[s.name] = buf[s.offset:s.offset + s.nbytes].view(s.dtype).reshape(s.shape)
    return out


# ------------------------------------------------------------------ the bridge


def open_store(addr: str, timeout_s: float) -> dist.TCPStore:
    """The root's store, listening on a free port of this host (``store.port``) before
    anyone joins: hand ``(addr, store.port)`` to the generator ranks, then the store to
    the root's `WeightBridge`."""
    return dist.TCPStore(addr, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


class WeightBridge:
    """One side of the bridge (see the module docstring). Rank 0 is the root (it sends);
    ranks >= 1 receive after `start_receiving`. Joining blocks until all `world` ranks
    joined, at most `timeout_s` (then `BridgeError` naming the ranks that did not).

    `store`: the root's own store from `open_store` (else the root serves one at `port`).
    `name` names the bridge in its errors."""

    def __init__(self, addr: str, port: int, rank: int, world: int, device: torch.device, timeout_s: float,
                 *, store: dist.TCPStore | None = None, name: str = "weight bridge"):
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"{name}: rank {rank} of {world}; a bridge joins a root and at least one receiver")
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.timeout_s = float(timeout_s)
        self.name = name
        self.error: BridgeError | None = None
        """The first failure (a receiver's, for its owner to raise; the root raises its own)."""
        self.last_send_s = 0.0
        """Seconds the last finished push took on the root (announce to the last bucket)."""
        self.last_bytes = 0
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline = 0.0
        self._sending_version: int | None = None
        self._seq = 0
        timeout = timedelta(seconds=self.timeout_s)
        try:
            if store is None:
                store = dist.TCPStore(addr, port, None, rank == 0, timeout, wait_for_workers=False)
            store.set_timeout(timeout)
            self.store = store
            self._join(timeout)
        except BridgeError:
            raise
        except Exception as e:  # noqa: BLE001 - the store's and the group's own words, in one line
            raise BridgeError(f"{name}: {side(rank)} could not join at {addr}:{port}: {_first_line(e)}") from e

    def _join(self, timeout: timedelta) -> None:
        self.store.set(f"joined/{self.rank}", "1")
        keys = [f"joined/{r}" for r in range(self.world)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world) if not self.store.check([f"joined/{r}"])]
                raise BridgeError(f"{self.name}: {_sides(missing)} did not join within {self.timeout_s:g} s")
            time.sleep(POLL_S)
        prefix = dist.PrefixStore("pg/", self.store)
        if self.device.type == "cuda":
            # our waits poll the work and abort the group at the deadline (NCCL waits do not block the host)
            self.pg = dist.ProcessGroupNCCL(prefix, self.rank, self.world, dist.ProcessGroupNCCL.Options())
        else:
            # the group's own limit is a backstop behind our waits (which name who did not answer)
            self.pg = dist.ProcessGroupGloo(prefix, self.rank, self.world, timeout + timedelta(seconds=GRACE_S))
        # One broadcast both ways through the group: every rank can reach the root.
        probe = torch.tensor([self.world], dtype=torch.int64, device=self.device)
        self._wait(self.pg.broadcast(probe, 0), time.monotonic() + self.timeout_s, "the join")

    # -- waits

    def _wait(self, work, deadline: float, what: str) -> None:
        """Wait for `work` until `deadline` (monotonic seconds); TimeoutError naming `what`."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(what)
        if self.device.type == "cuda":  # NCCL's wait does not block the host: poll it
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self.pg.abort()
                    raise TimeoutError(what)
                time.sleep(0.001)
        try:
            done = work.wait(timedelta(seconds=max(left, 0.001)))
        except RuntimeError:
            if time.monotonic() >= deadline - 0.01:  # gloo's words for a wait that ran out
                raise TimeoutError(what) from None
            raise
        if not done:
            raise TimeoutError(what)

    # -- the root

    def send(self, version: int, named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
        """Push `named` (HF names, full tensors this bridge may keep until sent) as
        `version` to every receiver; returns at once (a thread broadcasts them). Raises
        `BridgeError` when the previous push failed or has not finished within `timeout_s`
        of its start. Root only."""
        if self.rank != 0:
            raise RuntimeError(f"{self.name}: only the root (bridge rank 0) sends")
        self._finish_previous()
        slots, sizes = bucket_layout(named, bucket_bytes)  # a tensor no push carries: raised here
        self._seq += 1
        self._sending_version = int(version)
        self._deadline = time.monotonic() + self.timeout_s
        self._thread = threading.Thread(target=self._send, args=(self._seq, int(version), named, slots, sizes),
                                        name=f"bridge-send-{version}", daemon=True)
        self._thread.start()

    def _finish_previous(self) -> None:
        if self._thread is not None:
            self._thread.join(max(self._deadline - time.monotonic(), 0.0))
            if self._thread.is_alive() and self.error is None:
                self.error = BridgeError(f"{self.name}: the push of version {self._sending_version} did not "
                                         f"finish in {self.timeout_s:g} s: {self._missing(self._seq)} did not answer")
            if not self._thread.is_alive():
                self._thread = None
        if self.error is not None:
            raise self.error

    def _missing(self, seq: int) -> str:
        try:
            ranks = [r for r in range(1, self.world) if not self.store.check([f"got/{seq}/{r}"])]
        except Exception:  # noqa: BLE001 - only to say who; the store itself may be gone
            return "a receiver"
        return _sides(ranks) if ranks else "the group"

    def _send(self, seq: int, version: int, named: list[tuple[str, torch.Tensor]], slots: list[Slot],
              sizes: list[int]) -> None:
        start = time.perf_counter()
        what = "the header"
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.store.set(f"push/{seq}", str(version))
            header = encode_header(version, slots, sizes).to(self.device)
            length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
            self._wait(self.pg.broadcast(length, 0), self._deadline, what)
            self._wait(self.pg.broadcast(header, 0), self._deadline, what)
            for b in range(len(sizes)):
                what = f"bucket {b + 1} of {len(sizes)}"
                if sizes[b]:
                    buf = pack_bucket(named, slots, sizes, b, self.device)
                    self._wait(self.pg.broadcast(buf, 0), self._deadline, what)
            del named
            self.last_send_s = time.perf_counter() - start
            self.last_bytes = sum(sizes)
        except TimeoutError:
            self.error = BridgeError(f"{self.name}: the push of version {version} did not finish in "
                                     f"{self.timeout_s:g} s ({what}): {self._missing(seq)} did not answer")
        except Exception as e:  # noqa: BLE001 - kept, raised at the next send or close
            self.error = BridgeError(f"{self.name}: the push of version {version} failed ({what}): "
                                     f"{self._missing(seq)} did not answer: {_first_line(e)}")

    # -- a receiver

    def start_receiving(self, on_weights: Callable[[int, dict[str, torch.Tensor]], None],
                        on_announce: Callable[[int], None] | None = None) -> None:
        """Receive every push in a thread, calling ``on_weights(version, {name: tensor})``
        after each complete one (in the thread), and ``on_announce(version)`` as soon as the
        root has announced it, before its tensors come (the root has finished what made
        them). A failure stops it and stays in `error`. Receivers only."""
        if self.rank == 0:
            raise RuntimeError(f"{self.name}: the root sends; ranks >= 1 receive")
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: already receiving")
        self._thread = threading.Thread(target=self._receive, args=(on_weights, on_announce), name="bridge-receive",
                                        daemon=True)
        self._thread.start()

    def _receive(self, on_weights: Callable[[int, dict[str, torch.Tensor]], None],
                 on_announce: Callable[[int], None] | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        seq = 0
        version: int | str = "?"
        what = "the next announcement"
        try:
            while not self._closing.is_set():
                seq += 1
                key = f"push/{seq}"
                what, version = "the next announcement", "?"
                while not self.store.check([key]):  # idle: the actor may train for long
                    if self._closing.wait(POLL_S):
                        return
                announced = self.store.get(key).decode()
                if announced == _STOP:
                    return
                version = int(announced)
                if on_announce is not None:
                    on_announce(version)
                deadline = time.monotonic() + self.timeout_s
                what = "the header"
                length = torch.zeros(1, dtype=torch.int64, device=self.device)
                self._wait(self.pg.broadcast(length, 0), deadline, what)
                header = torch.zeros(int(length.item()), dtype=torch.uint8, device=self.device)
                self._wait(self.pg.broadcast(header, 0), deadline, what)
                version, slots, sizes = decode_header(header)
                tensors: dict[str, torch.Tensor] = {}
                for b, size in enumerate(sizes):
                    what = f"bucket {b + 1} of {len(sizes)}"
                    buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                    if size:
                        self._wait(self.pg.broadcast(buf, 0), deadline, what)
                    tensors.update(unpack_bucket(buf, slots, b))
                self.store.set(f"got/{seq}/{self.rank}", "1")
                on_weights(version, tensors)
        except TimeoutError:
            self.error = BridgeError(f"{self.name}: {side(self.rank)} waited {self.timeout_s:g} s for {what} of "
                                     f"version {version}: {side(0)} did not answer")
        except Exception as e:  # noqa: BLE001 - kept for the owner's next call
            if self._closing.is_set():
                return
            if version == "?":  # idle between pushes: the root's store went away (its process, its node)
                self.error = BridgeError(f"{self.name}: {side(self.rank)} lost {side(0)} while waiting for the "
                                         f"next push: {_first_line(e)}")
            else:
                self.error = BridgeError(f"{self.name}: {side(self.rank)} lost the push of version {version} "
                                         f"({what}): {side(0)} did not answer: {_first_line(e)}")

    # -- both

    def close(self) -> None:
        """Stop: the root finishes its last push (bounded; raises its failure, once) and
        tells the receivers to stop; a receiver stops its thread. The group is shut down."""
        if self._closing.is_set():
            return
        error = None
        try:
            if self.rank == 0:
                try:
                    self._finish_previous()
                except BridgeError as e:
                    error = e
                try:
                    self.store.set(f"push/{self._seq + 1}", _STOP)
                except Exception:  # noqa: BLE001 - nobody left to tell
                    pass
            self._closing.set()
            if self.rank != 0 and self._thread is not None:
                self._thread.join(self.timeout_s)
        finally:
            self._closing.set()
            pg = getattr(self, "pg", None)
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception:  # noqa: BLE001 - a group already broken has nothing to shut
                    pass
        if error is not None:
            raise error


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
