"""Decoder parity with transformers' PyTorch models, cache decode, sharded forward, loading."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.precision import model_rtol, tolerance

torch = pytest.importorskip("torch")
import transformers  # noqa: E402
from helpers.hf_tiny import FAMILIES, TINY, save_random_hf_model  # noqa: E402

from fastrl_jax.config import MeshConfig  # noqa: E402
from fastrl_jax.models.config import ModelConfig  # noqa: E402
from fastrl_jax.models.decoder import KVCache  # noqa: E402
from fastrl_jax.models.loading import load_model  # noqa: E402
from fastrl_jax.sharding import make_mesh  # noqa: E402


def single_device_mesh():
    return make_mesh(MeshConfig(), jax.devices()[:1])


def relative_error(ours, ref):
    return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    """A random HF model (every weight perturbed, biases and norms included) saved with save_pretrained."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_hf_model(request.param, path)
    model, cfg = load_model(path, single_device_mesh())
    return hf, model, cfg


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(tokens))).logits.numpy()


def prefill(model, cfg, tokens, max_len=64):
    B, T = tokens.shape
    cache = KVCache.zeros(cfg, B, max_len)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    return model(jnp.asarray(tokens), positions, cache, jnp.zeros(B, jnp.int32))


def test_prefill_matches_transformers(tiny):
    hf, model, cfg = tiny
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17))
    logits, hidden, _ = prefill(model, cfg, tokens)
    assert relative_error(logits, hf_logits(hf, tokens)) < model_rtol()
    with torch.no_grad():
        ref_hidden = hf(torch.tensor(tokens), output_hidden_states=True).hidden_states[-1].numpy()
    # HF's last hidden_states entry is after the final norm; ours is before it (the drafter's input).
    normed = np.asarray(hidden) / np.sqrt(np.mean(np.asarray(hidden) ** 2, -1, keepdims=True) + cfg.rms_norm_eps)
    w = np.asarray(model.final_norm[...])
    assert relative_error(normed * w, ref_hidden) < model_rtol()


def test_captured_layer_features_match_transformers_hidden_states(tiny):
    """EAGLE-3's features: capture index i is the residual stream entering layer i, HF's hidden_states[i]
    (SGLang captures the same), concatenated; the logits do not change."""
    hf, model, cfg = tiny
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9))
    capture = tuple(range(cfg.num_layers))[::-1]
    B, T = tokens.shape
    logits, feats, _ = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (B, T)), KVCache.zeros(cfg, B, 16),
                             jnp.zeros(B, jnp.int32), capture=capture)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens), output_hidden_states=True).hidden_states
    H = cfg.hidden_size
    assert feats.shape == (B, T, len(capture) * H)
    for j, i in enumerate(capture):
        assert relative_error(feats[..., j * H : (j + 1) * H], ref[i].numpy()) < model_rtol(), i
    np.testing.assert_array_equal(logits, prefill(model, cfg, tokens, 16)[0])


def test_cached_decode_matches_transformers(tiny):
    hf, model, cfg = tiny
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 20))
    ref = hf_logits(hf, tokens)
    n = 8
    logits, _, cache = prefill(model, cfg, tokens[:, :n])
    assert relative_error(logits, ref[:, :n]) < model_rtol()
    step = jax.jit(lambda m, t, p, c, s: m(t, p, c, s))
    for t in range(n, tokens.shape[1]):
        pos = jnp.full((3, 1), t, jnp.int32)
        logits, _, cache = step(model, jnp.asarray(tokens[:, t : t + 1]), pos, cache, jnp.full(3, t, jnp.int32))
        assert relative_error(logits[:, 0], ref[:, t]) < model_rtol(), t


def test_ragged_rows_share_one_prefill(tiny):
    """Right-padded rows of different lengths give each row's own logits, then decode on."""
    hf, model, cfg = tiny
    rng = np.random.default_rng(2)
    lengths = [5, 11, 8]
    rows = [rng.integers(0, cfg.vocab_size, n + 1) for n in lengths]
    padded = np.zeros((3, max(lengths)), np.int64)
    for r, (row, n) in enumerate(zip(rows, lengths)):
        padded[r, :n] = row[:n]
    logits, _, cache = prefill(model, cfg, padded)
    nxt = np.array([[row[n]] for row, n in zip(rows, lengths)])
    pos = jnp.asarray(np.array(lengths)[:, None], jnp.int32)
    step_logits, _, _ = model(jnp.asarray(nxt), pos, cache, jnp.asarray(lengths, jnp.int32))
    for r, (row, n) in enumerate(zip(rows, lengths)):
        ref = hf_logits(hf, row[None])[0]
        assert relative_error(logits[r, :n], ref[:n]) < model_rtol()
        assert relative_error(step_logits[r, 0], ref[n]) < model_rtol()


def test_attention_backend_runs_the_named_kernel(tmp_path):
    """model.attention reaches every layer: the loaded model's prefill and decode run the interpreted Pallas
    kernel (the default, on CPU, runs none) and still match transformers."""
    hf = save_random_hf_model("llama", tmp_path)
    model, cfg = load_model(tmp_path, single_device_mesh(), attention="pallas_interpret")
    assert cfg.attention_backend == model.cfg.attention_backend == "pallas_interpret"
    default, _ = load_model(tmp_path, single_device_mesh())
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 12))
    ref = hf_logits(hf, tokens)
    logits, _, cache = prefill(model, cfg, tokens[:, :11])
    assert relative_error(logits, ref[:, :11]) < model_rtol()

    def step(m, c):
        return m(jnp.asarray(tokens[:, 11:]), jnp.full((2, 1), 11, jnp.int32), c, jnp.full(2, 11, jnp.int32))[0]

    assert relative_error(step(model, cache)[:, 0], ref[:, 11]) < model_rtol()
    assert "pallas_call" in str(jax.make_jaxpr(step)(model, cache))
    assert "pallas_call" not in str(jax.make_jaxpr(step)(default, cache))
    with pytest.raises(ValueError, match="attention backend 'flash' is unknown"):
        dataclasses.replace(cfg, attention_backend="flash")


def test_unstacked_layers_run_unrolled_to_the_same_outputs(tiny):
    """unstack_layers (rollout.layer_loop 'unrolled'): logits, captured features and the new cache are the
    scan's, bit for bit, in one jitted program each, for a prefill and for the pass that runs two groups
    of tokens together; the caller's stacked state is left as it was."""
    from flax import nnx

    from fastrl_jax.models.decoder import unstack_layers

    _, model, cfg = tiny
    graphdef, state = nnx.split(model)
    unstacked = unstack_layers(state)
    assert all(isinstance(v.get_value(), tuple) and len(v.get_value()) == cfg.num_layers
               for v in jax.tree.leaves(unstacked["layers"], is_leaf=lambda x: isinstance(x, nnx.Variable)))
    assert all(not isinstance(v.get_value(), tuple)
               for v in jax.tree.leaves(state["layers"], is_leaf=lambda x: isinstance(x, nnx.Variable)))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 7)))
    positions, start = jnp.broadcast_to(jnp.arange(7), (2, 7)), jnp.array([0, 3], jnp.int32)
    capture = (0, cfg.num_layers)

    @jax.jit
    def forward(state):
        m = nnx.merge(graphdef, state)
        cache = KVCache.zeros(cfg, 2, 16)
        one = m(tokens, positions, cache, start, capture=capture)
        mask = jnp.ones((2, 7, 16), bool)
        two = m.hidden_and_features_together([(tokens, positions, cache, start, mask, None)] * 2, capture)
        return one, two

    for a, b in zip(jax.tree.leaves(forward(state)), jax.tree.leaves(forward(unstacked))):
        np.testing.assert_array_equal(a, b)


def test_unrolled_decode_steps_update_the_cache_in_place(tiny):
    """Unrolled layers (unstack_layers) in a loop of decode steps over a donated cache: XLA must not copy
    the cache. It copied the whole of it twice per step while the writes were not ordered after the last
    layer's read (CPU, SmolLM2 at batch 64: 428 against 202 ms a step)."""
    from flax import nnx

    from fastrl_jax.models.decoder import unstack_layers

    _, model, cfg = tiny
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=1)
    def steps(state, cache):
        m = nnx.merge(graphdef, state)

        def step(i, carry):
            token, cache = carry
            length = jnp.full((4,), 5, jnp.int32) + i
            logits, _, cache = m(token[:, None], length[:, None], cache, length, kv_len=16)
            return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, 3, step, (jnp.zeros(4, jnp.int32), cache))

    cache = KVCache.zeros(cfg, 4, 32)
    whole = f"f32[{','.join(map(str, cache.k.shape))}]"
    for layers in (state, unstack_layers(state)):
        hlo = steps.lower(layers, cache).compile().as_text()
        copies = [line.strip()[:100] for line in hlo.splitlines() if whole in line and " copy(" in line]
        assert not copies, copies
    scan_out, unrolled_out = steps(state, KVCache.zeros(cfg, 4, 32)), steps(unstack_layers(state), KVCache.zeros(cfg, 4, 32))
    for a, b in zip(jax.tree.leaves(scan_out), jax.tree.leaves(unrolled_out), strict=True):
        np.testing.assert_array_equal(a, b)


def test_kv_len_bucket_and_tree_mask(tiny):
    """Attending to a shorter length bucket changes nothing; a block mask limits what new tokens see."""
    _, model, cfg = tiny
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 10))
    full, _, _ = prefill(model, cfg, tokens, max_len=64)
    B, T = tokens.shape
    bucket, _, _ = model(
        jnp.asarray(tokens), jnp.arange(T)[None], KVCache.zeros(cfg, B, 64), jnp.zeros(1, jnp.int32), kv_len=16
    )
    np.testing.assert_allclose(bucket, full, **tolerance())
    # Tokens 5..9 as two branches off token 4: {5,6,7} and {8,9}, each a chain (a draft tree).
    _, _, cache = prefill(model, cfg, tokens[:, :5])
    branch = [5, 6, 7, 8, 9]
    parent_rel = [-1, 0, 1, -1, 3]
    mask = np.eye(5, dtype=bool)
    for i, p in enumerate(parent_rel):
        while p >= 0:
            mask[i, p] = True
            p = parent_rel[p]
    depth = mask.sum(1) - 1
    tree_logits, _, _ = model(
        jnp.asarray(tokens[:, branch]), jnp.asarray(5 + depth)[None], cache, jnp.array([5]),
        block_mask=jnp.asarray(mask)[None],
    )
    # Branch two (tokens 8, 9 at positions 5, 6) equals a plain forward of tokens 0..4, 8, 9.
    alt = np.concatenate([tokens[:, :5], tokens[:, [8, 9]]], axis=1)
    ref, _, _ = prefill(model, cfg, alt)
    np.testing.assert_allclose(tree_logits[:, 3:], ref[:, 5:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(tree_logits[:, :3], full[:, 5:8], rtol=1e-4, atol=1e-4)


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown architecture model_type='gpt2'.*llama, qwen2, qwen3"):
        ModelConfig.from_hf_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_biases_the_layers_lack_are_refused():
    """Llama's attention_bias adds an o_proj bias and mlp_bias MLP biases: loading without them would be silently wrong."""
    base = transformers.LlamaConfig(**TINY).to_dict()
    for extra, message in (({"mlp_bias": True}, "MLP biases"), ({"attention_bias": True}, "attention biases on llama")):
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_dict({**base, **extra})
    assert ModelConfig.from_hf_dict({**base, "model_type": "qwen2"}).qkv_bias


def test_generation_config_stop_ids_count(tmp_path):
    """transformers' generate stops at generation_config.json's EOS ids too (Llama-3-Instruct's <|eot_id|>)."""
    from fastrl_jax.models.loading import read_model_config

    transformers.LlamaConfig(**TINY, eos_token_id=1).save_pretrained(tmp_path)
    assert read_model_config(tmp_path).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 5]}')
    assert read_model_config(tmp_path).eos_token_ids == (1, 5)


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, single_device_mesh())
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, single_device_mesh())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="truncated|corrupt"):
        load_model(tmp_path, single_device_mesh())


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    """The real SmolLM2-135M: prefill and cached decode logits within 1e-4 of transformers."""
    from fastrl_jax.data.prompts import chat_prompt_ids
    from fastrl_jax.models.torch_reference import torch_model

    model, cfg, tokenizer = smollm2.model, smollm2.cfg, smollm2.tokenizer
    hf = torch_model(smollm2.path)
    step = jax.jit(lambda m, t, p, c, s: m(t, p, c, s))
    for text in ["What is 17 * 23?", "Write a haiku about rain.", "Explain photosynthesis in one sentence."]:
        ids = np.array([chat_prompt_ids(tokenizer, text) + [1, 504, 3777]])  # a few continuation tokens too
        ref = hf_logits(hf, ids)
        n = ids.shape[1] - 3
        logits, _, cache = prefill(model, cfg, ids[:, :n], max_len=128)
        assert relative_error(logits, ref[:, :n]) < model_rtol()
        for t in range(n, ids.shape[1]):
            pos = jnp.full((1, 1), t, jnp.int32)
            logits, _, cache = step(model, jnp.asarray(ids[:, t : t + 1]), pos, cache, jnp.full(1, t, jnp.int32))
            assert relative_error(logits[:, 0], ref[:, t]) < model_rtol()


_ROPE_BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)
_ROPE_CASES = {
    # Qwen2.5's documented YaRN block: the factor applies although max_position_embeddings equals the original length
    "qwen2.5 yarn": ("qwen2", dict(max_position_embeddings=32768, rope_theta=1e6,
                                   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})),
    "qwen3 yarn": ("qwen3", dict(max_position_embeddings=40960, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768})),
    "yarn, no original length": ("llama", dict(max_position_embeddings=4096,
                                               rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})),
    "yarn mscale": ("llama", dict(max_position_embeddings=4096, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16,
        "beta_slow": 2, "truncate": False})),
    "linear, rope_theta beside rope_parameters": ("llama", dict(max_position_embeddings=4096, rope_theta=5e5,
                                                                rope_parameters={"rope_type": "linear", "factor": 2.0})),
    "qwen3 without head_dim": ("qwen3", dict(max_position_embeddings=4096, rope_theta=1e4)),
    # transformers' own max_position_embeddings, where YaRN without an original length reads it
    "llama yarn, no lengths": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})),
    "qwen2 yarn, no lengths": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})),
    # transformers reads a missing original length as max_position_embeddings for llama3 too
    "llama3, no original length": ("llama", dict(max_position_embeddings=8192, rope_scaling={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})),
    "linear via rope_scaling type": ("llama", dict(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 4.0})),
}


@pytest.mark.parametrize("case", _ROPE_CASES)
def test_rope_frequencies_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fastrl_jax.models.config import rope_inv_freq

    family, settings = _ROPE_CASES[case]
    ours = ModelConfig.from_hf_dict({"model_type": family, **_ROPE_BASE, **settings})
    inv_freq, scaling = rope_inv_freq(ours)
    hf = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family](
        **_ROPE_BASE, **settings)
    head_dim = getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)  # as transformers' RoPE reads it
    assert ours.head_dim == head_dim
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        theirs, their_scaling = 1.0 / hf.rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim), 1.0
    else:
        theirs, their_scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    np.testing.assert_allclose(inv_freq, np.asarray(theirs), rtol=1e-5)
    assert scaling == pytest.approx(float(their_scaling), rel=1e-6)


def test_logits_match_transformers_at_long_positions(tmp_path):
    """RoPE's frequencies rounded as torch rounds them: from the correctly rounded float64 table, a third of
    Qwen2.5's 64 differed in the last bit, and the logits drifted with the position (1.6e-3 apart at 30000, where
    reasoning rollouts go)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        vocab_size=256, hidden_size=1024, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=65536, rope_theta=1e6)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path, single_device_mesh())
    tokens, start = np.random.default_rng(0).integers(0, 256, (1, 32)), 30000
    ours = model(jnp.asarray(tokens), (start + jnp.arange(32))[None], KVCache.zeros(cfg, 1, 64), jnp.zeros(1, jnp.int32))[0]
    with torch.no_grad():
        ref = hf(torch.tensor(tokens), position_ids=torch.arange(start, start + 32)[None]).logits.numpy()
    assert relative_error(ours, ref) < model_rtol()


def test_a_safetensors_dtype_we_cannot_read_is_named(tmp_path):
    import json
    import struct

    from fastrl_jax.models.loading import SafetensorsDir

    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F8_E4M3", "shape": [4, 4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ValueError, match=r"tensor model.embed_tokens.weight has dtype F8_E4M3, which fastrl-jax cannot load"):
        SafetensorsDir(tmp_path).get("model.embed_tokens.weight")


@pytest.mark.parametrize("extra,key", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "use_sliding_window"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantized"),  # int8 codes: garbage logits
])
def test_config_features_the_layers_lack_are_refused_by_key(extra, key):
    """The layers run SiLU, rotate whole heads with a fixed RoPE table and attend to every earlier token: another
    activation, a rotary fraction (which transformers' Llama / Qwen ignore and vLLM honours), a sliding window or
    dynamic RoPE would give other logits than the checkpoint's, and a quantized checkpoint's codes are no weights;
    refused, naming the key."""
    base = transformers.LlamaConfig(**TINY).to_dict()
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict({**base, **extra})
    for same in ({"hidden_act": "silu"}, {"hidden_act": "swish"}, {"partial_rotary_factor": 1.0},
                 # transformers slides only layers from max_window_layers on: here none (Qwen2.5's own configs)
                 {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 28}):
        ModelConfig.from_hf_dict({**base, **same})
    with pytest.raises(ValueError, match=r"sliding-window attention in layers \[1\]"):
        ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]})


def test_a_tensor_in_two_files_is_refused_without_an_index(tmp_path):
    """A stray copy beside the checkpoint's file (model (1).safetensors) silently won when it sorted last."""
    import shutil

    from fastrl_jax.models.loading import SafetensorsDir

    save_random_hf_model("qwen2", tmp_path)
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "old.safetensors")
    with pytest.raises(ValueError, match="is in both model.safetensors and old.safetensors"):
        SafetensorsDir(tmp_path)


def test_integer_weights_are_refused_as_a_quantized_checkpoint(tmp_path):
    """int8 codes (a quantized checkpoint whose config.json does not say so) would load as weights ~100x too large."""
    from safetensors.numpy import load_file, save_file

    save_random_hf_model("qwen2", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = np.round(tensors[name] * 1000).astype(np.int8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name} is int8, not floating point: a quantized checkpoint"):
        load_model(tmp_path, make_mesh(MeshConfig(), jax.devices()[:1]))


def test_a_tied_config_over_a_distinct_lm_head_is_refused(tmp_path):
    """transformers 5 does not tie an lm_head.weight the checkpoint holds with other values than the embedding
    (it warns and keeps both), so tying it here would silently compute other logits."""
    import json

    hf = save_random_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings: true.*lm_head.weight"):
        load_model(tmp_path, single_device_mesh())
    with torch.no_grad():  # the same values in both: transformers ties them, and so do we
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
    hf.config.tie_word_embeddings = False  # save both tensors
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model, cfg = load_model(tmp_path, single_device_mesh())
    assert cfg.tie_word_embeddings
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 5))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert relative_error(prefill(model, cfg, tokens)[0], hf_logits(theirs, tokens)) < model_rtol()


@pytest.mark.parametrize("scaling, missing", [
    ({"type": "linear"}, "factor"),
    ({"rope_type": "linear", "factor": None}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
])
def test_a_rope_scaling_without_its_settings_is_refused_by_name(scaling, missing):
    """A scaling block short of a setting (hand-edited, or a GGUF with rope.scaling.type and no factor) failed at the
    first forward with a bare KeyError or TypeError (review)."""
    from fastrl_jax.models.config import ModelConfig

    d = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
         "num_attention_heads": 4, "max_position_embeddings": 4096, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=f"rope_type '{scaling.get('rope_type', 'linear')}' needs {missing}"):
        ModelConfig.from_hf_dict(d)


def test_rope_scaling_added_beside_rope_parameters_is_refused(tmp_path):
    """Qwen2.5's README says to add a YaRN rope_scaling block to config.json; a config.json written by transformers 5
    already holds rope_parameters. transformers then reads rope_scaling alone (losing rope_theta 1e6 for 10000), and
    reading rope_parameters alone would drop the YaRN scaling: neither is what the user meant, so it is refused."""
    import json

    from fastrl_jax.models.loading import read_model_config

    transformers.Qwen2Config(**TINY, rope_theta=1e6).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": yarn}))
    with pytest.raises(ValueError, match="both rope_parameters .* and rope_scaling"):
        read_model_config(tmp_path)
    # the same settings in both (rope_scaling's old `type` spelling included) are one RoPE, not a conflict
    same = {**config, "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 32768}, "rope_scaling": yarn}
    (tmp_path / "config.json").write_text(json.dumps(same))
    assert read_model_config(tmp_path).rope_params["factor"] == 4.0


def test_a_checkpoint_that_is_not_a_causal_lm_is_refused():
    """A reward or classification model of a supported family (Qwen2ForSequenceClassification, with its score head)
    would load as a policy that reads its tied embedding as the LM head: refused by its architectures."""
    for arch in ("Qwen2ForSequenceClassification", "Qwen2ForRewardModel"):
        config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True, architectures=[arch]).to_dict()
        with pytest.raises(ValueError, match=f"architectures=\\['{arch}'\\].*ForCausalLM"):
            ModelConfig.from_hf_dict(config)
    ModelConfig.from_hf_dict(transformers.Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"]).to_dict())
