#!/usr/bin/env python
"""Reward, accuracy and held-out accuracy against the RL step from one or more metrics.jsonl files: a table
on stdout, the series as JSON, and a plot (matplotlib, the [plot] extra; the table and JSON need none).

    python scripts/plot_rewards.py runs/a/metrics.jsonl [runs/b/metrics.jsonl ...] -o reward.png
"""

import argparse
import sys
from pathlib import Path


def series(path: str, smooth: int) -> dict:
    """One run's training reward (raw and a moving average of `smooth` steps) and held-out accuracy by step."""
    from fastrl_jax.metric_sink import read_metrics

    rows = read_metrics(path)
    train = [r for r in rows if "reward_mean" in r]
    reward = [r["reward_mean"] for r in train]
    window = [reward[max(0, i - smooth + 1) : i + 1] for i in range(len(reward))]
    evals = [r for r in rows if "eval_accuracy" in r]
    return {"metrics": path, "label": Path(path).parent.name, "smooth": smooth, "steps": [r["step"] for r in train],
            "reward_mean": reward, "reward_smoothed": [sum(w) / len(w) for w in window],
            "eval_steps": [r["step"] for r in evals], "eval_accuracy": [r["eval_accuracy"] for r in evals],
            # not logged by older runs
            "eval_temperature": evals[0].get("eval_temperature") if evals else None}


def _last(values: list[float]) -> str:
    return f"{values[-1]:.3f}" if values else "-"


def plot(runs: list[dict], path: str) -> bool:
    from fastrl_jax.plotting import pyplot, save

    if (plt := pyplot()) is None:
        return False
    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        (line,) = ax_r.plot(run["steps"], run["reward_smoothed"], label=f"{run['label']} (mean of {run['smooth']})")
        ax_r.plot(run["steps"], run["reward_mean"], alpha=0.3, color=line.get_color())
        t = run["eval_temperature"]
        mode = "" if t is None else " (greedy)" if t == 0 else f" (sampled at T={t:g})"
        ax_e.plot(run["eval_steps"], run["eval_accuracy"], marker="o", color=line.get_color(), label=run["label"] + mode)
    ax_r.set(xlabel="RL step", ylabel="training reward (accuracy of samples)", title="reward vs step")
    ax_e.set(xlabel="RL step", ylabel="held-out accuracy", title="held-out accuracy")
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save(fig, path)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files written by fastrl-jax train")
    parser.add_argument("-o", "--output", default="reward_vs_step.png")
    parser.add_argument("--out", help="the series as JSON (default: --output with .json)")
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window for the training reward")
    args = parser.parse_args(argv)

    from fastrl_jax import files
    from fastrl_jax.cli import check_output_file

    try:
        png = check_output_file(args.output, "--output")
        out = check_output_file(args.out or str(png.with_suffix(".json")), "--out")
    except (OSError, ValueError) as e:
        parser.error(str(e))
    try:
        runs = [series(path, max(1, args.smooth)) for path in args.metrics]
    except (OSError, ValueError) as e:  # no such file, a line that is not JSON
        parser.error(str(e))
    print(f"{'run':>20} {'steps':>5} {'reward':>7} {'smoothed':>8} {'eval_acc':>8}")
    for r in runs:
        print(f"{r['label']:>20} {len(r['steps']):>5} {_last(r['reward_mean']):>7} {_last(r['reward_smoothed']):>8} "
              f"{_last(r['eval_accuracy']):>8}")
    files.write_json(out, {"runs": runs})
    # The plot is what this script is for: without matplotlib it says the fix (pyplot) and exits 1.
    if not plot(runs, str(png)):
        print(f"wrote {out}, no plot", file=sys.stderr)
        return 1
    print(f"wrote {png} and {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
