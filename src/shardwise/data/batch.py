"""The batch protocol: rows of tensors, per-row arrays and metadata, passed between the
generation engine, the scorers and the RL workers.

A `Batch` is rows of one step's data in three parts:

- ``tensors``: ``dict[str, torch.Tensor]``, each ``(rows, ...)``; e.g. ``input_ids``
  ``(rows, seq)`` int64, ``old_logp`` ``(rows, response_len)`` float32;
- ``arrays``: ``dict[str, numpy.ndarray]``, each ``(rows, ...)``; per-row data that is not
  a tensor (prompt strings, group ids, ground truth), ``dtype=object`` allowed;
- ``meta``: ``dict[str, Any]``, data about the batch as a whole (e.g. ``"metrics"``,
  a dict of name -> value or list of values).

Every tensor and array shares the first dimension, the number of rows, ``len(batch)``.
Row operations (indexing, chunk, split, repeat, pad) apply to tensors and arrays alike and
copy ``meta`` (a deep copy, so a worker editing one part's meta does not edit another's).

Workers exchange batches as bytes (`Batch.to_bytes` / `Batch.from_bytes`): tensors go
through safetensors and arrays/meta through JSON, so a pickled `Batch` carries data only,
never code, and unpickling cannot run anything.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from shardwise.errors import nearest

__all__ = ["Batch", "RowIndex"]

RowIndex = int | slice | Sequence[int] | torch.Tensor | np.ndarray
"""Rows to take: an int (kept as one row), a slice, or an index/boolean tensor, array or list."""

# Serialised layout: magic, little-endian u64 length of a UTF-8 JSON header, the header,
# then the safetensors bytes of the tensors.
_MAGIC = b"SWBATCH1"
_HEADER_LEN = struct.Struct("<Q")
_JSON_SCALARS = (str, int, float, bool, type(None))


def _rows_of(value: torch.Tensor | np.ndarray) -> int | None:
    """First-dimension size, or None for a 0-d value (which has no rows)."""
    return int(value.shape[0]) if value.ndim > 0 else None


def _equal(a: Any, b: Any) -> bool:
    """Value equality across tensors, arrays, containers and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype == object:
            return all(_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1), strict=True))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    try:
        return bool(a == b)
    except Exception:  # e.g. objects whose == returns something without a truth value
        return a is b


def _check_json_value(value: Any, where: str) -> None:
    """Raise TypeError unless `value` survives a JSON round trip unchanged.

    Allowed: str, int, float (NaN/inf included), bool, None, lists of these and dicts with
    str keys. Tuples are refused because JSON would give them back as lists.
    """
    if isinstance(value, _JSON_SCALARS):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-str key {k!r}; JSON keys must be str")
            _check_json_value(item, f"{where}[{k!r}]")
        return
    hint = ""
    if isinstance(value, (np.generic, torch.Tensor, np.ndarray)):
        hint = " (convert it with .item() or .tolist())"
    elif isinstance(value, tuple):
        hint = " (use a list: JSON would give a tuple back as a list)"
    raise TypeError(
        f"{where} is a {type(value).__name__}, which Batch.to_bytes cannot serialise as JSON; "
        f"use str, int, float, bool, None, lists or str-keyed dicts{hint}"
    )


def _array_to_json(key: str, arr: np.ndarray) -> dict[str, Any]:
    """JSON form of one array: dtype string, shape, and the elements in C order."""
    if arr.dtype == object:
        flat = arr.reshape(-1).tolist()
        for i, item in enumerate(flat):
            _check_json_value(item, f"arrays[{key!r}] element {i}")
        return {"dtype": "object", "shape": list(arr.shape), "data": flat}
    if arr.dtype.kind not in "biufU":
        raise TypeError(
            f"arrays[{key!r}] has dtype {arr.dtype}, which Batch.to_bytes cannot serialise as "
            "JSON; use bool, int, uint, float, str or object (of JSON-able values)"
        )
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def _array_from_json(spec: dict[str, Any]) -> np.ndarray:
    shape = tuple(spec["shape"])
    data = spec["data"]
    if spec["dtype"] == "object":
        out = np.empty(len(data), dtype=object)
        for i, item in enumerate(data):
            out[i] = item  # element-wise so that list elements stay single objects
        return out.reshape(shape)
    return np.asarray(data, dtype=np.dtype(spec["dtype"])).reshape(shape)


def _normalize_index(index: RowIndex) -> int | slice | torch.Tensor:
    """An int, a slice, or a 1-d CPU int64/bool tensor for the rows to take."""
    if isinstance(index, bool):
        raise TypeError("Batch indexing with a bool is ambiguous; use a list or tensor of bools")
    if isinstance(index, (int, np.integer)):
        return int(index)
    if isinstance(index, slice):
        return index
    if isinstance(index, str):
        raise TypeError(f"Batch indexing selects rows; use batch.tensors[{index!r}] or batch.arrays[{index!r}]")
    if isinstance(index, tuple):
        raise TypeError("Batch indexing selects rows only; use a list, not a tuple, for several rows")
    if isinstance(index, torch.Tensor):
        t = index.detach().cpu()
    else:
        arr = np.asarray(index)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        t = torch.from_numpy(arr)
    if t.ndim == 0:
        if t.dtype == torch.bool:
            raise TypeError("Batch indexing with a 0-d bool is ambiguous; use a 1-d mask")
        return int(t)
    if t.ndim != 1:
        raise TypeError(f"row index must be 1-dimensional, got shape {tuple(t.shape)}")
    if t.dtype != torch.bool:
        if t.is_floating_point() or t.is_complex():
            raise TypeError(f"row index must be integer or bool, got {t.dtype}")
        t = t.to(torch.int64)
    return t


@dataclass(eq=False)
class Batch:
    """Rows of tensors and per-row arrays, plus batch-level metadata.

    Construct with `Batch.from_dict` (accepts lists for arrays) or directly; both check
    that every tensor and array has the same first dimension.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row tensors, each ``(rows, ...)``, any dtype and device."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-row non-tensor data, each ``(rows, ...)`` numpy array (``dtype=object`` allowed)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Batch-level data; ``meta["metrics"]`` (name -> value or list) merges in `concat`."""

    def __post_init__(self) -> None:
        ref_key: str | None = None
        ref_rows: int | None = None
        for kind, store, typ in (("tensor", self.tensors, torch.Tensor), ("array", self.arrays, np.ndarray)):
            for key, value in store.items():
                if not isinstance(key, str):
                    raise TypeError(f"{kind} keys must be str, got {key!r}")
                if not isinstance(value, typ):
                    raise TypeError(
                        f"{kind} {key!r} is a {type(value).__name__}; expected {typ.__module__}.{typ.__name__}"
                    )
                rows = _rows_of(value)
                if rows is None:
                    raise ValueError(
                        f"{kind} {key!r} is 0-dimensional; every tensor and array needs a first "
                        "(row) dimension. Put batch-level values in meta instead"
                    )
                if ref_rows is None:
                    ref_key, ref_rows = key, rows
                elif rows != ref_rows:
                    raise ValueError(
                        f"{kind} {key!r} has {rows} rows but {ref_key!r} has {ref_rows}; all "
                        "tensors and arrays of a Batch must share the first dimension"
                    )
        if not isinstance(self.meta, dict):
            raise TypeError(f"meta must be a dict, got {type(self.meta).__name__}")

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        arrays: dict[str, np.ndarray | Sequence[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Batch:
        """Build a batch, turning list-valued arrays into 1-d ``dtype=object`` arrays.

        A list becomes one object per row (a list of lists stays ``(rows,)`` with list
        elements, never a 2-d array). Raises ValueError naming the key whose first
        dimension differs from the others.
        """
        converted: dict[str, np.ndarray] = {}
        for key, value in (arrays or {}).items():
            if isinstance(value, np.ndarray):
                converted[key] = value
            else:
                items = list(value)
                arr = np.empty(len(items), dtype=object)
                for i, item in enumerate(items):
                    arr[i] = item
                converted[key] = arr
        return cls(tensors=dict(tensors or {}), arrays=converted, meta=dict(meta or {}))

    # ---------------------------------------------------------------- basics

    def __len__(self) -> int:
        """Number of rows; 0 for a batch with no tensors and no arrays."""
        for value in (*self.tensors.values(), *self.arrays.values()):
            return int(value.shape[0])
        return 0

    def __repr__(self) -> str:
        t = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items())
        a = ", ".join(f"{k}: {v.shape} {v.dtype}" for k, v in self.arrays.items())
        return f"Batch(len={len(self)}, tensors={{{t}}}, arrays={{{a}}}, meta_keys={list(self.meta)})"

    def _with_rows(self, tensors: dict[str, torch.Tensor], arrays: dict[str, np.ndarray]) -> Batch:
        return Batch(tensors=tensors, arrays=arrays, meta=copy.deepcopy(self.meta))

    def select(
        self,
        tensor_keys: Iterable[str] | None = None,
        array_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> Batch:
        """A batch with only the named keys; None keeps all keys of that part, [] none.

        Tensors and arrays are shared with this batch (no copy); meta is deep-copied.
        Raises ValueError for a key that is absent, with the nearest present name.
        """

        def pick(part: str, store: dict[str, Any], keys: Iterable[str] | None) -> dict[str, Any]:
            if keys is None:
                return dict(store)
            keys = list(keys)
            for k in keys:
                if k not in store:
                    near = nearest(k, store, n=1)
                    hint = f"did you mean {near[0]!r}?" if near else f"present: {sorted(store)}"
                    raise ValueError(f"select: no {part} key {k!r}; {hint}")
            return {k: store[k] for k in keys}

        return Batch(
            tensors=pick("tensors", self.tensors, tensor_keys),
            arrays=pick("arrays", self.arrays, array_keys),
            meta=copy.deepcopy(pick("meta", self.meta, meta_keys)),
        )

    def __getitem__(self, index: RowIndex) -> Batch:
        """Select rows; always returns a Batch (an int index gives a batch of one row).

        `index`: int (negative allowed), slice, int64 index or bool mask as a torch tensor,
        numpy array or list. A slice gives views of the tensors; other indices copy.
        """
        index = _normalize_index(index)
        n = len(self)
        if isinstance(index, int):
            if not -n <= index < n:
                raise IndexError(f"row {index} out of range for a batch of {n} rows")
            index = slice(index % n, index % n + 1)
        if isinstance(index, torch.Tensor):
            if index.dtype == torch.bool and index.numel() != n:
                raise IndexError(f"bool row mask has {index.numel()} entries for a batch of {n} rows")
            np_index: Any = index.numpy()
            tensors = {k: v[index.to(v.device)] for k, v in self.tensors.items()}
        else:
            np_index = index
            tensors = {k: v[index] for k, v in self.tensors.items()}
        arrays = {k: v[np_index] for k, v in self.arrays.items()}
        return self._with_rows(tensors, arrays)

    # ---------------------------------------------------------------- splitting

    def chunk(self, n: int) -> list[Batch]:
        """`n` parts of ``len(self) // n`` consecutive rows each.

        Raises ValueError when the rows do not divide by `n`: pad first with
        `pad_to_divisor(n)` and `unpad` the gathered result.
        """
        if n < 1:
            raise ValueError(f"chunk: n must be >= 1, got {n}")
        rows = len(self)
        if rows % n:
            raise ValueError(
                f"chunk: {rows} rows do not divide into {n} equal parts; call "
                f"pad_to_divisor({n}) first and unpad(pad_count) after gathering the results"
            )
        size = rows // n
        return [self[i * size : (i + 1) * size] for i in range(n)]

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of `size` rows; the last may be shorter. [] for an empty batch."""
        if size < 1:
            raise ValueError(f"split: size must be >= 1, got {size}")
        return [self[start : start + size] for start in range(0, len(self), size)]

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Rows of `batches` one after another.

        All batches need the same tensor and array keys, and per key the same dtype.
        ``meta["metrics"]`` (a dict name -> value or list) merges by name into lists in
        batch order (a list value is extended, any other value appended); every other meta
        key must be present with an equal value in all batches, else ValueError naming it.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat: need at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for part in ("tensors", "arrays"):
                a_keys, b_keys = set(getattr(first, part)), set(getattr(b, part))
                if a_keys != b_keys:
                    raise ValueError(
                        f"concat: batch {i} has {part} keys {sorted(b_keys)} but batch 0 has "
                        f"{sorted(a_keys)}; select the same keys before concatenating"
                    )
            for k, v in b.tensors.items():
                if v.dtype != first.tensors[k].dtype:
                    raise ValueError(f"concat: tensor {k!r} is {v.dtype} in batch {i} but {first.tensors[k].dtype} in batch 0")
        tensors = {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in first.tensors}
        arrays = {k: np.concatenate([b.arrays[k] for b in batches], axis=0) for k in first.arrays}
        return cls(tensors=tensors, arrays=arrays, meta=_concat_meta(batches))

    def union(self, other: Batch) -> Batch:
        """A new batch with the keys of both; both must have the same number of rows.

        A key present in both must hold equal values (tensors, arrays and meta alike), else
        ValueError naming it. ``meta["metrics"]`` merges by metric name under the same rule.
        """
        if len(self) != len(other) and (self.tensors or self.arrays) and (other.tensors or other.arrays):
            raise ValueError(f"union: batches have {len(self)} and {len(other)} rows; they must match")
        tensors = _union_dict("tensor", self.tensors, other.tensors)
        arrays = _union_dict("array", self.arrays, other.arrays)
        meta_a = {k: v for k, v in self.meta.items() if k != "metrics"}
        meta_b = {k: v for k, v in other.meta.items() if k != "metrics"}
        meta = _union_dict("meta", meta_a, meta_b)
        if "metrics" in self.meta or "metrics" in other.meta:
            meta["metrics"] = _union_dict(
                "metric", self.meta.get("metrics", {}), other.meta.get("metrics", {})
            )
        return Batch(tensors=tensors, arrays=arrays, meta=copy.deepcopy(meta))

    # ---------------------------------------------------------------- row order

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row `n` times: interleaved (r0, r0, r1, r1, ...) or tiled (r0, r1, r0, r1, ...)."""
        if n < 1:
            raise ValueError(f"repeat: n must be >= 1, got {n}")
        rows = torch.arange(len(self))
        index = rows.repeat_interleave(n) if interleave else rows.repeat(n)
        return self[index]

    def reorder(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        """Rows in the order `indices`, which must be a permutation of ``range(len(self))``.

        Row ``i`` of the result is row ``indices[i]`` of this batch.
        """
        idx = indices.detach().cpu() if isinstance(indices, torch.Tensor) else torch.as_tensor(np.asarray(indices))
        idx = idx.reshape(-1).to(torch.int64)
        rows = len(self)
        if idx.numel() != rows or not torch.equal(torch.sort(idx).values, torch.arange(rows)):
            raise ValueError(
                f"reorder: indices must be a permutation of range({rows}); use batch[indices] "
                "to select or repeat rows"
            )
        return self[idx]

    def pad_to_divisor(self, d: int) -> tuple[Batch, int]:
        """Append rows 0, 1, 2, ... (cyclically) until ``len % d == 0``.

        Returns ``(padded, pad_count)`` with ``pad_count`` in ``[0, d)``; 0 (and a batch
        with the same rows) when already divisible. Works when ``d > len`` (rows repeat
        as often as needed, e.g. 1 row padded to 7).
        """
        if d < 1:
            raise ValueError(f"pad_to_divisor: d must be >= 1, got {d}")
        rows = len(self)
        pad = -rows % d
        if pad == 0:
            return self[:], 0
        index = torch.cat([torch.arange(rows), torch.arange(pad) % rows])
        return self[index], pad

    def unpad(self, pad_count: int) -> Batch:
        """Drop the last `pad_count` rows (undoes `pad_to_divisor`)."""
        if not 0 <= pad_count <= len(self):
            raise ValueError(f"unpad: pad_count must be in [0, {len(self)}], got {pad_count}")
        return self[: len(self) - pad_count]

    # ---------------------------------------------------------------- serialisation

    def to_bytes(self) -> bytes:
        """Data-only serialisation: safetensors for tensors, JSON for arrays and meta.

        Tensors keep dtype and shape and come back on CPU. Arrays keep dtype and shape;
        object arrays and meta must hold JSON-able values (str, int, float, bool, None,
        lists, str-keyed dicts), else TypeError naming the offending entry.
        """
        header = {
            "rows": len(self),
            "tensor_keys": list(self.tensors),
            "arrays": {k: _array_to_json(k, v) for k, v in self.arrays.items()},
            "meta": self.meta,
        }
        _check_json_value(self.meta, "meta")
        # clone: safetensors needs contiguous CPU tensors, and detach drops autograd history
        payload = _st_save({k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in self.tensors.items()})
        head = json.dumps(header, ensure_ascii=False).encode("utf-8")
        return _MAGIC + _HEADER_LEN.pack(len(head)) + head + payload

    @classmethod
    def from_bytes(cls, data: bytes) -> Batch:
        """Inverse of `to_bytes`; tensors are on CPU."""
        data = bytes(data)
        if not data.startswith(_MAGIC):
            raise ValueError("from_bytes: not a serialised shardwise Batch (bad magic)")
        start = len(_MAGIC) + _HEADER_LEN.size
        (head_len,) = _HEADER_LEN.unpack(data[len(_MAGIC) : start])
        header = json.loads(data[start : start + head_len].decode("utf-8"))
        loaded = _st_load(data[start + head_len :])
        tensors = {k: loaded[k] for k in header["tensor_keys"]}
        arrays = {k: _array_from_json(spec) for k, spec in header["arrays"].items()}
        batch = cls(tensors=tensors, arrays=arrays, meta=header["meta"])
        assert len(batch) == header["rows"], "row count changed in serialisation"
        return batch

    def __getstate__(self) -> bytes:
        # Ray and multiprocessing pickle through here: only data crosses, as to_bytes gives it.
        return self.to_bytes()

    def __setstate__(self, state: bytes) -> None:
        restored = Batch.from_bytes(state)
        self.tensors, self.arrays, self.meta = restored.tensors, restored.arrays, restored.meta

    def __copy__(self) -> Batch:
        return Batch(tensors=dict(self.tensors), arrays=dict(self.arrays), meta=dict(self.meta))

    def __deepcopy__(self, memo: dict[int, Any]) -> Batch:
        # Not through __getstate__: a deep copy keeps devices and non-JSON meta.
        return Batch(
            tensors={k: v.clone() for k, v in self.tensors.items()},
            arrays={k: copy.deepcopy(v, memo) for k, v in self.arrays.items()},
            meta=copy.deepcopy(self.meta, memo),
        )


def _union_dict(part: str, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if k in out and not _equal(out[k], v):
            raise ValueError(f"union: {part} {k!r} is present in both batches with different values")
        out[k] = v
    return out


def _concat_meta(batches: list[Batch]) -> dict[str, Any]:
    keys: dict[str, None] = {}
    for b in batches:
        keys.update(dict.fromkeys(b.meta))
    meta: dict[str, Any] = {}
    for key in keys:
        if key == "metrics":
            merged: dict[str, list[Any]] = {}
            for b in batches:
                for name, value in b.meta.get("metrics", {}).items():
                    dest = merged.setdefault(name, [])
                    if isinstance(value, list):
                        dest.extend(value)
                    else:
                        dest.append(value)
            meta["metrics"] = merged
            continue
        missing = [i for i, b in enumerate(batches) if key not in b.meta]
        if missing:
            raise ValueError(f"concat: meta key {key!r} is missing from batch(es) {missing} but present in others")
        value = batches[0].meta[key]
        for i, b in enumerate(batches[1:], start=1):
            if not _equal(value, b.meta[key]):
                raise ValueError(
                    f"concat: meta key {key!r} differs between batch 0 ({value!r}) and batch {i} "
                    f"({b.meta[key]!r}); only meta['metrics'] is merged, other keys must agree"
                )
        meta[key] = copy.deepcopy(value)
    return meta
