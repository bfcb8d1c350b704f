"""The EAGLE drafter: one decoder layer over the policy's last hidden state and the next token.

Entry t of a sequence pairs the policy's feature f_t with token x_{t+1}:
    fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer (no input norm) -> predicted f_{t+1}
and the LM head turns the prediction into logits for x_{t+2}. Features live in the space EAGLE
and SGLang use: the policy's last hidden state *after* its final norm (`policy_features`), so the
head applies to a prediction directly and an exported drafter serves in SGLang as is. The
embedding and head are the policy's own (shared, frozen); the drafter owns fc and the layer.
Entry t sits at drafter cache slot t with RoPE position t.

With a reduced draft vocabulary (EAGLE-3's d2t/t2d) the drafter scores only the K token ids in
`draft_vocab`, through those rows of the policy's head: logits are [.., K] and `token_ids` maps
an index back to a full-vocabulary id. The policy still verifies every drafted token, so
decoding stays lossless; tokens outside the draft vocabulary are simply never drafted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import Decoder, KVCache, Layers, attention_mask, head_logits, rms_norm, run_layers


class DraftVocab(nnx.Variable):
    """int32 [K] token ids the drafter scores (not trained)."""


def policy_features(policy: Decoder, hidden: jax.Array) -> jax.Array:
    """The drafter's input features: the policy's last hidden states [..., H] through its final norm."""
    return rms_norm(hidden, policy.final_norm[...], policy.cfg.rms_norm_eps)


class Drafter(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32, draft_vocab=None):
        """draft_vocab: optional int [K] distinct token ids of a reduced draft vocabulary."""
        self.cfg = dataclasses.replace(cfg, num_layers=1)
        H = cfg.hidden_size
        self.fc = nnx.Param(
            jax.random.normal(rngs.params(), (2 * H, H), dtype) / jnp.sqrt(2.0 * H), logical_axes=("mlp", "embed")
        )
        self.layers = Layers(self.cfg, rngs, dtype)
        if draft_vocab is not None:
            ids = np.asarray(draft_vocab)
            if ids.ndim != 1 or not len(ids) or len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= cfg.vocab_size:
                raise ValueError(f"draft_vocab must be distinct token ids in [0, {cfg.vocab_size}), got shape {ids.shape}")
            draft_vocab = DraftVocab(jnp.asarray(ids, jnp.int32))
        self.draft_vocab = draft_vocab

    @property
    def draft_vocab_size(self) -> int:
        return self.cfg.vocab_size if self.draft_vocab is None else self.draft_vocab[...].shape[0]

    def empty_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        return KVCache.zeros(self.cfg, batch, max_len, dtype)

    def head_weight(self, policy: Decoder) -> jax.Array:
        """The policy's LM head rows the drafter scores, [K, H] (K = vocab without a draft vocabulary).
        Gather it once per draft tree and pass it as `head`: every drafter step reuses it."""
        head = jax.lax.stop_gradient(policy.head_weight())
        return head if self.draft_vocab is None else jnp.take(head, self.draft_vocab[...], axis=0)

    def token_ids(self, index: jax.Array) -> jax.Array:
        """Draft-vocabulary indices -> token ids (identity without a draft vocabulary)."""
        return index if self.draft_vocab is None else self.draft_vocab[...][index]

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
        head: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Runs drafter entries (x_{t+1} = tokens [B, T], f_t = hidden [B, T, H]) like Decoder.__call__.

        hidden holds features: policy_features of policy hidden states, or the drafter's own
        predictions. head: head_weight(policy), computed here when None.

        Returns logits [B, T, K] float32 for the token after each entry's (over the draft
        vocabulary), the predicted features [B, T, H] (the next entries' inputs while drafting),
        and the updated cache.
        """
        kv_len = cache.max_len if kv_len is None else kv_len
        if mask is None:
            mask = attention_mask(start, block_mask, tokens.shape[1], kv_len)
        if head is None:
            head = self.head_weight(policy)
        embed = jax.lax.stop_gradient(policy.embed[tokens])
        x = jnp.concatenate([embed, hidden.astype(embed.dtype)], axis=-1) @ self.fc[...]
        out, cache = run_layers(self.cfg, self.layers, x, positions, cache, start, mask, input_norm=False)
        logits = head_logits(out, head)
        return logits, out, cache
