"""A GRPO run directory: what it holds, never writing over one by accident, and reading its policy back.

RUN_DIR (rl.out_dir) holds config.yaml (the resolved config), checkpoints/ (RunCheckpointer steps;
the "policy" item is the pure dict of the Decoder's nnx state, as Trainer._arrays saves it),
metrics.jsonl, tensorboard/, with the online drafter drafter_buffer/ (its sample buffer at each
checkpoint's step, STEP.npz) and with history drafting history/ (the store of earlier completions, STEP.npz). The tokenizer and the model config come from the run's base model
(model.path in config.yaml).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from fastrl_jax.checkpoint import RunCheckpointer, checkpoint_steps
from fastrl_jax.config import Config, ConfigError, load_config
from fastrl_jax.models.decoder import DTYPES, abstract_decoder
from fastrl_jax.models.hub import resolve_model_path
from fastrl_jax.models.loading import Policy, read_model_config
from fastrl_jax.models.tokenizer import load_tokenizer, stop_ids
from fastrl_jax.sharding import shardings_for

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "tensorboard", "drafter_buffer", "history")
# What else a run writes there: earlier configs of a resumed run, checkpoint steps a resume could not read, its W&B run
OTHER_RUN_FILES = ("config.to_step_*.yaml", "checkpoints.unreadable", "wandb_id", "wandb")


def run_contents(out_dir: str | Path) -> list[str]:
    """Which of a run's files and directories `out_dir` already holds."""
    out_dir = Path(out_dir).expanduser()
    return [name for name in RUN_FILES if (out_dir / name).exists()]


def prepare_run_dir(cfg: Config, *, resume: bool, overwrite: bool = False) -> None:
    """Checks rl.out_dir against --resume / --overwrite before anything is loaded or written: resuming
    needs a checkpoint; a fresh run refuses a directory that holds a run, or with `overwrite` moves
    the run's files aside (into a new directory beside it, never deleted). Every process checks before any of them
    writes."""
    out = Path(cfg.rl.out_dir).expanduser()
    if resume and overwrite:
        raise ConfigError("--resume continues the run in rl.out_dir and --overwrite moves it aside: give one of them")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"rl.out_dir {out} is a file; set rl.out_dir to a directory")
    if not os.access(_existing_ancestor(out), os.W_OK):
        raise ConfigError(f"rl.out_dir {out} is not writable (by this user, in {_existing_ancestor(out)})")
    found = run_contents(out)
    if resume and not checkpoint_steps(out):
        fresh = ("add --overwrite instead of --resume to move what it holds aside and start again" if found
                 else "drop --resume to start a new run there")
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'} (rl.out_dir={cfg.rl.out_dir}); {fresh}")
    if not resume and found and not overwrite:
        steps = checkpoint_steps(out)
        held = ", ".join(found) + (f"; checkpoints up to step {steps[-1]}" if steps else "")
        raise ConfigError(f"rl.out_dir {out} already holds a run ({held}): add --resume to continue it, --overwrite "
                          "to move it aside and start again, or set rl.out_dir to a new directory")
    if not resume and found and jax.process_index() == 0:
        real = out.resolve()  # a symlink (runs/x -> /scratch/x): the run moves aside there, and the link stays
        aside = _free_name(real.with_name(f"{real.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
        aside.mkdir()
        for path in [*(real / name for name in RUN_FILES), *(p for pattern in OTHER_RUN_FILES for p in real.glob(pattern))]:
            if path.exists():  # the run's own files: what else the directory holds (the user's notes, plots) stays
                path.rename(aside / path.name)
        print(f"[fastrl-jax] --overwrite: moved the previous run in {out} to {aside}", file=sys.stderr)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("fastrl-jax run directory checked")


def _existing_ancestor(path: Path) -> Path:
    """`path` or its nearest existing parent: where creating it would start."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


def read_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The resolved config a run was started with (RUN_DIR/config.yaml), with `overrides` applied."""
    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "config.yaml").is_file():
        what = "does not exist" if not run_dir.exists() else "has no config.yaml"
        raise FileNotFoundError(f"--run {run_dir} {what}: give a GRPO run directory (the rl.out_dir of "
                                "`fastrl-jax train`, holding config.yaml and checkpoints/)")
    return load_config(run_dir / "config.yaml", overrides)


def check_run(run_dir: str | Path, step: int | None = None, overrides: Sequence[str] = ()) -> Config:
    """The run's config, after checking what can be checked without reading weights: the run exists,
    has checkpoints (and `step`, if given), and its base model is where config.yaml says."""
    cfg = read_run_config(run_dir, overrides)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"--run {run_dir} has no checkpoint yet (checkpoints/ is empty or missing)")
    if not (Path(run_dir).expanduser() / "checkpoints" / str(steps[-1]) / "policy").is_dir():
        raise ValueError(f"--run {run_dir} is not a GRPO run: its checkpoints hold no policy (a train-drafter "
                         "directory? its drafter/ goes to --drafter)")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"--step {step}: no such checkpoint in {Path(run_dir) / 'checkpoints'}; "
                                f"its steps: {', '.join(map(str, steps))}")
    base_model_path(cfg, run_dir)
    return cfg


def base_model_path(cfg: Config, run_dir: str | Path) -> Path:
    try:
        return resolve_model_path(cfg.model.path)
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"the base model of run {run_dir} (model.path in its config.yaml) is not usable: "
                                f"{e} Its tokenizer and config are read from there: if it moved, add "
                                "--set model.path=NEW_PATH") from None


def load_run_policy(run_dir: str | Path, mesh: Mesh, step: int | None = None, overrides: Sequence[str] = (),
                    tokenizer=None) -> tuple[Policy, int, Config]:
    """The policy of checkpoint `step` of a GRPO run (None: the latest readable one) sharded on `mesh`,
    with the base model's tokenizer (loaded here unless given) and stop ids; returns (policy, step, the
    run's config)."""
    t0 = time.perf_counter()
    cfg = check_run(run_dir, step, overrides)
    path = base_model_path(cfg, run_dir)
    model_cfg = read_model_config(path)
    graphdef, state = nnx.split(abstract_decoder(model_cfg, DTYPES[cfg.model.dtype]))
    shardings = nnx.to_pure_dict(shardings_for(state, mesh))
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          nnx.to_pure_dict(state), shardings)
    with RunCheckpointer(Path(run_dir).expanduser() / "checkpoints", keep=None, read_only=True) as ckpt:
        step, arrays, _ = ckpt.restore(step, {"policy": target})
    nnx.replace_by_pure_dict(state, arrays["policy"])
    tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
    print(f"[fastrl-jax] loaded step {step} of run {run_dir} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return Policy(nnx.merge(graphdef, state), tokenizer, stop_ids(model_cfg, tokenizer), path), step, cfg
