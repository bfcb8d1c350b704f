"""Where a SmolLM2-shaped decode step spends its time on XLA CPU: the engine's stacked layers under
lax.scan against per-layer weight and cache buffers in an unrolled loop. Prints a table, writes JSON.

    python scripts/profile_decode.py --batch 1 16 64 --out profile_decode.json

Both layouts run the same decoder layer (fastrl_jax.models.decoder._layer) over random float32
weights of SmolLM2-135M's shapes, one greedy token per step; the cache holds --slots slots, of which
attention reads the first --kv-len (the engine's length-bucket window). With --ops, XLA's own
trace of each step is summed per source operation (the einsum / slice that produced each
compiled op), summed over both CPU threads, so it can exceed the wall time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fastrl_jax import files
from fastrl_jax.cli import check_output_file
from fastrl_jax.machine import machine_facts
from fastrl_jax.models import decoder as D
from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.known_configs import KNOWN


def stacked_step(cfg: ModelConfig, graphdef, kv_len: int):
    """The engine's forward: stacked layer weights and cache, lax.scan over layers."""

    def step(state, cache, token, start):
        logits, _, cache = nnx.merge(graphdef, state)(token[:, None], start[:, None], cache, start, kv_len=kv_len)
        return jnp.argmax(logits[:, 0], -1), cache

    return step


def per_layer_step(cfg: ModelConfig, kv_len: int):
    """The same layers unrolled in Python over per-layer weight and cache buffers."""

    def step(weights, cache, token, start):
        cos, sin = D.rope_tables(cfg, start[:, None])
        mask = D.attention_mask(start, None, 1, kv_len)
        x, new = weights["embed"][token[:, None]], []
        for p, k, v in zip(weights["layers"], *cache):
            x, kv = D._layer(cfg, p, x, k[:, :, :kv_len], v[:, :, :kv_len], cos, sin, start, mask)
            new.append(kv)

        def write_row(b, cache):
            def put(c, n):
                return jax.lax.dynamic_update_slice(c, jax.lax.dynamic_slice_in_dim(n, b, 1, 0), (b, 0, start[b], 0))

            return tuple(tuple(put(c, n[i]) for c, n in zip(cache[i], new)) for i in range(2))

        cache = jax.lax.fori_loop(0, token.shape[0], write_row, cache)
        logits = D.head_logits(D.rms_norm(x, weights["final_norm"], cfg.rms_norm_eps), weights["embed"])
        return jnp.argmax(logits[:, 0], -1), cache

    return step


def op_seconds(compiled, trace_dir: Path, steps: int) -> dict[str, float]:
    """Seconds per step of each source operation, from XLA's trace and the optimized HLO's metadata."""
    source = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s+%([\w.\-]+) = .*op_name=\"([^\"]*)\"", line)
        if m:
            parts = m.group(2).split("/")
            source[m.group(1)] = parts[-2] if len(parts) > 1 else parts[-1]
    trace = next(trace_dir.rglob("*.json.gz"))
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in source:
            total[source[e["name"]]] += e["dur"] / 1e6 / steps
    return dict(total.most_common())


def run(cfg: ModelConfig, layout: str, batch: int, slots: int, kv_len: int, steps: int, ops: bool) -> dict:
    model = D.Decoder(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    cache = D.KVCache.zeros(cfg, batch, slots)
    if layout == "stacked":
        fn, weights = stacked_step(cfg, graphdef, kv_len), state
    else:
        stacked = nnx.to_pure_dict(nnx.state(model.layers))
        layers = [jax.tree.map(lambda a: a[i], stacked) for i in range(cfg.num_layers)]
        weights = {"embed": model.embed[...], "final_norm": model.final_norm[...], "layers": layers}
        cache = tuple(tuple(c[i] for i in range(cfg.num_layers)) for c in (cache.k, cache.v))
        fn = per_layer_step(cfg, kv_len)
    token = jnp.ones(batch, jnp.int32)
    start = jnp.full(batch, kv_len // 2, jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=(1,)).lower(weights, cache, token, start).compile()
    compile_s = time.perf_counter() - t0
    out, cache = compiled(weights, cache, token, start)
    out.block_until_ready()  # dispatch is asynchronous: the first timed step must not wait for this call
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out, cache = compiled(weights, cache, token, start)
        out.block_until_ready()
        times.append(time.perf_counter() - t0)
    row = {"layout": layout, "batch": batch, "slots": slots, "kv_len": kv_len,
           "step_ms": 1e3 * float(np.median(times)), "compile_s": compile_s}
    if ops:
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(steps):
                    out, cache = compiled(weights, cache, token, start)
                    out.block_until_ready()
            row["op_ms"] = {k: 1e3 * v for k, v in op_seconds(compiled, Path(d), steps).items()}
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--slots", type=int, nargs="+", default=[192, 640], help="cache slots per row")
    parser.add_argument("--kv-len", type=int, default=192, help="slots attention reads (the length bucket)")
    parser.add_argument("--layouts", nargs="+", choices=["stacked", "per-layer"], default=["stacked", "per-layer"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ops", type=int, default=0, help="print the N costliest source operations of each run")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if min(args.slots) < args.kv_len or min(args.batch + args.slots + [args.kv_len, args.steps]) < 1:
        parser.error(f"--slots {min(args.slots)} below --kv-len {args.kv_len} (attention reads that many slots), "
                     f"or a size below 1")
    if args.out:
        try:  # before the runs: a path that cannot be written would lose them all
            check_output_file(args.out, "--out")
        except (OSError, ValueError) as e:
            parser.error(str(e))

    cfg = ModelConfig.from_hf_dict(KNOWN["smollm2-135m"])
    rows = []
    print(f"{'layout':>9} {'batch':>5} {'slots':>5} {'kv_len':>6} {'ms/step':>8} {'compile s':>9}")
    for b in args.batch:
        for s in args.slots:
            for layout in args.layouts:
                r = run(cfg, layout, b, s, args.kv_len, args.steps, args.ops > 0)
                rows.append(r)
                print(f"{layout:>9} {b:>5} {s:>5} {args.kv_len:>6} {r['step_ms']:>8.1f} {r['compile_s']:>9.1f}", flush=True)
                for name, ms in list(r.get("op_ms", {}).items())[: args.ops]:
                    print(f"{'':>20} {ms:8.2f} ms  {name}")
    if args.out:
        files.write_json(args.out, {"jax": jax.__version__, "machine": machine_facts(), "rows": rows})


if __name__ == "__main__":
    main()
