"""Mesh construction, logical-axis rules, and the sharded forward equal to the single-device one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from fastrl_jax.config import ConfigError, MeshConfig
from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import Decoder, KVCache
from fastrl_jax.models.loading import decoder_from_hf_tensors
from fastrl_jax.sharding import logical_to_spec, make_mesh, replica_meshes, shardings_for


def test_mesh_shape_and_minus_one():
    assert len(jax.devices()) == 8
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ConfigError, match=r"2\*2\*4 = 16 but 8 devices.*device_count=16"):
        make_mesh(MeshConfig(data=2, fsdp=2, tensor=4))


def test_rules_replicate_indivisible_dims_and_never_reuse_an_axis():
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    assert logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 64, 3, 16), mesh) == P(None, "fsdp", None, None)
    assert logical_to_spec(("embed", "heads"), (64, 4), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("mlp", "vocab"), (96, 256), mesh) == P("tensor", None)
    assert logical_to_spec(("batch", "embed"), (8, 64), mesh) == P("fsdp", None)


def test_replica_meshes():
    subs = replica_meshes(make_mesh(MeshConfig(data=4, tensor=2)))
    assert len(subs) == 4 and all(dict(m.shape) == {"data": 1, "fsdp": 1, "tensor": 2} for m in subs)
    assert len({d for m in subs for d in m.devices.flat}) == 8


def test_sharded_forward_equals_single_device():
    cfg = ModelConfig(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128,
        tie_word_embeddings=False, qkv_bias=True, qk_norm=True,
    )
    model = Decoder(cfg, nnx.Rngs(0))
    flat = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 12)))
    positions = jnp.broadcast_to(jnp.arange(12), (4, 12))

    def forward(mesh):
        m = decoder_from_hf_tensors(cfg, _hf_view(cfg, flat), mesh)
        return jax.jit(lambda m, t, p: m(t, p, KVCache.zeros(cfg, 4, 16), jnp.zeros(4, jnp.int32))[0])(m, tokens, positions), m

    single, _ = forward(make_mesh(MeshConfig(), jax.devices()[:1]))
    sharded, m = forward(make_mesh(MeshConfig(fsdp=4, tensor=2)))
    assert m.layers.wq.get_value().sharding.spec == P(None, "fsdp", "tensor", None)
    assert len(m.layers.w_up.get_value().addressable_shards) == 8
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-5)


def _hf_view(cfg, flat):
    """HF-named tensors for a model's own random weights (inverse of the loader's mapping)."""
    from fastrl_jax.models.loading import hf_layer_tensors

    H, D = cfg.hidden_size, cfg.head_dim
    inverse = {
        "wq": lambda w: w.reshape(H, -1).T, "wk": lambda w: w.reshape(H, -1).T, "wv": lambda w: w.reshape(H, -1).T,
        "wo": lambda w: w.reshape(-1, H).T, "w_gate": lambda w: w.T, "w_up": lambda w: w.T, "w_down": lambda w: w.T,
        "bq": lambda b: b.reshape(-1), "bk": lambda b: b.reshape(-1), "bv": lambda b: b.reshape(-1),
    }
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = flat["lm_head"].T
    for ours, (template, _) in hf_layer_tensors(cfg).items():
        for i in range(cfg.num_layers):
            out[template.format(i)] = inverse.get(ours, lambda w: w)(flat[f"layers.{ours}"][i])
    return out.__getitem__


def test_shardings_for_follows_logical_axes():
    cfg = ModelConfig(
        family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64,
        tie_word_embeddings=True, qkv_bias=False, qk_norm=False,
    )
    state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    shardings = shardings_for(state, make_mesh(MeshConfig(fsdp=4, tensor=2)))
    assert shardings["embed"].get_value().spec == P("tensor", "fsdp")
    assert shardings["layers"]["w_down"].get_value().spec == P(None, "tensor", "fsdp")
