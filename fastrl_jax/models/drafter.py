"""The EAGLE and EAGLE-3 drafters: one decoder layer over policy features and the next token.

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

kind "eagle3" (EAGLE-3, as SGLang's llama_eagle3.py serves it): the features are the policy's
residual stream entering three layers (`feature_layers`: SGLang's default [2, L//2, L-3], clamped
into [0, L-1] for models of few layers, where SGLang can still capture them), concatenated [.., 3H]
and stored raw; fc fuses them 3H -> H at the first draft step, and later steps feed the drafter's
own output h (already H wide) instead. The layer's attention
reads concat(rmsnorm(embed(x_{t+1})), rmsnorm(h)) (2H) with h as the residual stream, and the
drafter's own final norm precedes the head. It trains on cross-entropy alone (drafter/train.py). Its
layer is Llama's for every policy (no Qwen2 q/k/v biases, no Qwen3 q/k norm): SGLang serves EAGLE-3
drafters of Llama and Qwen targets alike as LlamaForCausalLMEagle3.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import Decoder, KVCache, Layers, attention_mask, head_logits, rms_norm, run_layers

KINDS = ("eagle", "eagle3")


class DraftVocab(nnx.Variable):
    """int32 [K] token ids the drafter scores (not trained)."""


def policy_features(policy: Decoder, hidden: jax.Array) -> jax.Array:
    """The EAGLE drafter's input features: the policy's last hidden states [..., H] through its final norm."""
    return rms_norm(hidden, policy.final_norm[...], policy.cfg.rms_norm_eps)


def feature_layers(kind: str, num_layers: int) -> tuple[int, ...]:
    """The policy layers whose input hidden states a drafter of `kind` reads (Decoder capture indices):
    () for EAGLE (the last hidden state), SGLang's [2, L//2, L-3] clamped into [0, L-1] for EAGLE-3 (SGLang
    captures the input of layers 0 .. L-1 only)."""
    if kind not in KINDS:
        raise ValueError(f"drafter kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "eagle":
        return ()
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


class Drafter(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32, draft_vocab=None, kind: str = "eagle",
                 layers: tuple[int, ...] | None = None):
        """cfg: the policy's config. draft_vocab: optional int [K] distinct token ids of a reduced draft
        vocabulary. kind: "eagle" or "eagle3". layers: the feature layers when not feature_layers(kind, ...)
        of cfg (a copy of another drafter's)."""
        self.kind = kind
        self.feature_layers = feature_layers(kind, cfg.num_layers) if layers is None else tuple(layers)
        self.cfg = dataclasses.replace(cfg, num_layers=1)
        if kind == "eagle3":  # a Llama layer whatever the policy's family, as SGLang's LlamaForCausalLMEagle3 serves it
            self.cfg = dataclasses.replace(self.cfg, family="llama", qkv_bias=False, qk_norm=False)
        H = cfg.hidden_size
        F = 3 * H if kind == "eagle3" else 2 * H
        self.fc = nnx.Param(
            jax.random.normal(rngs.params(), (F, H), dtype) / jnp.sqrt(float(F)), logical_axes=("mlp", "embed")
        )
        self.layers = Layers(self.cfg, rngs, dtype, embed_input=kind == "eagle3")
        if kind == "eagle3":
            self.norm = nnx.Param(jnp.ones((H,), dtype), logical_axes=("norm",))
        if draft_vocab is not None:
            ids = np.asarray(draft_vocab)
            if ids.ndim != 1 or not len(ids) or len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= cfg.vocab_size:
                raise ValueError(f"draft_vocab must be distinct token ids in [0, {cfg.vocab_size}), got shape {ids.shape}")
            draft_vocab = DraftVocab(jnp.asarray(ids, jnp.int32))
        self.draft_vocab = draft_vocab

    @property
    def draft_vocab_size(self) -> int:
        return self.cfg.vocab_size if self.draft_vocab is None else self.draft_vocab.get_value().shape[0]  # abstract too

    @property
    def feature_size(self) -> int:
        """Width of the stored policy features this drafter reads: H, or 3H for EAGLE-3."""
        return self.cfg.hidden_size * max(len(self.feature_layers), 1)

    def features(self, policy: Decoder, stored: jax.Array) -> jax.Array:
        """Stored policy features (Decoder outputs with capture=feature_layers) [..., feature_size] -> the
        drafter's `hidden` input: through the policy's final norm for EAGLE, as they are for EAGLE-3."""
        return stored if self.kind == "eagle3" else policy_features(policy, stored)

    def draft_index(self, token_ids: jax.Array) -> jax.Array:
        """Token ids -> draft-vocabulary indices, -1 for ids outside it (identity without one)."""
        if self.draft_vocab is None:
            return token_ids
        ids = self.draft_vocab[...]
        table = jnp.full((self.cfg.vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
        return table[token_ids]

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
        rows=None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Runs drafter entries (x_{t+1} = tokens [B, T], f_t = hidden [B, T, F]) like Decoder.__call__.

        hidden holds features (`features` of stored policy features, F = feature_size) or the
        drafter's own predictions (F = H). head: head_weight(policy), computed here when None. rows: as run_layers'
        (training keeps each device's rows; None keeps every row on every device under a mesh).

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
        if self.kind == "eagle":
            x = jnp.concatenate([embed, hidden.astype(embed.dtype)], axis=-1) @ self.fc[...]
            out, cache = run_layers(self.cfg, self.layers, x, positions, cache, start, mask, input_norm=False, rows=rows)
            return head_logits(out, head), out, cache
        # EAGLE-3: fuse the policy's layer features at the first step; own predictions are H wide already.
        x = hidden.astype(embed.dtype)
        if x.shape[-1] != self.cfg.hidden_size:
            x = x @ self.fc[...]
        out, cache = run_layers(self.cfg, self.layers, x, positions, cache, start, mask, embeds=embed, rows=rows)
        return head_logits(rms_norm(out, self.norm[...], self.cfg.rms_norm_eps), head), out, cache
