"""K GRPO steps with speculative decoding off and adaptive (+ the online drafter), from the same seeds.

Both runs must produce the same rollouts (token ids, by digest) and rewards at every step: lossless SD
changes the time, not the training. That is required with float32 rollouts; with bfloat16 ones
(model.rollout_dtype) SD equals plain decoding up to near-ties of the top two logits, and a rollout that
parts at one trains on other samples from then on (docs/measurements.md): reported, not required. The
adaptive runs must speculate at some step (else they compare SD off with itself: exit 1). Reports the time
of each step split into rollout, policy update and drafter work (online training in the tail is part of the
rollout's wall time on one device; the per-step acceptance estimate is drafter work), adaptive's speed-up
(SD off's seconds / adaptive's: step_time_ratio and rollout_ratio, > 1 when adaptive is faster) over all
steps and over steps 2.. (step 1 compiles), the median of --repeats runs, the machine's facts; JSON + PNG.

    python scripts/bench_rl.py --config configs/smollm2_cpu.yaml --steps 5 --repeats 3 --out bench_rl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path


def run(cfg, policy, mode: str, out_dir: Path) -> dict:
    """One GRPO run with sd.mode `mode`; per-step metrics and seconds."""
    from fastrl_jax.rl.trainer import Trainer

    rl = dataclasses.replace(cfg.rl, out_dir=str(out_dir), checkpoint_every_steps=0, eval_every_steps=0, tensorboard=False)
    cfg = dataclasses.replace(cfg, sd=dataclasses.replace(cfg.sd, mode=mode), rl=rl)
    t0 = time.perf_counter()
    with open(out_dir / "table.txt", "w") as table:
        steps = Trainer(cfg, policy.model, policy.tokenizer, stream=table).run()
    rows = []
    for m in steps:
        drafter = m.get("drafter_eval_s", 0.0)
        rows.append({"step": m["step"], "rollout_s": m["rollout_s"], "update_s": m["train_s"], "drafter_s": drafter,
                     "drafter_spot_s": m.get("drafter_spot_s", 0.0), "compile_s": m["rollout_compile_s"],
                     "sd_saved_s": m["sd_saved_s"], "drafter_bank_s": m.get("drafter_bank_s", 0.0),
                     "step_s": m["rollout_s"] + m["train_s"] + drafter,
                     "reward_mean": m["reward_mean"], "digest": m["rollout_digest"], "tokens": m["tokens"],
                     "sd_share": m["sd_share"], "acceptance_length": m["acceptance_length"]})
    return {"mode": mode, "wall_s": time.perf_counter() - t0, "steps": rows}


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: sum(s["step_s"] for s in r["steps"]))[len(runs) // 2]


def summary(off: dict, adaptive: dict, all_off: list[dict], all_on: list[dict]) -> dict:
    def total(run, key, first=0):
        return sum(s[key] for s in run["steps"][first:])

    reference = [(s["digest"], s["reward_mean"]) for s in all_off[0]["steps"]]
    identical = all([(s["digest"], s["reward_mean"]) for s in r["steps"]] == reference for r in all_off + all_on)
    # Identical rollouts show SD lossless only where it ran: adaptive runs that never speculated compare SD off
    # with itself.
    speculated = any(s["sd_share"] > 0 for r in all_on for s in r["steps"])
    out = {"identical_rollouts_and_rewards": identical, "speculated": speculated, "steps": len(off["steps"])}
    for label, first in (("all_steps", 0), ("steps_2_on", 1))[: 1 + (len(off["steps"]) > 1)]:
        out[label] = {
            "step_time_ratio": total(off, "step_s", first) / total(adaptive, "step_s", first),
            "rollout_ratio": total(off, "rollout_s", first) / total(adaptive, "rollout_s", first),
            "off": {k: total(off, k, first) for k in ("rollout_s", "update_s", "drafter_s", "step_s")},
            "adaptive": {k: total(adaptive, k, first) for k in ("rollout_s", "update_s", "drafter_s", "drafter_spot_s", "step_s")},
        }
    out["runs_step_s"] = {"off": [total(r, "step_s") for r in all_off], "adaptive": [total(r, "step_s") for r in all_on]}
    out["acceptance_by_step"] = [s["acceptance_length"] for s in adaptive["steps"]]
    out["sd_share_by_step"] = [s["sd_share"] for s in adaptive["steps"]]
    return out


def plot(off: dict, adaptive: dict, path: str) -> bool:
    from fastrl_jax import files
    from fastrl_jax.plotting import pyplot

    if (plt := pyplot()) is None:
        return False

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for i, (run, label) in enumerate(((off, "SD off"), (adaptive, "adaptive SD"))):
        steps = [s["step"] + (i - 0.5) * width for s in run["steps"]]
        bottom = [0.0] * len(steps)
        for key, color in (("rollout_s", "tab:blue"), ("update_s", "tab:orange"), ("drafter_s", "tab:green")):
            values = [s[key] for s in run["steps"]]
            ax.bar(steps, values, width, bottom=bottom, color=color, alpha=0.55 if i == 0 else 0.95,
                   label=f"{label}: {key[:-2]}")
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with files.replacing(path) as tmp:  # keeps the suffix: savefig picks the format from it
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2_cpu.yaml")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (odd); the median run is reported")
    parser.add_argument("--out", default="bench_rl.json")
    parser.add_argument("--plot", help="PNG (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.repeats % 2 == 0:
        parser.error("--steps must be >= 1 and --repeats odd: the figures come from the median run, one of the runs")

    from fastrl_jax.cli import check_output_file

    try:  # before the runs, not after them: a path that cannot be written would lose them all
        out = check_output_file(args.out, "--out")
        png = check_output_file(args.plot or str(out.with_suffix(".png")), "--plot")
    except (OSError, ValueError) as e:
        parser.error(str(e))

    import jax

    from fastrl_jax import files
    from fastrl_jax.config import load_config, to_dict
    from fastrl_jax.machine import machine_facts
    from fastrl_jax.models.loading import load_policy
    from fastrl_jax.rollout.pool import enable_persistent_cache
    from fastrl_jax.sharding import make_mesh

    cfg = load_config(args.config or None, [*args.set, f"rl.steps={args.steps}"])
    if cfg.rollout.compile_cache_dir:
        enable_persistent_cache(cfg.rollout.compile_cache_dir)
    policy = load_policy(cfg.model, make_mesh(cfg.mesh))
    runs: dict[str, list[dict]] = {"off": [], "adaptive": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in ("off", "adaptive"):
                out_dir = Path(tmp) / f"{mode}{r}"
                out_dir.mkdir()
                runs[mode].append(run(cfg, policy, mode, out_dir))
                total = sum(s["step_s"] for s in runs[mode][-1]["steps"])
                print(f"[bench-rl] run {r + 1}/{args.repeats} {mode}: {total:.1f}s over {args.steps} steps", file=sys.stderr)
    off, adaptive = median_run(runs["off"]), median_run(runs["adaptive"])
    result = {"summary": summary(off, adaptive, runs["off"], runs["adaptive"]), "machine": machine_facts(),
              "backend": jax.default_backend(), "config": args.config, "overrides": args.set,
              "resolved_config": to_dict(cfg), "runs": runs}
    s = result["summary"]
    s["dtype"], s["identical_required"] = cfg.model.engine_dtype, cfg.model.engine_dtype == "float32"
    print(f"{'step':>4} {'off s':>7} {'adapt s':>7} {'rollout':>8} {'update':>7} {'drafter':>7} {'sd':>5} {'accept':>6} {'same':>5}")
    for a, b in zip(off["steps"], adaptive["steps"]):
        print(f"{a['step']:>4} {a['step_s']:>7.1f} {b['step_s']:>7.1f} {b['rollout_s']:>8.1f} {b['update_s']:>7.1f} "
              f"{b['drafter_s']:>7.1f} {b['sd_share']:>5.2f} {b['acceptance_length']:>6.2f} {str(a['digest'] == b['digest']):>5}")
    for label in ("all_steps", "steps_2_on")[: 1 + (args.steps > 1)]:
        print(f"{label}: adaptive speed-up over SD off (SD off s / adaptive s): step time "
              f"{s[label]['step_time_ratio']:.2f}x, rollout {s[label]['rollout_ratio']:.2f}x")
    print(f"identical rollouts and rewards: {s['identical_rollouts_and_rewards']}; median of {args.repeats} "
          f"(step seconds off {[round(x, 1) for x in s['runs_step_s']['off']]}, adaptive {[round(x, 1) for x in s['runs_step_s']['adaptive']]})")
    files.write_json(out, result, indent=1)
    if plot(off, adaptive, str(png)):
        print(f"[bench-rl] wrote {out} and {png}", file=sys.stderr)
    if not s["identical_rollouts_and_rewards"] and not s["identical_required"]:
        print(f"{s['dtype']} rollouts: SD equals plain decoding up to near-ties, so the runs may part (not required)")
    if not s["speculated"]:
        print("[bench-rl] FAIL: adaptive never speculated (sd_share 0 at every step of every run): the runs compared SD "
              "off with itself; raise sd.threshold_live_batch, or give rl.drafter_path (a trained drafter)", file=sys.stderr)
    return 0 if s["speculated"] and (s["identical_rollouts_and_rewards"] or not s["identical_required"]) else 1


if __name__ == "__main__":
    sys.exit(main())
