"""Safe loading of DCP checkpoint folders: no checkpoint can run code on load.

No file of ours is a pickle. DCP's own `.metadata` is one, and DCP reads its non-tensor
entries (the optimizer's param_groups) with ``torch.load(weights_only=False)``; loading
goes through `SafeFileSystemReader` (an unpickler that admits only DCP's metadata classes)
and `SafeLoadPlanner` (``weights_only=True``). `metadata_problem` reads a folder's
``.metadata`` the same way, to refuse a crafted one in one line before any rank loads it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardwise.checkpoint.disk import short_error
from shardwise.checkpoint.layout import DCP_METADATA

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "metadata_problem"]

# What DCP's .metadata pickle refers to (torch 2.13): its dataclasses, torch.Size, dtypes,
# a layout helper and paths. Anything else is refused rather than imported and called.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # DCP's dataclasses and enums, never a function
                return obj
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def metadata_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with a checkpoint's DCP ``.metadata`` (None: it reads as DCP's
    Metadata through the restricted unpickler, which imports nothing else and calls no
    function). DCP itself logs each failed read with a traceback on every rank before it
    raises; reading it here first turns that into one line."""
    try:
        with open(Path(path) / DCP_METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as exc:  # a crafted or damaged pickle raises anything
        return f"{DCP_METADATA} cannot be read ({short_error(exc)})"
    if not isinstance(metadata, Metadata):
        return f"{DCP_METADATA} is not DCP metadata (it holds a {type(metadata).__name__})"
    return None


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose .metadata is read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        assert isinstance(metadata, Metadata), type(metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _set_path(root: dict, path: tuple, value: Any) -> None:
    """Put `value` at `path` (keys and list indexes) in the nested state dict `root`,
    making the dicts (a str key next) and lists (an int index next, grown with None) on the
    way: how DCP's default planner puts an unflattened entry back (its own helper,
    ``_traverse.set_element``, is private; this one behaves the same)."""

    def grow(seq: Any, index: int) -> None:
        while len(seq) <= index:
            seq.append(None)

    container: Any = root
    for key, nxt in zip(path, path[1:]):
        fresh: Any = {} if type(nxt) is str else []
        if isinstance(container, Mapping):
            container = container.setdefault(key, fresh)
        else:
            grow(container, key)
            if container[key] is None:
                container[key] = fresh
            container = container[key]
    if type(path[-1]) is int:
        grow(container, path[-1])
    container[path[-1]] = value


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer param_groups: numbers, strings, tuples) with weights_only."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
