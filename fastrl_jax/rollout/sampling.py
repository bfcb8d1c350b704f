"""Position-keyed sampling: temperature, top-k, top-p, and the log-prob of the chosen token.

The token a request places at sequence position t is
    argmax(filtered_logits / temperature + Gumbel(key(seed, t)))
so it depends only on the request's seed, its position and the logits, never on the batch the
request shares, its row, or whether speculative decoding produced it (DESIGN.md).
Temperature 0 is greedy.
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


def position_gumbel(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [vocab] keyed by (seed, position): the same draw wherever the token is produced."""
    key = jax.random.fold_in(jax.random.key(seed), position)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] -> temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    needs_filter = jnp.any(params.top_k > 0) | jnp.any(params.top_p < 1.0)
    return jax.lax.cond(needs_filter, _top_k_top_p, lambda s, p: s, scaled, params)


def _top_k_top_p(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    V = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(desc, jnp.clip(params.top_k - 1, 0, V - 1)[:, None], axis=-1)
    k_threshold = jnp.where(params.top_k[:, None] > 0, kth, -jnp.inf)
    desc = jnp.where(desc >= k_threshold, desc, -jnp.inf)
    # Keep the smallest prefix of the sorted tokens whose probability reaches top_p (HF's rule:
    # a token stays when the mass strictly before it is below top_p; the first always stays).
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_before < params.top_p[:, None], axis=-1), 1)
    p_threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(k_threshold, p_threshold)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


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
    filtered = filtered_logits(logits, params)
    sampled = jax.lax.cond(
        jnp.any(params.temperature > 0),
        lambda: jnp.argmax(filtered + jax.vmap(position_gumbel, (0, 0, None))(params.seed, positions, V), -1),
        lambda: jnp.zeros(logits.shape[0], jnp.int32),
    )
    tokens = jnp.where(params.temperature > 0, sampled, jnp.argmax(logits, -1)).astype(jnp.int32)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature[:, None], axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
