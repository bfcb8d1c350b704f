"""The (data, fsdp, tensor) device mesh, logical-axis -> mesh-axis rules, and replica sub-meshes."""

from __future__ import annotations

import functools
import logging
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fastrl_jax.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axes. Parameters carry their logical names (nnx.Param metadata
# `logical_axes`); names not listed here are replicated.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("batch", ("data", "fsdp")),
    ("layers", None),
    ("head_dim", None),
    ("norm", None),
    ("cache_seq", None),
)


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A mesh of all (or the given) devices with axes (data, fsdp, tensor)."""
    devices = jax.devices() if devices is None else devices
    shape = [cfg.data, cfg.fsdp, cfg.tensor]
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        if len(devices) % known:
            raise ConfigError(f"mesh axes {shape}: {len(devices)} devices are not divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise ConfigError(
            f"mesh data*fsdp*tensor = {'*'.join(map(str, shape))} = {math.prod(shape)} but {len(devices)} devices "
            f"are visible; set mesh.* so the product is {len(devices)} (or use -1 for one axis); on CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={math.prod(shape)} fakes that many devices"
        )
    # Auto axes: XLA's partitioner propagates shardings (explicit-sharding mode would demand
    # annotations on every op of the decoder).
    return jax.make_mesh(tuple(shape), AXES, devices=devices, axis_types=(AxisType.Auto,) * 3)


def logical_to_spec(logical_axes, shape, mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for an array; a dim not divisible by its mesh axes is replicated (logged once)."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape):
        axes = table.get(name)
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        if axes and size % math.prod(mesh.shape[a] for a in axes):
            _log_replicated(name, size, axes, math.prod(mesh.shape[a] for a in axes))
            axes = ()
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


@functools.cache
def _log_replicated(name, size, axes, n):
    log.info("logical axis %r of size %d is not divisible by mesh %s (%d): replicated", name, size, axes, n)


def named_sharding(mesh: Mesh, logical_axes, shape, rules=DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def shardings_for(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.State:
    """The NamedSharding of every variable in an nnx State (same structure, shardings as leaves)."""

    def one(var):
        value = var.get_value()
        axes = getattr(var, "logical_axes", None) or (None,) * np.ndim(value)
        return var.replace(named_sharding(mesh, axes, np.shape(value), rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One sub-mesh per index along `data`, each with axes (data=1, fsdp, tensor)."""
    devices = mesh.devices
    return [
        Mesh(devices[i : i + 1], AXES, axis_types=(AxisType.Auto,) * 3) for i in range(devices.shape[0])
    ]
