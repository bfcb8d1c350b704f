"""Pure-JAX tree attention: the reference every kernel is tested against, and the CPU default.

Shapes (every backend):
  q    [B, T, KV, G, D]  new tokens' queries, already scaled by 1/sqrt(D); G query heads per KV head
  k, v [B, KV, S, D]     the attention window of the cache (new keys already placed in it)
  mask [B, T, S] bool    which slots each new token sees; every (b, t) row has a True
  out  [B, T, KV, G, D]  in q.dtype; the softmax runs over S in float32
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# The largest query block (new tokens per row) `cached_attention` contracts with (batch, kv head) as
# two dot batch dimensions; longer blocks flatten them into one (docs/measurements.md, "query blocks").
SMALL_QUERY_BLOCK = 16


def check_shapes(q, k, v, mask) -> None:
    """Raises ValueError naming the offending shapes; static, so it costs nothing under jit."""

    def fail(why):
        raise ValueError(
            f"masked_attention: {why}. Expected q [B, T, KV, G, D], k and v [B, KV, S, D], mask [B, T, S] bool; "
            f"got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}, "
            f"mask {tuple(mask.shape)} {mask.dtype}"
        )

    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4 or mask.ndim != 3:
        fail("wrong ranks")
    if k.shape != v.shape:
        fail("k and v shapes differ")
    B, T, KV, G, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, KV, D):
        fail("k/v batch, kv-head or head-dim size does not match q")
    if mask.shape != (B, T, k.shape[2]):
        fail("mask is not [B, T, S]")
    if mask.dtype != jnp.bool_:
        fail("mask must be bool")
    if not (q.dtype == k.dtype == v.dtype):
        fail("q, k and v dtypes differ")


# A large finite negative instead of -inf, as the kernels use: exp(MASK_VALUE - m) is 0 beside any visible slot,
# and a row that sees no slot gets a finite softmax (which `visible` then zeroes) instead of NaN, in the forward
# and in the gradient the compiled backends take from here.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def mask_bias(mask: jax.Array) -> jax.Array:
    """0 where mask is True, MASK_VALUE where False, to add to the scores: XLA CPU's YNNPACK fusion ran a
    jnp.where select after a flattened batched score dot 3-4x slower once the window passed 512 slots
    (docs/measurements.md). Adding 0 leaves a score as it was."""
    return jnp.where(mask, 0.0, MASK_VALUE).astype(jnp.float32)


def visible(out: jax.Array, *masks: jax.Array) -> jax.Array:
    """out [B, T, KV, G, D] with the tokens whose mask rows ([B, T, n] each) hold no slot set to 0, as the
    kernels leave them."""
    sees = functools.reduce(jnp.logical_or, [m.any(-1) for m in masks])
    return jnp.where(sees[:, :, None, None, None], out, 0).astype(out.dtype)


def masked_attention(q, k, v, mask):
    """Masked attention over the placed window (module docstring shapes); (batch, kv head) flattened
    into one dot batch dimension."""
    check_shapes(q, k, v, mask)
    B, T, KV, G, D = q.shape
    S = k.shape[2]
    qg = q.transpose(0, 2, 3, 1, 4).reshape(B * KV, G * T, D)
    s = jax.lax.dot_general(
        qg, k.reshape(B * KV, S, D), (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32
    ).reshape(B, KV, G, T, S)
    s = s + mask_bias(mask)[:, None, None]
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jax.lax.dot_general(p.reshape(B * KV, G * T, S), v.reshape(B * KV, S, D), (((2,), (1,)), ((0,), (0,))))
    return visible(out.reshape(B, KV, G, T, D).transpose(0, 3, 1, 2, 4), mask)


def place_new_tokens(cached: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cached [B, KV, S, D] with new [B, KV, T, D] in slots [start, start + T) of each row (a select
    that fuses into the window's copy; slots past S are dropped)."""
    B, KV, S, _ = cached.shape
    T = new.shape[2]
    rel = jnp.arange(S)[None, :] - start[:, None]
    in_block = ((rel >= 0) & (rel < T))[:, None, :, None]
    idx = jnp.broadcast_to(jnp.clip(rel, 0, T - 1)[:, None, :, None], (B, KV, S, 1))
    return jnp.where(in_block, jnp.take_along_axis(new, idx, axis=2), cached)


def cached_attention(q, k_cached, v_cached, k_new, v_new, start, mask, cached_slots: int | None = None):
    """Attention of T new tokens over a cache window in which slots [start, start + T) are theirs.

    q [B, T, KV, G, D] (scaled), k_cached, v_cached [B, KV, S, D] (what slots [start, start + T) hold
    is ignored), k_new, v_new [B, KV, T, D], start [B] int32, mask [B, T, S] bool (slot start + j
    stands for new token j). Scores the cached slots and the new tokens apart under one softmax, so
    the window with the new keys placed in it, a copy of the whole window at every layer, is never
    built (SmolLM2 decode and verify steps on CPU: 4-20% faster without it).
    cached_slots (static): no new token sees a cached key at or past this slot (only the new tokens'
    own slots lie there, as in a packed prefill behind a shared prefix), so the cached part scores
    the first cached_slots slots only.
    """
    check_shapes(q, k_cached, v_cached, mask)
    B, T, KV, G, D = q.shape
    S = k_cached.shape[2]
    rel = jnp.arange(S)[None, :] - start[:, None]  # [B, S] slot relative to the first new token
    cached_mask = mask & ~((rel >= 0) & (rel < T))[:, None, :]
    slots = start[:, None] + jnp.arange(T)[None, :]  # [B, T] slot of each new token
    idx = jnp.broadcast_to(jnp.minimum(slots, S - 1)[:, None, :], (B, T, T))
    new_mask = jnp.take_along_axis(mask, idx, axis=2) & (slots < S)[:, None, :]
    if cached_slots is not None:
        k_cached, v_cached = k_cached[:, :, :cached_slots], v_cached[:, :, :cached_slots]
        cached_mask = cached_mask[..., :cached_slots]
    scores, weighted = _contractions(q, small=T <= SMALL_QUERY_BLOCK)
    s_cached, s_new = scores(k_cached, cached_mask), scores(k_new, new_mask)
    # initial: a packed prefill with no shared prefix has cached_slots = 0
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(s_cached, -1, keepdims=True, initial=-jnp.inf), s_new.max(-1, keepdims=True)))
    p_cached, p_new = jnp.exp(s_cached - m), jnp.exp(s_new - m)
    total = p_cached.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)
    out = (weighted(p_cached, v_cached) + weighted(p_new, v_new)) / total
    return visible(out.astype(q.dtype).transpose(0, 3, 1, 2, 4), cached_mask, new_mask)


def _contractions(q, small: bool):
    """(scores(k, mask) -> [B, KV, G, T, n] float32 with masked entries -inf, weighted(p, v) ->
    [B, KV, G, T, D] float32). Decode and tree verification (small) keep (batch, kv head) as two dot
    batch dimensions; prefill chunks and training sequences flatten them into one."""
    B, T, KV, G, D = q.shape
    if small:

        def scores(k, m):
            s = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
            return s + mask_bias(m)[:, None, None]

        def weighted(p, v):
            return jnp.einsum("bkgts,bksd->bkgtd", p.astype(q.dtype), v, preferred_element_type=jnp.float32)

        return scores, weighted
    qg = q.transpose(0, 2, 3, 1, 4).reshape(B * KV, G * T, D)

    def scores(k, m):
        s = jax.lax.dot_general(qg, k.reshape(B * KV, -1, D), (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        return s.reshape(B, KV, G, T, -1) + mask_bias(m)[:, None, None]

    def weighted(p, v):
        p = p.astype(q.dtype).reshape(B * KV, G * T, -1)
        out = jax.lax.dot_general(p, v.reshape(B * KV, -1, D), (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        return out.reshape(B, KV, G, T, D)

    return scores, weighted
