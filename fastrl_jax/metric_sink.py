"""Metric sinks shared by the trainers: one JSON line, TensorBoard scalars and Weights & Biases values per
logged step.

On resume, lines a killed run logged after its last checkpoint are dropped (and TensorBoard purges
the same steps), so the resumed run's metrics continue the file as an uninterrupted run would have.
A W&B run continues too (its id is kept in the out_dir); W&B keeps what it was sent, so a resume that
falls back past a damaged checkpoint sends steps it already holds, which W&B ignores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

import jax

from fastrl_jax import files
from fastrl_jax.config import ConfigError


class MetricsSink:
    """out_dir/metrics.jsonl, with `tensorboard` out_dir/tensorboard, with `wandb_project` a W&B run of that
    project (named after out_dir, its config `config`); resume_after: the step resumed from."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_after: int | None = None,
                 wandb_project: str = "", config: dict | None = None):
        out_dir = Path(out_dir)
        self.path = out_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb, self._tb_dir = None, out_dir / "tensorboard"
        self.drop_after(-1 if resume_after is None else resume_after)
        if tensorboard:
            self._tb = self._tensorboard(resume_after)
        self._wandb = _wandb_run(out_dir, wandb_project, config) if wandb_project else None

    def _tensorboard(self, after: int | None):
        """A TensorBoard writer whose steps after `after` replace those of earlier event files (None: none are)."""
        from tensorboardX import SummaryWriter

        # A file of its own: tensorboardX names it by the second, and a second writer in the same second wrote over
        # the first one's file
        return SummaryWriter(str(self._tb_dir), purge_step=None if after is None else after + 1,
                             filename_suffix=f".{time.time_ns()}")

    def drop_after(self, step: int) -> None:
        """Keeps the metrics up to `step`: a resume that fell back past a damaged checkpoint runs the later
        steps again."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        # A process killed mid-rewrite leaves the file whole.
        files.write_text(self.path, "".join(ln + "\n" for ln in lines if ln.strip() and _step(ln) <= step))
        if self._tb is not None:  # TensorBoard drops them as a new writer purging from there opens
            self._tb.close()
            self._tb = self._tensorboard(step)

    def write(self, metrics: dict[str, Any]) -> None:
        """metrics: JSON-able, with an int "step"; finite numbers also go to TensorBoard."""
        with open(self.path, "a") as f:  # strict JSON: an unmeasured NaN as null (jq, JavaScript, Go refuse NaN)
            f.write(json.dumps(files.strict_json(metrics), allow_nan=False) + "\n")
        scalars = {k: v for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, metrics["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=metrics["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def check_wandb(key: str, project: str, login: bool = True) -> None:
    """Refuses a W&B project without the wandb package, or (with `login`, on the process that logs) without a W&B
    login, before anything loads: wandb.init failed once the policy had loaded and the run directory was made, which
    a rerun then refused to write over. A dry run (login False) plans a job that logs in elsewhere."""
    if not project:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"{key}={project} logs to Weights & Biases: pip install 'fastrl-jax[wandb]' (or set it to '')")
    if not login or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or jax.process_index():
        return
    import wandb

    try:
        wandb.login(verify=False)  # WANDB_API_KEY or ~/.netrc; asks for a key on a terminal, raises without one
    except wandb.errors.UsageError as e:
        raise ConfigError(f"{key}={project}: W&B cannot log in ({e}): run `wandb login`, set WANDB_API_KEY or "
                          "WANDB_MODE=offline, or set it to ''") from None


def _wandb_run(out_dir: Path, project: str, config: dict | None):
    """The out_dir's W&B run: the id in out_dir/wandb_id, made on the first start, continues it on resume."""
    import wandb

    id_file = out_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    files.write_text(id_file, run_id + "\n")
    return wandb.init(project=project, id=run_id, resume="allow", name=out_dir.name, dir=str(out_dir), config=config)


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """A metrics.jsonl's lines (or a run directory's), a null metric (written for NaN: unmeasured) as NaN; a last line
    without its newline (being written, or cut by a crash) is no step yet."""
    path = Path(path)
    text = (path / "metrics.jsonl" if path.is_dir() else path).read_text()
    lines = [json.loads(ln) for ln in text[: text.rfind("\n") + 1].splitlines() if ln.strip()]
    return [{k: math.nan if v is None else v for k, v in line.items()} for line in lines]
