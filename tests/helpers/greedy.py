"""A plain step-by-step greedy decoder: the simple reference the rollout engine is tested against."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax.numpy as jnp
from flax import nnx

from fastrl_jax.models.decoder import Decoder, KVCache


@nnx.jit
def _prefill(model: Decoder, tokens, cache):
    positions = jnp.arange(tokens.shape[1])[None]
    logits, _, cache = model(tokens, positions, cache, jnp.zeros(1, jnp.int32))
    return jnp.argmax(logits[0, -1]), cache


@nnx.jit
def _step(model: Decoder, token, position, cache):
    logits, _, cache = model(token[None, None], position[None, None], cache, position[None])
    return jnp.argmax(logits[0, -1]), cache


def greedy_tokens(
    model: Decoder, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> Iterator[int]:
    """Yields greedy tokens one at a time (a stop token is yielded, then generation ends)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    max_len = len(prompt_ids) + max_new_tokens
    if max_len > model.cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_position_embeddings ({model.cfg.max_position_embeddings}); lower --max-new-tokens"
        )
    # Round the cache up so prompts of similar length share one compiled program.
    cache = KVCache.zeros(model.cfg, 1, -(-max_len // 128) * 128, model.embed[...].dtype)
    token, cache = _prefill(model, jnp.asarray([prompt_ids], jnp.int32), cache)
    for t in range(len(prompt_ids), max_len):
        token_id = int(token)
        yield token_id
        if token_id in stop_ids or t + 1 == max_len:
            return
        token, cache = _step(model, token, jnp.int32(t), cache)


def greedy_generate(model: Decoder, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids=()) -> list[int]:
    return list(greedy_tokens(model, prompt_ids, max_new_tokens, stop_ids))

