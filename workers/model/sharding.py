"""Device mesh and the one table from logical axis names to mesh axes.

This is the only module that names mesh axes (`data`, `model`). The model and the step
name logical axes only ("batch", "heads", ...); `logical_sharding` turns a tuple of them
into a NamedSharding for a concrete array shape, replicating any dimension the mesh axis
does not divide (logged), so a model whose kv heads do not split 8 ways still runs.
"""

from __future__ import annotations

import logging
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from actx.schemas import parallelism

log = logging.getLogger(__name__)

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)

# Logical axis -> mesh axis (None = replicated). Parameters split over `model` (tensor
# parallel over attention heads and MLP width, experts); activations split over `data`
# (batch). A mesh axis goes to the first dimension of a parameter that it divides.
LOGICAL_TO_MESH: dict[str, str | None] = {
    "batch": DATA_AXIS,
    "seq": None,
    "embed": None,
    "heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "head_dim": None,
    "mlp": MODEL_AXIS,
    "vocab": MODEL_AXIS,
    "layers": None,
    # A mixture of experts: the experts split over `model` (expert parallelism: each
    # device holds whole experts); where `model` does not divide the experts, each
    # expert's width splits over it instead (tensor parallelism within every expert).
    "moe_experts": MODEL_AXIS,
    "moe_mlp": MODEL_AXIS,
}

# Logical axes that must divide exactly: silently replicating the batch would make every
# data-parallel device redo the whole batch, so that is an error instead.
_MUST_DIVIDE = frozenset({"batch"})


def make_mesh(data: int = -1, model: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all devices, of all processes).

    data=-1 means "all devices left after `model`". data * model must equal the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if model < 1 or n % model:
        raise ValueError(f"model axis size {model} does not divide the {n} devices")
    if data == -1:
        data = n // model
    if data * model != n:
        raise ValueError(
            f"mesh data={data} x model={model} = {data * model} devices, but {n} devices "
            "were given; choose sizes whose product is the device count")
    # Row-major over the given device order: model-parallel groups are neighbouring
    # devices (same host on a pod), data-parallel replicas step across hosts.
    grid = np.asarray(devices, dtype=object).reshape(data, model)
    return Mesh(grid, MESH_AXES)


def axis_size(mesh: Mesh, logical_axis: str) -> int:
    """Number of shards the logical axis gets on `mesh` (1 when replicated)."""
    mesh_axis = LOGICAL_TO_MESH[logical_axis]
    return 1 if mesh_axis is None else mesh.shape[mesh_axis]


def logical_spec(logical_axes: Sequence[str | None], shape: Sequence[int],
                 mesh: Mesh, name: str = "") -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims carry `logical_axes`.

    A dimension its mesh axis does not divide is replicated (and logged), except the
    batch, which raises: see `_MUST_DIVIDE`.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"{name}: {len(logical_axes)} logical axes for shape {tuple(shape)}")
    spec: list[str | None] = []
    used: set[str] = set()
    for logical, dim in zip(logical_axes, shape):
        mesh_axis = None if logical is None else LOGICAL_TO_MESH[logical]
        if mesh_axis is None or mesh_axis in used:
            spec.append(None)
            continue
        size = mesh.shape[mesh_axis]
        if dim % size:
            if logical in _MUST_DIVIDE:
                raise ValueError(
                    f"{name or 'array'}: {logical} size {dim} is not divisible by the "
                    f"'{mesh_axis}' mesh axis size {size}; use a batch size that is a "
                    f"multiple of {size}")
            log.info("%s: %s dim %d not divisible by mesh axis %s=%d; replicating it",
                     name or "array", logical, dim, mesh_axis, size)
            spec.append(None)
            continue
        used.add(mesh_axis)
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def logical_sharding(logical_axes: Sequence[str | None], shape: Sequence[int],
                     mesh: Mesh, name: str = "") -> NamedSharding:
    """NamedSharding for an array of `shape` with the given logical axes on `mesh`."""
    return NamedSharding(mesh, logical_spec(logical_axes, shape, mesh, name))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def activation_logical_axes() -> tuple[str, str, str]:
    """Logical axes of a [batch, seq, hidden] activation."""
    return ("batch", "seq", "embed")


def token_logical_axes() -> tuple[str, str]:
    """Logical axes of [batch, seq] token inputs (ids, positions, segment ids)."""
    return ("batch", "seq")


def data_parallel_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a [batch, ...] array of `ndim` dims: batch over `data`, rest replicated."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS, *([None] * (ndim - 1))))


def check_batch(batch: int, mesh: Mesh) -> None:
    """Raises ValueError when the `data` axis does not divide the (global) batch."""
    size = mesh.shape[DATA_AXIS]
    if parallelism.devices_problem(batch, size):  # the rule deploy checks too
        raise ValueError(
            f"batch size {batch} is not divisible by the '{DATA_AXIS}' mesh axis size "
            f"{size}; use a batch size that is a multiple of {size}")



def annotation_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    name: str = "") -> PartitionSpec:
    """PartitionSpec for a user's Flax parameter from its own sharding annotation
    (`nnx.with_partitioning`): a name that is one of actx's mesh axes is used as is, a
    logical name of the table above is mapped through it, and any other name, or a
    dimension its mesh axis does not divide, is replicated (logged)."""
    names = tuple(names) + (None,) * (len(shape) - len(names))
    spec: list[str | None] = []
    for axis_name, dim in zip(names, shape):
        mesh_axis = axis_name if axis_name in MESH_AXES else LOGICAL_TO_MESH.get(axis_name)
        if axis_name is not None and mesh_axis is None and axis_name not in LOGICAL_TO_MESH:
            log.info("%s: sharding annotation %r is neither a mesh axis (%s) nor a logical "
                     "axis of actx; replicating that dimension", name or "param", axis_name,
                     ", ".join(MESH_AXES))
        if mesh_axis is not None and dim % mesh.shape[mesh_axis]:
            log.info("%s: dim %d not divisible by mesh axis %s=%d; replicating it",
                     name or "param", dim, mesh_axis, mesh.shape[mesh_axis])
            mesh_axis = None
        spec.append(None if mesh_axis in spec else mesh_axis)
    return PartitionSpec(*spec)
