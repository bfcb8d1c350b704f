"""Rollout throughput: fastrl-jax's engine vs HF transformers `generate`, side by side in one run.

SmolLM2-135M float32, the same chat prompts, greedy, a fixed number of new tokens (no early
stop, so both do the same work), batch sizes 1, 16, 64. Prints a table and writes JSON.

    python scripts/bench_rollout.py --out bench_rollout.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

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


def copy_bandwidth_gbs(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Measured memory copy bandwidth (read + write counted once, as a decode step reads weights once)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def bench_engine(model, prompt_ids, batch_sizes, new_tokens, repeats):
    from fastrl_jax.config import RolloutConfig
    from fastrl_jax.rollout.engine import Request, RolloutEngine

    longest = max(len(p) for p in prompt_ids)
    prompt_bucket = -(-longest // 32) * 32
    cfg = RolloutConfig(
        batch_buckets=tuple(batch_sizes),
        prompt_buckets=(prompt_bucket,),
        length_buckets=tuple(prompt_bucket + k for k in (new_tokens // 2, new_tokens)),
        steps_per_call=new_tokens,
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


def bench_hf(gguf_path, prompt_ids, batch_sizes, new_tokens, repeats, pad_id):
    import torch

    from fastrl_jax.models.torch_reference import torch_model

    hf = torch_model(gguf_path)
    hf.generation_config.eos_token_id = None  # never stop early: the engine runs without stop ids too
    out = {}
    for b in batch_sizes:
        rows = [prompt_ids[i % len(prompt_ids)] for i in range(b)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        kwargs = dict(
            attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
            pad_token_id=pad_id,
        )
        with torch.no_grad():
            hf.generate(ids, **kwargs)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                gen = hf.generate(ids, **kwargs)
                times.append(time.perf_counter() - t0)
        out[b] = (b * new_tokens / min(times), gen[:, width:].tolist())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="bench_rollout.json")
    args = parser.parse_args(argv)

    import jax

    from fastrl_jax.models.hub import smollm2_gguf_path
    from fastrl_jax.models.loading import load_model
    from fastrl_jax.models.tokenizer import chat_prompt_ids, load_tokenizer

    path = smollm2_gguf_path()
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    model, model_cfg = load_model(path, mesh, "float32")
    tokenizer = load_tokenizer(path)
    prompt_ids = [chat_prompt_ids(tokenizer, q) for q in make_prompts(64)]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(__import__("flax").nnx.state(model)))
    bandwidth = copy_bandwidth_gbs()
    floor = bandwidth * 1e9 / weight_bytes

    print(f"SmolLM2-135M float32 ({weight_bytes / 1e6:.0f} MB), {args.new_tokens} new tokens, greedy", file=sys.stderr)
    ours, compile_s, pool_report = bench_engine(model, prompt_ids, args.batch_sizes, args.new_tokens, args.repeats)
    hf = {} if args.skip_hf else bench_hf(path, prompt_ids, args.batch_sizes, args.new_tokens, args.repeats,
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
        "model": "SmolLM2-135M-Instruct float32", "new_tokens": args.new_tokens, "backend": jax.default_backend(),
        "weight_bytes": weight_bytes, "copy_bandwidth_gbs": bandwidth, "batch1_floor_tok_s": floor,
        "engine_start_seconds": compile_s, "programs": pool_report, "rows": rows,
    }
    print(f"{'batch':>6} {'fastrl tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'same':>5}")
    for r in rows:
        print(f"{r['batch']:>6} {r['fastrl_tok_s']:>13.1f} {r.get('hf_tok_s', float('nan')):>9.1f} "
              f"{r.get('ratio', float('nan')):>6.2f} {str(r.get('same_tokens', '-')) + '/' + str(r['batch']):>5}")
    print(f"batch-1 floor {floor:.1f} tok/s ({bandwidth:.1f} GB/s copy); reached {rows[0].get('floor_fraction', 0):.0%}"
          f"; engine start {compile_s:.1f}s ({pool_report})")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
