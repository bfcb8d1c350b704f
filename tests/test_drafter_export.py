"""Drafter export: EAGLE / EAGLE-3 safetensors layout, what SGLang computes from it, round trips and refusals;
reduced draft vocabulary stays lossless."""

import dataclasses
import json
import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.greedy import greedy_generate
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.config import SpecConfig
from fastrl_jax.drafter.export import eagle_config, export_eagle, export_eagle3, load_eagle
from fastrl_jax.models.decoder import Decoder
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.models.drafter_io import load_drafter, save_drafter
from fastrl_jax.models.export import export_into
from fastrl_jax.rollout import speculative
from fastrl_jax.rollout.engine import Request, RolloutEngine

VOCAB = np.arange(1, 128, 4)  # 32 of the 128 ids


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def random_drafter(vocab=None, seed=0, kind="eagle", cfg=TINY):
    d = Drafter(cfg, nnx.Rngs(seed), draft_vocab=vocab, kind=kind)
    for i, (path, var) in enumerate(nnx.iter_graph(d)):  # norms away from 1, biases away from 0: a dropped one shows
        if isinstance(var, nnx.Param) and (var.get_value().shape[-1] == TINY.hidden_size and var.get_value().ndim <= 2
                                           and (var.get_value().ndim == 1 or var.get_value().shape[0] == 1)
                                           or path[-1] in ("bq", "bk", "bv")):
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
    export_eagle3(drafter, model.cfg, head_rows(drafter, model), tmp_path / "e3")
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


def sglang_forward(path, policy, tokens, hidden):
    """What SGLang computes from an exported directory, rebuilt with transformers' torch Llama modules and
    read by SGLang's tensor names (llama_eagle.py / llama_eagle3.py), independent of our loader: a prefill
    of entries (tokens [B, T], hidden [B, T, F]) at positions 0..T-1. Returns (logits over the draft
    vocabulary [B, T, K], their target token ids [K], the next step's hidden input [B, T, H])."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from transformers import LlamaConfig, Qwen2Config
    from transformers.models.llama import modeling_llama as hf
    from transformers.models.qwen2 import modeling_qwen2 as qwen2_modules

    t = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    eagle3 = config["architectures"] == ["LlamaForCausalLMEagle3"]
    qwen2 = config["architectures"] == ["Qwen2ForCausalLMEagle"]  # qwen2_eagle.py: Qwen2's layer, q/k/v biases
    cfg = (Qwen2Config if qwen2 else LlamaConfig)(**config)
    cfg._attn_implementation = "eager"
    H = cfg.hidden_size
    layer = (qwen2_modules.Qwen2DecoderLayer if qwen2 else hf.LlamaDecoderLayer)(cfg, 0)
    prefix = "midlayer." if eagle3 else "layers.0."
    if eagle3:  # the midlayer's q/k/v read concat(embeds, hidden): 2H wide
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(layer.self_attn, name, torch.nn.Linear(2 * H, t[f"{prefix}self_attn.{name}.weight"].shape[0], bias=False))
        hidden_norm = hf.LlamaRMSNorm(H, cfg.rms_norm_eps)
        hidden_norm.weight.data = t[f"{prefix}hidden_norm.weight"]
    else:  # layer 0 of an EAGLE drafter has no input_layernorm
        layer.input_layernorm = torch.nn.Identity()
    missing, unexpected = layer.load_state_dict(
        {k.removeprefix(prefix): v for k, v in t.items() if k.startswith(prefix) and "hidden_norm" not in k}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    B, T = tokens.shape
    embeds = torch.tensor(np.asarray(policy.embed[...]))[torch.tensor(np.asarray(tokens))]
    hidden = torch.tensor(np.asarray(hidden))
    cos_sin = hf.LlamaRotaryEmbedding(cfg)(embeds, torch.arange(T)[None].expand(B, T))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    head = torch.tensor(np.asarray(policy.head_weight()))
    with torch.no_grad():
        if eagle3:
            h = hidden @ t["fc.weight"].T if hidden.shape[-1] != H else hidden
            attn, _ = layer.self_attn(torch.cat([layer.input_layernorm(embeds), hidden_norm(h)], -1), cos_sin, mask)
            h = h + attn
            out = h + layer.mlp(layer.post_attention_layernorm(h))
            norm = hf.LlamaRMSNorm(H, cfg.rms_norm_eps)
            norm.weight.data = t["norm.weight"]
            logits = norm(out) @ t["lm_head.weight"].T
            ids = t["d2t"] + torch.arange(len(t["d2t"])) if "d2t" in t else torch.arange(cfg.vocab_size)
        else:
            x = torch.cat([embeds, hidden], -1) @ t["fc.weight"].T + t["fc.bias"]
            out = layer(x, attention_mask=mask, position_embeddings=cos_sin)
            # SGLang's EAGLE drafts over --speculative-token-map's ids: the target head's rows of them
            token_map = path / "token_map.pt"
            ids = torch.tensor(torch.load(token_map)) if token_map.is_file() else torch.arange(cfg.vocab_size)
            logits = out @ head[ids].T
    return logits.numpy(), ids.numpy(), out.numpy()


QWEN = {"qwen2": dataclasses.replace(TINY, family="qwen2", qkv_bias=True),
        "qwen3": dataclasses.replace(TINY, family="qwen3", qk_norm=True)}


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "qwen2 eagle", "qwen3 eagle3"])
@pytest.mark.parametrize("vocab", [None, VOCAB])
def test_export_drafts_in_sglang_as_it_drafts_here(model, tmp_path, kind, vocab):
    """The exported tensors, read by SGLang's names into transformers' torch Llama (Qwen2) modules (transposes,
    norm placement, the EAGLE-3 concat, q/k/v biases, d2t offsets / token map, RoPE from config.json), give our
    logits over the same target ids and our next hidden input."""
    if kind.startswith("qwen"):  # the GPU configs' Qwen2.5 policies; EAGLE-3 drafters of Qwen policies are Llama layers
        family, kind = kind.split()
        model = Decoder(QWEN[family], nnx.Rngs(0))
    drafter = random_drafter(vocab, seed=5, kind=kind, cfg=model.cfg)
    if kind == "eagle3":
        export_eagle3(drafter, model.cfg, head_rows(drafter, model), tmp_path / kind)
    else:
        export_eagle(drafter, model.cfg, tmp_path / kind)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 7)), jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(2, 7, drafter.feature_size)), jnp.float32)
    logits, pred, _ = drafter(model, tokens, hidden, jnp.broadcast_to(jnp.arange(7), (2, 7)), drafter.empty_cache(2, 8),
                              jnp.zeros(2, jnp.int32))
    theirs, ids, out = sglang_forward(tmp_path / kind, model, tokens, hidden)
    np.testing.assert_array_equal(ids, np.asarray(drafter.token_ids(jnp.arange(drafter.draft_vocab_size))))
    np.testing.assert_allclose(theirs, logits, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    np.testing.assert_allclose(out, pred, rtol=1e-4, atol=1e-4 * np.abs(out).max())
    if model.cfg.family != "llama":  # (Llama drafters' round trips: the tests above)
        back = load_eagle(tmp_path / kind, model.cfg)
        for a, b in zip(outputs(drafter, model), outputs(back, model)):
            np.testing.assert_array_equal(a, b)
    if model.cfg.qkv_bias and kind == "eagle":
        from safetensors.numpy import load_file

        # SGLang's Qwen2 loader looks every tensor up among Qwen2ForCausalLMEagle's parameters (KeyError on d2t / t2d);
        # the draft vocabulary goes in token_map.pt alone, and our loader reads it back from there
        assert all(name.startswith(("fc.", "layers.0.")) for name in load_file(str(tmp_path / kind / "model.safetensors")))
        with pytest.raises(ValueError, match="holds a Qwen2ForCausalLMEagle drafter; a llama policy drafts with Llama"):
            load_eagle(tmp_path / kind, TINY)


def head_rows(drafter, model):
    return np.asarray(drafter.head_weight(model))


def export(drafter, model, out):
    if drafter.kind == "eagle3":
        return export_eagle3(drafter, model.cfg, head_rows(drafter, model), out)
    return export_eagle(drafter, TINY, out)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_export_into_a_non_empty_directory_is_refused_and_changes_nothing(model, tmp_path, kind):
    """Exporting over an earlier export mixed the two (a full-vocabulary drafter kept the first one's
    token_map.pt, which SGLang's --speculative-token-map then restricts it to): refused, files untouched."""
    out = tmp_path / "e"
    export(random_drafter(VOCAB, kind=kind), model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="exists and is not empty"):
        export(random_drafter(None, seed=1, kind=kind), model, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no partial export left beside it


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_export_files_are_readable_as_the_umask_allows(model, tmp_path, kind):
    """safetensors creates model.safetensors owner-only (0600): an SGLang server running as another user
    could not read the drafter. Every exported file gets the mode the umask gives."""
    umask = os.umask(0o022)
    try:
        out = export(random_drafter(VOCAB, kind=kind), model, tmp_path / "e")
    finally:
        os.umask(umask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {
        p.name: oct(0o644) for p in out.iterdir()}


def test_a_drafter_of_another_policy_shape_is_refused_with_the_fix(tmp_path):
    """Orbax's own message for a shape mismatch advises disabling its check (`strict=False`), which would load
    a truncated / zero-padded drafter: the refusal names the tensors and the fix instead."""
    save_drafter(tmp_path / "d", random_drafter())
    for other, tensor in ((dataclasses.replace(TINY, hidden_size=32, head_dim=8), "fc"),
                          (dataclasses.replace(TINY, intermediate_size=64), "w_down"),
                          # another family of the same widths: Orbax's diff of the trees advised partial_restore (review)
                          (dataclasses.replace(TINY, family="qwen2", qkv_bias=True), "layers/bk is here, not there"),
                          (dataclasses.replace(TINY, family="qwen3", qk_norm=True), "layers/k_norm is here, not there")):
        with pytest.raises(ValueError, match=rf"is a drafter of another policy: .*{tensor}.*give the policy it was trained"
                           ) as refused:
            load_drafter(tmp_path / "d", other)
        assert "strict" not in str(refused.value) and "partial_restore" not in str(refused.value)


def test_a_damaged_drafter_checkpoint_is_one_clear_error(tmp_path):
    """A drafter cut short (a full disk while it was written, a copy cut short) given to --drafter, rl.drafter_path
    or export-drafter: TensorStore's bare Exception went past the CLI's one-line errors as a 150-line traceback
    (review); it is one ValueError naming the file."""
    from helpers.checkpoints import damage

    from fastrl_jax.checkpoint import UnreadableCheckpoint

    save_drafter(tmp_path / "d", random_drafter())
    damage(tmp_path / "d")
    with pytest.raises(UnreadableCheckpoint, match=rf"{tmp_path / 'd'} is unreadable \(.+\): its files are damaged"):
        load_drafter(tmp_path / "d", TINY)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_exporting_with_another_policy_is_refused_and_writes_nothing(tmp_path, kind):
    """config.json describes the policy given, the tensors the drafter: a drafter of another policy (here one
    twice as wide) made an export SGLang cannot load, or one with another policy's head rows (EAGLE-3)."""
    wide = dataclasses.replace(TINY, hidden_size=128, intermediate_size=256, head_dim=32)
    drafter = Drafter(wide, nnx.Rngs(0), draft_vocab=VOCAB, kind=kind)
    with pytest.raises(ValueError, match=r"of another policy: its hidden_size 128 \(policy: 64\)"):
        export(drafter, tiny_model(), tmp_path / "e")
    assert not any(tmp_path.iterdir())


def test_without_torch_the_token_map_note_names_no_partial_directory(tmp_path, monkeypatch, caplog):
    """export-drafter writes into a partial directory renamed when complete: a note naming the path the
    token map went to sent the user to a directory that no longer exists."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with caplog.at_level(logging.WARNING), export_into(tmp_path / "export") as partial:  # as cmd_export_drafter
        export_eagle(random_drafter(VOCAB), TINY, partial / "eagle")
    assert json.loads((tmp_path / "export" / "eagle" / "token_map.json").read_text()) == VOCAB.tolist()
    assert "token_map.json" in caplog.text and "partial" not in caplog.text


def test_loading_an_eagle3_export_for_a_shallower_policy_is_refused(model, tmp_path):
    """Its feature layers come from its config.json: a policy of the same width but fewer layers has no
    such layers to capture (SGLang captures layers 0 .. L-1)."""
    drafter = random_drafter(kind="eagle3")
    export_eagle3(drafter, model.cfg, head_rows(drafter, model), tmp_path / "e3")
    with pytest.raises(ValueError, match=r"of another policy: its feature layers \[1, 1, 0\] \(policy: 1 layers\)"):
        load_eagle(tmp_path / "e3", dataclasses.replace(TINY, num_layers=1))


def test_an_eagle3_drafter_with_a_qwen_layer_says_to_train_again(tmp_path):
    """EAGLE-3 drafters saved before 2026-11-27 have their Qwen policy's layer (q/k/v biases); their checkpoints
    are named as such, not as some other policy's."""
    from fastrl_jax.models.decoder import Layers

    old = Drafter(QWEN["qwen2"], nnx.Rngs(0), kind="eagle3")
    old.layers = Layers(dataclasses.replace(QWEN["qwen2"], num_layers=1), nnx.Rngs(1), jnp.float32, embed_input=True)
    save_drafter(tmp_path / "d", old)
    with pytest.raises(ValueError, match="EAGLE-3 drafter whose layer has the policy's bq .* train it again"):
        load_drafter(tmp_path / "d", QWEN["qwen2"])


def test_export_drafter_of_a_train_run_writes_the_head_rows_of_that_checkpoints_policy(tmp_path):
    """A `train` run's EAGLE-3 drafter learned to score with the RL-updated policy's head; export-drafter --drafter RUN
    wrote the base model's head rows as its lm_head.weight instead (SGLang scores with those, ours with the trained
    ones). The policy loads on the devices here (as export-policy), not on the mesh of the run's config (2 devices):
    that refused to export on a machine of fewer devices, as for a drafter of the base model."""
    from helpers.cli import fastrl_jax
    from helpers.tiny_run import write_tiny_checkpoint
    from safetensors.numpy import load_file

    from fastrl_jax.checkpoint import RunCheckpointer
    from fastrl_jax.config import load_config, save_config
    from fastrl_jax.models.loading import load_model

    base = write_tiny_checkpoint(tmp_path / "policy")
    trained_mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    trained, _ = load_model(base, trained_mesh)
    trained.lm_head.set_value(trained.lm_head[...] + 1.0)  # RL moved the head
    drafter = random_drafter(VOCAB, kind="eagle3")
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, [f"model.path={base}", "mesh.data=2"]), run / "config.yaml")
    with RunCheckpointer(run / "checkpoints") as ckpt:
        ckpt.save(3, {"policy": nnx.to_pure_dict(nnx.state(trained)), "drafter": nnx.to_pure_dict(nnx.state(drafter))})
    res = fastrl_jax("export-drafter", "--drafter", str(run), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr[-3000:]
    head = load_file(str(tmp_path / "out" / "eagle3" / "model.safetensors"))["lm_head.weight"]
    np.testing.assert_array_equal(head, np.asarray(drafter.head_weight(trained)))
    save_drafter(tmp_path / "d", drafter)  # a drafter of the base model: its head rows, on the device here too
    res = fastrl_jax("export-drafter", "--model", str(base), "--drafter", str(tmp_path / "d"), "--out", str(tmp_path / "out2"),
                     "--set", "mesh.data=2")
    assert res.returncode == 0, res.stderr[-3000:]
    head = load_file(str(tmp_path / "out2" / "eagle3" / "model.safetensors"))["lm_head.weight"]
    np.testing.assert_array_equal(head, np.asarray(drafter.head_weight(load_model(base, trained_mesh)[0])))


def test_an_eagle_drafter_of_another_family_is_refused_and_writes_nothing(tmp_path):
    """A Qwen2 policy's EAGLE drafter (q/k/v biases) exported with a Llama policy of the same widths was written as
    LlamaForCausalLMEagle with the bias tensors, which SGLang's Llama loader skips (it has no place for them):
    served without its biases, it drafts other tokens than it was trained to. The other way round, Qwen2's layer
    would keep uninitialised biases."""
    for drafter_cfg, policy_cfg, wrong in ((QWEN["qwen2"], TINY, r"qkv_bias True \(policy: False\)"),
                                           (TINY, QWEN["qwen2"], r"qkv_bias False \(policy: True\)")):
        with pytest.raises(ValueError, match=rf"of another policy: its {wrong}"):
            export_eagle(random_drafter(cfg=drafter_cfg), policy_cfg, tmp_path / "e")
        assert not any(tmp_path.iterdir())
