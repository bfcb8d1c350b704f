"""The drafter's training loss and jitted train step (EAGLE recipe, optional EAGLE-3 style unrolling).

Alignment, pinned by tests/test_drafter_train.py: entry t of a sequence is (f_t, x_{t+1}) with
f_t = policy_features(h_t); it predicts f_{t+1}, and through the head the token x_{t+2}:
    loss_t = SmoothL1(pred_t, f_{t+1}) + ce_weight x CE(softmax(head f_{t+1}), log_softmax(head pred_t))
counted where x_{t+2} is a token to learn (loss_mask) of the same sequence. The CE target is the
policy's own next-token distribution at f_{t+1}; with a reduced draft vocabulary both sides are
restricted to it.

EAGLE-3 (drafter.kind "eagle3") trains on cross-entropy alone, against the token the policy emitted,
x_{t+2} (the buffer stores EAGLE-3's layer features, not the last hidden state the policy's own
distribution would need; on the policy's own samples this is an unbiased estimate of that CE);
entries whose target lies outside the draft vocabulary are not counted. A token sampled at
temperature T came from softmax(logits / T), so the CE is of softmax(drafter logits / T): the drafter
learns the policy's logits themselves, which is what drafting assumes (draft_tree's coupled_logp
divides the drafter's log-probs by the row's T, as sampling divides the policy's).

Unrolling (training-time test): drafting feeds the drafter its own predictions, so unroll step j
re-runs the drafter at anchor a with entry (pred_{a+j-1}, x_{a+j+1}) at position a+j, attending to
the true entries <= a and to its own earlier unroll entries for the same anchor, exactly as a depth
j+1 draft-tree node sees the cache; it predicts f_{a+j+1}. Step j's loss is weighted decay**j.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fastrl_jax.models.decoder import Decoder, KVCache, head_logits
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout.sampling import SamplingParams
from fastrl_jax.rollout.speculative import coupled_logp
from fastrl_jax.sharding import training_rows


@dataclasses.dataclass(frozen=True)
class LossSettings:
    ce_weight: float = 0.1  # weight of the cross-entropy term
    input_noise: float = 0.0  # input features get uniform noise in [-input_noise, input_noise]
    unroll_steps: int = 1  # 1 = EAGLE (true features only); k > 1 adds k - 1 steps on own predictions
    unroll_decay: float = 0.8


def _shift(x: jax.Array, n: int, fill=0) -> jax.Array:
    """x[:, t + n] at t along axis 1, `fill` past the end. x [B, S, ...]."""
    if n == 0:
        return x
    pad = jnp.full((x.shape[0], n, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def smooth_l1(x: jax.Array) -> jax.Array:
    """torch's SmoothL1 with beta 1, elementwise."""
    a = jnp.abs(x)
    return jnp.where(a < 1.0, 0.5 * x * x, a - 0.5)


def _unrolled(drafter: Drafter, policy: Decoder, batch: dict, inputs: jax.Array, head: jax.Array, steps: int):
    """Yields (j, logits [B, S, K], predicted features [B, S, H]) of unroll steps j = 0 .. steps - 1.

    Step 0 runs entry a on (inputs_a, x_{a+1}); step j runs it on (step j-1's prediction, x_{a+j+1})
    at position pos_a + j, attending to the true entries <= a and its own earlier unroll entries, and
    predicts f_{a+j+1} / x_{a+j+2}.
    """
    tokens, seg = batch["tokens"], batch["segments"]
    B, S = tokens.shape
    slot = jnp.arange(S)
    # Step 0 entries see the true entries of their own sequence up to themselves.
    causal = (slot[None, :, None] >= slot[None, None, :]) & (seg[:, :, None] == seg[:, None, :])
    causal = causal | jnp.eye(S, dtype=bool)[None]  # padding entries see themselves (no empty softmax row)
    cache = KVCache.zeros(drafter.cfg, B, S * steps, inputs.dtype)
    own = jnp.broadcast_to(jnp.eye(S, dtype=bool), (B, S, S))
    rows = training_rows((B, S, drafter.cfg.hidden_size))  # the online trainer's block: each device keeps its rows
    for j in range(steps):
        mask_j = jnp.concatenate(
            [causal] + [own] * j + [jnp.zeros((B, S, S), bool)] * (steps - 1 - j), axis=2
        )
        logits, pred, cache = drafter(
            policy, _shift(tokens, j + 1), inputs, batch["positions"] + j, cache, jnp.full((B,), j * S, jnp.int32),
            mask=mask_j, kv_len=S * steps, head=head, rows=rows,
        )
        yield j, logits, pred
        inputs = pred  # the next unroll step feeds the drafter its own predictions


def _target_valid(batch: dict, j: int) -> jax.Array:
    """[B, S] whether anchor a's unroll step j has a target: x_{a+j+2} is a token to learn of a's sequence."""
    seg = batch["segments"]
    return (seg > 0) & (_shift(seg, j + 2) == seg) & _shift(batch["loss_mask"], j + 2, False)


def drafter_loss(drafter: Drafter, policy: Decoder, batch: dict, key: jax.Array, settings: LossSettings):
    """Mean loss over the batch's valid entries, and metrics.

    batch (see buffer.PackedBatch): tokens [B, S] int32, hidden [B, S, H] policy hidden states (before
    the final norm), loss_mask [B, S] bool, positions [B, S] int32, segments [B, S] int32 (0 = pad),
    temperature [B, S] float32 (each token's sampling temperature, 0 greedy; read by EAGLE-3).
    batch["hidden"] holds the stored policy features ([B, S, 3H] for EAGLE-3).
    Returns (loss, {"loss", "hidden_l1_<j>" (EAGLE), "ce_<j>", "acc_<j>" per unroll step, "entries"}).
    """
    feats = jax.lax.stop_gradient(drafter.features(policy, batch["hidden"].astype(jnp.float32)))
    head = drafter.head_weight(policy)  # [K, H]
    noise = jax.random.uniform(key, feats.shape, feats.dtype, -settings.input_noise, settings.input_noise)
    total, metrics = 0.0, {}
    weight_sum = 0.0
    for j, logits, pred in _unrolled(drafter, policy, batch, feats + noise, head, settings.unroll_steps):
        w = _target_valid(batch, j).astype(jnp.float32)
        if drafter.kind == "eagle3":
            label = drafter.draft_index(_shift(batch["tokens"], j + 2))
            w = w * (label >= 0)
            n = jnp.maximum(w.sum(), 1.0)
            T = _shift(batch["temperature"], j + 2)
            sampled = jax.nn.log_softmax(logits / jnp.where(T > 0, T, 1.0)[..., None], -1)
            ce = (-jnp.take_along_axis(sampled, jnp.maximum(label, 0)[..., None], -1)[..., 0] * w).sum() / n
            acc = ((jnp.argmax(logits, -1) == label) * w).sum() / n
            step_loss, metrics[f"ce_{j}"] = ce, ce
        else:
            n = jnp.maximum(w.sum(), 1.0)
            target = _shift(feats, j + 1)
            l1 = (smooth_l1(pred - target).mean(-1) * w).sum() / n
            target_logits = head_logits(target, head)
            p = jax.nn.softmax(target_logits, -1)
            ce = (-(p * jax.nn.log_softmax(logits, -1)).sum(-1) * w).sum() / n
            acc = ((jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)) * w).sum() / n
            step_loss = l1 + settings.ce_weight * ce
            metrics |= {f"hidden_l1_{j}": l1, f"ce_{j}": ce}
        scale = settings.unroll_decay**j
        total = total + scale * step_loss
        weight_sum += scale
        metrics[f"acc_{j}"] = acc
        if j == 0:
            metrics["entries"] = w.sum()
    loss = total / weight_sum
    metrics["loss"] = loss
    return loss, metrics


def chain_acceptance(drafter: Drafter, policy: Decoder, batch: dict, depth: int) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced acceptance of a draft chain on recorded sequences: (accepted drafts summed over
    anchors, number of anchors).

    At each anchor a (x_{a+2} a token to learn) the drafter drafts `depth` tokens from its own
    predictions, each the token the engine's draft_tree ranks first: the argmax for a greedy sequence
    (batch "temperature" [B, S] 0), and for a sampled one (> 0, with "seeds" [B, S]) the drafter's
    Gumbel-coupled guess of the token the policy samples there (speculative.coupled_logp). The drafts accepted
    are the leading ones equal to the recorded tokens x_{a+2}, x_{a+3}, ... That is what a chain of
    this depth accepts when the policy emits those tokens (they were decoded with those seeds), so
    1 + accepted / anchors estimates tokens per speculative step without running the policy.
    batch["positions"] must be the tokens' positions in their sequences (the noise's key).
    """
    feats = drafter.features(policy, batch["hidden"].astype(jnp.float32))
    head = drafter.head_weight(policy)
    tokens = batch["tokens"]
    alive = _target_valid(batch, 0)
    anchors = alive.sum()
    accepted = jnp.zeros((), jnp.int32)
    for j, logits, _ in _unrolled(drafter, policy, batch, feats, head, depth):
        draft = _engine_draft(drafter, logits, batch, batch["positions"] + j + 2)
        alive = alive & _target_valid(batch, j) & (draft == _shift(tokens, j + 2))
        accepted = accepted + alive.sum()
    return accepted, anchors


def _engine_draft(drafter: Drafter, logits: jax.Array, batch: dict, positions: jax.Array) -> jax.Array:
    """[B, S] token ids draft_tree ranks first for logits [B, S, K] of the tokens at positions [B, S]."""
    B, S, K = logits.shape
    N = B * S  # one sampling row per entry: its own temperature, seed and position
    params = SamplingParams(batch["temperature"].reshape(N), jnp.zeros(N, jnp.int32), jnp.ones(N, jnp.float32),
                            batch["seeds"].reshape(N))
    ids = drafter.token_ids(jnp.arange(K))
    scores = coupled_logp(logits.reshape(N, K), params, positions.reshape(N), ids)
    return drafter.token_ids(jnp.argmax(scores, -1)).reshape(B, S)


def drafter_optimizer(learning_rate: float, warmup_steps: int, total_steps: int | None, weight_decay: float,
                   grad_clip_norm: float) -> optax.GradientTransformation:
    """AdamW with linear warm-up (from 0 at the first step to the peak at warmup_steps; none when 0) then
    cosine decay to a tenth at total_steps (None: constant after the warm-up, for online training that
    has no end), after global-norm clipping."""
    if total_steps is None:
        # A schedule either way: the optimizer state (its step count) keeps one structure for checkpoints
        schedule = (optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps
                    else optax.constant_schedule(learning_rate))
    elif not warmup_steps:  # optax's warm-up of one step would spend the first step at rate 0
        schedule = optax.cosine_decay_schedule(learning_rate, max(total_steps, 1), alpha=0.1)
    else:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1), learning_rate / 10
        )
    parts = [optax.clip_by_global_norm(grad_clip_norm)] if grad_clip_norm > 0 else []
    return optax.chain(*parts, optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


def make_train_step(optimizer: optax.GradientTransformation, settings: LossSettings, donate: bool = True):
    """A jitted step (dgraphdef, params, rest, opt_state, pgraphdef, pstate, batch, key) ->
    (params, opt_state, metrics). Only the drafter's nnx.Param leaves train; the policy (embedding,
    final norm, head) is an input, never differentiated. donate=False when other holders (engines
    drafting with the same buffers) may still read the parameters."""

    @functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(1, 3) if donate else ())
    def step(dgraphdef, params, rest, opt_state, pgraphdef, pstate, batch, key):
        policy = nnx.merge(pgraphdef, pstate)

        def loss_fn(params):
            return drafter_loss(nnx.merge(dgraphdef, params, rest), policy, batch, key, settings)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return optax.apply_updates(params, updates), opt_state, metrics

    return step
