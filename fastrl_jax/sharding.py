"""The (data, fsdp, tensor) device mesh, logical-axis -> mesh-axis rules, NamedShardings, replica sub-meshes,
and moving weights between meshes (reshard).

Arrays name their dimensions with logical axes ('embed', 'heads', 'batch', ...);
parameters carry them as nnx metadata, `nnx.Param(x, logical_axes=(...))`. A rules
table maps each logical name to mesh axes, so one model definition runs on any mesh.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fastrl_jax.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor")

# (logical name, mesh axis | mesh axes | None). None replicates that dimension.
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),  # scanned over: every device holds its slice of every layer
    ("norm", None),
    # activations and KV cache
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("cache_seq", None),
)


VISIBLE = "visible (jax.devices())"


def mesh_sizes(cfg: MeshConfig, devices: int, where: str = VISIBLE) -> dict[str, int]:
    """The mesh axis sizes {data, fsdp, tensor} for `devices` devices; the -1 axis takes the rest.
    `where` says in errors where the device count came from."""
    if devices < 1:
        raise ConfigError(f"a mesh needs at least 1 device; {devices} are {where}")
    shape = [cfg.data, cfg.fsdp, cfg.tensor]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if devices % known:
            raise ConfigError(
                f"mesh data*fsdp*tensor = {'*'.join(map(str, shape))}: the -1 axis cannot take the rest of "
                f"{devices} {where} devices because {devices} is not divisible by {known}; set mesh.* so the "
                f"product is {devices}"
            )
        shape[shape.index(-1)] = devices // known
    if math.prod(shape) != devices:
        raise ConfigError(
            f"mesh data*fsdp*tensor = {'*'.join(map(str, shape))} = {math.prod(shape)} but {devices} devices are "
            f"{where}; set mesh.* so the product is {devices}"
            # the visible devices only: a planned count (--dry-run --devices) is the user's own number
            + (f", or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={math.prod(shape)}"
               if where == VISIBLE else "")
        )
    return dict(zip(AXES, shape))


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all visible (or the given) devices with axes (data, fsdp, tensor); -1 takes the rest."""
    where = VISIBLE if devices is None else "given"
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(mesh_sizes(cfg, len(devices), where).values())
    # Auto axes: XLA propagates shardings from the annotated inputs; Explicit axes would
    # demand a sharding annotation on every op of the model.
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dims are named `logical_axes`.

    A mesh axis is dropped (that dim stays replicated along it) when the dim size is not
    divisible by it, e.g. SmolLM2's 3 KV heads on tensor=2 (a warning, once: every device along
    that axis then holds the whole dim), and when an earlier dim of the same array already uses
    it: a mesh axis may appear only once in a spec.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(
            f"logical axes {tuple(logical_axes)} name {len(logical_axes)} dims, but the shape is {tuple(shape)}"
        )
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape):
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {', '.join(table)}")
        target = table.get(name)
        kept: list[str] = []
        for axis in (target,) if isinstance(target, str) else target or ():
            if axis in used:
                continue
            if size % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]):
                _log_replicated(name, size, axis, mesh.shape[axis])
                continue
            kept.append(axis)
        used.update(kept)
        spec.append(kept[0] if len(kept) == 1 else tuple(kept) or None)
    return PartitionSpec(*spec)


@functools.cache
def _log_replicated(name: str, size: int, axis: str, axis_size: int) -> None:
    # A warning: the CLI shows warnings only, and a dim the mesh was sized to split costs memory on every device.
    log.warning("logical axis %r of size %d is not divisible by mesh axis %r (size %d): replicated along it, so "
                "each device along %r holds all of it; choose mesh sizes that divide it to split it",
                name, size, axis, axis_size, axis)


def training_rows(shape: Sequence[int]) -> PartitionSpec | None:
    """The PartitionSpec of activations [B, ...] whose rows a training forward keeps split over data x fsdp through
    its layers, under the mesh set around the trace (decoder.run_layers' rows); None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else logical_to_spec(("batch",) + (None,) * (len(shape) - 1), shape, mesh)


def named_sharding(
    mesh: Mesh, logical_axes: Sequence[str | None], shape: Sequence[int], rules: Rules = DEFAULT_RULES
) -> NamedSharding:
    """The NamedSharding of one array (an activation, a KV cache) from its logical axes."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def shardings_for(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """The sharding of every Variable of an nnx State: the same State with NamedShardings as values.

    Variables without `logical_axes` metadata (RNG state, counters) are replicated. The
    result fits `jax.device_put(state, shardings)` and `jax.jit(in_shardings=/out_shardings=)`.
    """

    def one(path, var: nnx.Variable) -> nnx.Variable:
        axes = getattr(var, "logical_axes", None)
        try:
            spec = PartitionSpec() if axes is None else logical_to_spec(axes, np.shape(var.get_value()), mesh, rules)
        except ValueError as e:
            raise ValueError(f"{jax.tree_util.keystr(path, simple=True, separator='.')}: {e}") from e
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One sub-mesh per index along `data`, each with axes (data=1, fsdp, tensor): a rollout replica."""
    return [Mesh(mesh.devices[i : i + 1], AXES, axis_types=mesh.axis_types) for i in range(mesh.shape["data"])]


def local_replicas(mesh: Mesh) -> list[int]:
    """The indices along `data` whose devices all belong to this process (every index, single-process); a replica
    spanning processes is refused (check_replicas_on_hosts)."""
    check_replicas_on_hosts(mesh)
    me = jax.process_index()
    return [i for i in range(mesh.shape["data"]) if all(d.process_index == me for d in mesh.devices[i].flat)]


def check_replicas_on_hosts(mesh: Mesh) -> None:
    """Refuses a mesh whose rollout replica (an index along `data`) spans processes: each replica's engine runs on
    one host."""
    for i in range(mesh.shape["data"]):
        if len(owners := {d.process_index for d in mesh.devices[i].flat}) > 1:
            raise ConfigError(f"rollout replica {i} spans processes {sorted(owners)}: make mesh.data a multiple of the "
                              "number of hosts so every replica (one index along data) lives on one host")


def to_replicated(tree: Any, mesh: Mesh) -> Any:
    """Host-local arrays that every process holds alike (the drafter) as global arrays replicated over `mesh`:
    what Orbax saves from several processes (it refuses host-local arrays there)."""
    sharding = NamedSharding(mesh, PartitionSpec())

    def one(x: jax.Array) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree)


def to_host_local(tree: Any) -> Any:
    """The inverse of to_replicated: each array's copy on this process's first device it has (no copy)."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)


def reshard(tree: Any, shardings: Any) -> Any:
    """Each array of `tree` on the matching NamedSharding of `shardings` (same pytree).

    Zero-copy when the target's devices already hold the target's shards (a replica of a mesh whose
    parameters are replicated along data); otherwise a device_put (single process only).
    """

    def one(x: jax.Array, target: NamedSharding) -> jax.Array:
        if x.sharding == target:
            return x
        devices = set(target.device_set)
        shards = [s for s in x.addressable_shards if s.device in devices]
        if len({s.device for s in shards}) == len(devices) and all(
            s.data.shape == target.shard_shape(x.shape) and s.index == target.devices_indices_map(x.shape)[s.device]
            for s in shards
        ):
            unique = {s.device: s.data for s in shards}
            return jax.make_array_from_single_device_arrays(x.shape, target, list(unique.values()))
        return jax.device_put(x, target)

    return jax.tree.map(one, tree, shardings)


def process_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axis 'process' of each process's first device (of `devices`, else the default backend's), in
    process order; ValueError when a process has none there."""
    devices = jax.devices() if devices is None else devices
    firsts = [min((d for d in devices if d.process_index == p), key=lambda d: d.id, default=None)
              for p in range(jax.process_count())]
    if None in firsts:
        raise ValueError(f"processes {[p for p, d in enumerate(firsts) if d is None]} have none of these devices")
    return Mesh(np.array(firsts), ("process",))


@functools.cache
def _host_gather() -> tuple[Mesh, Any] | None:
    """A mesh of each process's first CPU device and the program that gathers [processes, ...] over it; None
    where the CPUs are not one multi-process backend (no CPU platform, or collectives other than gloo)."""
    try:
        mesh = process_mesh(jax.devices("cpu"))  # every process's with gloo (rl.distributed.initialize)
    except (RuntimeError, ValueError) as e:
        log.warning("gathering across processes on the accelerators (%s): a process whose replicas have finished "
                    "waits there without training the online drafter", e)
        return None
    return mesh, jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def host_allgather(tree: Any) -> Any:
    """Every process's numpy arrays (the same shapes everywhere), stacked in process order along a new first axis,
    on every process. It runs over the hosts' CPUs (gloo), never the accelerators, so the online drafter trainer
    keeps a process's idle replicas busy while it waits here for the others (multihost_utils.process_allgather
    runs on the accelerators and would queue behind, or block, those steps; it is the fallback, said once)."""
    from jax.experimental import multihost_utils

    if (host := _host_gather()) is None:
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree))
    mesh, gather = host
    me = mesh.devices[jax.process_index()]

    def one(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        stacked = jax.make_array_from_single_device_arrays(
            (mesh.size, *x.shape), NamedSharding(mesh, PartitionSpec("process")), [jax.device_put(x[None], me)])
        return np.asarray(gather(stacked).addressable_data(0))

    return jax.tree.map(one, tree)


def allgather_json(value: Any) -> list[Any]:
    """A JSON-able value of every process, in process order (on every process)."""
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = host_allgather(np.array([data.size], np.int32))[:, 0]
    padded = np.zeros(1 << int(sizes.max() - 1).bit_length(), np.uint8)  # a power of two: few programs to compile
    padded[: data.size] = data
    g = host_allgather(padded)
    return [json.loads(g[p, : sizes[p]].tobytes()) for p in range(len(sizes))]
