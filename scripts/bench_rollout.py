"""Rollout benchmarks on the config's model (SmolLM2-135M by default; its model.rollout_dtype, float32 on
CPU), side by side in one run. Prints a table, writes JSON. Output paths are checked before anything loads.

--workload throughput (default): fastrl-jax's engine vs HF transformers `generate`: the same chat
prompts, greedy, a fixed number of new tokens (no early stop, so both do the same work), batch
sizes 1, 16, 64.

    python scripts/bench_rollout.py --out bench_rollout.json

--workload longtail: a realistic RL rollout, 16 math word problems x 4 samples at temperature 0.7,
up to 512 new tokens, run as plain decoding (with compaction), always-on speculative decoding (each
strategy given, e.g. 3/1/4 h8 3/1/4+h8; the best is the comparison) and adaptive SD (the config's sd
section), with the same seeds, so all produce the same tokens (checked; exit 1 otherwise). Each engine
runs every request once untimed after compiling (a program's first run pays one-time costs, and the
adaptive bandit does not count it). The modes take turns, a rollout each per round, so the machine's drift
weighs on all alike. Reports the median of --repeats rollouts, metric by metric: wall
time, tokens/s, speedups, the share of plain time spent at live batch <= the SD threshold and adaptive's
speedup inside it, acceptance; the drafted tokens per step by source (EAGLE / history), the machine's
facts, and a PNG timeline (live batch, tokens/s, SD on/off and strategy over time) of the run of median
seconds.

    python scripts/bench_rollout.py --workload longtail --drafter DRAFTER_DIR --repeats 3 --out longtail.json

--workload stream: continuous batching, 512 requests of long-tailed lengths (lognormal, median 114,
p90 ~193 new tokens, as SmolLM2's answers to math problems at T=0.7) through a 64-row table, every
program compiled before the clock starts. Reports tok/s, the steady full-batch rate (decode calls with
all 64 rows decoding, in the same run), their ratio `stream_vs_full_batch`, the mean live rows, the
shares of time in prefill and in compilation (a length-bucket move that compiled), the idle row-steps
of finished rows waiting for their refill: each metric's median over --repeats runs (and every run's),
after one untimed rollout; and a timeline PNG. With --sd adaptive, a random drafter's (no --drafter)
EAGLE arms sit out, as in the trainer.

    python scripts/bench_rollout.py --workload stream --repeats 3 --out stream.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

QUESTIONS = [
    "A baker makes {a} loaves a day and sells {b} of them. How many are left after {c} days?",
    "Tom has {a} marbles and gives {b} to each of his {c} friends. How many does he have now?",
    "A train travels {a} km in {b} hours. How far does it go in {c} hours at the same speed?",
    "A box holds {a} pencils. How many pencils are in {b} boxes if {c} are missing?",
]


def make_prompts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [
        QUESTIONS[i % len(QUESTIONS)].format(a=rng.integers(20, 99), b=rng.integers(2, 9), c=rng.integers(2, 9))
        for i in range(n)
    ]


def bench_engine(model, prompt_ids, batch_sizes, new_tokens, repeats, layer_loop=None, base=None):
    """layer_loop: rollout.layer_loop (None: base's); base: the config's rollout section (None: RolloutConfig's
    defaults), whose sizes the benchmark sets."""
    from fastrl_jax.config import RolloutConfig
    from fastrl_jax.rollout.engine import Request, RolloutEngine

    longest = max(len(p) for p in prompt_ids)
    prompt_bucket = -(-longest // 32) * 32
    base = base or RolloutConfig()
    cfg = dataclasses.replace(
        base,
        batch_buckets=tuple(batch_sizes),
        prompt_buckets=(prompt_bucket,),
        length_buckets=tuple(prompt_bucket + k for k in (new_tokens // 2, new_tokens)),
        steps_per_call=new_tokens,
        layer_loop=layer_loop or base.layer_loop,
    )
    t0 = time.perf_counter()
    engine = RolloutEngine(model, cfg, progress=False)
    compile_s = time.perf_counter() - t0
    out = {}
    for b in batch_sizes:
        reqs = [Request(prompt_ids[i % len(prompt_ids)], max_new_tokens=new_tokens) for i in range(b)]
        engine.generate(reqs)  # first call: any program not warmed up compiles here
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = engine.generate(reqs)
            times.append(time.perf_counter() - t0)
        assert all(len(r.tokens) == new_tokens for r in res)
        out[b] = (b * new_tokens / min(times), res)
    return out, compile_s, engine.pool.report()


def bench_hf(hf, prompt_ids, batch_sizes, new_tokens, repeats, pad_id):
    """HF transformers `generate` tok/s per batch size for a loaded CausalLM (on any torch device)."""
    import torch

    hf.generation_config.eos_token_id = None  # never stop early: the engine runs without stop ids too
    out = {}
    for b in batch_sizes:
        rows = [prompt_ids[i % len(prompt_ids)] for i in range(b)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=hf.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=hf.device)
        kwargs = dict(
            attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
            pad_token_id=pad_id,
        )
        with torch.no_grad():
            hf.generate(ids, **kwargs)
            times = []
            for _ in range(repeats):
                _sync(hf.device)
                t0 = time.perf_counter()
                gen = hf.generate(ids, **kwargs)
                _sync(hf.device)
                times.append(time.perf_counter() - t0)
        out[b] = (b * new_tokens / min(times), gen[:, width:].tolist())
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_smollm2(cfg):
    """The config's policy (SmolLM2 float32 by default) on one device in the engines' dtype
    (model.rollout_dtype), with the compilation cache on."""
    import jax

    from fastrl_jax.config import MeshConfig
    from fastrl_jax.models.loading import load_policy
    from fastrl_jax.rollout.pool import enable_persistent_cache
    from fastrl_jax.sharding import make_mesh

    if cfg.rollout.compile_cache_dir:
        enable_persistent_cache(cfg.rollout.compile_cache_dir)
    return load_policy(cfg.model, make_mesh(MeshConfig(), jax.devices()[:1]), cfg.model.engine_dtype)


# ---- long-tail workload -----------------------------------------------------------------------

LONGTAIL_SEED = 2026  # problem stream of fastrl_jax.data.math_problems; not the training streams' seeds
INSTRUCTION = "Explain step by step, then put the final answer after 'The answer is'."


def longtail_requests(policy, args):
    from fastrl_jax.data.math_problems import problems
    from fastrl_jax.data.prompts import chat_prompt_ids
    from fastrl_jax.rollout.engine import Request

    word_problems = problems(LONGTAIL_SEED, args.problems, levels=(4, 5))
    return [
        Request(chat_prompt_ids(policy.tokenizer, f"{p.question} {INSTRUCTION}"), args.max_new_tokens, args.temperature,
                seed=args.seed + 100 * i + j, stop_ids=policy.stop_ids)
        for i, p in enumerate(word_problems)
        for j in range(args.samples)
    ]


def longtail_rollout_config(cfg, requests, margin: int):
    """Batch buckets down to 1 for compaction; two length buckets sized for this workload."""
    longest = max(len(r.prompt_ids) for r in requests)
    prompt = -(-longest // 32) * 32
    full = -(-(prompt + max(r.max_new_tokens for r in requests) + margin) // 32) * 32
    return dataclasses.replace(
        cfg.rollout, batch_buckets=(1, 2, 4, 8, 16, 32, 64), prompt_buckets=(prompt,),
        length_buckets=(prompt + (full - prompt) // 2, full), warm_up=False,
    )


def check_completions(name: str, completions: list) -> list:
    """The completions, or a ValueError naming the first request the engine refused (its 'error' completion
    has no tokens: a timing with it would measure less work than asked for)."""
    for i, c in enumerate(completions):
        if c.finish_reason == "error":
            raise ValueError(f"[{name}] request {i} cannot run: {c.error}")
    return completions


def same_outputs(runs: list[dict]) -> bool | None:
    """Whether the runs gave the same outputs; None (not checked) for one run, which would be compared with itself."""
    return all(r["outputs"] == runs[0]["outputs"] for r in runs) if len(runs) > 1 else None


def time_at_or_below(timeline, live_batch: int) -> float:
    """Seconds of a rollout spent in program calls that started at live batch <= live_batch."""
    t_prev, total = 0.0, 0.0
    for e in timeline:
        total += (e["end_s"] - t_prev) * (e["live"] <= live_batch)
        t_prev = e["end_s"]
    return total


def run_longtail(modes, model, drafter, rollout_cfg, requests, repeats: int, drafter_accept: float) -> list[dict]:
    """`repeats` rollouts of the requests per mode (name, SpecConfig), each mode on its own engine, compiled and
    run once untimed before the clock starts. The modes take turns, one rollout each per round, so a machine that
    drifts (load, clocks) over the minutes of a benchmark weighs on every mode alike; each rollout has a fresh
    adaptive controller (a cold rollout, the conservative case). Returns per mode the median over its runs of
    seconds, tok/s and acceptance, each on its own, with every run's value (all_*); stats, timeline and outputs
    are the run of median seconds'. drafter_accept: the drafter's tokens per step as the engines assume them."""
    engines = {name: _longtail_engine(name, model, drafter, rollout_cfg, sd, requests, drafter_accept) for name, sd in modes}
    runs = {name: [] for name in engines}
    for _ in range(repeats):
        for name, (engine, _) in engines.items():
            engine.reset_controller()
            background, dropped = engine.pool.background_seconds, engine.pool.dropped
            out = check_completions(name, engine.generate(requests))
            s = engine.stats
            runs[name].append({
                "seconds": s.seconds["total"], "tokens": s.tokens, "stats": s.as_dict(),
                "timeline": [c._asdict() for c in engine.timeline], "outputs": [o.tokens for o in out],
                # programs dropped near vm.max_map_count and compiled again while this run decoded plainly
                "background_compile_s": engine.pool.background_seconds - background,
                "programs_dropped": engine.pool.dropped - dropped,
            })
            print(f"[{name}] {s.tokens} tokens in {s.seconds['total']:.1f}s"
                  + (f" ({s.seconds['compile']:.1f}s compiling)" if s.seconds["compile"] else ""), file=sys.stderr)
    return [_longtail_result(name, sd, *engines[name], runs[name]) for name, sd in modes]


def _longtail_engine(name, model, drafter, rollout_cfg, sd, requests, drafter_accept):
    """A mode's engine with every program the rollout can reach compiled, after its untimed first rollout; and
    the compile's seconds."""
    from fastrl_jax.rollout.engine import RolloutEngine, bucket_for

    engine = RolloutEngine(model, rollout_cfg, sd=sd, drafter=drafter if sd.mode != "off" else None, progress=False,
                           drafter_accept=drafter_accept)
    # All requests fit in the first table, which only shrinks; prefills skip the prompts' shared prefix (a chat
    # template's), prefilled once by its own program.
    buckets = rollout_cfg.batch_buckets
    first = bucket_for(min(len(requests), buckets[-1]), buckets)
    shared = engine.shared_prefix_len(requests)
    keys = [k for k in engine.warm_up_keys(shared) if k[1] <= first and (k[0] != "prefill" or k[1] == first)]
    t0 = time.perf_counter()
    engine.pool.warm_up(keys, progress=False)
    compile_s = time.perf_counter() - t0
    print(f"[{name}] {engine.pool_report()}; {compile_s:.0f}s", file=sys.stderr)
    first_rollout(name, engine, requests)
    return engine, compile_s


def _longtail_result(name, sd, engine, compile_s: float, runs: list[dict]) -> dict:
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return {"name": name, "sd": dataclasses.asdict(sd), **median,
            "seconds": float(np.median([r["seconds"] for r in runs])),
            "tok_s": float(np.median([r["tokens"] / r["seconds"] for r in runs])),
            "acceptance_length": float(np.median([r["stats"]["acceptance_length"] for r in runs])),
            "statistic": "seconds, tok_s, acceptance_length and seconds at the threshold: medians over the repeats, each "
                         "on its own; stats, timeline: the run of median seconds",
            "all_seconds": [r["seconds"] for r in runs], "all_tok_s": [r["tokens"] / r["seconds"] for r in runs],
            "all_acceptance_length": [r["stats"]["acceptance_length"] for r in runs],
            "all_runs": [{k: r[k] for k in ("background_compile_s", "programs_dropped")} for r in runs],
            "all_timelines": [r["timeline"] for r in runs], "start_seconds": compile_s, "programs": engine.pool_report(),
            "identical_across_repeats": same_outputs(runs), "untimed_first_rollout": True}


def first_rollout(name: str, engine, requests) -> None:
    """One untimed rollout of every request, after the warm-up compiled the programs: a program's first run
    pays one-time costs (tens of ms on CPU against a fraction of one later), and the adaptive bandit does not
    count a call that was one (its arm stays untried), so without it the first timed run is no repeat."""
    t0 = time.perf_counter()
    check_completions(name, engine.generate(requests))
    print(f"[{name}] untimed first rollout (every program's first run): {time.perf_counter() - t0:.1f}s", file=sys.stderr)


# ---- stream workload ---------------------------------------------------------------------------

STREAM_SEED = 2027  # problem stream of the stream workload


def stream_requests(policy, args):
    """args.requests math prompts, each with a max_new_tokens drawn from the long tail and no stop id,
    so the work is the same in every run."""
    from fastrl_jax.data.math_problems import problems
    from fastrl_jax.data.prompts import chat_prompt_ids
    from fastrl_jax.rollout.engine import Request

    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.rint(np.exp(rng.normal(np.log(114), 0.41, args.requests))), 8, args.max_new_tokens)
    texts = [f"{p.question} {INSTRUCTION}" for p in problems(STREAM_SEED, args.requests, levels=(1, 2, 3, 4, 5))]
    return [Request(chat_prompt_ids(policy.tokenizer, t), int(n), args.temperature, seed=args.seed + i)
            for i, (t, n) in enumerate(zip(texts, lengths))]


def stream_rollout_config(cfg, requests, batch: int, prompt_step: int = 32, batch_buckets=None):
    """Batch buckets (default: powers of two down to 1); packed prefills of prompt_step to 384 tokens by
    prompt_step (a refill's 4 prompts fill one pack of ~150); length buckets every 128 slots."""
    longest = max(len(r.prompt_ids) for r in requests)
    prompts = tuple(range(prompt_step, max(384, -(-longest // prompt_step) * prompt_step) + 1, prompt_step))
    full = -(-max(longest + max(r.max_new_tokens for r in requests), prompts[-1] + 1) // 128) * 128
    buckets = tuple(sorted({b for b in batch_buckets or (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < batch} | {batch}))
    return dataclasses.replace(cfg.rollout, batch_buckets=buckets, prompt_buckets=prompts,
                               length_buckets=tuple(range(128, full + 1, 128)), warm_up=False)


def stream_metrics(engine, seconds: float, batch: int) -> dict:
    """What a stream run measures, from the engine's stats and timeline."""
    s, calls = engine.stats, engine.timeline
    # Full batch: every row of the table emits a token per step (a plain step costs the same whatever
    # rows are live, so calls that started with the table full time it, also where rows finished in them).
    full = [c for c in calls if c.live == batch and not c.speculative]
    device = sum(c.seconds for c in calls)
    full_rate = sum(c.steps * batch for c in full) / sum(c.seconds for c in full) if full else float("nan")
    kv = [c.kv_len for c in calls]
    return {
        "seconds": seconds, "tokens": s.tokens, "tok_s": s.tokens / seconds, "full_batch_tok_s": full_rate,
        "stream_vs_full_batch": s.tokens / seconds / full_rate,
        # Requests of one token finish at their prefill: no decode call to average over.
        "mean_live_rows": sum(live_rows(c) * c.seconds for c in calls) / device if device else float("nan"),
        "prefill_share": s.seconds["prefill"] / seconds, "compile_share": s.seconds["compile"] / seconds,
        "decode_admit_share": s.seconds["decode_admit"] / seconds, "decode_admit_calls": s.calls["decode_admit"],
        "host_share": s.seconds["host"] / seconds, "bucket_moves": sum(a != b for a, b in zip(kv, kv[1:])),
        "idle_row_steps": s.idle_row_steps, "decode_calls": len(calls), "prefill_calls": s.calls["prefill"],
        "pack_padding": s.prompt_slots / s.prompt_tokens - 1,  # prefill packs' padding per prompt token
        "stats": s.as_dict(), "timeline": [c._asdict() for c in calls],
    }


def live_rows(call) -> float:
    """Mean rows decoding in a call: its tokens per step for plain decoding (rows that finished in
    the call stop counting), the rows live at its start for speculation."""
    return call.tokens / call.steps if call.steps and not call.speculative else call.live


STREAM_KEYS = ("tok_s", "full_batch_tok_s", "stream_vs_full_batch", "mean_live_rows", "prefill_share", "decode_admit_share",
               "compile_share", "host_share", "bucket_moves", "idle_row_steps", "prefill_calls", "pack_padding",
               "decode_admit_calls", "decode_calls")


def stream_engine(cfg, policy, args, requests):
    """The stream's engine with every program it can reach compiled and run once (an untimed first rollout)."""
    from fastrl_jax.config import SpecConfig
    from fastrl_jax.models.drafter_io import drafter_accept_prior, make_drafter
    from fastrl_jax.rollout.engine import RolloutEngine

    sd = dataclasses.replace(cfg.sd, mode=args.sd) if args.sd != "off" else SpecConfig()
    rollout_cfg = stream_rollout_config(cfg, requests, args.batch, args.prompt_step, args.batch_buckets)
    drafter = make_drafter(cfg, policy.cfg, args.drafter, cfg.model.engine_dtype) if sd.uses_drafter() else None
    # A random drafter accepts ~1 token per step: adaptive leaves its EAGLE arms out, as the trainer does.
    engine = RolloutEngine(policy.model, rollout_cfg, sd=sd, drafter=drafter, progress=False,
                           drafter_accept=drafter_accept_prior(args.drafter))
    t0 = time.perf_counter()
    shared = engine.shared_prefix_len(requests)  # every program the stream can reach, compiled first
    # (more requests than rows: only the full table prefills, it moves to smaller ones once the queue is empty)
    keys = [k for k in engine.warm_up_keys(shared)
            if k[0] not in ("prefill", "decode_admit") or k[1] == args.batch or len(requests) < args.batch]
    engine.pool.warm_up(keys, progress=True)
    print(f"[stream] {engine.pool_report()}; {time.perf_counter() - t0:.0f}s; {len(requests)} requests, "
          f"batch {args.batch}, refill {rollout_cfg.refill_rows} rows, shared prompt prefix {shared} tokens, "
          f"length buckets {rollout_cfg.length_buckets}",
          file=sys.stderr)
    first_rollout("stream", engine, requests)
    return engine, sd, rollout_cfg


def stream_runs(engine, requests, args) -> list[dict]:
    """--repeats timed streams, each with a fresh adaptive controller."""
    runs = []
    for r in range(args.repeats):
        engine.reset_controller()
        t0 = time.perf_counter()
        out = engine.generate(requests)
        seconds = time.perf_counter() - t0
        outputs = [o.tokens for o in check_completions("stream", out)]
        runs.append(stream_metrics(engine, seconds, args.batch) | {"outputs": outputs})
        print(f"[stream] run {r + 1}: {runs[-1]['tok_s']:.1f} tok/s, {runs[-1]['stream_vs_full_batch']:.2f} of full batch",
              file=sys.stderr)
    return runs


def stream_summary(cfg, args, runs: list[dict], requests, sd, rollout_cfg) -> dict:
    """Each metric's median over the runs (one run's figures need not be the medians of the others), every
    run's value, and what was run."""
    return ({k: float(np.median([m[k] for m in runs])) for k in STREAM_KEYS}
            | {"statistic": f"median over {len(runs)} runs of each metric; by_run: every run's",
               "by_run": {k: [m[k] for m in runs] for k in STREAM_KEYS}, "runs_tok_s": [m["tok_s"] for m in runs],
               "identical_across_runs": same_outputs(runs), "untimed_first_rollout": True,
               "requests": len(requests), "batch": args.batch, "sd": sd.mode, "repeats": args.repeats, "seed": args.seed,
               "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "dtype": cfg.model.engine_dtype,
               "model": cfg.model.path, "drafter": (args.drafter or "random") if sd.uses_drafter() else None,
               "rollout": dataclasses.asdict(rollout_cfg)})


def bench_stream(args) -> int:
    from fastrl_jax import files
    from fastrl_jax.config import load_config
    from fastrl_jax.machine import facts_after, format_machine, machine_facts

    cfg = load_config(args.config, args.set)
    policy = load_smollm2(cfg)
    requests = stream_requests(policy, args)
    facts = machine_facts()  # before the runs: after them the load average is the benchmark's own
    engine, sd, rollout_cfg = stream_engine(cfg, policy, args, requests)
    runs = stream_runs(engine, requests, args)
    summary = stream_summary(cfg, args, runs, requests, sd, rollout_cfg) | {"machine": facts_after(facts)}
    files.write_json(args.out, {"summary": summary, "runs": [{k: v for k, v in m.items() if k != "outputs"} for m in runs]},
                     indent=1)
    print(f"machine: {format_machine(summary['machine'])}")
    print(f"{len(requests)} requests (new tokens p50 {np.median([r.max_new_tokens for r in requests]):.0f}, max "
          f"{max(r.max_new_tokens for r in requests)}), batch {args.batch}, sd {sd.mode}; each metric the median of "
          f"{args.repeats} runs, after an untimed first rollout")
    for k in STREAM_KEYS:
        print(f"  {k:<22} {summary[k]:.3f}  {[round(x, 3) for x in summary['by_run'][k]]}")
    identical = summary["identical_across_runs"]
    print(f"  outputs identical across runs: {'- (one run)' if identical is None else identical}")
    median = sorted(runs, key=lambda m: m["seconds"])[len(runs) // 2]  # a timeline is one run's: the median by seconds
    if plot_stream(median, args.batch, args.plot):
        print(f"timeline plot (the run of median seconds): {args.plot}")
    return 0 if identical is not False else 1


def plot_stream(run: dict, batch: int, path: str) -> bool:
    from fastrl_jax.plotting import pyplot, save

    if (plt := pyplot()) is None:
        return False

    calls = run["timeline"]
    t = np.array([0.0] + [c["end_s"] for c in calls])
    fig, (ax_b, ax_t) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    ax_b.stairs([c["live"] for c in calls], t, baseline=None, label="live rows")
    ax_b.stairs([c["kv_len"] / 16 for c in calls], t, baseline=None, label="length bucket / 16")
    ax_b.axhline(batch, color="gray", ls=":", lw=1)
    ax_b.legend()
    ax_t.stairs([c["tokens"] / max(c["seconds"], 1e-9) for c in calls], t, baseline=None, label="decode tok/s (device)")
    ax_t.axhline(run["full_batch_tok_s"], color="gray", ls=":", lw=1, label="full-batch rate")
    ax_t.set_ylabel("tokens/s")
    ax_t.set_xlabel("seconds")
    ax_t.legend()
    fig.suptitle(f"stream: {run['tok_s']:.0f} tok/s = {run['stream_vs_full_batch']:.2f} of full batch; "
                 f"prefill {run['prefill_share']:.0%} of the time; mean live rows {run['mean_live_rows']:.1f}")
    fig.tight_layout()
    save(fig, path)
    return True


def plot_timelines(runs, threshold: int, title: str, path: str) -> bool:
    from fastrl_jax.plotting import pyplot, save

    if (plt := pyplot()) is None:
        return False

    fig, (ax_b, ax_t, ax_s) = plt.subplots(3, 1, figsize=(11, 8), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 3, 1.4]})
    for run in runs:
        t = np.array([0.0] + [e["end_s"] for e in run["timeline"]])
        live = [e["live"] for e in run["timeline"]]
        rate = [e["tokens"] / max(t1 - t0, 1e-9) for e, t0, t1 in zip(run["timeline"], t[:-1], t[1:])]
        ax_b.stairs(live, t, baseline=None, label=f"{run['name']} ({run['seconds']:.0f}s)", lw=1.5)
        ax_t.stairs(rate, t, baseline=None, label=run["name"], alpha=0.8)
    ax_b.axhline(threshold, color="gray", ls=":", lw=1)
    ax_b.set_ylabel("live batch")
    ax_b.set_yscale("log", base=2)
    ax_b.legend()
    ax_t.set_ylabel("tokens/s")
    adaptive = runs[-1]
    labels = sorted({e["strategy"] for e in adaptive["timeline"] if e["speculative"]})
    colors = dict(zip(labels, plt.cm.tab10.colors))
    t_prev = 0.0
    for e in adaptive["timeline"]:
        ax_s.axvspan(t_prev, e["end_s"], color=colors[e["strategy"]] if e["speculative"] else "lightgray", lw=0)
        t_prev = e["end_s"]
    handles = [plt.Rectangle((0, 0), 1, 1, color="lightgray")] + [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in labels]
    ax_s.legend(handles, ["plain"] + [f"SD {k}" for k in labels], ncol=len(handles), loc="upper left", fontsize=8)
    ax_s.set_yticks([])
    ax_s.set_ylabel(adaptive["name"])
    ax_s.set_xlabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)
    return True


def bench_longtail(args) -> int:
    import jax

    from fastrl_jax import files
    from fastrl_jax.config import SpecConfig, StrategySpec, load_config
    from fastrl_jax.machine import facts_after, machine_facts
    from fastrl_jax.models.drafter_io import drafter_accept_prior, make_drafter

    cfg = load_config(args.config, args.set)
    policy = load_smollm2(cfg)
    drafter = make_drafter(cfg, policy.cfg, args.drafter, cfg.model.engine_dtype)
    drafter_name = args.drafter or "random"
    requests = longtail_requests(policy, args)
    adaptive_sd = dataclasses.replace(cfg.sd, mode="adaptive")
    on_specs = [StrategySpec.from_config(s, "--on-strategies") for s in args.on_strategies or adaptive_sd.strategy_list()]
    margin = max(s.nodes() for s in [*adaptive_sd.strategy_list(), *on_specs]) - 1
    rollout_cfg = longtail_rollout_config(cfg, requests, margin)
    print(f"{len(requests)} requests, T={args.temperature}, max {args.max_new_tokens} new tokens; "
          f"batch buckets {rollout_cfg.batch_buckets}, length buckets {rollout_cfg.length_buckets}; "
          f"drafter {drafter_name}; {args.repeats} runs each", file=sys.stderr)

    modes = [("plain", SpecConfig()), *[(f"on {spec}", dataclasses.replace(cfg.sd, mode="on", strategies=(spec,)))
                                         for spec in on_specs], ("adaptive", adaptive_sd)]
    facts = machine_facts()  # before the runs: after them the load average is the benchmark's own
    runs = run_longtail(modes, policy.model, drafter, rollout_cfg, requests, args.repeats,
                        drafter_accept_prior(args.drafter))
    plain, *on_runs, adaptive = runs
    summary = longtail_summary(args, runs, adaptive_sd.threshold_live_batch, drafter_name)
    # float32: every run's tokens must equal plain decoding's; bfloat16 equals it up to near-ties of the top two
    # logits, which the verify forward's rounding settles its own way (docs/measurements.md): counted, not required
    summary["dtype"], summary["identical_required"] = cfg.model.engine_dtype, cfg.model.engine_dtype == "float32"
    summary |= {"model": cfg.model.path, "seed": args.seed, "problems": args.problems, "samples": args.samples,
                "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "untimed_first_rollout": True,
                "modes_take_turns": True}
    summary["machine"] = facts_after(facts)
    summary["backend"] = jax.default_backend()
    summary |= {"rollout": dataclasses.asdict(rollout_cfg), "sd": dataclasses.asdict(adaptive_sd)}
    # The measurement first, whole or not at all: the printout and the plot after it may fail.
    files.write_json(args.out, {"summary": summary, "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]},
                     indent=1)
    print_longtail(summary, runs)
    # Two lines: a drafter path after the workload ran past the figure's edge.
    title = f"{cfg.model.path} rollout on {summary['backend']}: {summary['workload']}\ndrafter {drafter_name}"
    best_on = min(on_runs, key=lambda r: r["seconds"]) if on_runs else None
    if plot_timelines([r for r in (plain, best_on, adaptive) if r is not None], adaptive_sd.threshold_live_batch, title,
                      args.plot):
        print(f"timeline plot: {args.plot}")
    repeatable = all(r["identical_across_repeats"] is not False for r in runs)
    identical = all(r["identical_to_plain"] == len(requests) for r in runs)
    if not identical and not summary["identical_required"]:
        print(f"{summary['dtype']}: outputs equal plain decoding's up to near-ties (the identical column counts them)")
    return 0 if repeatable and (identical or not summary["identical_required"]) else 1


def longtail_summary(args, runs, k: int, drafter_name: str) -> dict:
    """Speedups, tail shares and acceptance by source of the runs (plain first, adaptive last); adds
    each run's comparison with plain to the run."""
    plain, adaptive = runs[0], runs[-1]

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")  # a rollout may never get down to the threshold

    def tail_seconds(run) -> float:  # median over the repeats' timelines
        return float(np.median([time_at_or_below(t, k) for t in run.get("all_timelines", [run["timeline"]])]))

    plain_tail = tail_seconds(plain)
    for run in runs:
        run["speedup"] = plain["seconds"] / run["seconds"]
        run["identical_to_plain"] = sum(a == b for a, b in zip(run["outputs"], plain["outputs"]))
        run[f"seconds_at_live_batch_le_{k}"] = tail_seconds(run)
        run[f"speedup_at_live_batch_le_{k}"] = ratio(plain_tail, run[f"seconds_at_live_batch_le_{k}"])
    lengths = np.array([len(o) for o in plain["outputs"]])
    best_on = min(runs[1:-1], key=lambda r: r["seconds"]) if len(runs) > 2 else None
    return {
        "workload": f"{args.problems} math word problems x {args.samples} samples, T={args.temperature}, "
                    f"max {args.max_new_tokens} new tokens",
        "drafter": drafter_name, "repeats": args.repeats,
        "statistic": "each run's seconds, tok/s, acceptance and seconds at the threshold: medians over the repeats",
        "response_tokens": {"p50": float(np.percentile(lengths, 50)), "p90": float(np.percentile(lengths, 90)),
                            "max": int(lengths.max()), "at_limit": int((lengths >= args.max_new_tokens).sum())},
        "threshold_live_batch": k, f"plain_share_at_live_batch_le_{k}": ratio(plain_tail, plain["seconds"]),
        "best_on": best_on["name"] if best_on else None, "adaptive_vs_plain": adaptive["speedup"],
        "adaptive_vs_best_on": best_on["seconds"] / adaptive["seconds"] if best_on else None,
        f"adaptive_speedup_at_live_batch_le_{k}": adaptive[f"speedup_at_live_batch_le_{k}"],
        "acceptance": {r["name"]: r.get("acceptance_length", r["stats"]["acceptance_length"]) for r in runs[1:]},
        "drafts_per_step": {r["name"]: r["stats"]["drafts_per_step"] for r in runs[1:]},
    }


def print_longtail(summary: dict, runs: list[dict]) -> None:
    from fastrl_jax.machine import format_machine

    k = summary["threshold_live_batch"]
    n = len(runs[0]["outputs"])
    print(f"machine: {format_machine(summary['machine'])}")
    print(f"\n{summary['workload']}; drafter {summary['drafter']}; response tokens p50 {summary['response_tokens']['p50']:.0f}"
          f" p90 {summary['response_tokens']['p90']:.0f} max {summary['response_tokens']['max']}; median of {summary['repeats']}")
    print(f"{'run':>16} {'seconds':>8} {'tok/s':>7} {'speedup':>8} {'s@<=' + str(k):>7} {'x@<=' + str(k):>7}"
          f" {'accept':>7} {'eagle':>6} {'hist':>6} {'identical':>10}")
    for run in runs:
        st = run["stats"]
        src = st["drafts_per_step"]
        print(f"{run['name']:>16} {run['seconds']:>8.1f} {run['tok_s']:>7.1f} {run['speedup']:>7.2f}x "
              f"{run[f'seconds_at_live_batch_le_{k}']:>7.1f} {run[f'speedup_at_live_batch_le_{k}']:>6.2f}x "
              f"{run.get('acceptance_length', st['acceptance_length']):>7.2f} {src['eagle']:>6.2f} {src['history']:>6.2f} {run['identical_to_plain']:>4}/{n}"
              + (", its repeats differ" if run["identical_across_repeats"] is False else ""))
    print(f"plain spends {summary[f'plain_share_at_live_batch_le_{k}']:.0%} of its time at live batch <= {k}; "
          f"adaptive is {summary['adaptive_vs_plain']:.2f}x plain "
          f"({summary[f'adaptive_speedup_at_live_batch_le_{k}']:.2f}x inside that share)")
    for run in runs:
        if recompiled := [round(r["background_compile_s"], 1) for r in run.get("all_runs", []) if r["background_compile_s"]]:
            print(f"{run['name']}: programs compiled in the background during timed runs ({recompiled} s; dropped near "
                  "vm.max_map_count, see README), decoding plainly meanwhile: `sysctl -w vm.max_map_count=262144`")
    s = runs[-1]["stats"]
    print("adaptive: steps plain {}, SD {}; acceptance by strategy {}; seconds {}".format(
        s["steps_plain"], s["steps_sd"], {k2: round(v, 2) for k2, v in s["acceptance_by_strategy"].items()},
        {k2: round(v, 1) for k2, v in s["seconds"].items()}))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["throughput", "longtail", "stream"], default="throughput")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int,
                        help="timed runs of each cell (throughput: the best is kept, default 2; longtail and stream: "
                             "each figure is the median over the runs, an odd count, default 3)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="bench_rollout.json")
    parser.add_argument("--config", default="configs/smollm2_cpu.yaml",
                        help="its model section is the policy; its sd section drives adaptive (longtail)")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. sd.threshold_live_batch=4")
    longtail = parser.add_argument_group("longtail")
    longtail.add_argument("--drafter", help="drafter checkpoint directory (save_drafter); a random drafter when omitted")
    longtail.add_argument("--on-strategies", nargs="*", metavar="SPEC",
                          help="always-on strategies to run, e.g. 3/1/4 h8 3/1/4+h8 (default: the config's sd strategies)")
    longtail.add_argument("--problems", type=int, default=16)
    longtail.add_argument("--samples", type=int, default=4)
    longtail.add_argument("--temperature", type=float, default=0.7)
    longtail.add_argument("--max-new-tokens", type=int, default=512)
    longtail.add_argument("--seed", type=int, default=0)
    longtail.add_argument("--plot", help="timeline PNG (default: --out with .png)")
    stream = parser.add_argument_group("stream")
    stream.add_argument("--requests", type=int, default=512)
    stream.add_argument("--batch", type=int, default=64, help="rows of the table")
    stream.add_argument("--sd", choices=["off", "adaptive"], default="off", help="speculation in the stream's tail")
    stream.add_argument("--prompt-step", type=int, default=32, help="prompt (pack) buckets every this many tokens")
    stream.add_argument("--batch-buckets", type=int, nargs="+", help="table sizes (default: powers of two up to --batch)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("--batch-sizes", "--new-tokens", "--problems", "--samples", "--max-new-tokens", "--requests", "--batch",
                 "--prompt-step", "--batch-buckets"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and min(value if isinstance(value, list) else [value]) < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.repeats is None:
        args.repeats = 2 if args.workload == "throughput" else 3
    if args.repeats < 1 or args.workload != "throughput" and args.repeats % 2 == 0:
        parser.error(f"--repeats {args.repeats}: {args.workload} reports medians over the runs: use an odd count")
    from fastrl_jax.cli import check_output_file

    try:  # before loading anything: a path that cannot be written would lose minutes of rollouts
        args.out = str(check_output_file(args.out, "--out"))
        if args.workload != "throughput":  # the one without a plot
            args.plot = str(check_output_file(args.plot or str(Path(args.out).with_suffix(".png")), "--plot"))
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if args.workload == "longtail":
        return bench_longtail(args)
    if args.workload == "stream":
        return bench_stream(args)
    return bench_throughput(args)


def bench_throughput(args) -> int:
    """Plain decoding tok/s per batch size against HF transformers and the batch-1 memory floor."""
    import jax
    from flax import nnx

    from fastrl_jax import files
    from fastrl_jax.config import load_config
    from fastrl_jax.data.prompts import chat_prompt_ids
    from fastrl_jax.machine import format_machine, machine_facts

    cfg = load_config(args.config, args.set)
    policy = load_smollm2(cfg)
    model, tokenizer = policy.model, policy.tokenizer
    dtype = cfg.model.engine_dtype
    prompt_ids = [chat_prompt_ids(tokenizer, q) for q in make_prompts(64)]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    facts = machine_facts()
    print(f"machine: {format_machine(facts)}", file=sys.stderr)
    bandwidth = facts.get("device_copy_gbs", facts["copy_gbs"])  # a GPU's HBM, not its host's memory
    floor = bandwidth * 1e9 / weight_bytes

    print(f"{cfg.model.path} {dtype} ({weight_bytes / 1e6:.0f} MB), {args.new_tokens} new tokens, greedy", file=sys.stderr)
    ours, compile_s, pool_report = bench_engine(model, prompt_ids, args.batch_sizes, args.new_tokens, args.repeats,
                                                base=cfg.rollout)  # --set rollout.* is timed
    if args.skip_hf:
        hf = {}
    else:
        from fastrl_jax.models.torch_reference import torch_model

        hf = bench_hf(torch_model(policy.path), prompt_ids, args.batch_sizes, args.new_tokens, args.repeats,
                      tokenizer.pad_token_id or 0)
    rows = []
    for b in args.batch_sizes:
        row = {"batch": b, "fastrl_tok_s": ours[b][0]}
        if hf:
            row["hf_tok_s"] = hf[b][0]
            row["ratio"] = ours[b][0] / hf[b][0]
            row["same_tokens"] = sum(r.tokens == h for r, h in zip(ours[b][1], hf[b][1]))
        if b == 1:
            row["floor_fraction"] = ours[b][0] / floor
        rows.append(row)
    result = {
        "model": f"{cfg.model.path} {dtype}", "new_tokens": args.new_tokens, "backend": jax.default_backend(),
        "weight_bytes": weight_bytes, "copy_bandwidth_gbs": bandwidth, "batch1_floor_tok_s": floor,
        "engine_start_seconds": compile_s, "programs": pool_report, "rows": rows, "machine": facts,
        "rollout": dataclasses.asdict(cfg.rollout),
    }
    print(f"{'batch':>6} {'fastrl tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'same':>5}")
    for r in rows:
        print(f"{r['batch']:>6} {r['fastrl_tok_s']:>13.1f} {r.get('hf_tok_s', float('nan')):>9.1f} "
              f"{r.get('ratio', float('nan')):>6.2f} {str(r.get('same_tokens', '-')) + '/' + str(r['batch']):>5}")
    reached = [f"; reached {r['floor_fraction']:.0%}" for r in rows if "floor_fraction" in r]
    print(f"batch-1 floor {floor:.1f} tok/s ({bandwidth:.1f} GB/s copy){''.join(reached)}; engine start {compile_s:.1f}s "
          f"({pool_report})")
    files.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
