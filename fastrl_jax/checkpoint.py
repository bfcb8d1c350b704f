"""Orbax step-numbered run checkpoints for training (policy, optimizer, drafter, data position)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class RunCheckpointer:
    """Step-numbered checkpoints of a training run: async, atomic, keeps the last `keep`.

    A checkpoint is a dict of named items. Array pytrees are saved with Orbax's
    StandardSave (sharded arrays restore onto the shardings of the abstract target), plain
    JSON-able dicts (data iterator position, metrics, RNG seeds) with JsonSave. Orbax writes
    each step into a temporary directory and renames it when complete, so a crash or a full
    disk mid-save leaves the previous checkpoint as the latest valid one.
    """

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).expanduser().resolve()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, arrays: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Starts saving `arrays` (name -> pytree of arrays) and `meta` (name -> JSON-able dict)
        as `step`; returns once the arrays are copied off device (the write continues behind)."""
        items = {name: ocp.args.StandardSave(tree) for name, tree in arrays.items()}
        items |= {name: ocp.args.JsonSave(value) for name, value in (meta or {}).items()}
        self._manager.save(step, args=ocp.args.Composite(**items))

    def restore(
        self, step: int | None, arrays: dict[str, Any], meta: Sequence[str] = ()
    ) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """Restores `step` (None: the latest). `arrays` maps names to abstract targets
        (pytrees of jax.ShapeDtypeStruct with shardings, or concrete arrays to mirror).
        Returns (step, arrays, meta)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        targets = {name: jax.tree.map(_abstract, tree) for name, tree in arrays.items()}
        items = {name: ocp.args.StandardRestore(tree) for name, tree in targets.items()}
        items |= {name: ocp.args.JsonRestore() for name in meta}
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return step, {n: restored[n] for n in arrays}, {n: restored[n] for n in meta}

    def wait(self) -> None:
        """Blocks until the last save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "RunCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
