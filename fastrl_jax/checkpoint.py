"""Orbax checkpoints: the drafter's weights, and step-numbered run checkpoints for training."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.drafter import Drafter, DraftVocab


def save_drafter(path: str | Path, drafter: Drafter) -> Path:
    """Writes the drafter's parameters (and its draft vocabulary, if any) as an Orbax checkpoint
    at `path` (a new directory)."""
    path = Path(path).expanduser().resolve()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.to_pure_dict(nnx.state(drafter, (nnx.Param, DraftVocab))))
    return path


def abstract_drafter(cfg: ModelConfig, dtype="float32", draft_vocab_size: int = 0) -> Drafter:
    """The drafter's structure without memory; draft_vocab_size 0 means the full vocabulary."""
    vocab = np.arange(draft_vocab_size) if draft_vocab_size else None
    return nnx.eval_shape(lambda: Drafter(cfg, nnx.Rngs(0), dtype, draft_vocab=vocab))


def load_drafter(path: str | Path, cfg: ModelConfig, dtype="float32") -> Drafter:
    """Reads a drafter saved by save_drafter, or the final drafter of a train-drafter out_dir
    (its drafter/), for a policy of config `cfg`."""
    path = Path(path).expanduser().resolve()
    if (path / "drafter").is_dir():
        path = path / "drafter"
    if not path.is_dir():
        raise FileNotFoundError(
            f"drafter checkpoint {path} not found (expected a directory written by save_drafter, or a train-drafter out_dir)"
        )
    with ocp.StandardCheckpointer() as ckptr:
        try:
            saved = ckptr.metadata(path).item_metadata
            vocab = saved.get("draft_vocab")
            abstract = abstract_drafter(cfg, dtype, vocab.shape[0] if vocab is not None else 0)
            graphdef, state = nnx.split(abstract)
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
            restored = ckptr.restore(path, target)
        except (ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{path} is not a drafter checkpoint for this policy ({e})") from e
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


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
