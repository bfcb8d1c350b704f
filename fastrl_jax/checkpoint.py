"""Orbax checkpoints: the drafter's weights (more state joins as training lands)."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.drafter import Drafter


def save_drafter(path: str | Path, drafter: Drafter) -> Path:
    """Writes the drafter's parameters as an Orbax checkpoint at `path` (a new directory)."""
    path = Path(path).expanduser().resolve()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    return path


def load_drafter(path: str | Path, cfg: ModelConfig, dtype="float32") -> Drafter:
    """Reads a drafter saved by save_drafter for a policy of config `cfg`."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"drafter checkpoint {path} not found (expected a directory written by save_drafter)")
    abstract = nnx.eval_shape(lambda: Drafter(cfg, nnx.Rngs(0), dtype))
    graphdef, state = nnx.split(abstract)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as ckptr:
        try:
            restored = ckptr.restore(path, target)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path} is not a drafter checkpoint for this policy ({e})") from e
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
