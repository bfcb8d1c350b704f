"""Metric sinks shared by the trainers: one JSON line and TensorBoard scalars per logged step.

On resume, lines a killed run logged after its last checkpoint are dropped (and TensorBoard purges
the same steps), so the resumed run's metrics continue the file as an uninterrupted run would have.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastrl_jax import files


class MetricsSink:
    """out_dir/metrics.jsonl and, with `tensorboard`, out_dir/tensorboard; resume_after: the step resumed from."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_after: int | None = None):
        out_dir = Path(out_dir)
        self.path = out_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.drop_after(-1 if resume_after is None else resume_after)
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_after is None else resume_after + 1
            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge)

    def drop_after(self, step: int) -> None:
        """Keeps the file's lines up to `step`: a resume that fell back past a damaged checkpoint runs the later
        steps again (TensorBoard purges only where the sink opened, resume_after)."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        # A process killed mid-rewrite leaves the file whole.
        files.write_text(self.path, "".join(ln + "\n" for ln in lines if ln.strip() and _step(ln) <= step))

    def write(self, metrics: dict[str, Any]) -> None:
        """metrics: JSON-able, with an int "step"; finite numbers also go to TensorBoard."""
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, metrics["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
