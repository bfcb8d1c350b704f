"""The EAGLE drafter: one decoder layer over the policy's last hidden state and the next token.

Entry t of a sequence pairs the policy's hidden state h_t with token x_{t+1}:
    fc(concat(embed(x_{t+1}), h_t)) -> one decoder layer (no input norm) -> predicted h_{t+1}
and the policy's final norm and LM head turn the prediction into logits for x_{t+2}. The
embedding and head are the policy's own (shared, frozen); the drafter owns fc and the layer.
Entry t sits at drafter cache slot t with RoPE position t.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import Decoder, KVCache, Layers, attention_mask, run_layers


class Drafter(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = dataclasses.replace(cfg, num_layers=1)
        H = cfg.hidden_size
        self.fc = nnx.Param(
            jax.random.normal(rngs.params(), (2 * H, H), dtype) / jnp.sqrt(2.0 * H), logical_axes=("mlp", "embed")
        )
        self.layers = Layers(self.cfg, rngs, dtype)

    def empty_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        return KVCache.zeros(self.cfg, batch, max_len, dtype)

    def __call__(
        self,
        policy: Decoder,
        tokens: jax.Array,
        hidden: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        start: jax.Array,
        block_mask: jax.Array | None = None,
        kv_len: int | None = None,
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Runs drafter entries (x_{t+1} = tokens, h_t = hidden [B, T, H]) like Decoder.__call__.

        Returns logits [B, T, vocab] for the token after each entry's, the predicted hidden states
        [B, T, H] (the next entries' inputs while drafting), and the updated cache.
        """
        kv_len = cache.max_len if kv_len is None else kv_len
        if mask is None:
            mask = attention_mask(start, block_mask, tokens.shape[1], kv_len)
        embed = jax.lax.stop_gradient(policy.embed[tokens])
        x = jnp.concatenate([embed, hidden.astype(embed.dtype)], axis=-1) @ self.fc[...]
        out, cache = run_layers(self.cfg, self.layers, x, positions, cache, start, mask, input_norm=False)
        return policy.logits(out), out, cache
