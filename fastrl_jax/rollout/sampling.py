"""Position-keyed sampling: temperature, top-k, top-p, and the log-prob of the chosen token.

The token a request places at sequence position t is
    argmax(filtered_logits / temperature + Gumbel(key(seed, t)))
so it depends only on the request's seed, its position and the logits, never on the batch the
request shares, its row, or whether speculative decoding produced it (DESIGN.md's key(seed, r, t):
the request r is its seed, which the trainer derives from (run seed, step, request index), so two
requests with one seed and one prompt draw the same sample). Temperature 0 is greedy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingParams:
    """Per-row sampling parameters, each [B]."""

    temperature: jax.Array  # float32; 0 means greedy
    top_k: jax.Array  # int32; 0 means off
    top_p: jax.Array  # float32; 1 means off
    seed: jax.Array  # uint32


def _mix32(x: jax.Array) -> jax.Array:
    """A full-avalanche 32-bit integer hash (lowbias32, from Wellons' hash-prospector)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def position_gumbel(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [..., vocab] keyed by (seed, position) [...]: the same draw wherever the token is produced.

    A counter-based hash of (seed, position, token id); seed and position each enter through a
    bijective mix, so neighbouring seeds or positions draw unrelated noise (a chi-square test checks
    it). It is several times cheaper than jax.random's threefry, which matters because every sampled
    row draws a whole vocabulary of noise per step (docs/measurements.md).
    """
    return gumbel_at(seed, position, jnp.arange(vocab, dtype=jnp.uint32))


def gumbel_at(seed: jax.Array, position: jax.Array, token_ids: jax.Array) -> jax.Array:
    """position_gumbel's noise [..., K] for the token ids [K] only (a draft vocabulary): the same
    value each of those tokens gets from position_gumbel."""
    a = _mix32(seed.astype(jnp.uint32) ^ jnp.uint32(0x3C6EF372))[..., None]
    b = _mix32(position.astype(jnp.uint32) ^ jnp.uint32(0xA54FF53A))[..., None]
    bits = _mix32(_mix32(token_ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) ^ a) ^ b)
    # 23 random bits: (k + 0.5) / 2**23 is exact in float32 and at most 1 - 2**-24. With 24 bits the top draw
    # rounded to 1.0, whose noise is +inf: a random token, outside top-k / top-p too, once in ~2**24 / vocab draws.
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / 2**23)
    return -jnp.log(-jnp.log(u))


def first_argmax(x: jax.Array, chunk: int = 128) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum; NaN counts as the maximum):
    [..., V] -> [...] int32. XLA CPU's argmax reduce over a whole vocabulary runs far slower than a
    max (docs/measurements.md), so this finds the first chunk of `chunk` entries holding the maximum,
    then the argmax inside it."""
    V = x.shape[-1]
    pad = -V % chunk
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    chunks = x.reshape(*x.shape[:-1], -1, chunk)
    c = jnp.argmax(jnp.max(chunks, axis=-1), axis=-1)
    inside = jnp.take_along_axis(chunks, c[..., None, None], axis=-2)[..., 0, :]
    return (c * chunk + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] -> temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    # Only rows that sample decide (greedy rows take the argmax, which filtering keeps): the filter costs
    # full-vocabulary passes over every row
    needs_filter = jnp.any((params.temperature > 0) & ((params.top_k > 0) | (params.top_p < 1.0)))
    return jax.lax.cond(needs_filter, _top_k_top_p, lambda s, p: s, scaled, params)


def _top_k_top_p(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """HF's top-k then top-p filter, with each threshold found by bisection over the float order (32
    passes over the vocabulary) instead of a sort: XLA CPU's sort of a vocabulary costs more than a
    decode step (docs/measurements.md)."""
    keys = _order_keys(scaled)
    top_k = params.top_k[:, None]
    k_key = _largest_key_where(keys, lambda key: jnp.sum(keys >= key, -1, keepdims=True) >= top_k)
    k_key = jnp.where(top_k > 0, k_key, 0)
    # Keep the smallest prefix of the sorted tokens whose probability reaches top_p (HF's rule: a token
    # stays when the mass strictly before it is below top_p; the first always stays). Its last token is
    # the largest value v whose {tokens >= v} hold at least top_p of the mass after top-k.
    probs = jax.nn.softmax(jnp.where(keys >= k_key, scaled, -jnp.inf), axis=-1)
    top_p = params.top_p[:, None]
    p_key = _largest_key_where(keys, lambda key: jnp.sum(jnp.where(keys >= key, probs, 0.0), -1, keepdims=True) >= top_p)
    p_key = jnp.where(top_p < 1.0, p_key, 0)  # off: float32's running mass reaches 1.0 before the tail does
    return jnp.where(keys >= jnp.maximum(k_key, p_key), scaled, -jnp.inf)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (negative floats flip every bit, others the sign bit); -0.0 and
    0.0 get one key, as they are one value."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_where(keys: jax.Array, holds) -> jax.Array:
    """[B, V] keys -> [B, 1] the largest key of each row's entries for which `holds(key)` [B, 1] is
    true, given that it holds for all keys up to some point and for none above; the row's smallest
    key when it holds for none. Bisection: `holds` only changes at entry keys, so the largest key
    where it holds is one of them."""
    lo = jnp.min(keys, -1, keepdims=True)
    hi = jnp.max(keys, -1, keepdims=True)

    def step(_, bounds):  # invariant: holds(lo) or lo is the row minimum; not holds(hi + 1)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # the upper middle, without overflowing uint32
        ok = holds(mid) & (mid > lo)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, jnp.maximum(mid, lo + 1) - 1)

    return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Chooses one token per row.

    Args:
      logits: [B, V] policy logits for the next token.
      params: per-row sampling parameters.
      positions: [B] int32 sequence position the chosen token will occupy (the key's position).

    Returns:
      tokens [B] int32 and their log-probs [B] under the temperature-scaled policy (before top-k/p
      filtering; temperature 1 for greedy rows), the quantity GRPO's importance ratio needs.
    """
    V = logits.shape[-1]
    # Filtering and noise only when a row samples: both cost full-vocabulary passes.
    sampled = jax.lax.cond(
        jnp.any(params.temperature > 0),
        lambda: first_argmax(filtered_logits(logits, params) + position_gumbel(params.seed, positions, V)),
        lambda: jnp.zeros(logits.shape[0], jnp.int32),
    )
    tokens = jnp.where(params.temperature > 0, sampled, first_argmax(logits)).astype(jnp.int32)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature[:, None], axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
