"""Per-step metrics: summaries of a rollout, and their sinks (a table on stdout, JSONL, TensorBoard)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastrl_jax.metric_sink import MetricsSink
from fastrl_jax.rollout.stats import RolloutStats


def rollout_summary(rewards: Sequence[float], correct: Sequence[float], lengths: Sequence[int],
                    finish_reasons: Sequence[str], stats: RolloutStats) -> dict[str, float]:
    """Reward, accuracy and response-length statistics of one rollout, plus the engine's SD figures."""
    r, n = np.asarray(rewards, np.float64), np.asarray(lengths, np.float64)
    out = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "accuracy": float(np.mean(correct)),
        "len_mean": float(n.mean()),
        "len_p50": float(np.percentile(n, 50)),
        "len_p99": float(np.percentile(n, 99)),
        "len_max": int(n.max()),
        "truncated_frac": float(np.mean([f == "length" for f in finish_reasons])),
        "tokens": int(n.sum()),
    }
    tokens, plain, spec = stats.tokens, stats.steps_plain, stats.steps_sd
    # Share of decode steps that were speculative (1 with sd.mode=on, 0 when off, the tail when adaptive),
    # and share of generated tokens those steps produced.
    out["sd_share"] = float(spec / (plain + spec)) if plain + spec else 0.0
    out["sd_token_share"] = float(stats.sd_tokens / tokens) if tokens else 0.0
    out["rollout_compile_s"] = float(stats.seconds["compile"])
    out["sd_saved_s"] = float(stats.sd_saved_s)  # against plain steps of the same tables (negative: SD cost more)
    out["acceptance_length"] = stats.acceptance_length()
    return out


# (metric key, column header, width, format spec); a missing or NaN value prints as '-'.
COLUMNS = (
    ("step", "step", 4, "d"),
    ("reward_mean", "reward", 6, ".3f"),
    ("reward_std", "r_std", 5, ".3f"),
    ("accuracy", "acc", 5, ".3f"),
    ("len_mean", "len", 5, ".1f"),
    ("len_p50", "p50", 4, ".0f"),
    ("len_p99", "p99", 4, ".0f"),
    ("len_max", "max", 4, "d"),
    ("rollout_s", "roll_s", 6, ".1f"),
    ("sd_share", "sd", 4, ".2f"),
    ("acceptance_length", "acc_len", 7, ".2f"),
    ("drafter_steps", "d_steps", 7, "d"),
    ("drafter_accept", "d_acc", 5, ".2f"),
    ("train_s", "train_s", 7, ".1f"),
    ("tokens_per_s", "tok/s", 6, ".1f"),
    ("loss", "loss", 8, ".4f"),
    ("eval_accuracy", "eval_acc", 8, ".3f"),
)


def _cell(value: Any, width: int, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return format(value, f">{width}{spec}")


def table_header() -> str:
    return " ".join(header.rjust(width) for _, header, width, _ in COLUMNS)


def table_row(metrics: dict[str, Any]) -> str:
    return " ".join(_cell(metrics.get(key), width, spec) for key, _, width, spec in COLUMNS)


class MetricsLog:
    """Writes each step's metrics to stdout (one table row), out_dir/metrics.jsonl, TensorBoard and W&B."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_after: int | None = None,
                 enabled: bool = True, stream=sys.stdout, wandb_project: str = "", config: dict | None = None):
        self.stream = stream
        self._sink = MetricsSink(out_dir, tensorboard, resume_after, wandb_project, config) if enabled else None
        if enabled:
            print(table_header(), file=self.stream, flush=True)

    def log(self, metrics: dict[str, Any]) -> None:
        if self._sink is None:
            return
        print(table_row(metrics), file=self.stream, flush=True)
        self._sink.write(metrics)

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
