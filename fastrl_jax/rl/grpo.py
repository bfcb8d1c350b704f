"""GRPO math as pure functions: group advantages, token log-probs, the clipped surrogate, KL, aggregation.

Losses come out as *sums divided by a normaliser the caller passes* (all completion tokens, or
all sequences, of the whole mini-batch), so per-micro-batch gradients add up to exactly the
gradient of the mini-batch loss under gradient accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fastrl_jax.config import KL_ESTIMATORS, LOSS_AGGREGATIONS


def group_advantages(rewards: jax.Array, group_size: int, std_normalize: bool = True, eps: float = 1e-6) -> jax.Array:
    """rewards [N] (N = groups x group_size, a group's samples adjacent) -> advantages [N].

    A = (r - mean of its group) / (std of its group + eps), the sample std (ddof 1, as verl's and TRL's
    torch.std); a group whose samples all got the same reward has A = 0 and contributes no gradient.
    std_normalize=False keeps r - mean (Dr. GRPO). Groups of one sample get A = r / (1 + eps) (or r), as verl's.
    """
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size).astype(jnp.float32)
    if group_size == 1:  # verl: a lone sample's baseline is 0 and its std 1 (the sample std of one is undefined)
        return (r / (1.0 + eps) if std_normalize else r).reshape(-1)
    centred = r - r.mean(axis=1, keepdims=True)
    if std_normalize:
        centred = centred / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    # Exactly 0 for equal rewards: float32's mean of e.g. eight 0.1s is not 0.1, and / (std + eps) would blow
    # the rounding up to a real advantage.
    same = r.max(axis=1, keepdims=True) == r.min(axis=1, keepdims=True)
    return jnp.where(same, 0.0, centred).reshape(-1)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """logits [B, T, V], targets [B, T] int -> log p(target) [B, T] under softmax(logits / temperature).

    The rollout engine reports log-probs under the same temperature-scaled distribution.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """logits [B, T, V] -> entropy of each position's temperature-scaled distribution [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def clipped_surrogate(
    logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, clip_low: float, clip_high: float, clip_ratio_c: float = 0.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token PPO loss with DAPO's decoupled clip range [1 - clip_low, 1 + clip_high], and dual-clip PPO.

    logp, old_logp [B, T]; advantages [B] (one per sequence). Dual clip (Ye et al. 2019; verl's clip_ratio_c,
    0 = off): a token of a negative advantage loses at most clip_ratio_c x |A|, so one the policy has since made
    far likelier (off-policy mini-batches) cannot dominate the batch. The log-ratio is clamped to [-20, 20], as
    verl does, so a ratio cannot overflow. Returns (loss [B, T], clipped [B, T] bool: tokens whose gradient the
    PPO clip removed, dual_clipped [B, T] bool: those the dual clip removed).
    """
    ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped_value = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    clipped = clipped_value < unclipped  # PPO's min takes the clipped side, where the ratio is past a bound
    # A where, not jnp.minimum: at a tie (ratio 1 on a bound of 1, on-policy with clip_low or clip_high 0) JAX's
    # minimum and clip split the gradient between their sides, leaving 0.75 of the policy gradient.
    loss = -jnp.where(clipped, clipped_value, unclipped)
    dual_clipped = (adv < 0) & (loss > -clip_ratio_c * adv) if clip_ratio_c else jnp.zeros_like(loss, bool)
    return jnp.where(dual_clipped, -clip_ratio_c * adv, loss), clipped, dual_clipped


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs [B, T]; verl's names in
    parentheses.

    k1 = log p - log q ("kl"; an unbiased estimate of the KL's value, can be negative; as a loss term its gradient
    is zero in expectation on-policy); k2 = (log p - log q)^2 / 2 ("mse"; biased in value, but its gradient is the
    KL's gradient in expectation on-policy); k3 = q/p - log(q/p) - 1 ("low_var_kl"; unbiased, >= 0, lower
    variance; Schulman's estimator, GRPO's choice), clamped as verl clamps it: log(q/p) to [-20, 20] and the
    estimate to at most 10, so a token the policy has drifted far from cannot overflow exp() or, with a gradient
    of ~q/p, swamp the batch's gradient (past the bound it gets none); abs = |log p - log q| ("abs"). "k1+" and
    "k3+" are verl's straight-through forms: k1's / k3's value with k2's gradient.
    """
    if estimator in ("k1+", "k3+"):
        value, k2 = kl_penalty(logp, ref_logp, estimator[:-1]), kl_penalty(logp, ref_logp, "k2")
        return k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * jnp.square(logp - ref_logp)
    if estimator == "abs":  # torch's |x|, whose gradient is sign(x): 0 where p == q (jnp.abs has 1 there), as on the
        d = logp - ref_logp  # first step, whose reference is the policy itself
        return d * jnp.sign(d)
    if estimator == "k3":
        log_ratio = jnp.clip(ref_logp - logp, -20.0, 20.0)
        return jnp.minimum(jnp.exp(log_ratio) - log_ratio - 1.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, normalizer: jax.Array | float,
              length_scale: float = 1.0) -> jax.Array:
    """Sums per-token values [B, T] over the mask [B, T] into one scalar: verl's loss_agg_mode token-mean,
    seq-mean-token-mean, seq-mean-token-sum and seq-mean-token-sum-norm, but normalised over the whole
    mini-batch, never per micro-batch.

    token: sum over tokens / normalizer (= completion tokens of the mini-batch): every token weighs
      the same, so long responses are not diluted (DAPO).
    sequence: sum over sequences of each one's token mean / normalizer (= sequences of the
      mini-batch): every sequence weighs the same (the original GRPO).
    sequence_sum: sum over sequences of each one's token sum / normalizer (= sequences).
    sequence_sum_norm: the same / length_scale, a constant (the longest completion, rl.max_new_tokens): Dr. GRPO's
      unbiased aggregation, in which no sequence's length divides its tokens.
    """
    mask = mask.astype(jnp.float32)
    if mode == "token":
        return jnp.sum(per_token * mask) / normalizer
    if mode == "sequence":
        per_seq = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return jnp.sum(per_seq) / normalizer
    if mode in ("sequence_sum", "sequence_sum_norm"):
        return jnp.sum(per_token * mask) / (normalizer * (length_scale if mode == "sequence_sum_norm" else 1.0))
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {', '.join(LOSS_AGGREGATIONS)}")


def per_token_mode(mode: str) -> str:
    """How a per-token statistic (a clip fraction, the entropy) is averaged under loss aggregation `mode`, with the
    same normalizer: per token for token, per sequence for the others (the sums would not be fractions)."""
    return "token" if mode == "token" else "sequence"


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: str,
    normalizer: jax.Array | float,
    clip_ratio_c: float = 0.0,
    ref_logp: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    length_scale: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO objective of one micro-batch: clipped surrogate + kl_coef x KL, aggregated (length_scale: aggregate's).

    logp, old_logp, ref_logp, mask [B, T]; advantages [B]. Returns (loss, metrics); metrics are
    normalised with the same normalizer, so they too add up over micro-batches.
    """
    # Padding slots hold log-probs nothing trains; a log-ratio of ~90 there would make exp() inf, and inf x 0 a
    # NaN loss and gradient. Their ratios are 1 instead (the mask already drops them from every sum).
    live, pad = mask > 0, jax.lax.stop_gradient(logp)
    old_logp = jnp.where(live, old_logp, pad)
    ref_logp = None if ref_logp is None else jnp.where(live, ref_logp, pad)
    surrogate, clipped, dual_clipped = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high, clip_ratio_c)
    loss = aggregate(surrogate, mask, aggregation, normalizer, length_scale)
    fraction = per_token_mode(aggregation)
    metrics = {"pg_loss": loss, "clip_fraction": aggregate(clipped.astype(jnp.float32), mask, fraction, normalizer),
               "dual_clip_fraction": aggregate(dual_clipped.astype(jnp.float32), mask, fraction, normalizer)}
    if ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp, kl_estimator), mask, aggregation, normalizer, length_scale)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl
    return loss, metrics
