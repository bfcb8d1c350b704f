"""Drafter weights in and out: Orbax save / load, and make_drafter, the one way a run gets its drafter."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from fastrl_jax.checkpoint import checkpoint_steps, damage_reported
from fastrl_jax.config import Config
from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import DTYPES
from fastrl_jax.models.drafter import Drafter, DraftVocab

log = logging.getLogger(__name__)


def save_drafter(path: str | Path, drafter: Drafter) -> Path:
    """Writes the drafter's parameters (and its draft vocabulary, if any) as an Orbax checkpoint
    at `path` (a new directory). The parameters record the kind: only an EAGLE-3 drafter has `norm`
    (its own final norm) and a 3H-wide fc, so checkpoints written before EAGLE-3 existed load as EAGLE."""
    path = Path(path).expanduser().resolve()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.to_pure_dict(nnx.state(drafter, (nnx.Param, DraftVocab))))
    return path


def abstract_drafter(cfg: ModelConfig, dtype="float32", draft_vocab_size: int = 0, kind: str = "eagle") -> Drafter:
    """The drafter's structure without memory; draft_vocab_size 0 means the full vocabulary."""
    vocab = np.arange(draft_vocab_size) if draft_vocab_size else None
    return nnx.eval_shape(lambda: Drafter(cfg, nnx.Rngs(0), dtype, draft_vocab=vocab, kind=kind))


def drafter_dir(path: str | Path) -> Path:
    """The drafter checkpoint directory `path` names: itself (written by save_drafter, e.g. export-drafter's
    orbax/), a finished train-drafter out_dir's drafter/, or a `train` run's (rl.out_dir) latest checkpoint
    of its online-trained drafter. Raises FileNotFoundError / ValueError with the fix for anything else (a
    missing path, an unfinished train-drafter run, a train run without a drafter, another directory)."""
    path = Path(path).expanduser().resolve()
    if (path / "drafter").is_dir():
        path = path / "drafter"
    elif not path.exists():
        raise FileNotFoundError(f"drafter checkpoint {path} not found (expected a train-drafter out_dir, a train run's "
                                "rl.out_dir, or a directory written by save_drafter such as export-drafter's OUT/orbax)")
    elif any((path / name).exists() for name in ("data.npz", "summary.json")):
        raise ValueError(f"{path} is a train-drafter run that has not finished (it has no drafter/ yet): let "
                         f"`fastrl-jax train-drafter --config {path / 'config.yaml'}` run to the end (it resumes)")
    elif (path / "checkpoints").is_dir():  # a GRPO run: its checkpoints hold the drafter trained online
        steps = [s for s in checkpoint_steps(path) if (path / "checkpoints" / str(s) / "drafter").is_dir()]
        if not steps:
            raise ValueError(f"{path} is a train run whose checkpoints hold no drafter (it ran with sd.mode off, or "
                             "has no checkpoint yet)")
        path = path / "checkpoints" / str(steps[-1]) / "drafter"
        print(f"[fastrl-jax] the drafter of {path.parents[2]}: its checkpoint at step {steps[-1]}", file=sys.stderr)
    if not (path / "_CHECKPOINT_METADATA").is_file() and not (path / "_METADATA").is_file():
        raise ValueError(f"{path} is not a drafter checkpoint (no Orbax metadata): give a train-drafter out_dir, or "
                         "a directory written by save_drafter such as export-drafter's OUT/orbax")
    return path


def load_drafter(path: str | Path, cfg: ModelConfig, dtype="float32") -> Drafter:
    """Reads a drafter saved by save_drafter, or the final drafter of a train-drafter out_dir
    (its drafter/), for a policy of config `cfg`; of the kind it was saved as."""
    path = drafter_dir(path)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            saved = ckptr.metadata(path).item_metadata
            vocab = saved.get("draft_vocab")
            kind = "eagle3" if "norm" in saved else "eagle"
            abstract = abstract_drafter(cfg, dtype, vocab.shape[0] if vocab is not None else 0, kind)
            graphdef, state = nnx.split(abstract)
            # Onto this process's first device whatever the saved layout: a run's online drafter is sharded over
            # its mesh, and Orbax refuses to infer shardings on a machine of another device count.
            here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), nnx.to_pure_dict(state))
            old_layer = kind == "eagle3" and {"bq", "q_norm"} & set(saved.get("layers", {}))
            if old_layer:  # saved before 1f998b3, with the layer of its policy's family
                raise ValueError(f"an EAGLE-3 drafter whose layer has the policy's {' and '.join(sorted(old_layer))} "
                                 "(saved before 2026-11-27); EAGLE-3 layers are Llama's for every policy now, as SGLang "
                                 "serves them: train it again")
            wrong = _mismatches(saved, target)
        except (ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{path} is not a drafter checkpoint for this policy ({e})") from e
        if not wrong:
            with damage_reported(path):
                restored = ckptr.restore(path, target)
    if wrong:  # Orbax's own message would advise strict=False or partial_restore: a truncated / padded drafter
        more = f" and {len(wrong) - 2} more" if len(wrong) > 2 else ""
        raise ValueError(f"{path} is a drafter of another policy: {'; '.join(wrong[:2])}{more} (this policy: hidden size "
                         f"{cfg.hidden_size}, intermediate size {cfg.intermediate_size}, {cfg.num_heads} heads and "
                         f"{cfg.num_kv_heads} KV heads of {cfg.head_dim}); give the policy it was trained with (--model "
                         "or model.path)")
    ids = restored.get("draft_vocab")
    if ids is not None and (len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= cfg.vocab_size):
        raise ValueError(f"{path}: its draft vocabulary is not distinct ids of this policy's {cfg.vocab_size}-token "
                         f"vocabulary (ids {int(ids.min())} .. {int(ids.max())}): it was trained for another policy")
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def _mismatches(saved, target) -> list[str]:
    """How the parameters in Orbax metadata `saved` differ from `target`'s: 'NAME is SHAPE there, SHAPE here', and the
    names only one of them has (a drafter of another family: q / k / v biases, q / k norms)."""
    def flat(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
        return {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(v.shape) for p, v in leaves}

    there, here = flat(saved), flat(target)
    return ([f"{k} is {shape} there, {here[k]} here" for k, shape in there.items() if k in here and here[k] != shape]
            + [f"{k} is there, not here" for k in there if k not in here]
            + [f"{k} is here, not there" for k in here if k not in there])


def make_drafter(cfg: Config, model_cfg: ModelConfig, path: str | Path | None, dtype: str | None = None) -> Drafter:
    """The drafter of a run: the checkpoint at `path`, or a randomly initialised one (seed cfg.seed)
    when path is None or '' (lossless, since the policy verifies every token, but it accepts ~1
    token per step until trained). A fresh drafter scores a reduced draft vocabulary of
    drafter_train.draft_vocab_size tokens too (fresh_draft_vocab), so its steps cost what a trained
    one's do, and is of kind drafter_train.kind (a checkpoint keeps its own). dtype: its weights' dtype
    name, cfg.model.dtype (the dtype it trains in) when None; cfg.model.engine_dtype for inference only."""
    dtype = DTYPES[dtype or cfg.model.dtype]
    if path:
        return load_drafter(path, model_cfg, dtype)
    log.warning("no drafter checkpoint (--drafter, rl.drafter_path): a randomly initialised drafter (lossless, "
                "but it accepts ~1 token per step until trained)")
    vocab = fresh_draft_vocab(model_cfg, cfg.drafter_train.draft_vocab_size)
    return Drafter(model_cfg, nnx.Rngs(cfg.seed), dtype, draft_vocab=vocab, kind=cfg.drafter_train.kind)


def drafter_accept_prior(path: str | Path | None) -> float:
    """The tokens per step an engine assumes of make_drafter(path)'s drafter before any estimate: a
    checkpoint is trusted (inf; the adaptive controller's bandit judges it); a randomly initialised
    drafter accepts ~1 token per step, so adaptive SD leaves its EAGLE arms out (sd.min_drafter_accept)."""
    return math.inf if path else 1.0


def fresh_draft_vocab(model_cfg: ModelConfig, size: int) -> np.ndarray | None:
    """A draft vocabulary before any text was seen: the lowest `size` token ids (a BPE vocabulary's
    bytes and earliest merges, its most frequent pieces) with the end-of-sequence ids in place of the
    last ones; None when size is 0 or covers the whole vocabulary. The trained drafter's vocabulary
    comes from token counts instead (drafter/vocab.py)."""
    if not 0 < size < model_cfg.vocab_size:
        return None
    eos = sorted({t for t in model_cfg.eos_token_ids if 0 <= t < model_cfg.vocab_size})[:size]
    low = [t for t in range(size) if t not in eos][: size - len(eos)]
    return np.asarray(sorted([*low, *eos]), np.int32)
