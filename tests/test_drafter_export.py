"""Drafter export: EAGLE safetensors layout and round trips; reduced draft vocabulary stays lossless."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.greedy import greedy_generate
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.config import SpecConfig
from fastrl_jax.drafter.export import export_eagle, load_eagle
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.models.drafter_io import load_drafter, save_drafter
from fastrl_jax.rollout import speculative
from fastrl_jax.rollout.engine import Request, RolloutEngine

VOCAB = np.arange(1, 128, 4)  # 32 of the 128 ids


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def random_drafter(vocab=None, seed=0):
    d = Drafter(TINY, nnx.Rngs(seed), draft_vocab=vocab)
    for _, var in nnx.iter_graph(d):  # norms away from 1, so a dropped or misplaced norm shows
        if isinstance(var, nnx.Param) and var.get_value().ndim == 2 and var.get_value().shape[0] == 1:
            var.set_value(var.get_value() + 0.3 * jax.random.normal(jax.random.key(seed), var.get_value().shape))
    return d


def outputs(drafter, model):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 7)), jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(2, 7, TINY.hidden_size)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    logits, pred, _ = drafter(model, tokens, hidden, pos, drafter.empty_cache(2, 8), jnp.zeros(2, jnp.int32))
    return np.asarray(logits), np.asarray(pred)


@pytest.mark.parametrize("vocab", [None, VOCAB])
def test_eagle_export_round_trip(model, tmp_path, vocab):
    from safetensors.numpy import load_file

    drafter = random_drafter(vocab)
    export_eagle(drafter, TINY, tmp_path / "eagle")
    tensors = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    H, F = TINY.hidden_size, TINY.intermediate_size
    expected = {
        "fc.weight": (H, 2 * H), "fc.bias": (H,),
        "layers.0.self_attn.q_proj.weight": (TINY.num_heads * TINY.head_dim, H),
        "layers.0.self_attn.k_proj.weight": (TINY.num_kv_heads * TINY.head_dim, H),
        "layers.0.self_attn.v_proj.weight": (TINY.num_kv_heads * TINY.head_dim, H),
        "layers.0.self_attn.o_proj.weight": (H, TINY.num_heads * TINY.head_dim),
        "layers.0.mlp.gate_proj.weight": (F, H), "layers.0.mlp.up_proj.weight": (F, H),
        "layers.0.mlp.down_proj.weight": (H, F), "layers.0.post_attention_layernorm.weight": (H,),
    }
    if vocab is not None:
        expected |= {"d2t": (len(vocab),), "t2d": (TINY.vocab_size,)}
        np.testing.assert_array_equal(tensors["d2t"] + np.arange(len(vocab)), vocab)  # EAGLE-3: id = index + d2t
        assert tensors["t2d"].sum() == len(vocab) and tensors["t2d"][vocab].all()
    assert {k: v.shape for k, v in tensors.items()} == expected
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    assert config.get("draft_vocab_size") == (None if vocab is None else len(vocab))

    back = load_eagle(tmp_path / "eagle", TINY)
    for a, b in zip(outputs(drafter, model), outputs(back, model)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("vocab", [None, VOCAB])
def test_orbax_round_trip_keeps_the_draft_vocab(model, tmp_path, vocab):
    drafter = random_drafter(vocab, seed=1)
    save_drafter(tmp_path / "d", drafter)
    back = load_drafter(tmp_path / "d", TINY)
    assert back.draft_vocab_size == drafter.draft_vocab_size
    for a, b in zip(outputs(drafter, model), outputs(back, model)):
        np.testing.assert_array_equal(a, b)


def test_export_rejects_a_foreign_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="export-drafter"):
        load_eagle(tmp_path, TINY)
    export_eagle(random_drafter(), TINY, tmp_path / "e")
    other = dataclasses.replace(TINY, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="fc.weight"):
        load_eagle(tmp_path / "e", other)


def test_reduced_vocab_drafts_only_its_tokens(model):
    drafter = random_drafter(VOCAB, seed=2)
    st = speculative.Strategy(steps=3, topk=3, verify_tokens=8)
    B, H = 2, TINY.hidden_size
    ds = speculative.DraftState(
        cache=drafter.empty_cache(B, 32 + st.scratch_slots), pending_tok=jnp.ones((B, st.pending), jnp.int32),
        pending_h=jax.random.normal(jax.random.key(0), (B, st.pending, H)), n_pending=jnp.full((B,), 2, jnp.int32))
    tree, _ = speculative.draft_tree(model, drafter, ds, jnp.array([0, 2]), jnp.array([5, 9]), st, 32)
    assert np.isin(np.asarray(tree.tokens[:, 1:]), VOCAB).all()


SD_CFG = dataclasses.replace(CFG, length_buckets=(48, 96))


def test_reduced_vocab_greedy_and_sampling_equal_plain_decoding(model):
    # The draft vocabulary holds the policy's likely tokens, so drafts get accepted and paths move.
    reqs = [Request(p, max_new_tokens=12 + 3 * i) for i, p in enumerate(prompts(5, seed=4))]
    greedy = [greedy_generate(model, r.prompt_ids, r.max_new_tokens) for r in reqs]
    vocab = np.unique(np.concatenate([np.asarray(g) for g in greedy] + [np.arange(0, 128, 8)]))
    sd = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6)
    engine = RolloutEngine(model, SD_CFG, sd=sd, drafter=random_drafter(vocab, seed=3), progress=False)
    for r, o, g in zip(reqs, engine.generate(reqs), greedy):
        assert o.tokens == g
    sampled = [dataclasses.replace(r, temperature=0.8, seed=i) for i, r in enumerate(reqs)]
    plain = RolloutEngine(model, SD_CFG, progress=False).generate(sampled)
    for a, b in zip(plain, engine.generate(sampled)):
        assert a.tokens == b.tokens
