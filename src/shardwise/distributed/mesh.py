"""The torch DeviceMesh of a `shardwise.config.validate.MeshSpec` (whose docstring says which
shape each config gets)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.config.validate import MeshSpec

__all__ = ["build_mesh"]


def build_mesh(spec: MeshSpec, device_type: str) -> DeviceMesh:
    """The torch DeviceMesh for a spec (needs an initialised process group)."""
    return init_device_mesh(device_type, spec.shape, mesh_dim_names=spec.dim_names)
