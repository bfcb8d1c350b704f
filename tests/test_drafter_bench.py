"""bench-sd's measurement: every batch size generates every prompt, batch size at a time, and
speculative decoding reproduces plain decoding's tokens in every cell."""

import numpy as np
from flax import nnx
from test_rollout import CFG, TINY, prompts, tiny_model

from fastrl_jax.drafter.bench import run_bench, stop_paying
from fastrl_jax.models.drafter import Drafter


def test_each_batch_size_runs_every_prompt_and_matches_plain_decoding():
    drafter = Drafter(TINY, nnx.Rngs(1), draft_vocab=np.arange(0, TINY.vocab_size, 2))
    rows = run_bench(
        tiny_model(), drafter, prompts(3, seed=2, hi=8), stop_ids=[], base_cfg=CFG, batch_sizes=[1, 2],
        strategies=[(3, 1, 4)], temperatures=[0.0, 0.7], vocabs=["reduced"], new_tokens=6, repeats=1,
        log=lambda line: None,
    )
    assert sorted((r["temperature"], r["batch"], r["requests"]) for r in rows) == [
        (0.0, 1, 3), (0.0, 2, 4), (0.7, 1, 3), (0.7, 2, 4)]  # batch 2: two rounds, the third prompt repeated
    assert all(r["same_tokens"] == r["requests"] for r in rows)
    assert all(1.0 <= r["acceptance_length"] <= 4.0 for r in rows)
    assert set(stop_paying(rows)) == {"T=0 3/1/4 reduced", "T=0.7 3/1/4 reduced"}
