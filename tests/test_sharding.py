"""Mesh construction, logical-axis rules, nnx state placement, and a sharded forward equal to the unsharded one."""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fastrl_jax.kernels.tree_attention import api, reference
from flax import nnx
from helpers.tiny import CFG, TINY, prompts, tiny_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fastrl_jax.config import ConfigError, MeshConfig, SpecConfig
from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import Decoder, KVCache
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rl import update
from fastrl_jax.rollout import programs
from fastrl_jax.rollout.engine import Request, RolloutEngine
from fastrl_jax.sharding import logical_to_spec, make_mesh, mesh_sizes, named_sharding, replica_meshes, shardings_for


def test_eight_fake_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set XLA_FLAGS before jax is imported"


@pytest.mark.parametrize(
    "cfg, shape",
    [
        (MeshConfig(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
        (MeshConfig(data=-1), (8, 1, 1)),
        (MeshConfig(fsdp=4, tensor=-1), (1, 4, 2)),
        (MeshConfig(data=2, fsdp=2, tensor=2), (2, 2, 2)),
    ],
)
def test_mesh_shape_resolves_minus_one(cfg, shape):
    mesh = make_mesh(cfg)
    assert mesh.axis_names == ("data", "fsdp", "tensor") and tuple(mesh.shape.values()) == shape
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_mesh_product_mismatch_explains_the_fix():
    expected = (
        "mesh data*fsdp*tensor = 2*2*4 = 16 but 8 devices are visible (jax.devices()); set mesh.* so the product "
        "is 8, or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=16"
    )
    with pytest.raises(ConfigError) as info:
        make_mesh(MeshConfig(data=2, fsdp=2, tensor=4))
    assert str(info.value) == expected
    with pytest.raises(ConfigError, match="8 is not divisible by 3"):
        make_mesh(MeshConfig(data=3, tensor=-1))
    with pytest.raises(ConfigError, match="2 devices are given"):
        make_mesh(MeshConfig(tensor=4), jax.devices()[:2])
    for devices in (0, -8):  # e.g. train --dry-run --devices 0
        with pytest.raises(ConfigError, match=f"a mesh needs at least 1 device; {devices} are planned"):
            mesh_sizes(MeshConfig(fsdp=-1), devices, where="planned")
    # A planned count (train --dry-run --devices 3) is the user's own: no XLA_FLAGS advice
    with pytest.raises(ConfigError) as info:
        mesh_sizes(MeshConfig(data=2, fsdp=2), 3, where="planned (--devices)")
    assert str(info.value).endswith("set mesh.* so the product is 3")


def test_make_mesh_on_given_devices():
    mesh = make_mesh(MeshConfig(tensor=-1), jax.devices()[4:])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 4}
    assert {d.id for d in mesh.devices.flat} == {4, 5, 6, 7}


def test_rules_map_logical_names():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert logical_to_spec(("vocab", "embed"), (64, 32), mesh) == P("tensor", "fsdp")
    wq_axes = ("layers", "embed", "heads", "head_dim")
    assert logical_to_spec(wq_axes, (2, 32, 4, 16), mesh) == P(None, "fsdp", "tensor", None)
    assert logical_to_spec(("batch", "seq", "embed"), (8, 5, 32), mesh) == P(("data", "fsdp"), None, None)
    assert logical_to_spec((None, "norm"), (3, 32), mesh) == P(None, None)


def test_indivisible_dims_are_replicated_and_logged(caplog):
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    with caplog.at_level(logging.INFO, logger="fastrl_jax.sharding"):
        # SmolLM2: 3 KV heads cannot split over tensor=2.
        spec = logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (30, 576, 3, 64), mesh)
        logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (30, 576, 3, 64), mesh)
    assert spec == P(None, "fsdp", None, None)
    replicated = [r for r in caplog.records if "'kv_heads' of size 3" in r.getMessage()]
    assert len(replicated) == 1  # logged once per (name, size, axis), not per call


def test_a_replicated_dim_is_a_warning_the_cli_shows(caplog):
    # The CLI logs at WARNING: a user who set mesh.tensor=2 for a model of 7 heads must learn the heads are not split.
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    with caplog.at_level(logging.WARNING, logger="fastrl_jax.sharding"):
        assert logical_to_spec(("embed", "heads", "head_dim"), (64, 7, 16), mesh) == P("fsdp", None, None)
    assert [r.levelno for r in caplog.records if "'heads' of size 7" in r.getMessage()] == [logging.WARNING]


def test_multi_axis_rule_keeps_the_axes_that_divide():
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    assert logical_to_spec(("batch",), (16,), mesh) == P(("data", "fsdp"))
    assert logical_to_spec(("batch",), (2,), mesh) == P("data")  # 2 splits over data=2, not over data*fsdp=8
    assert logical_to_spec(("batch",), (3,), mesh) == P(None)


def test_no_mesh_axis_is_used_twice():
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    # vocab and mlp both map to tensor; batch and embed both want fsdp.
    assert logical_to_spec(("mlp", "vocab"), (96, 256), mesh) == P("tensor", None)
    assert logical_to_spec(("batch", "embed"), (8, 64), mesh) == P(("data", "fsdp"), None)
    # batch keeps the part of its rule that is still free.
    spec = logical_to_spec(("heads", "kv_heads", "embed", "batch"), (4, 4, 8, 8), mesh)
    assert spec == P("tensor", None, "fsdp", "data")


def test_bad_logical_axes_are_errors():
    mesh = make_mesh(MeshConfig(tensor=8))
    with pytest.raises(ValueError, match="logical axis 'kv_head' has no sharding rule"):
        logical_to_spec(("kv_head",), (8,), mesh)
    with pytest.raises(ValueError, match=r"name 1 dims, but the shape is \(8, 8\)"):
        logical_to_spec(("embed",), (8, 8), mesh)


def test_replica_meshes_split_along_data():
    mesh = make_mesh(MeshConfig(data=4, tensor=2))
    subs = replica_meshes(mesh)
    assert len(subs) == 4
    assert all(m.axis_names == ("data", "fsdp", "tensor") and dict(m.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
               for m in subs)
    assert [list(m.devices.flat) for m in subs] == [list(row.flat) for row in mesh.devices]
    assert len(replica_meshes(make_mesh(MeshConfig(fsdp=8)))) == 1


class _Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        rng = np.random.default_rng(0)
        self.embed = nnx.Param(jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), logical_axes=("vocab", "embed"))
        self.w = nnx.Param(
            jnp.asarray(rng.standard_normal((2, 8, 6)), jnp.float32), logical_axes=("layers", "embed", "mlp")
        )
        self.kv = nnx.Param(jnp.ones((8, 3)), logical_axes=("embed", "kv_heads"))
        self.scale = nnx.Param(jnp.ones((8,)))  # no logical axes: replicated
        self.rngs = rngs  # RNG state: replicated

    def __call__(self, tokens):
        h = self.embed[tokens] * self.scale
        return jnp.einsum("bd,ldf->blf", h, self.w) + (h @ self.kv).sum(-1)[:, None, None]


def test_device_put_and_jit_place_nnx_state_by_logical_axes():
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    model = _Tiny(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    shardings = shardings_for(state, mesh)

    placed = jax.device_put(state, shardings)
    expected = {"embed": P("tensor", "fsdp"), "w": P(None, "fsdp", "tensor"), "kv": P("fsdp", None), "scale": P()}
    for name, spec in expected.items():
        assert placed[name].get_value().sharding.spec == spec, name
    assert placed["rngs"]["default"]["key"].get_value().sharding.spec == P()
    assert len(placed["w"].get_value().addressable_shards) == 8

    merged = nnx.merge(graphdef, placed)
    assert merged.w.get_value().sharding.spec == P(None, "fsdp", "tensor")
    assert merged.w.logical_axes == ("layers", "embed", "mlp")

    tokens = jnp.arange(4)
    batch = named_sharding(mesh, ("batch",), tokens.shape)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t), in_shardings=(shardings, batch))
    np.testing.assert_allclose(forward(state, tokens), model(tokens), rtol=1e-5, atol=1e-5)
    update = jax.jit(lambda s: jax.tree.map(lambda x: x, s), out_shardings=shardings)
    assert update(state)["embed"].get_value().sharding.spec == P("tensor", "fsdp")


def test_abstract_state_gives_shardings_without_allocating():
    abstract = nnx.state(nnx.eval_shape(lambda: _Tiny(nnx.Rngs(0))))
    shardings = shardings_for(abstract, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    assert shardings["w"].get_value().spec == P(None, "fsdp", "tensor")


def test_sharded_decoder_forward_equals_unsharded():
    cfg = ModelConfig(
        family="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
        tie_word_embeddings=False, qkv_bias=True, qk_norm=True,
    )
    # Random weights from numpy: jax.random would compile one program per weight shape.
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), abstract)
    model = nnx.merge(graphdef, state)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 12)))
    positions = jnp.broadcast_to(jnp.arange(12), (4, 12))

    def forward(m, cache, t, p):
        return m(t, p, cache, jnp.zeros(4, jnp.int32))[0]

    single = jax.jit(forward)(model, KVCache.zeros(cfg, 4, 16), tokens, positions)

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded_model = nnx.merge(graphdef, jax.device_put(state, shardings_for(state, mesh)))
    cache = KVCache.zeros(cfg, 4, 16)
    cache_sharding = named_sharding(mesh, KVCache.LOGICAL_AXES, cache.k.shape)
    cache = jax.device_put(cache, KVCache(k=cache_sharding, v=cache_sharding))
    batch = named_sharding(mesh, ("batch", "seq"), tokens.shape)
    sharded = jax.jit(forward)(sharded_model, cache, jax.device_put(tokens, batch), jax.device_put(positions, batch))

    assert sharded_model.layers.wq.get_value().sharding.spec == P(None, "fsdp", "tensor", None)
    assert cache.k.sharding.spec == P(None, ("data", "fsdp"), "tensor", None, None)
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-5)


def test_attention_kernels_run_per_shard_under_a_mesh():
    """Under jax.set_mesh a kernel sees its own rows (data x fsdp) and KV heads (tensor) only, and the result
    equals the reference's; axes that do not divide a dim leave it whole. A kernel's custom call has no
    partitioning rule, so without shard_map XLA gathers every operand whole onto every device."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((4, 3, 4, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((4, 4, 24, 16)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((4, 3, 24)) < 0.7).at[..., 0].set(True)
    seen = []

    def kernel(q, k, v, mask):
        seen.append((q.shape, k.shape, mask.shape))
        return reference.masked_attention(q, k, v, mask)

    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    with jax.set_mesh(mesh):
        out = jax.jit(api.sharded(kernel))(q, k, v, mask)
        interpreted = jax.jit(lambda *a: api.masked_attention(*a, backend="pallas_interpret"))(q, k, v, mask)
    assert seen == [((2, 3, 1, 2, 16), (2, 1, 24, 16), (2, 3, 24))]
    expected = reference.masked_attention(q, k, v, mask)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(interpreted, expected, rtol=1e-5, atol=1e-5)
    jax.jit(api.sharded(kernel))(q, k, v, mask)  # no mesh: whole
    assert seen[-1] == (q.shape, k.shape, mask.shape)

    assert api.shard_specs(mesh.abstract_mesh, 1, 3) is None  # one row, 3 heads on tensor=4
    assert api.shard_specs(mesh.abstract_mesh, 1, 4) == (P(None, None, "tensor"), P(None, "tensor"), P(None))
    both = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)).abstract_mesh
    assert api.shard_specs(both, 4, 3)[0] == P(("data", "fsdp"), None, None)
    assert api.shard_specs(both, 2, 2)[1] == P("data", "tensor")


def test_a_compiled_backend_passes_its_compile_check_under_the_trainers_mesh():
    """The compiled backends (pallas, triton) are compile-checked before they run (backends.dispatch). Under the
    training programs' abstract mesh (update.traced_under) the check compiled the kernel's shard_map with no devices to
    place its shards on, failed (an unlowered Shardy custom call), and GPU training fell back to the reference."""
    from fastrl_jax.kernels import backends

    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((4, 5, 2, 2, 8)), jnp.float32)  # shapes of this test alone: the check is cached
    k, v = (jnp.asarray(rng.standard_normal((4, 2, 20, 8)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((4, 5, 20)) < 0.7).at[..., 0].set(True)
    used = []

    def attention(q, k, v, mask):  # pallas_interpret checked as "pallas" and "triton" are on a GPU
        out, name = backends.dispatch("attention", api.IMPLS, "pallas_interpret", (q, k, v, mask),
                                      compiled=("pallas_interpret",))
        used.append(name)
        return out

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    args = jax.device_put((q, k, v, mask), NamedSharding(mesh, P()))  # on the mesh, as the trainer's arrays are
    out = jax.jit(update.traced_under(mesh, attention))(*args)
    assert used == ["pallas_interpret"]
    np.testing.assert_allclose(out, reference.masked_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_a_tensor_parallel_engine_holds_its_own_heads_of_the_cache():
    """On tensor=2 each device of a replica holds the KV caches (the policy's and the drafter's) of its own KV heads
    (the weights' split), not the whole caches, with the attention kernel run per shard; a speculating engine's
    sampled outputs equal a one-device plain engine's."""
    reqs = [Request(p, max_new_tokens=10, temperature=0.8, seed=3 + i) for i, p in enumerate(prompts(3, seed=5))]
    expected = RolloutEngine(tiny_model(), CFG, progress=False).generate(reqs)
    model = tiny_model()
    model.cfg = dataclasses.replace(TINY, attention_backend="pallas_interpret")
    mesh = make_mesh(MeshConfig(tensor=2), jax.devices()[:2])

    def on_mesh(module):
        graphdef, state = nnx.split(module)
        return nnx.merge(graphdef, jax.device_put(state, shardings_for(state, mesh)))

    spec = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6)
    engine = RolloutEngine(on_mesh(model), CFG, sd=spec, drafter=on_mesh(Drafter(model.cfg, nnx.Rngs(5))), progress=False)

    out = engine.generate(reqs)
    assert [o.tokens for o in out] == [e.tokens for e in expected]
    assert engine.stats.calls["sd"] > 0
    table = engine.pool.get(("empty", 4))()
    for cache in (table.cache, table.draft.cache):
        assert cache.k.sharding.spec == P(None, None, "tensor", None, None)
        assert {s.data.shape[2] for s in cache.k.addressable_shards} == {1}  # of TINY's 2 KV heads
    assert table.token.sharding.spec == P()
    # The kept features split over tensor as XLA carries them: replicated, every call copied and gathered the
    # whole [B, S, F] table (found by review)
    assert table.hidden.sharding.spec == P(None, None, "tensor")
    fn, args = engine._build(("decode", 4, 32))
    with jax.set_mesh(mesh):
        hlo = fn.lower(*args).compile().as_text()
    whole = f"[4,{table.hidden.shape[1]},{table.hidden.shape[2]}]"
    assert not [line for line in hlo.splitlines() if "all-gather" in line and whole in line]


def test_an_engine_splits_its_tables_rows_over_fsdp():
    """On fsdp=2 x tensor=2 each device of a replica holds half the rows of the KV caches (the policy's and the
    drafter's) and of the kept hidden states, of its own KV heads: with rows whole every device along fsdp held the
    whole table (found by review). Attention runs each device's rows, the other contractions every row over the
    split weights; speculation moves each device's own rows, where a dynamic slice of the split row axis gathered
    the whole cache onto every device; compaction takes rows across devices. Sampled outputs and hidden states
    equal a one-device plain engine's."""
    reqs = [Request(p, max_new_tokens=4 + 6 * (i % 5), temperature=0.8, seed=3 + i)
            for i, p in enumerate(prompts(10, seed=5))]
    plain = RolloutEngine(tiny_model(), CFG, keep_hidden=True, progress=False)
    expected = plain.generate(reqs)
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])

    def on_mesh(module):
        graphdef, state = nnx.split(module)
        return nnx.merge(graphdef, jax.device_put(state, shardings_for(state, mesh)))

    model = tiny_model()
    spec = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6)
    engine = RolloutEngine(on_mesh(model), CFG, sd=spec, drafter=on_mesh(Drafter(model.cfg, nnx.Rngs(5))),
                           keep_hidden=True, progress=False)
    out = engine.generate(reqs)
    assert [o.tokens for o in out] == [e.tokens for e in expected]
    for o, e in zip(out, expected):
        np.testing.assert_allclose(o.hidden_states, e.hidden_states, rtol=2e-3, atol=1e-2)  # entries up to ~400
    assert engine.stats.calls["sd"] > 0 and engine.stats.calls["resize"] >= 2  # 16 -> 4 -> 1 rows
    # A stream refilling rows beside decode steps (prefills riding on them) on the same mesh
    stream = RolloutEngine(on_mesh(tiny_model()), dataclasses.replace(CFG, batch_buckets=(1, 4), prefill_with_decode=True),
                           progress=False)
    assert [o.tokens for o in stream.generate(reqs)] == [e.tokens for e in expected]
    assert stream.stats.calls["decode_admit"] > 0

    table = engine.pool.get(("empty", 4))()
    for cache in (table.cache, table.draft.cache):
        assert cache.k.sharding.spec == P(None, "fsdp", "tensor", None, None)
        assert {s.data.shape[1:3] for s in cache.k.addressable_shards} == {(2, 1)}
    assert {s.data.shape[0] for s in table.hidden.addressable_shards} == {2}
    assert engine.pool.get(("empty", 1))().cache.k.sharding.spec == P(None, None, "tensor", None, None)  # one row: whole
    L, B, _, S, _ = table.cache.k.shape
    whole = re.compile(rf"= f32\[{L},{B},\d+,{S},\d+\].* all-gather")  # the whole cache, of a device's heads
    for key in (("decode", 4, 32), ("sd", 4, 32, engine.strategies[0])):
        fn, args = engine._build(key)
        with jax.set_mesh(mesh):
            hlo = fn.lower(*args).compile().as_text()
        assert not whole.search(hlo), key


@pytest.mark.parametrize("old, new", [(8, 4), (4, 1), (6, 4), (3, 1)])
def test_compaction_takes_rows_split_over_fsdp(old, new):
    """programs.resize's take of a table's split rows (each device takes those it holds, a reduce-scatter hands out
    the new rows) equals jnp.take, from rows split or whole into rows split or whole; -1 gives zeros."""
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])
    x = jnp.asarray(np.random.default_rng(old).standard_normal((2, old, 2, 3, 4)), jnp.float32)
    index = np.random.default_rng(new).permutation(old)[:new]
    index[0] = -1
    rows = jnp.where(index < 0, old, index)
    specs = [programs.cache_spec(mesh, n, 2) for n in (old, new)]
    assert [s[1] for s in specs] == ["fsdp" if old % 2 == 0 else None, "fsdp" if new % 2 == 0 else None]
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x, r: programs._take_split_rows(x, r, 1, *specs))(
            jax.device_put(x, NamedSharding(mesh, specs[0])), rows)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, specs[1]), out.ndim)
    np.testing.assert_array_equal(out, jnp.take(x, rows, axis=1, mode="fill", fill_value=0))


def test_an_engine_on_a_mesh_takes_a_drafter_loaded_on_one_device():
    """load_drafter gives the drafter on one device, and generate / eval / bench-sd --drafter hand it to an engine
    whose policy is on the config's mesh: its programs refused the drafter there ('incompatible devices')."""
    reqs = [Request(p, max_new_tokens=8, temperature=0.8, seed=7 + i) for i, p in enumerate(prompts(2, seed=9))]
    expected = RolloutEngine(tiny_model(), CFG, progress=False).generate(reqs)
    mesh = make_mesh(MeshConfig(tensor=2), jax.devices()[:2])
    graphdef, state = nnx.split(tiny_model())
    model = nnx.merge(graphdef, jax.device_put(state, shardings_for(state, mesh)))

    def on_one_device():  # committed there, as Orbax restores it
        graphdef, state = nnx.split(Drafter(TINY, nnx.Rngs(5)))
        return nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))

    engine = RolloutEngine(model, CFG, sd=SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6),
                           drafter=on_one_device(), progress=False)
    assert [o.tokens for o in engine.generate(reqs)] == [e.tokens for e in expected]
    engine.update_drafter(on_one_device())
    assert [o.tokens for o in engine.generate(reqs)] == [e.tokens for e in expected]
    assert engine.stats.calls["sd"] > 0


def test_training_programs_run_the_kernels_per_shard():
    """The update step and the old log-probs trace under the trainer's mesh, so a kernel backend runs per shard
    there too (rows over data x fsdp, heads over tensor), with the reference's log-probs."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rng = np.random.default_rng(1)
    M, P, C = 4, 8, 8
    tokens = rng.integers(0, TINY.vocab_size, (M, P + C)).astype(np.int32)
    pad = np.asarray([0, 3, 1, 5], np.int32)
    mask = np.ones((M, C), np.float32)
    logps = []
    for backend in ("reference", "pallas_interpret"):
        graphdef, state = nnx.split(Decoder(dataclasses.replace(TINY, attention_backend=backend), nnx.Rngs(0)))
        shardings = nnx.to_pure_dict(shardings_for(state, mesh))
        params = jax.device_put(nnx.to_pure_dict(state), shardings)
        fn = update.jit_logprobs(graphdef, 0.7, shardings, mesh, M)
        per_shard = "manual_computation" in fn.lower(params, tokens, pad, mask).as_text()
        assert per_shard == (backend != "reference")
        logps.append(np.asarray(fn(params, tokens, pad, mask)))
        tx = optax.sgd(1.0)
        step = update.jit_train_step(graphdef, tx, update.StepOptions(0.7, 0.2, 0.28, 3.0, "token", 0.0, "k3", True, True),
                                     shardings, update.optimizer_shardings(tx, params, shardings, mesh), mesh, False, M)
        batch = update.GRPOBatch(tokens[None], pad[None], mask[None], np.ones((1, M), np.float32),
                                 np.zeros((1, M, C), np.float32))
        per_shard = "manual_computation" in step.lower(params, tx.init(params), None, batch).as_text()
        assert per_shard == (backend != "reference")
    np.testing.assert_allclose(logps[1], logps[0], rtol=1e-5, atol=1e-5)


def test_the_update_keeps_each_devices_rows_through_the_layers():
    """Rows arrive split over data x fsdp; unconstrained, XLA gathered the whole micro-batch's activations onto
    every device along fsdp to split the contractions over the fsdp-sharded weight dimension (review: fsdp=8 needed
    4.2x data=8's temporaries, and ZeRO saved no activation memory). Compiled only; the parity tests run it."""
    cfg = dataclasses.replace(TINY, num_layers=4, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=8,
                              head_dim=32, vocab_size=512)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    tx, M, P, C = optax.sgd(1.0), 64, 64, 64
    opts = update.StepOptions(1.0, 0.2, 0.28, 0.0, "token", 0.0, "k3", True, on_policy=True)
    S = jax.ShapeDtypeStruct
    batch = update.GRPOBatch(S((1, M, P + C), jnp.int32), S((1, M), jnp.int32), S((1, M, C), jnp.float32),
                             S((1, M), jnp.float32), S((1, M, C), jnp.float32))
    temporaries = {}
    for axis in ("data", "fsdp"):
        mesh = make_mesh(MeshConfig(**{axis: 8}))
        shardings = nnx.to_pure_dict(shardings_for(abstract, mesh))
        params = jax.tree.map(lambda a, s: S(a.shape, a.dtype, sharding=s), nnx.to_pure_dict(abstract), shardings)
        opt = update.optimizer_shardings(tx, params, shardings, mesh)
        step = update.jit_train_step(graphdef, tx, opts, shardings, opt, mesh, False, M)
        compiled = step.lower(params, jax.eval_shape(tx.init, params), None, batch).compile()
        temporaries[axis] = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries["fsdp"] <= 1.5 * temporaries["data"], temporaries


def test_drafter_training_keeps_each_devices_rows_through_its_layer():
    """The online drafter trainer places its batch rows over data x fsdp; its forward constrained every row onto
    every device (the engines' rule for run_layers(rows=None) under a mesh), and XLA gathered the whole batch's
    activations there (found by review). Compiled only: no all-gather of a [B, S, ...] activation."""
    from fastrl_jax.drafter.buffer import PackedBatch
    from fastrl_jax.drafter.train import LossSettings, drafter_loss

    mesh = make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()[:4])

    def on_mesh(module):
        graphdef, state = nnx.split(module)
        return graphdef, jax.device_put(state, shardings_for(state, mesh))

    (pg, ps), (dg, ds) = on_mesh(tiny_model()), on_mesh(Drafter(TINY, nnx.Rngs(1)))
    B, S = 8, 32
    batch = dataclasses.asdict(PackedBatch.zeros(B, S, TINY.hidden_size))
    batch = {k: jax.device_put(v, named_sharding(mesh, ("batch",) + (None,) * (v.ndim - 1), v.shape)) for k, v in batch.items()}

    def loss(ds, ps, batch):
        return drafter_loss(nnx.merge(dg, ds), nnx.merge(pg, ps), batch, jax.random.key(0), LossSettings(unroll_steps=2))[0]

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(ds, ps, batch).compile().as_text()
    gathered = re.findall(rf"= f32\[{B},{S},[\d,]*\]\S* all-gather", hlo)
    assert not gathered, gathered


def test_a_rollout_replica_spanning_hosts_is_refused_by_name_before_loading(monkeypatch, tmp_path):
    """mesh.data=1 over 2 hosts: every process drives no replica, so the online drafter's check said min_idle_replicas
    (1) exceeds 0 replicas and advised drafter_online.enabled=false, after which the weights loaded and Workers named
    the real problem (review). Two processes of 4 devices each, faked by the devices' process_index."""
    import types

    from fastrl_jax.config import load_config
    from fastrl_jax.rl import trainer as trainer_module
    from fastrl_jax.sharding import check_replicas_on_hosts, make_mesh

    hosts = np.array([types.SimpleNamespace(process_index=i // 4) for i in range(8)])
    check_replicas_on_hosts(types.SimpleNamespace(shape={"data": 2}, devices=hosts.reshape(2, 4, 1)))  # one a host
    spanning = types.SimpleNamespace(shape={"data": 1, "fsdp": 8}, devices=hosts.reshape(1, 8, 1))
    with pytest.raises(ConfigError, match=r"rollout replica 0 spans processes \[0, 1\]: make mesh.data a multiple"):
        check_replicas_on_hosts(spanning)
    real = make_mesh(MeshConfig(data=1, fsdp=8))
    monkeypatch.setattr(trainer_module, "make_mesh", lambda cfg: types.SimpleNamespace(
        shape=real.shape, devices=spanning.devices, size=8))
    cfg = load_config(None, [f"rl.out_dir={tmp_path / 'run'}", "mesh.fsdp=8", "rl.micro_batch_size=8",
                             "rl.prompts_per_step=8", "sd.mode=adaptive"])
    monkeypatch.setattr(trainer_module, "load_tokenizer", lambda path: pytest.fail("read the model before refusing"))
    with pytest.raises(ConfigError, match="spans processes"):
        trainer_module.train(cfg)
