"""K GRPO steps with speculative decoding off and adaptive (+ the online drafter), from the same seeds.

Both runs must produce the same rollouts (token ids, by digest) and rewards at every step: lossless SD
changes the time, not the training. That is required with float32 rollouts; with bfloat16 ones
(model.rollout_dtype) SD equals plain decoding up to near-ties of the top two logits, and a rollout that
parts at one trains on other samples from then on (docs/measurements.md): reported, not required. The
adaptive runs must speculate at some step (else they compare SD off with itself: exit 1). Reports the time
of each step split into rollout, policy update and drafter work (online training in the tail is part of the
rollout's wall time on one device; the per-step acceptance estimate is drafter work) and the seconds its
rollout programs compiled (compile_s: in front of the rollout and on the program pool's background thread).
Adaptive's speed-up (SD off's seconds / adaptive's: step_time_ratio and rollout_ratio, > 1 when adaptive is
faster) is the median over --repeats of each repeat's ratio, the modes run interleaved (off, adaptive, off,
adaptive, ...) so drift in the machine hits both; over all steps as measured (compiles included), and over
steps 2.. with the compile seconds each step's rollout waited for subtracted (a program first reached at a
later step, a length bucket or an SD arm, compiles there, and the first run in the process compiles what later
runs get from JAX's caches; a background compile the rollout did not wait for overlapped its decoding and is not
subtracted). The policy update's own compiles are not subtracted (the same rollouts, so the same update
programs, in both modes). Also the machine's facts; JSON + PNG.

    python scripts/bench_rl.py --config configs/smollm2_cpu.yaml --steps 5 --repeats 3 --out bench_rl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RATIO_STATISTIC = ("median over repeats of each repeat's SD off / adaptive seconds (modes interleaved per repeat); "
                   "'off' / 'adaptive' seconds: median over repeats of each key's total")


def pool_compiles(trainer) -> list:
    """Every compile the rollout engines' program pools hold now (ProgramStats, one per compile: a recompile
    replaces its key's entry), in front of the caller or on the pool's background thread."""
    return [s for r in trainer.workers.replicas for s in r.engine.pool.stats.values()]


def compile_seconds(before: list, after: list) -> tuple[float, float]:
    """(all, background) compile seconds of the compiles in `after` that `before` lacks. Counted from the pool's
    per-program records, not the rollout's waited seconds, which hold a waited-on background compile too."""
    seen = {id(s) for s in before}
    new = [s for s in after if id(s) not in seen]
    return sum(s.compile_seconds for s in new), sum(s.compile_seconds for s in new if s.background)


def run(cfg, policy, mode: str, out_dir: Path) -> dict:
    """One GRPO run with sd.mode `mode`; per-step metrics and seconds."""
    from fastrl_jax.rl.trainer import Trainer

    rl = dataclasses.replace(cfg.rl, out_dir=str(out_dir), checkpoint_every_steps=0, eval_every_steps=0, tensorboard=False)
    cfg = dataclasses.replace(cfg, sd=dataclasses.replace(cfg.sd, mode=mode), rl=rl)
    t0 = time.perf_counter()
    rows = []
    with open(out_dir / "table.txt", "w") as table:
        trainer = Trainer(cfg, policy.model, policy.tokenizer, stream=table)
        try:  # Trainer.run's loop, step by step: the pools' compiles are read between the steps
            while trainer.step < cfg.rl.steps:
                before = pool_compiles(trainer)  # held until after the step: ids of live objects stay unique
                m = trainer.run_step()
                rows.append(step_row(m, *compile_seconds(before, pool_compiles(trainer))))
        finally:
            trainer.close()
    return {"mode": mode, "wall_s": time.perf_counter() - t0, "steps": rows}


def step_row(m: dict, compile_s: float, background_s: float) -> dict:
    """One step's figures from the trainer's metrics and the seconds its rollout programs compiled."""
    drafter = m.get("drafter_eval_s", 0.0)
    return {"step": m["step"], "rollout_s": m["rollout_s"], "update_s": m["train_s"], "drafter_s": drafter,
            "drafter_spot_s": m.get("drafter_spot_s", 0.0), "compile_s": compile_s, "background_compile_s": background_s,
            "rollout_waited_compile_s": m["rollout_compile_s"], "sd_saved_s": m["sd_saved_s"],
            "drafter_bank_s": m.get("drafter_bank_s", 0.0), "step_s": m["rollout_s"] + m["train_s"] + drafter,
            "reward_mean": m["reward_mean"], "digest": m["rollout_digest"], "tokens": m["tokens"],
            "sd_share": m["sd_share"], "acceptance_length": m["acceptance_length"]}


def totals(run: dict, first: int, subtract_compile: bool) -> dict:
    """A run's seconds summed over steps first+1.., by key; rollout_s and step_s less the compile seconds the
    rollout waited for if asked (a background compile it did not wait for overlapped its plain decoding)."""
    steps = run["steps"][first:]
    out = {k: sum(s.get(k, 0.0) for s in steps) for k in ("rollout_s", "update_s", "drafter_s", "drafter_spot_s",
                                                           "compile_s", "rollout_waited_compile_s", "step_s")}
    if subtract_compile:
        out["rollout_s"] -= out["rollout_waited_compile_s"]
        out["step_s"] -= out["rollout_waited_compile_s"]
    return out


def ratios(all_off: list[dict], all_on: list[dict], first: int, subtract_compile: bool) -> dict:
    """Adaptive's speed-up over SD off: the median of the per-repeat ratios (repeat r's off run against its
    adaptive run), and the median seconds of each mode."""
    off = [totals(r, first, subtract_compile) for r in all_off]
    on = [totals(r, first, subtract_compile) for r in all_on]
    step = [_ratio(a["step_s"], b["step_s"]) for a, b in zip(off, on)]
    rollout = [_ratio(a["rollout_s"], b["rollout_s"]) for a, b in zip(off, on)]
    return {"compile": "subtracted" if subtract_compile else "included", "statistic": RATIO_STATISTIC,
            "step_time_ratio": float(np.median(step)), "rollout_ratio": float(np.median(rollout)),
            "step_time_ratio_by_repeat": step, "rollout_ratio_by_repeat": rollout,
            "off": {k: float(np.median([t[k] for t in off])) for k in off[0]},
            "adaptive": {k: float(np.median([t[k] for t in on])) for k in on[0]}}


def _ratio(a: float, b: float) -> float:
    """a / b, NaN (null in the JSON) where b holds no time: a run without those steps."""
    return a / b if b > 0 else float("nan")


def median_repeat(all_off: list[dict], all_on: list[dict]) -> int:
    """The repeat whose steps-2.. (else all-steps) step-time ratio is the median: the one the table and plot show."""
    first = 1 if len(all_off[0]["steps"]) > 1 else 0
    step = ratios(all_off, all_on, first, first == 1)["step_time_ratio_by_repeat"]
    return sorted(range(len(step)), key=step.__getitem__)[len(step) // 2]


def summary(all_off: list[dict], all_on: list[dict]) -> dict:
    """Identical rollouts, whether adaptive speculated, and the speed-ups (runs in repeat order, off and
    adaptive of one repeat at one index)."""
    reference = [(s["digest"], s["reward_mean"]) for s in all_off[0]["steps"]]
    identical = all([(s["digest"], s["reward_mean"]) for s in r["steps"]] == reference for r in all_off + all_on)
    # Identical rollouts show SD lossless only where it ran: adaptive runs that never speculated compare SD off
    # with itself.
    speculated = any(s["sd_share"] > 0 for r in all_on for s in r["steps"])
    steps = len(all_off[0]["steps"])
    out = {"identical_rollouts_and_rewards": identical, "speculated": speculated, "steps": steps,
           "repeats": len(all_off), "all_steps": ratios(all_off, all_on, 0, False)}
    if steps > 1:
        out["steps_2_on"] = ratios(all_off, all_on, 1, True)
    table = median_repeat(all_off, all_on)
    adaptive = all_on[table]
    out["runs_step_s"] = {"off": [totals(r, 0, False)["step_s"] for r in all_off],
                          "adaptive": [totals(r, 0, False)["step_s"] for r in all_on]}
    out["runs_compile_s"] = {"off": [totals(r, 0, False)["compile_s"] for r in all_off],
                             "adaptive": [totals(r, 0, False)["compile_s"] for r in all_on]}
    out["table_repeat"] = table  # 0-based: the repeat of the median ratio, whose steps the table and plot show
    out["acceptance_by_step"] = [s["acceptance_length"] for s in adaptive["steps"]]
    out["sd_share_by_step"] = [s["sd_share"] for s in adaptive["steps"]]
    return out


def plot(off: dict, adaptive: dict, path: str) -> bool:
    from fastrl_jax.plotting import pyplot, save

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
    save(fig, path)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2_cpu.yaml")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per mode, interleaved (odd); the median of the per-repeat ratios is reported")
    parser.add_argument("--out", default="bench_rl.json")
    parser.add_argument("--plot", help="PNG (default: --out with .png)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.repeats % 2 == 0:
        parser.error("--steps must be >= 1 and --repeats odd: the figures are medians over the repeats")

    from fastrl_jax.cli import check_output_file
    from fastrl_jax.config import load_config
    from fastrl_jax.models.drafter_io import drafter_dir

    cfg = load_config(args.config or None, [*args.set, f"rl.steps={args.steps}"])
    try:  # before the runs, not after them: a path that cannot be written, or read, would lose them all
        out = check_output_file(args.out, "--out")
        png = check_output_file(args.plot or str(out.with_suffix(".png")), "--plot")
        if cfg.rl.drafter_path:  # the adaptive runs load it, after the first SD-off run
            drafter_dir(cfg.rl.drafter_path)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    from fastrl_jax.machine import machine_facts

    facts = machine_facts()  # before the runs: after them the load average is the benchmark's own
    runs = run_all(cfg, args, out)
    return report(cfg, args, runs, out, png, facts)


def run_all(cfg, args, out: Path) -> dict[str, list[dict]]:
    """--repeats runs of each mode on one loaded policy, interleaved (off, adaptive, off, adaptive, ...), each
    written to `out` as it ends ("complete": false), so a later run's failure keeps it."""
    from fastrl_jax import files
    from fastrl_jax.models.loading import load_policy
    from fastrl_jax.rollout.pool import enable_persistent_cache
    from fastrl_jax.sharding import make_mesh

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
                t = totals(runs[mode][-1], 0, False)
                print(f"[bench-rl] run {r + 1}/{args.repeats} {mode}: {t['step_s']:.1f}s over {args.steps} steps "
                      f"({t['compile_s']:.1f}s compiling rollout programs)", file=sys.stderr)
                files.write_json(out, {"complete": False, "config": args.config, "overrides": args.set, "runs": runs},
                                 indent=1)
    return runs


def report(cfg, args, runs: dict[str, list[dict]], out: Path, png: Path, facts: dict) -> int:
    """Writes the JSON and the plot, prints the table; the exit status. facts: the machine's, taken before the runs."""
    import jax

    from fastrl_jax import files
    from fastrl_jax.config import to_dict
    from fastrl_jax.machine import facts_after

    s = summary(runs["off"], runs["adaptive"])
    s["dtype"], s["identical_required"] = cfg.model.engine_dtype, cfg.model.engine_dtype == "float32"
    result = {"complete": True, "summary": s, "machine": facts_after(facts), "backend": jax.default_backend(),
              "config": args.config, "overrides": args.set, "resolved_config": to_dict(cfg), "runs": runs}
    off, adaptive = runs["off"][s["table_repeat"]], runs["adaptive"][s["table_repeat"]]
    print(f"repeat {s['table_repeat'] + 1} (the median ratio's):")
    print(f"{'step':>4} {'off s':>7} {'adapt s':>7} {'rollout':>8} {'compile':>7} {'update':>7} {'drafter':>7} {'sd':>5} "
          f"{'accept':>6} {'same':>5}")
    for a, b in zip(off["steps"], adaptive["steps"]):
        print(f"{a['step']:>4} {a['step_s']:>7.1f} {b['step_s']:>7.1f} {b['rollout_s']:>8.1f} {b['compile_s']:>7.1f} "
              f"{b['update_s']:>7.1f} {b['drafter_s']:>7.1f} {b['sd_share']:>5.2f} {b['acceptance_length']:>6.2f} "
              f"{a['digest'] == b['digest']!s:>5}")
    for label in ("all_steps", "steps_2_on")[: 1 + (args.steps > 1)]:
        print(f"{label} (compile {s[label]['compile']}): adaptive speed-up over SD off (SD off s / adaptive s), median "
              f"of {args.repeats} repeats: step time {s[label]['step_time_ratio']:.2f}x "
              f"{[round(x, 2) for x in s[label]['step_time_ratio_by_repeat']]}, rollout {s[label]['rollout_ratio']:.2f}x")
    print(f"identical rollouts and rewards: {s['identical_rollouts_and_rewards']} (step seconds off "
          f"{[round(x, 1) for x in s['runs_step_s']['off']]}, adaptive {[round(x, 1) for x in s['runs_step_s']['adaptive']]})")
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
