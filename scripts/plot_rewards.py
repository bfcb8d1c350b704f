#!/usr/bin/env python
"""Plots reward, accuracy and held-out accuracy against the RL step from one or more metrics.jsonl files.

    python scripts/plot_rewards.py runs/a/metrics.jsonl [runs/b/metrics.jsonl ...] -o reward.png
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files written by fastrl-jax train")
    parser.add_argument("-o", "--output", default="reward_vs_step.png")
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window for the training reward")
    args = parser.parse_args()
    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for path in args.metrics:
        rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
        label = Path(path).parent.name
        train = [r for r in rows if "reward_mean" in r]
        steps = [r["step"] for r in train]
        reward = [r["reward_mean"] for r in train]
        k = max(1, args.smooth)
        smooth = [sum(reward[max(0, i - k + 1) : i + 1]) / len(reward[max(0, i - k + 1) : i + 1]) for i in range(len(reward))]
        (line,) = ax_r.plot(steps, smooth, label=f"{label} (mean of {k})")
        ax_r.plot(steps, reward, alpha=0.3, color=line.get_color())
        evals = [r for r in rows if "eval_accuracy" in r]
        temperature = evals[0].get("eval_temperature") if evals else None  # not logged by older runs
        mode = "" if temperature is None else " (greedy)" if temperature == 0 else f" (sampled at T={temperature:g})"
        ax_e.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], marker="o", color=line.get_color(),
                  label=label + mode)
    ax_r.set(xlabel="RL step", ylabel="training reward (accuracy of samples)", title="reward vs step")
    ax_e.set(xlabel="RL step", ylabel="held-out accuracy", title="held-out accuracy")
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
