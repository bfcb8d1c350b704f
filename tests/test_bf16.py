"""Speculative decoding with policy and drafter in bfloat16: every accept mode, greedy and sampled,
adaptive; the row table keeps hidden states and drafter features in the policy's dtype. (GRPO with
bfloat16 engines over float32 master weights: test_mixed_precision.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.config import SpecConfig
from fastrl_jax.models.decoder import cast_floating
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout.engine import Request, RolloutEngine

# Few buckets: bfloat16 compiles and runs slowly on XLA CPU, and every bucket is a program.
SD_CFG = dataclasses.replace(CFG, batch_buckets=(1, 4), length_buckets=(48,), prompt_buckets=(16,))
BF16 = jnp.bfloat16


@pytest.fixture(scope="module")
def model():
    return cast_floating(tiny_model(), BF16)


@pytest.fixture(scope="module")
def drafter():
    return Drafter(TINY, nnx.Rngs(5), BF16)


@pytest.fixture(scope="module")
def plain(model):
    """One plain engine for the module's comparisons: its programs compile once."""
    return RolloutEngine(model, SD_CFG, progress=False)


def _requests(n, temperature, seed=1, max_new=12):
    return [Request(p, max_new_tokens=max_new, temperature=temperature, top_p=0.9, seed=i, stop_ids=(7,))
            for i, p in enumerate(prompts(n, seed=seed))]


def test_cast_floating_casts_floats_only_and_copies_nothing_already_cast(model):
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(BF16)}
    vocab_drafter = Drafter(TINY, nnx.Rngs(0), draft_vocab=np.arange(0, 128, 2))
    cast = cast_floating(vocab_drafter, BF16)
    assert cast.draft_vocab[...].dtype == jnp.int32 and cast.fc[...].dtype == BF16
    same = nnx.to_pure_dict(nnx.state(model))
    assert all(a is b for a, b in zip(jax.tree.leaves(cast_floating(same, BF16)), jax.tree.leaves(same)))


def test_bf16_speculative_greedy_equals_bf16_plain_greedy(model, drafter, plain):
    """A tree (chains: the adaptive test below)."""
    reqs = _requests(4, 0.0)
    engine = RolloutEngine(model, SD_CFG, sd=SpecConfig(mode="on", steps=2, topk=3, verify_tokens=7), drafter=drafter,
                           progress=False)
    out = engine.generate(reqs)
    assert engine.stats.sd_steps > 0
    assert [o.tokens for o in out] == [p.tokens for p in plain.generate(reqs)]


def test_bf16_coupled_sampling_equals_bf16_plain_sampling(model, drafter):
    reqs = _requests(4, 1.0, seed=2)
    plain = RolloutEngine(model, SD_CFG, keep_hidden=True, progress=False).generate(reqs)
    sd = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6)
    spec = RolloutEngine(model, SD_CFG, sd=sd, drafter=drafter, keep_hidden=True, progress=False).generate(reqs)
    assert len({tuple(p.tokens) for p in plain}) > 1
    for a, b in zip(plain, spec):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        # bfloat16 logits: verifying a tree and decoding one token round differently
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=0.1)
        assert a.hidden_states.dtype == b.hidden_states.dtype == np.float32  # host copies, whatever the engine's dtype


def test_bf16_rejection_accept_runs(model, drafter, plain):
    """Rejection sampling in bfloat16: greedy rows equal plain greedy; sampled rows finish with valid tokens."""
    sd = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6, accept="rejection")
    engine = RolloutEngine(model, SD_CFG, sd=sd, drafter=drafter, progress=False)
    greedy = _requests(4, 0.0)
    assert [o.tokens for o in engine.generate(greedy)] == [p.tokens for p in plain.generate(greedy)]
    out = engine.generate(_requests(4, 1.0))
    assert engine.stats.sd_steps > 0
    for o in out:
        assert o.finish_reason in ("stop", "length") and all(0 <= t < TINY.vocab_size for t in o.tokens)
        assert np.all(np.array(o.logprobs) <= 0) and np.all(np.isfinite(o.logprobs))


def test_bf16_adaptive_equals_plain(model, drafter, plain):
    sd = SpecConfig(mode="adaptive", threshold_live_batch=2, patience_host_steps=1, compile_in_background=False,
                    strategies=((3, 1, 4), (2, 2, 4)), group_live_batch_ranges=((4, 1, 2),))
    engine = RolloutEngine(model, dataclasses.replace(SD_CFG, steps_per_call=2), sd=sd, drafter=drafter, progress=False)
    reqs = [Request(p, max_new_tokens=4 + 6 * i, temperature=0.7, seed=i) for i, p in enumerate(prompts(4, seed=3))]
    out = engine.generate(reqs)
    assert engine.stats.sd_steps > 0 and engine.stats.steps_plain > 0  # both kinds of step ran
    assert [o.tokens for o in out] == [p.tokens for p in plain.generate(reqs)]


def test_row_table_holds_hidden_states_and_features_in_the_policy_dtype(model, drafter):
    engine = RolloutEngine(model, SD_CFG, sd=SpecConfig(mode="on", steps=2, topk=2, verify_tokens=4), drafter=drafter,
                           progress=False)
    slots = jax.eval_shape(lambda: engine._empty(4))
    assert slots.hidden.dtype == slots.draft.pending_h.dtype == slots.cache.k.dtype == BF16
    assert slots.draft.cache.k.dtype == BF16


def test_engine_refuses_weights_of_another_dtype(model, drafter):
    engine = RolloutEngine(model, SD_CFG, sd=SpecConfig(mode="on", steps=2, topk=2, verify_tokens=4), drafter=drafter,
                           progress=False)
    with pytest.raises(ValueError, match=r"update_weights got weights in \['float32'\], the engine runs \['bfloat16'\]"):
        engine.update_weights(tiny_model())
    with pytest.raises(ValueError, match="update_drafter got weights"):
        engine.update_drafter(Drafter(TINY, nnx.Rngs(5)))
    engine.update_weights(cast_floating(tiny_model(1), BF16))  # the same dtype is taken
