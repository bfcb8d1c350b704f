#!/usr/bin/env python
"""Online drafter training vs a frozen drafter, per RL step, from `fastrl-jax train` metrics.

    python scripts/plot_drafter_drift.py runs/online/metrics.jsonl [--baseline runs/frozen/metrics.jsonl] \\
        -o drift.png --out drift.json

From the online run (drafter_online.enabled=true, frozen_eval_every_steps=1): the estimated acceptance
length of the online drafter and of the frozen starting drafter on the same rollouts. With --baseline
(the same config with drafter_online.enabled=false; SD is lossless, so its rollouts are the same
tokens): rollout seconds per step with and without spot training. Prints a table, writes JSON (strict: an
unmeasured value is null) and a PNG (matplotlib, the [plot] extra; the table and JSON need none).
"""

import argparse
import json
import math
import statistics
import sys

from fastrl_jax import files
from fastrl_jax.cli import check_output_file
from fastrl_jax.metric_sink import read_metrics


def _by_step(path: str) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(path) if "rollout_s" in m}


def drift_summary(rows: list[dict], estimated: list[dict], baseline: bool) -> dict:
    """The online drafter's acceptance against its first estimate and against the frozen drafter's."""
    nan = float("nan")
    first = estimated[0]["accept_online"]
    summary = {"start": first, "online_last": estimated[-1]["accept_online"], "steps_estimated": len(estimated),
               "online_min_after_start": min(r["accept_online"] for r in estimated[1:]) if len(estimated) > 1 else first,
               "steps_online_at_or_above_start": sum(r["accept_online"] >= first for r in estimated[1:]),
               "frozen_last": next((r["accept_frozen"] for r in reversed(rows) if not math.isnan(r["accept_frozen"])), nan),
               "rollout_s_total": sum(r["rollout_s"] for r in rows),
               "rollout_s_total_without": sum(r["rollout_s_without"] for r in rows) if baseline else nan,
               "drafter_steps_total": sum(r["drafter_steps"] for r in rows)}
    # The per-step value moves with the step's prompts; online minus frozen on the same rollouts does not.
    diff = [r["accept_online"] - r["accept_frozen"] for r in estimated[1:] if not math.isnan(r["accept_frozen"])]
    if diff:
        summary |= {"paired_steps": len(diff), "online_minus_frozen_mean": statistics.fmean(diff),
                    "online_minus_frozen_stderr": statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else nan,
                    "steps_online_at_or_above_frozen": sum(d >= 0 for d in diff)}
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="metrics.jsonl of the run with online drafter training")
    parser.add_argument("--baseline", help="metrics.jsonl of the same run without it (drafter_online.enabled=false)")
    parser.add_argument("-o", "--output", default="drafter_drift.png")
    parser.add_argument("--out", default="drafter_drift.json")
    args = parser.parse_args(argv)
    try:
        check_output_file(args.output, "--output")
        check_output_file(args.out, "--out")
    except (OSError, ValueError) as e:
        parser.error(str(e))
    try:
        online = _by_step(args.metrics)
        base = _by_step(args.baseline) if args.baseline else {}
    except (OSError, ValueError) as e:  # no such file, a line that is not JSON
        parser.error(str(e))
    if not online or "drafter_accept" not in next(iter(online.values())):
        raise SystemExit(f"{args.metrics} has no drafter_accept: run with sd.mode != off and drafter_online.enabled=true")
    nan = float("nan")
    rows = [{"step": s, "accept_online": m["drafter_accept"], "accept_frozen": m.get("drafter_accept_frozen", nan),
             "drafter_steps": m["drafter_steps"], "drafter_spot_s": m["drafter_spot_s"],
             "drafter_loss": m["drafter_loss"], "rollout_s": m["rollout_s"],
             "rollout_s_without": base.get(s, {}).get("rollout_s", nan)} for s, m in sorted(online.items())]
    print(f"{'step':>4} {'acc_online':>10} {'acc_frozen':>10} {'d_steps':>7} {'spot_s':>6} {'d_loss':>7} "
          f"{'roll_s':>6} {'roll_s_no_spot':>14}")
    for r in rows:
        print(f"{r['step']:>4} {r['accept_online']:>10.3f} {r['accept_frozen']:>10.3f} {r['drafter_steps']:>7} "
              f"{r['drafter_spot_s']:>6.1f} {r['drafter_loss']:>7.3f} {r['rollout_s']:>6.1f} {r['rollout_s_without']:>14.1f}")
    # A step whose drafter had not trained since its last estimate has none (NaN).
    estimated = [r for r in rows if not math.isnan(r["accept_online"])]
    if not estimated:
        raise SystemExit(f"{args.metrics}: the drafter was never estimated (it never trained: see drafter_online.tail_budget)")
    first = estimated[0]["accept_online"]
    summary = drift_summary(rows, estimated, bool(base))
    print(json.dumps(files.strict_json(summary), indent=1))
    files.write_json(args.out, {"rows": rows, "summary": summary}, indent=1)
    if plot(rows, first, estimated[0]["step"], bool(base), args.output):
        print(f"wrote {args.output} and {args.out}")
    else:
        print(f"wrote {args.out}, no plot", file=sys.stderr)
    return 0


def plot(rows: list[dict], first: float, first_step: int, baseline: bool, path: str) -> bool:
    from fastrl_jax.plotting import pyplot, save

    if (plt := pyplot()) is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    frozen = [(r["step"], r["accept_frozen"]) for r in rows if not math.isnan(r["accept_frozen"])]
    panels = [
        ("est. tokens per SD step (chain)", "drafter acceptance on each step's rollouts",
         [("online (spot-trained)", steps, [r["accept_online"] for r in rows]),
          ("frozen starting drafter", [s for s, _ in frozen], [a for _, a in frozen])]),
        ("rollout seconds", "rollout time per step",
         [("with spot training", steps, [r["rollout_s"] for r in rows])]
         + ([("without", steps, [r["rollout_s_without"] for r in rows])] if baseline else [])),
    ]
    axes[0].axhline(first, color="gray", ls=":", lw=1, label=f"first estimate (step {first_step})")
    for ax, (ylabel, title, lines) in zip(axes, panels):
        for label, x, y in lines:
            ax.plot(x, y, marker="o", label=label)
        ax.set(xlabel="RL step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, path, bbox_inches="tight")
    return True


if __name__ == "__main__":
    sys.exit(main())
