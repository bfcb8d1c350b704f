"""The bucketed speculative-decoding benchmark: plain vs SD tokens/s per prompt set, batch size,
strategy, temperature and draft vocabulary, on the same prompts in one run; and a per-phase profile
of one speculative step.

Plain and speculative decoding produce the same tokens (greedy, and coupled sampling at T > 0 with
the same seeds), so both do the same work and tokens/s compare directly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fastrl_jax.config import RolloutConfig, SpecConfig, StrategySpec
from fastrl_jax.models.decoder import Decoder, KVCache, unstack_layers
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.plotting import pyplot, save
from fastrl_jax.rollout import accept as accept_lib
from fastrl_jax.rollout import speculative
from fastrl_jax.rollout.engine import Request, RolloutEngine
from fastrl_jax.rollout.history import HistoryStore
from fastrl_jax.rollout.programs import Slots
from fastrl_jax.rollout.sampling import SamplingParams
from fastrl_jax.rollout.stats import RolloutStats


def with_full_vocab(drafter: Drafter) -> Drafter:
    """The same drafter weights scoring the whole vocabulary."""
    if drafter.draft_vocab is None:
        return drafter
    full = nnx.eval_shape(lambda: Drafter(drafter.cfg, nnx.Rngs(0), drafter.fc[...].dtype, kind=drafter.kind,
                                          layers=drafter.feature_layers))
    graphdef, state = nnx.split(full)
    nnx.replace_by_pure_dict(state, nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
    return nnx.merge(graphdef, state)


def bench_cfg(base: RolloutConfig, batch_sizes, prompt_len: int, new_tokens: int, margin: int) -> RolloutConfig:
    """`base` with one prompt and one length bucket that hold prompt_len + new_tokens + margin (tree slots), no warm-up."""
    prompt_bucket = -(-prompt_len // 32) * 32
    length = -(-(prompt_bucket + new_tokens + margin) // 64) * 64
    return dataclasses.replace(
        base, batch_buckets=tuple(sorted(set(batch_sizes))), prompt_buckets=(prompt_bucket,),
        length_buckets=(length,), steps_per_call=new_tokens, warm_up=False,
    )


def _timed(engine: RolloutEngine, rounds: list[list[Request]], repeats: int) -> tuple[float, list, RolloutStats]:
    """Tokens/s over the rounds (one generate call each), their completions, and their summed
    stats, from the fastest of `repeats` runs after a compiling one. Each run starts with an empty
    history that every round's completions join (as an RL step's would), when the engine keeps one."""

    def run():
        if engine.history is not None:
            engine.history = HistoryStore(engine.history.tokens_per_prompt, engine.history.max_prompts)
        t0, out, totals = time.perf_counter(), [], RolloutStats()
        for reqs in rounds:
            done = engine.generate(reqs)
            if failed := next((c.error for c in done if c.finish_reason == "error"), None):
                raise ValueError(f"bench-sd: a request cannot run: {failed}")  # not a timing of 0 tokens
            if engine.history is not None:
                engine.history.add_all((r.prompt_ids, c.tokens) for r, c in zip(reqs, done))
            out += done
            totals += engine.stats
        return time.perf_counter() - t0, out, totals

    run()  # compiles what these batches reach
    best, out, stats = float("inf"), None, RolloutStats()
    for _ in range(repeats):
        seconds, completions, totals = run()
        if seconds < best:
            best, out, stats = seconds, completions, totals
    tokens = sum(len(o.tokens) for o in out)
    return tokens / best, out, stats


def run_bench(policy: Decoder, drafter: Drafter | None, prompt_sets: dict[str, Sequence[Sequence[int]]], stop_ids: Sequence[int], *,
              base_cfg: RolloutConfig, batch_sizes: Sequence[int], strategies: Sequence[StrategySpec],
              temperatures: Sequence[float], vocabs: Sequence[str] | None, new_tokens: int, repeats: int,
              samples_per_prompt: int = 1, sd: SpecConfig = SpecConfig(), log=print,
              completions: dict | None = None, row_done=lambda rows: None) -> list[dict]:
    """Rows {prompts, temperature, batch, strategy, vocab, plain_tok_s, sd_tok_s, acceptance_length,
    drafts_per_step, speedup, same_tokens, requests}: one per prompt set and cell. Sets are timed apart
    because the drafter's acceptance, and so the speedup, depends on the kind of text (math answers vs
    chat). samples_per_prompt > 1 asks each prompt that many times (other seeds) one after another, as
    an RL group: history strategies ('hD') draft from the earlier samples. vocabs None: the drafter's
    reduced draft vocabulary (when it has one) and the full one. sd: the accept rule and history settings
    (its mode and strategies are each cell's). With sd.accept 'rejection', sampled rows are exact in
    distribution only, so same_tokens counts fewer at T > 0. completions, when given, receives each row's
    (plain, SD) completions under the row's index; row_done(rows) is called with the rows so far after each."""
    empty = [name for name, prompts in prompt_sets.items() if not prompts]
    if empty or not prompt_sets:
        raise ValueError(f"bench-sd: no prompts to time in {empty or 'any set'}")
    margin = max(s.nodes() for s in strategies)
    longest = max(len(p) for prompts in prompt_sets.values() for p in prompts)
    cfg = bench_cfg(base_cfg, batch_sizes, longest, new_tokens, margin)
    if any(s.parts()[0] for s in strategies) and drafter is None:
        raise ValueError("EAGLE strategies (S/K/V) need a drafter: --drafter DIR")
    drafters = {"reduced": drafter, "full": with_full_vocab(drafter) if drafter is not None else None}
    if vocabs is None:
        vocabs = ["full"] if drafter is not None and drafter.draft_vocab is None else ["reduced", "full"]
    if "reduced" in vocabs and drafter is not None and drafter.draft_vocab is None:
        raise ValueError("--vocab reduced needs a drafter trained with a draft vocabulary (drafter_train.draft_vocab_size > 0)")

    def requests(prompts, b: int, t: float) -> list[list[Request]]:
        """Every prompt's samples in a row (at least b requests), b at a time: batch 1 over one prompt
        would time one answer's length. A last batch short of b rows is filled with copies of its own
        requests, seeds included: a copy decodes in lockstep with its original, so history strategies
        learn nothing from it (a copy of an earlier batch's request would draft that answer back)."""
        asked = [p for p in prompts for _ in range(samples_per_prompt)]
        reqs = [Request(p, new_tokens, t, seed=i, stop_ids=tuple(stop_ids)) for i, p in enumerate(asked)]
        rounds = [reqs[i : i + b] for i in range(0, len(reqs), b)]
        rounds[-1] = [rounds[-1][i % len(rounds[-1])] for i in range(b)]
        return rounds

    plain_engine = RolloutEngine(policy, cfg, progress=False)
    plain = {}
    for name, prompts in prompt_sets.items():
        for t in temperatures:
            for b in batch_sizes:
                plain[name, t, b] = _timed(plain_engine, requests(prompts, b, t), repeats)
                log(f"plain {name} T={t:g} batch {b}: {plain[name, t, b][0]:.1f} tok/s")
    rows = []
    cells = [(vocab, spec) for spec in strategies for vocab in (vocabs if spec.parts()[0] else vocabs[:1])]
    for vocab, spec in cells:  # a strategy without an EAGLE tree has no vocabulary to vary
        cell = dataclasses.replace(sd, mode="on", strategies=(spec,), group_live_batch_ranges=())
        history = HistoryStore(cell.history.corpus_tokens, cell.history.store_prompts) if cell.uses_history() else None
        engine = RolloutEngine(policy, cfg, sd=cell, drafter=drafters[vocab], progress=False, history=history)
        for name, prompts in prompt_sets.items():
            for t in temperatures:
                for b in batch_sizes:
                    tok_s, out, stats = _timed(engine, requests(prompts, b, t), repeats)
                    base_tok_s, base_out, _ = plain[name, t, b]
                    row = {
                        "prompts": name, "temperature": t, "batch": b, "strategy": str(spec),
                        "vocab": vocab if spec.parts()[0] else "-", "plain_tok_s": base_tok_s, "sd_tok_s": tok_s,
                        "acceptance_length": stats.acceptance_length(), "drafts_per_step": stats.drafts_per_step(),
                        "speedup": tok_s / base_tok_s,
                        "same_tokens": sum(a.tokens == c.tokens for a, c in zip(out, base_out)),
                        "requests": len(out),
                    }
                    rows.append(row)
                    if completions is not None:
                        completions[len(rows) - 1] = (base_out, out)
                    log(format_row(row))
                    row_done(rows)
    return rows


def _label(r: dict) -> str:
    return f"{r['prompts']} {r['strategy']} {r['vocab']}"


def stop_paying(rows: list[dict]) -> dict[str, int | None]:
    """Per (prompt set, temperature, strategy, vocab): the smallest batch whose speedup is below 1 (None: never).
    A cell that never speculated (every request done at its prefill) times plain against plain: it says nothing."""
    out: dict[str, int | None] = {}
    for r in sorted(rows, key=lambda r: r["batch"]):
        if math.isnan(r["acceptance_length"]):
            continue
        key = f"T={r['temperature']:g} {_label(r)}"
        out.setdefault(key, None)
        if out[key] is None and r["speedup"] < 1:
            out[key] = r["batch"]
    return out


HEADER = (f"{'prompts':>8} {'T':>4} {'batch':>5} {'strategy':>10} {'vocab':>7} {'plain tok/s':>11} {'SD tok/s':>9} "
          f"{'accept':>6} {'eagle':>5} {'hist':>5} {'speedup':>7} {'same':>6}")


def format_row(r: dict) -> str:
    src = r["drafts_per_step"]
    return (f"{r['prompts']:>8} {r['temperature']:>4g} {r['batch']:>5} {r['strategy']:>10} {r['vocab']:>7} "
            f"{r['plain_tok_s']:>11.1f} {r['sd_tok_s']:>9.1f} {r['acceptance_length']:>6.2f} {src['eagle']:>5.2f} "
            f"{src['history']:>5.2f} {r['speedup']:>6.2f}x {str(r['same_tokens']) + '/' + str(r['requests']):>6}")


def plot(rows: list[dict], path: str | Path) -> bool:
    """Speedup vs batch size, one line per (prompt set, strategy, vocab), one panel per temperature; False without matplotlib."""
    if (plt := pyplot()) is None:
        return False
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        lines: dict[str, list] = {}
        for r in rows:
            if r["temperature"] == t:
                lines.setdefault(_label(r), []).append((r["batch"], r["speedup"]))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"temperature {t:g}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)
    return True


# ---- profile of one speculative step -------------------------------------------------------------

def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def profile_step(policy: Decoder, drafter: Drafter, strategy: StrategySpec, *, batch: int = 1,
                 prefix_len: int = 160, kv_len: int = 320, temperature: float = 0.0, repeats: int = 10,
                 unrolled: bool = False) -> dict[str, float]:
    """Median milliseconds of each phase of one speculative step (each jitted alone, same shapes and
    dtypes as the engine's: the policy's), of the whole sd_step, and of one plain decode step. Random
    prefix contents: the cost does not depend on them. unrolled: the policy's layers as an engine with
    rollout.layer_loop 'unrolled' runs them."""
    st = speculative.Strategy(*strategy.parts())
    if st.steps == 0:
        raise ValueError(f"--profile times an EAGLE tree's phases; {strategy} has none")
    cfg = policy.cfg
    B, N = batch, st.verify_tokens
    dtype = policy.embed[...].dtype
    pg, ps = nnx.split(policy)
    ps = unstack_layers(ps) if unrolled else ps
    dg, dstate = nnx.split(drafter)
    L = jnp.full((B,), prefix_len, jnp.int32)
    cache = KVCache.zeros(cfg, B, kv_len, dtype)
    ds = speculative.DraftState.empty(drafter.empty_cache(B, kv_len + st.scratch_slots, dtype), st.pending,
                                      drafter.feature_size, dtype).replace(n_pending=jnp.full((B,), 2, jnp.int32))
    params = SamplingParams(jnp.full((B,), temperature, jnp.float32), jnp.zeros(B, jnp.int32),
                            jnp.ones(B, jnp.float32), jnp.arange(B, dtype=jnp.uint32))
    tree_shape = jax.eval_shape(lambda: speculative.draft_tree(
        nnx.merge(pg, ps), nnx.merge(dg, dstate), ds, jnp.zeros(B, jnp.int32), L, st, kv_len)[0])
    parents = jnp.broadcast_to(jnp.arange(N) - 1, (B, N)).astype(jnp.int32)  # a chain: the costliest walk
    tree = speculative.Tree(tokens=jnp.ones(tree_shape.tokens.shape, jnp.int32), parents=parents,
                            depth=jnp.broadcast_to(jnp.arange(N), (B, N)).astype(jnp.int32), valid=jnp.ones((B, N), bool),
                            source=jnp.ones((B, N), jnp.int32))

    @jax.jit
    def decode(ps, cache):
        return nnx.merge(pg, ps)(jnp.zeros((B, 1), jnp.int32), L[:, None], cache, L, kv_len=kv_len,
                                 capture=drafter.feature_layers)[0]

    @jax.jit
    def draft(ps, dstate, ds):
        return speculative.draft_tree(nnx.merge(pg, ps), nnx.merge(dg, dstate), ds, jnp.zeros(B, jnp.int32), L, st, kv_len)[0]

    @jax.jit
    def verify(ps, cache, tree):
        mask = speculative.ancestor_mask(tree.parents)
        return nnx.merge(pg, ps)(tree.tokens, L[:, None] + tree.depth, cache, L, block_mask=mask, kv_len=kv_len,
                                 capture=drafter.feature_layers)[0]

    logits = verify(ps, cache, tree)

    @jax.jit
    def accept(logits, tree):
        return accept_lib.accept_coupled(tree.tokens, tree.parents, tree.valid, logits, params, L)

    @jax.jit
    def move(cache):
        return speculative._move_path(cache, L, jnp.broadcast_to(jnp.arange(N), (B, N)).astype(jnp.int32))

    slots = Slots.empty(cfg, B, kv_len, 4, True, dtype, feature_layers=drafter.feature_layers).replace(
        length=L, live=jnp.ones(B, bool), max_new=jnp.full((B,), 10_000, jnp.int32), params=params)

    @jax.jit
    def full_step(ps, dstate, slots, ds):
        return speculative.sd_step(nnx.merge(pg, ps), nnx.merge(dg, dstate), slots, ds, st, kv_len, "coupled")

    out = {
        "plain_decode_step": _median_ms(decode, ps, cache, repeats=repeats),
        "draft_tree": _median_ms(draft, ps, dstate, ds, repeats=repeats),
        "verify_forward": _median_ms(verify, ps, cache, tree, repeats=repeats),
        "accept": _median_ms(accept, logits, tree, repeats=repeats),
        "cache_move": _median_ms(move, cache, repeats=repeats),
        "sd_step": _median_ms(full_step, ps, dstate, slots, ds, repeats=repeats),
    }
    out["other"] = out["sd_step"] - sum(out[k] for k in ("draft_tree", "verify_forward", "accept", "cache_move"))
    return out


