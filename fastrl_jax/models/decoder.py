"""The policy decoder (Llama / Qwen2 / Qwen3) in flax.nnx, with stacked layers and a static KV cache.

One forward serves prefill, single-token decode and tree verification: the new tokens of each
row are written into the cache at slots [start, start + T), and each new token attends to the
row's cached prefix (slots < start) plus the new slots its `block_mask` row allows (causal for
prefill and decode, ancestors-only for a draft tree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import PartitionSpec

from fastrl_jax.kernels.tree_attention.api import cached_attention, shard_specs
from fastrl_jax.models.config import ModelConfig, rope_inv_freq


@struct.dataclass
class KVCache:
    """Keys and values of every layer: k, v [layers, batch, kv_heads, max_len, head_dim].

    Slots, not lengths: the caller tracks how many slots of each row are valid.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale=0.02) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype), logical_axes=axes)


def _ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=axes)


class Layers(nnx.Module):
    """All decoder layers' weights, stacked on a leading `layers` axis and run under lax.scan."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, embed_input: bool = False):
        """embed_input: EAGLE-3's draft layer, whose attention reads concat(attn_norm(embed), hidden_norm(x))
        (q/k/v projections 2H wide, an extra hidden_norm) while the residual stream is x."""
        L, H, F, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        A = 2 * H if embed_input else H
        self.attn_norm = _ones((L, H), ("layers", "norm"), dtype)
        if embed_input:
            self.hidden_norm = _ones((L, H), ("layers", "norm"), dtype)
        self.wq = _param(rngs, (L, A, nh, D), ("layers", "embed", "heads", "head_dim"), dtype)
        self.wk = _param(rngs, (L, A, nkv, D), ("layers", "embed", "kv_heads", "head_dim"), dtype)
        self.wv = _param(rngs, (L, A, nkv, D), ("layers", "embed", "kv_heads", "head_dim"), dtype)
        self.wo = _param(rngs, (L, nh, D, H), ("layers", "heads", "head_dim", "embed"), dtype)
        if cfg.qkv_bias:
            self.bq = _param(rngs, (L, nh, D), ("layers", "heads", "head_dim"), dtype)
            self.bk = _param(rngs, (L, nkv, D), ("layers", "kv_heads", "head_dim"), dtype)
            self.bv = _param(rngs, (L, nkv, D), ("layers", "kv_heads", "head_dim"), dtype)
        if cfg.qk_norm:
            self.q_norm = _ones((L, D), ("layers", "head_dim"), dtype)
            self.k_norm = _ones((L, D), ("layers", "head_dim"), dtype)
        self.mlp_norm = _ones((L, H), ("layers", "norm"), dtype)
        self.w_gate = _param(rngs, (L, H, F), ("layers", "embed", "mlp"), dtype)
        self.w_up = _param(rngs, (L, H, F), ("layers", "embed", "mlp"), dtype)
        self.w_down = _param(rngs, (L, F, H), ("layers", "mlp", "embed"), dtype)


class Decoder(nnx.Module):
    """Token embedding, scanned decoder layers, final norm, LM head (tied or not)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = Layers(cfg, rngs, dtype)
        self.final_norm = _ones((cfg.hidden_size,), ("norm",), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    def head_weight(self) -> jax.Array:
        """LM head as [vocab, hidden] rows: the tied embedding as it is stored (XLA CPU copied the
        whole [hidden, vocab] transpose at every step)."""
        return self.embed[...] if self.cfg.tie_word_embeddings else self.lm_head[...].T

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        start: jax.Array,
        block_mask: jax.Array | None = None,
        kv_len: int | None = None,
        mask: jax.Array | None = None,
        capture: tuple[int, ...] = (),
        narrow: tuple[jax.Array, int] | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Runs the new tokens of every row against the cache.

        Args:
          tokens: [B, T] int32 new tokens.
          positions: [B, T] int32 RoPE positions of the new tokens.
          cache: KV cache; the new keys/values are written at slots [start, start + T).
          start: [B] int32 first cache slot of each row's new tokens (= its cached prefix length).
          block_mask: [B, T, T] bool, which new tokens each new token sees; causal when None.
          kv_len: static number of cache slots attention reads (a length bucket, >= start + T
            for every row); the whole cache when None.
          mask: [B, T, kv_len] bool, every slot each new token sees; replaces the prefix +
            block_mask rule when given (the drafter's tree steps need it).
          capture: static layer indices whose input hidden states come back as the features
            (SGLang's convention: index i is the residual stream entering layer i, num_layers the last
            layer's output); () for the last-layer hidden states.
          narrow: (wide_rows [n] int32, static S'): per-row windows. Every row but wide_rows reads only
            the first S' cache slots (each such row needs start + T <= S'); wide_rows read all kv_len.
            One long row then does not make every row read the long window.

        Returns:
          logits [B, T, vocab] float32, the features the drafter reads (last-layer hidden states
          [B, T, hidden] before the final norm, or with `capture` the captured states concatenated,
          [B, T, len(capture) * hidden]), and the updated cache.
        """
        hidden, features, cache = self.hidden_and_features(tokens, positions, cache, start, block_mask, kv_len, mask, capture,
                                                           narrow)
        return self.logits(hidden), features, cache

    def hidden(self, tokens, positions, cache: KVCache, start, block_mask=None, kv_len=None, mask=None):
        """__call__ without the LM head: (last-layer hidden states, cache), for callers that need
        the logits of a few positions only (a prefill samples from each prompt's last)."""
        hidden, _, cache = self.hidden_and_features(tokens, positions, cache, start, block_mask, kv_len, mask)
        return hidden, cache

    def hidden_and_features(self, tokens, positions, cache: KVCache, start, block_mask=None, kv_len=None, mask=None,
                            capture: tuple[int, ...] = (), narrow=None, cached_slots: int | None = None):
        """(last-layer hidden states, features as __call__ returns them, cache). cached_slots (static): no
        new token sees a cached slot at or past it (kernels' cached_attention), e.g. a packed prefill
        behind a shared prefix of cached_slots tokens, whose own slots then go unscored as cached ones."""
        kv_len = cache.max_len if kv_len is None else kv_len
        if mask is None:
            mask = attention_mask(start, block_mask, tokens.shape[1], kv_len)
        out = run_layers(self.cfg, self.layers, self.embed[tokens], positions, cache, start, mask, capture=capture,
                         narrow=narrow, cached_slots=cached_slots)
        if not capture:
            return out[0], out[0], out[1]
        return out

    def hidden_and_features_together(self, parts, capture: tuple[int, ...] = ()):
        """hidden_and_features of several groups of tokens in one pass over the weights
        (run_layers_together): parts of (tokens [B, T], positions [B, T], cache, start [B], mask
        [B, T, kv_len], cached_slots); returns (hidden, features, cache) per part."""
        return run_layers_together(self.cfg, self.layers, [(self.embed[t], *rest) for t, *rest in parts], capture)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm and LM head: [..., hidden] -> [..., vocab] float32."""
        x = rms_norm(hidden, self.final_norm[...], self.cfg.rms_norm_eps)
        return head_logits(x, self.head_weight())


def run_layers(cfg: ModelConfig, layers: Layers, x, positions, cache: KVCache, start, mask, input_norm=True, remat=False,
               capture: tuple[int, ...] = (), embeds=None, narrow=None, cached_slots: int | None = None, rows=None):
    """Scanned decoder layers over x [B, T, H]; new keys/values go to cache slots [start, start + T).

    mask [B, T, kv_len] gives the cache window attention reads. input_norm=False skips the first
    layer's input RMSNorm (the EAGLE drafter's layer has none). remat=True recomputes each layer's
    activations in the backward pass instead of keeping them (training memory). embeds [B, T, H]:
    the token embeddings an EAGLE-3 draft layer (Layers(embed_input=True)) reads beside x. narrow:
    per-row windows (Decoder.__call__). cached_slots: as Decoder.hidden_and_features. rows: a PartitionSpec of
    x under the context mesh that every layer's input and output keep (the training forward's rows split over
    data x fsdp; unconstrained, XLA gathered the whole micro-batch onto every device to split the contractions
    over the fsdp-sharded weight dimension instead); None under a mesh keeps every row on every device (the
    engines' and drafters' calls, whose weights are not gathered: attention alone runs each device's rows, _attend).

    Returns (x, cache); with `capture` (static layer indices in [0, num_layers]) (x, features, cache),
    features [B, T, len(capture) * H] the residual stream entering each captured layer (num_layers:
    the output), concatenated: EAGLE-3's policy features, kept in the scan carry so no per-layer
    stack of hidden states is materialised.
    """
    kv_len = mask.shape[-1]
    cos, sin = rope_tables(cfg, positions)
    layer_params = nnx.to_pure_dict(nnx.state(layers))
    if any(not 0 <= c <= cfg.num_layers for c in capture):
        raise ValueError(f"capture layers {capture} must lie in [0, {cfg.num_layers}]")

    if rows is None and not jax.sharding.get_abstract_mesh().empty:
        rows = PartitionSpec()

    def keep(t):
        return t if rows is None else jax.lax.with_sharding_constraint(t, rows)

    def layer(carry, inputs):
        x, aux = carry
        i, p, k_cached, v_cached = inputs
        x = keep(x)
        aux = _grab(capture, i, x, aux)
        x, kv = _layer(cfg, p, x, k_cached[:, :, :kv_len], v_cached[:, :, :kv_len], cos, sin, start, mask, input_norm,
                       embeds, narrow, cached_slots, rows)
        return (keep(x), aux), kv

    if remat:
        layer = jax.checkpoint(layer)

    # The cache is only read inside the loop; the new keys/values come out as small [L, B, KV, T, D]
    # outputs and are written once afterwards, in place (the caller donates the cache). Carrying
    # the cache through the scan instead made XLA copy it at every layer.
    aux = tuple(jnp.zeros_like(x) for _ in capture)
    (x, aux), (k_new, v_new) = _over_layers(layer, (x, aux), layer_params, (cache.k, cache.v))
    after = x if _unrolled(layer_params) else None
    cache = KVCache(k=_write_rows(cache.k, k_new, start, after), v=_write_rows(cache.v, v_new, start, after))
    if not capture:
        return x, cache
    aux = _grab(capture, cache.k.shape[0], x, aux)
    return x, jnp.concatenate(aux, axis=-1), cache


def _unrolled(params: dict) -> bool:
    """Whether unstack_layers split these layer weights (a tuple of per-layer arrays each)."""
    return isinstance(next(iter(params.values())), tuple)


def _over_layers(body, carry, params: dict, xs):
    """jax.lax.scan(body, carry, (layer index, layer weights, *xs)) with xs [L, ...] per layer. Weights that
    unstack_layers split run the same loop unrolled instead."""
    first = next(iter(params.values()))
    if not _unrolled(params):
        return jax.lax.scan(body, carry, (jnp.arange(first.shape[0]), params, *xs))
    outs = []
    for i in range(len(first)):
        carry, out = body(carry, (i, {k: v[i] for k, v in params.items()}, *(jax.tree.map(lambda a: a[i], x) for x in xs)))
        outs.append(out)
    return carry, jax.tree.map(lambda *o: jnp.stack(o), *outs)


def unstack_layers(state: nnx.State) -> nnx.State:
    """A decoder's state (nnx.split) with every stacked layer weight [L, ...] split into a tuple of L
    arrays, each its own buffer once passed through jit: run_layers then unrolls the layer loop
    (rollout.layer_loop 'unrolled'). Under the scan, XLA GPU copied each layer's MLP weights out of the
    stacked arrays at every layer of every decode step, tripling their HBM traffic (docs/gpu.md,
    2026-11-26). Stacked states (training, checkpoints, export) are unchanged."""
    def split(var):
        value = var.get_value()
        if isinstance(value, tuple):
            return var
        if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model (dry runs)
            return var.replace(tuple(jax.ShapeDtypeStruct(value.shape[1:], value.dtype) for _ in range(value.shape[0])))
        return var.replace(tuple(value[i] for i in range(value.shape[0])))

    state = jax.tree.map(lambda x: x, state)  # new Variables over the same arrays: the caller's state stays stacked
    state["layers"] = jax.tree.map(split, state["layers"], is_leaf=lambda x: isinstance(x, nnx.Variable))
    return state


def _grab(capture: tuple[int, ...], i, x, aux):
    """aux with x in the entries of the captured layers equal to i (the layer scan's index)."""
    return tuple(jnp.where(i == c, x, a) for c, a in zip(capture, aux))


def run_layers_together(cfg: ModelConfig, layers: Layers, parts, capture: tuple[int, ...] = ()):
    """run_layers over several groups of tokens in one pass: each part (x [B, T, H], positions [B, T],
    cache, start [B], mask [B, T, kv_len], cached_slots) attends over its own cache and writes its new keys / values
    there, while each layer's weight contractions run over every part's tokens at once (one pass over
    the weights: a prefill riding on a decode step). Returns (x, features, cache) per part; features
    as run_layers' with `capture`, x itself without."""
    sizes = [x.shape[0] * x.shape[1] for x, *_ in parts]
    cuts = np.cumsum(sizes)[:-1].tolist()

    def flat(pieces):  # [B, T, ...] per part -> [1, sum of B x T, ...]
        return jnp.concatenate([a.reshape(1, -1, *a.shape[2:]) for a in pieces], axis=1)

    def split(a, axis=1):  # flat -> [B, T, ...] per part; axis 2: keys / values [1, KV, M, D] -> [B, KV, T, D]
        out = []
        for piece, (x, *_) in zip(jnp.split(a, cuts, axis=axis), parts):
            B, T = x.shape[:2]
            out.append(piece.reshape(B, T, *piece.shape[2:]) if axis == 1
                       else piece.reshape(piece.shape[1], B, T, -1).transpose(1, 0, 2, 3))
        return out

    tables = [rope_tables(cfg, positions) for _, positions, *_ in parts]
    cos, sin = flat([c for c, _ in tables]), flat([s for _, s in tables])
    layer_params = nnx.to_pure_dict(nnx.state(layers))
    every_row = None if jax.sharding.get_abstract_mesh().empty else PartitionSpec()  # as run_layers' rows=None

    def layer(carry, inputs):
        x, aux = carry
        i, p, cached = inputs
        aux = _grab(capture, i, x, aux)
        q, k, v = _qkv(cfg, p, x, cos, sin)
        attn, new = [], []
        for q_, k_, v_, (k_cached, v_cached), (*_, start, mask, slots) in zip(split(q), split(k, 2), split(v, 2), cached, parts):
            kv_len = mask.shape[-1]
            attn.append(_attend(cfg, q_, k_cached[:, :, :kv_len], v_cached[:, :, :kv_len], k_, v_, start, mask,
                                cached_slots=slots, rows=every_row))
            new.append((k_, v_))
        return (_out_and_mlp(cfg, p, x, flat(attn)), aux), new

    x = flat([x for x, *_ in parts])
    aux = tuple(jnp.zeros_like(x) for _ in capture)
    cached = [(cache.k, cache.v) for _, _, cache, *_ in parts]
    (x, aux), new = _over_layers(layer, (x, aux), layer_params, (cached,))
    features = jnp.concatenate(_grab(capture, cfg.num_layers, x, aux), axis=-1) if capture else x
    out = []
    after = x if _unrolled(layer_params) else None
    for x_, f_, (k_new, v_new), (_, _, cache, start, *_) in zip(split(x), split(features), new, parts):
        out.append((x_, f_, KVCache(k=_write_rows(cache.k, k_new, start, after), v=_write_rows(cache.v, v_new, start, after))))
    return out


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE cos and sin [..., head_dim / 2] (float32, scaled) at int positions [...]."""
    inv_freq, rope_scale = rope_inv_freq(cfg)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * rope_scale, jnp.sin(angles) * rope_scale


def head_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """x [..., hidden] against LM head rows [vocab, hidden] -> float32 logits [..., vocab]."""
    return jnp.einsum("...h,vh->...v", x, head.astype(x.dtype), preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE in HF's half-split layout. x [B, T, heads, D]; cos/sin [B, T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention_mask(start: jax.Array, block_mask: jax.Array | None, T: int, kv_len: int) -> jax.Array:
    """[B, T, kv_len] bool: the cached prefix (slots < start) plus the new slots block_mask allows.

    block_mask [B, T, T] (None: causal) says which of the T new tokens each new token sees.
    """
    if block_mask is None:
        block_mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (start.shape[0], T, T))
    rel = jnp.arange(kv_len)[None, :] - start[:, None]  # [B, S]
    idx = jnp.broadcast_to(jnp.clip(rel, 0, T - 1)[:, None, :], (rel.shape[0], T, kv_len))
    in_block = ((rel >= 0) & (rel < T))[:, None, :] & jnp.take_along_axis(block_mask, idx, axis=2)
    return (rel < 0)[:, None, :] | in_block


def _write_rows(cache: jax.Array, new: jax.Array, start: jax.Array, after: jax.Array | None = None) -> jax.Array:
    """Writes new [L, B, KV, T, D] into cache [L, B, KV, S, D] at slot start[b] of each row b.

    One dynamic_update_slice per row in a loop updates the donated cache in place; the vmapped
    form lowers to a scatter that XLA CPU runs far slower (docs/measurements.md).

    after: the unrolled layers' output, which the writes must follow. The last layer's new keys do not
    depend on its own read of the cache, so XLA may order the writes before that read and then copies
    the whole cache to keep it: twice per decode step (CPU, batch 64: 428 against 202 ms a step). An
    optimization_barrier did not stop it; write slots read off `after` (always `start`, but not provably
    so) do, and the loop keeps its static trip count (a GPU while loop with a dynamic one syncs with the
    host at every iteration).
    """
    new = new.astype(cache.dtype)
    if after is not None:
        start = jnp.minimum(start, start + jnp.argmax(after[(0,) * (after.ndim - 1)][:8]))

    def write_row(b, cache):
        row = jax.lax.dynamic_slice_in_dim(new, b, 1, axis=1)
        return jax.lax.dynamic_update_slice(cache, row, (0, b, 0, start[b], 0))

    return jax.lax.fori_loop(0, cache.shape[1], write_row, cache)


def _layer(cfg: ModelConfig, p, x, k_cached, v_cached, cos, sin, start, mask, input_norm=True, embeds=None, narrow=None,
           cached_slots=None, rows=None):
    """One decoder layer. k_cached/v_cached [B, KV, S, D] hold the prefix (slots < start)."""
    q, k, v = _qkv(cfg, p, x, cos, sin, input_norm, embeds)
    attn = _attend(cfg, q, k_cached, v_cached, k, v, start, mask, narrow, cached_slots, rows)
    return _out_and_mlp(cfg, p, x, attn), (k, v)


def _qkv(cfg: ModelConfig, p, x, cos, sin, input_norm=True, embeds=None):
    """The layer's rotated queries [B, T, heads, D] and new keys / values [B, KV, T, D] (the cache layout)."""
    if embeds is not None:  # EAGLE-3's draft layer (SGLang's llama_eagle3 midlayer)
        h = jnp.concatenate([rms_norm(embeds.astype(x.dtype), p["attn_norm"], cfg.rms_norm_eps),
                             rms_norm(x, p["hidden_norm"], cfg.rms_norm_eps)], axis=-1)
    else:
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps) if input_norm else x
    q = jnp.einsum("bth,hnd->btnd", h, p["wq"])
    k = jnp.einsum("bth,hnd->btnd", h, p["wk"])
    v = jnp.einsum("bth,hnd->btnd", h, p["wv"])
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _attend(cfg: ModelConfig, q, k_cached, v_cached, k, v, start, mask, narrow=None, cached_slots=None, rows=None):
    """Attention of queries [B, T, heads, D] over the cache window and the new keys -> [B, T, heads x D].

    Under a mesh each device attends its own rows and KV heads, as the kernels split them (shard_specs): the
    rollout tables keep each device's rows of the KV cache only, and the layers' x, which `rows` (its
    PartitionSpec) places, may hold every row on every device (the engines' calls: their contractions split over
    the fsdp-sharded weight dimension). The output goes back to x's rows."""
    B, T = q.shape[:2]
    mesh = jax.sharding.get_abstract_mesh()
    split = None if mesh.empty else shard_specs(mesh, B, cfg.num_kv_heads)
    if split is not None:
        (row, _, heads), c = split[0], jax.lax.with_sharding_constraint
        x_row = rows[0] if rows else None
        # The new queries, keys and values as their projections give them, on x's rows, then cut to attention's
        # (cut straight to them, each device's projection of its own rows gathered the weights)
        q = c(c(q, PartitionSpec(x_row, None, heads, None)), PartitionSpec(row, None, heads, None))
        k, v = (c(c(a, PartitionSpec(x_row, heads, None, None)), PartitionSpec(row, heads, None, None)) for a in (k, v))
        k_cached, v_cached = (c(a, PartitionSpec(row, heads, None, None)) for a in (k_cached, v_cached))
    G = cfg.num_heads // cfg.num_kv_heads
    qg = q.reshape(B, T, cfg.num_kv_heads, G, cfg.head_dim) / np.sqrt(cfg.head_dim).astype(q.dtype)
    attn = _windowed_attention(qg, k_cached, v_cached, k, v, start, mask, narrow, cached_slots,  # [B, T, KV, G, D]
                               cfg.attention_backend)
    out = attn.reshape(B, T, cfg.num_heads * cfg.head_dim)
    if split is not None and rows is not None:
        out = jax.lax.with_sharding_constraint(out, PartitionSpec(x_row, None, heads))
    return out


def _out_and_mlp(cfg: ModelConfig, p, x, attn):
    """The output projection's residual, then the MLP's."""
    # One contraction over (heads x head_dim): contracting the two axes apart, XLA CPU copied a transpose
    # of wo in every layer of every step (docs/measurements.md).
    x = x + jnp.einsum("bte,eh->bth", attn, p["wo"].reshape(attn.shape[-1], -1))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    mlp = jax.nn.silu(jnp.einsum("bth,hf->btf", h, p["w_gate"])) * jnp.einsum("bth,hf->btf", h, p["w_up"])
    return x + jnp.einsum("btf,fh->bth", mlp, p["w_down"])


def _windowed_attention(q, k_cached, v_cached, k, v, start, mask, narrow, cached_slots=None, backend="auto"):
    """cached_attention on `backend` (ModelConfig.attention_backend); with narrow = (wide_rows, S') every row
    reads the first S' slots and then wide_rows, gathered, read the whole window: B x S' + n x S slots, not B x S."""
    if narrow is None:
        return cached_attention(q, k_cached, v_cached, k, v, start, mask, cached_slots=cached_slots, backend=backend)
    rows, short = narrow
    out = cached_attention(q, k_cached[:, :, :short], v_cached[:, :, :short], k, v, start, mask[..., :short],
                           backend=backend)

    def take(a):
        return jnp.take(a, rows, axis=0)

    wide = cached_attention(*map(take, (q, k_cached, v_cached, k, v, start, mask)), backend=backend)
    return out.at[rows].set(wide)


def abstract_decoder(cfg: ModelConfig, dtype=jnp.float32) -> Decoder:
    """The decoder's structure with ShapeDtypeStruct leaves: no memory is allocated."""
    return nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0), dtype))


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def cast_floating(tree, dtype):
    """tree (a pure dict, nnx State or Module) with its floating arrays in `dtype`, on the same
    shardings; integer leaves (a draft vocabulary) and arrays already in `dtype` are kept as they are
    (no copy). The weight hand-off from float32 master weights to bfloat16 rollout engines."""
    dtype = jnp.dtype(dtype)

    def one(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        return x.astype(dtype)

    if isinstance(tree, nnx.Module):
        graphdef, state = nnx.split(tree)
        return nnx.merge(graphdef, jax.tree.map(one, state))
    return jax.tree.map(one, tree)


def param_count(model: Decoder) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

