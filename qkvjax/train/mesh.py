"""The device mesh (data, fsdp, tensor) and the map from logical parameter axes to it."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from qkvjax import axes
from qkvjax.config import MeshConfig


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """Sizes of (data, fsdp, tensor), the -1 filled in; an error names the sizes and the device count."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(
                f"mesh (data, fsdp, tensor) = {tuple(sizes)}: the fixed sizes multiply to {known}, "
                f"which does not divide the {num_devices} devices"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh (data, fsdp, tensor) = {tuple(sizes)} multiplies to {math.prod(sizes)}, but there are "
            f"{num_devices} devices; make the product {num_devices} or set one size to -1"
        )
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A mesh with Auto axis types: pjit-style code, where XLA propagates shardings through the step."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(cfg, len(devices))
    return jax.make_mesh(shape, axes.MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are split over every data-like axis (data and fsdp), replicated over tensor."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def partition_spec(names, shape, sizes: dict[str, int], rules=axes.DEFAULT_RULES) -> PartitionSpec:
    """The PartitionSpec of one array with logical axis ``names`` on a mesh of axis ``sizes`` (see
    :func:`shardings_for`); pure arithmetic, so ``qkvjax plan`` uses it for meshes this machine does not have."""
    rule_map = dict(rules)
    spec, used = [], set()
    for name, dim in zip(names, shape, strict=True):
        target = rule_map.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        targets = tuple(t for t in targets if t not in used)
        size = int(np.prod([sizes[t] for t in targets])) if targets else 1
        if targets and size > 1 and dim % size == 0:
            used.update(targets)
            spec.append(targets[0] if len(targets) == 1 else targets)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def shardings_for(abstract_tree, mesh: Mesh, rules=axes.DEFAULT_RULES):
    """NamedShardings for a tree of (possibly logically boxed) ShapeDtypeStructs.

    Each logical axis goes to its mesh axis by ``rules`` unless that mesh axis is already used in this array or
    does not divide the dimension (MQA's single kv head, say), in which case that dimension is replicated: no
    scheme or head count needs its own sharding code.
    """
    sizes = dict(mesh.shape)

    def one(leaf):
        if isinstance(leaf, nn.LogicallyPartitioned):
            names, shape = leaf.names, leaf.value.shape
        else:
            names, shape = (None,) * len(leaf.shape), leaf.shape
        return NamedSharding(mesh, partition_spec(names, shape, sizes, rules))

    return jax.tree.map(one, abstract_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
