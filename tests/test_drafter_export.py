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
from fastrl_jax.drafter.export import eagle_config, export_eagle, export_eagle3, load_eagle
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.models.drafter_io import load_drafter, save_drafter
from fastrl_jax.rollout import speculative
from fastrl_jax.rollout.engine import Request, RolloutEngine

VOCAB = np.arange(1, 128, 4)  # 32 of the 128 ids


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def random_drafter(vocab=None, seed=0, kind="eagle"):
    d = Drafter(TINY, nnx.Rngs(seed), draft_vocab=vocab, kind=kind)
    for i, (_, var) in enumerate(nnx.iter_graph(d)):  # norms away from 1, so a dropped or misplaced norm shows
        if isinstance(var, nnx.Param) and var.get_value().shape[-1] == TINY.hidden_size and var.get_value().ndim <= 2 \
                and (var.get_value().ndim == 1 or var.get_value().shape[0] == 1):
            noise = jax.random.normal(jax.random.key(seed + i), var.get_value().shape)
            var.set_value(var.get_value() + 0.3 * noise)
    return d


def outputs(drafter, model):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 7)), jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(2, 7, drafter.feature_size)), jnp.float32)
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
    # untied even for a tied policy (SmolLM2): SGLang sets the target's embedding and head into separate modules
    assert eagle_config(dataclasses.replace(TINY, tie_word_embeddings=True), None, "float32")["tie_word_embeddings"] is False
    assert config.get("draft_vocab_size") == (None if vocab is None else len(vocab))
    # SGLang's EAGLE drafts over --speculative-token-map's ids (it does not read d2t): torch.load of the ids
    token_map = tmp_path / "eagle" / "token_map.pt"
    assert token_map.is_file() == (vocab is not None)
    if vocab is not None:
        torch = pytest.importorskip("torch")
        assert torch.load(token_map, weights_only=True) == vocab.tolist()

    back = load_eagle(tmp_path / "eagle", TINY)
    for a, b in zip(outputs(drafter, model), outputs(back, model)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("vocab", [None, VOCAB])
def test_eagle3_export_is_sglang_layout_and_round_trips(model, tmp_path, vocab):
    """SGLang's LlamaForCausalLMEagle3 names and shapes (llama_eagle3.py: fc 3H -> H, midlayer with 2H-wide
    q/k/v and hidden_norm, own norm and lm_head over the draft vocabulary, d2t/t2d); loading it back
    drafts the same trees."""
    from safetensors.numpy import load_file

    drafter = random_drafter(vocab, seed=4, kind="eagle3")
    export_eagle3(drafter, model, tmp_path / "e3")
    tensors = load_file(str(tmp_path / "e3" / "model.safetensors"))
    H, F, K = TINY.hidden_size, TINY.intermediate_size, drafter.draft_vocab_size
    q, kv = TINY.num_heads * TINY.head_dim, TINY.num_kv_heads * TINY.head_dim
    expected = {
        "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (K, H),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H), "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H), "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (F, H), "midlayer.mlp.up_proj.weight": (F, H), "midlayer.mlp.down_proj.weight": (H, F),
    }
    if vocab is not None:
        expected |= {"d2t": (len(vocab),), "t2d": (TINY.vocab_size,)}
        np.testing.assert_array_equal(tensors["d2t"] + np.arange(len(vocab)), vocab)  # SGLang's hot_token_id
        assert tensors["t2d"].sum() == len(vocab) and tensors["t2d"][vocab].all()
    assert {k: v.shape for k, v in tensors.items()} == expected
    np.testing.assert_array_equal(tensors["lm_head.weight"], drafter.head_weight(model))
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == K and config["target_hidden_size"] == H and config["vocab_size"] == TINY.vocab_size
    assert config["tie_word_embeddings"] is False and config["bias"] is False
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == list(drafter.feature_layers)

    back = load_eagle(tmp_path / "e3", TINY)
    assert back.kind == "eagle3" and back.feature_layers == drafter.feature_layers
    for a, b in zip(outputs(drafter, model), outputs(back, model)):
        np.testing.assert_array_equal(a, b)
    st = speculative.Strategy(steps=3, topk=2, verify_tokens=6)
    ds = speculative.DraftState(
        cache=drafter.empty_cache(2, 32 + st.scratch_slots), pending_tok=jnp.ones((2, st.pending), jnp.int32),
        pending_h=jax.random.normal(jax.random.key(1), (2, st.pending, 3 * H)), n_pending=jnp.full((2,), 2, jnp.int32))
    trees = [speculative.draft_tree(model, d, ds, jnp.array([0, 2]), jnp.array([5, 9]), st, 32)[0] for d in (drafter, back)]
    np.testing.assert_array_equal(trees[0].tokens, trees[1].tokens)
    with pytest.raises(ValueError, match="export_eagle3"):
        export_eagle(drafter, TINY, tmp_path / "wrong")


@pytest.mark.parametrize("vocab", [None, VOCAB])
def test_orbax_round_trip_keeps_the_draft_vocab(model, tmp_path, vocab):
    drafter = random_drafter(vocab, seed=1)
    save_drafter(tmp_path / "d", drafter)
    back = load_drafter(tmp_path / "d", TINY)
    assert back.draft_vocab_size == drafter.draft_vocab_size
    for a, b in zip(outputs(drafter, model), outputs(back, model)):
        np.testing.assert_array_equal(a, b)
    if vocab is not None:  # for a policy of a smaller vocabulary its ids do not exist: refused, not loaded broken
        with pytest.raises(ValueError, match=r"draft vocabulary is not distinct ids of this policy's 64-token"):
            load_drafter(tmp_path / "d", dataclasses.replace(TINY, vocab_size=64))


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


SD_CFG = dataclasses.replace(CFG, length_buckets=(48, 96), batch_buckets=(8,))  # one batch bucket: fewer programs


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_reduced_vocab_greedy_and_sampling_equal_plain_decoding(model, kind):
    # The draft vocabulary holds the policy's likely tokens, so drafts get accepted and paths move.
    reqs = [Request(p, max_new_tokens=12 + 3 * i) for i, p in enumerate(prompts(5, seed=4))]
    greedy = [greedy_generate(model, r.prompt_ids, r.max_new_tokens) for r in reqs]
    vocab = np.unique(np.concatenate([np.asarray(g) for g in greedy] + [np.arange(0, 128, 8)]))
    sd = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6)
    engine = RolloutEngine(model, SD_CFG, sd=sd, drafter=random_drafter(vocab, seed=3, kind=kind), progress=False)
    for r, o, g in zip(reqs, engine.generate(reqs), greedy):
        assert o.tokens == g
    sampled = [dataclasses.replace(r, temperature=0.8, seed=i) for i, r in enumerate(reqs)]
    plain = RolloutEngine(model, SD_CFG, progress=False).generate(sampled)
    for a, b in zip(plain, engine.generate(sampled)):
        assert a.tokens == b.tokens
