"""Held-out evaluation of a policy: pass@1 and unbiased pass@k, response lengths, per math level.

The prompts are the held-out records the trainer scores its eval_accuracy on (the math generator's
EVAL_SEED_OFFSET stream, or a prompt file), `samples` completions each; request i is seeded with
request_seed(seed, 0, i), as in the trainer's in-run evaluation, so evaluating a run with its own eval
settings repeats its eval_accuracy. Sampling is position keyed, so speculative decoding changes how
fast the completions come, never which they are.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from fastrl_jax.config import Config
from fastrl_jax.data.pipeline import MATH_SOURCE, MathSource
from fastrl_jax.data.prompt_files import read_records
from fastrl_jax.models.decoder import Decoder
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rl.rewards import correctness_reward
from fastrl_jax.rl.workers import RolloutWorkers, request_seed
from fastrl_jax.rollout.engine import Completion, Request

EVAL_SEED_OFFSET = 1_000_003  # the held-out math stream is a different seed from the training stream
MAX_SAMPLES = 1024  # samples per prompt; pass@k estimates need n >= k (the Codex paper used n = 200)
MAX_COMPLETIONS = 1_000_000  # per evaluation: beyond it the records alone take minutes to build


def held_out_records(cfg: Config, count: int, source: str | None = None) -> list[dict[str, Any]]:
    """The first `count` held-out records of `source` (default data.eval_source): the math generator's
    held-out stream (records carry their "level"), or a .jsonl / .parquet file read with data.*_field."""
    d = cfg.data
    source = source or d.eval_source
    if source == MATH_SOURCE:
        src = MathSource(cfg.seed + EVAL_SEED_OFFSET, d.math_levels, held_out=True)
        return [src[i] for i in range(count)]
    records = read_records(source, prompt_field=d.prompt_field, messages_field=d.messages_field,
                           answer_field=d.answer_field)
    if len(records) > count:
        print(f"[fastrl-jax] {source}: evaluating its first {count} of {len(records)} records (rl.eval_prompts, or "
              "eval's --num-prompts)", file=sys.stderr)
    return records[:count]


def eval_requests(prompts: Sequence[Sequence[int]], samples: int, max_new_tokens: int, temperature: float, top_k: int,
                  top_p: float, seed: int, stop_ids: Sequence[int]) -> list[Request]:
    """`samples` requests per prompt, prompt-major; request i has seed request_seed(seed, 0, i) (step 0 of
    the seed stream, which no training step uses)."""
    return [Request(prompts[i // samples], max_new_tokens, temperature, top_k, top_p, request_seed(seed, 0, i), stop_ids)
            for i in range(len(prompts) * samples)]


def completion_text(tokenizer, c: Completion) -> str:
    """The completion as text, without its stop token and special tokens (what rewards score)."""
    ids = c.tokens[:-1] if c.finish_reason == "stop" else c.tokens
    return tokenizer.decode(ids, skip_special_tokens=True)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k),
    as a product so large n does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(samples: int) -> list[int]:
    """The k reported for `samples` samples per prompt: 1, 2, 4, ... up to samples, and samples itself."""
    return sorted({2**i for i in range(int(math.log2(samples)) + 1)} | {samples})


def summarize(levels: Sequence[int | None], correct: np.ndarray, lengths: np.ndarray, truncated: np.ndarray) -> dict:
    """Results per subset ("all", then "level N" for records that carry one). correct, lengths and
    truncated are [prompts, samples]."""
    samples = correct.shape[1]
    groups = {"all": np.arange(len(levels))}
    for level in sorted({lv for lv in levels if lv is not None}):
        groups[f"level {level}"] = np.array([i for i, lv in enumerate(levels) if lv == level])
    out = {}
    for name, rows in groups.items():
        n_correct, lens = correct[rows].sum(1), lengths[rows].ravel()
        out[name] = {"prompts": len(rows), "samples": samples,
                     **{f"pass@{k}": float(np.mean([pass_at_k(samples, int(c), k) for c in n_correct]))
                        for k in pass_ks(samples)},
                     "len_mean": float(lens.mean()), "len_p50": float(np.percentile(lens, 50)),
                     "len_p90": float(np.percentile(lens, 90)), "len_max": int(lens.max()),
                     "truncated": float(truncated[rows].mean())}
    return out


def format_table(results: dict) -> str:
    """The results as a text table, one row per subset."""
    ks = [key for key in next(iter(results.values())) if key.startswith("pass@")]
    head = f"{'subset':<9} {'prompts':>7} {'samples':>7} " + " ".join(f"{k:>7}" for k in ks) + \
        f" {'len':>6} {'p50':>5} {'p90':>5} {'max':>5} {'trunc':>5}"
    rows = [head]
    for name, r in results.items():
        rows.append(f"{name:<9} {r['prompts']:>7} {r['samples']:>7} " + " ".join(f"{r[k]:>7.3f}" for k in ks) +
                    f" {r['len_mean']:>6.1f} {r['len_p50']:>5.0f} {r['len_p90']:>5.0f} {r['len_max']:>5} "
                    f"{r['truncated']:>5.2f}")
    return "\n".join(rows)


def model_workers(cfg: Config, model: Decoder, drafter: Drafter | None = None, progress: bool = True,
                  drafter_accept: float = math.inf) -> RolloutWorkers:
    """Rollout workers for `model` on its own mesh (cfg.rollout; cfg.sd with `drafter`, whose estimated
    tokens per step is drafter_accept)."""
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    return RolloutWorkers(cfg, graphdef, params, params["embed"].sharding.mesh, drafter, progress=progress,
                          drafter_accept=drafter_accept)


def evaluate(workers: RolloutWorkers, tokenizer, records: Sequence[dict], requests: Sequence[Request],
             samples: int) -> dict[str, Any]:
    """Generates `requests` (eval_requests of the records' prompts, `samples` each) with `workers` and
    scores them with the correctness reward.

    Returns {"results": summarize(...), "per_prompt": [...], "generate_s", "tokens", "tokens_per_s",
    "acceptance_length"}; results["all"]["pass@1"] is the mean correctness, the trainer's eval_accuracy."""
    # The trainer evaluates on its own rollout workers: what the adaptive-SD bandits learn from held-out prompts
    # (greedy by default, where drafts are accepted more often) must not steer the training rollouts' strategy
    # choices, nor advance their exploration RNG, so a run with evaluations rolls out as one without them.
    bandits = [(r.engine.chooser, r.engine.chooser.state()) for r in workers.replicas if r.engine.chooser is not None]
    # Scoring reads tokens: the hidden states the online drafter trainer keeps would be GBs gathered for nothing
    # (500 prompts x ~4k positions x 3584 float32 at 7B: ~28 GiB of host memory).
    hidden = [(r.engine, r.engine.return_hidden) for r in workers.replicas]
    t0 = time.perf_counter()
    try:
        for engine, _ in hidden:
            engine.return_hidden = False
        completions, stats = workers.generate(requests, samples)
        seconds = time.perf_counter() - t0
    finally:
        for chooser, state in bandits:
            chooser.restore(state)
        for engine, keep in hidden:
            engine.return_hidden = keep
    failed = [c.error for c in completions if c.finish_reason == "error"]
    if failed:
        raise ValueError(f"{len(failed)} evaluation requests failed, e.g.: {failed[0]}")
    texts = [completion_text(tokenizer, c) for c in completions]
    shape = (len(records), samples)
    correct = np.array([correctness_reward(t, records[i // samples]["answer"]) for i, t in enumerate(texts)]).reshape(shape)
    lengths = np.array([len(c.tokens) for c in completions]).reshape(shape)
    truncated = np.array([c.finish_reason == "length" for c in completions]).reshape(shape)
    per_prompt = [{"record": r, "completions": texts[i * samples:(i + 1) * samples], "correct": correct[i].tolist(),
                   "lengths": lengths[i].tolist()} for i, r in enumerate(records)]
    tokens = int(lengths.sum())
    return {"results": summarize([r.get("level") for r in records], correct, lengths, truncated),
            "per_prompt": per_prompt, "generate_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "acceptance_length": stats.acceptance_length() if stats.sd_steps else None}
