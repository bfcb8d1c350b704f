"""GRPO math: properties of advantages, the clipped surrogate, KL and aggregation; log-prob recomputation;
gradient accumulation equals one big batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.tiny import CFG, TINY, prompts, tiny_model
from jax.sharding import NamedSharding, PartitionSpec

from fastrl_jax.config import MeshConfig, OptimConfig
from fastrl_jax.models.decoder import Decoder, KVCache
from fastrl_jax.rl import grpo, update
from fastrl_jax.rollout.engine import Request, RolloutEngine
from fastrl_jax.sharding import make_mesh

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("seed", range(5))
def test_group_advantages_properties(seed):
    rng = np.random.default_rng(seed)
    G, n = 6, 5
    r = rng.normal(size=G * n).astype(np.float32)
    r[:n] = 0.7  # a constant group
    a = np.asarray(grpo.group_advantages(jnp.asarray(r), n)).reshape(G, n)
    assert (a[0] == 0.0).all()  # exactly: 0.7's float32 mean is not 0.7, and / (std + eps) magnified that
    for reward in (0.1, 1.1):  # "format" 0.1 of the GPU configs' rewards, "correct" + "format"
        assert (np.asarray(grpo.group_advantages(jnp.full(16, reward), 8)) == 0.0).all()
        assert (np.asarray(grpo.group_advantages(jnp.full(16, reward), 8, std_normalize=False)) == 0.0).all()
    np.testing.assert_allclose(a.mean(1), 0.0, atol=1e-5)
    np.testing.assert_allclose(a[1:].std(1, ddof=1), 1.0, rtol=1e-3)  # the sample std, as verl's torch.std
    # invariant to a positive affine map of the rewards, order preserving within a group
    b = np.asarray(grpo.group_advantages(jnp.asarray(3.0 * r - 2.0), n)).reshape(G, n)
    np.testing.assert_allclose(a, b, atol=1e-3)
    assert all((np.argsort(a[g]) == np.argsort(r.reshape(G, n)[g])).all() for g in range(1, G))
    c = np.asarray(grpo.group_advantages(jnp.asarray(r), n, std_normalize=False)).reshape(G, n)
    np.testing.assert_allclose(c, r.reshape(G, n) - r.reshape(G, n).mean(1, keepdims=True), atol=1e-6)
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.group_advantages(jnp.zeros(10), 4)


def test_group_of_one_is_verls():
    """verl's compute_grpo_outcome_advantage gives a group of one sample mean 0 and std 1: A = r / (1 + eps), or r
    without the std; not 0, which would silently train nothing (and the sample std of one sample is NaN)."""
    r = jnp.asarray([0.0, 1.0, -0.5, 1.1])
    np.testing.assert_allclose(grpo.group_advantages(r, 1), np.asarray(r) / (1 + 1e-6), rtol=1e-7)
    np.testing.assert_array_equal(grpo.group_advantages(r, 1, std_normalize=False), np.asarray(r))


def test_padding_slots_cannot_make_the_loss_nan():
    """Log-probs at masked slots are never trained; a ratio there that overflows exp() must not reach the loss or
    its gradient (inf x 0 is NaN)."""
    logp = jnp.array([[-1.0, -1.2, -200.0]])
    old, ref = jnp.array([[-1.1, -1.0, 0.0]]), jnp.array([[-1.0, -1.1, -5.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])

    def loss(lp, old):
        return grpo.grpo_loss(lp, old, jnp.array([1.0]), mask, clip_low=0.2, clip_high=0.28, aggregation="token",
                              normalizer=2.0, ref_logp=ref, kl_coef=0.1)[0]

    for old_at_pad in (0.0, -300.0):  # the k3 path (ref - logp = 195) and the ratio path (logp - old = 100)
        o = old.at[0, 2].set(old_at_pad)
        value, grad = jax.value_and_grad(loss)(logp, o)
        assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all() and float(grad[0, 2]) == 0.0
        # the live slots' loss is the loss without the padding slot
        short = grpo.grpo_loss(logp[:, :2], o[:, :2], jnp.array([1.0]), mask[:, :2], clip_low=0.2, clip_high=0.28,
                               aggregation="token", normalizer=2.0, ref_logp=ref[:, :2], kl_coef=0.1)[0]
        np.testing.assert_allclose(float(value), float(short), rtol=1e-6)


def surrogate_grad(logp, old, adv, lo=0.2, hi=0.28):
    return jax.grad(lambda lp: grpo.clipped_surrogate(lp, old, adv, lo, hi)[0].sum())(logp)


def test_on_policy_surrogate_is_policy_gradient():
    logp = jnp.asarray(RNG.normal(size=(3, 7)), jnp.float32)
    adv = jnp.asarray([1.5, -0.5, 0.0])
    loss, clipped, _ = grpo.clipped_surrogate(logp, logp, adv, 0.2, 0.28, clip_ratio_c=3.0)
    np.testing.assert_allclose(loss, -np.broadcast_to(adv[:, None], (3, 7)))
    assert not clipped.any()
    np.testing.assert_allclose(surrogate_grad(logp, logp, adv), -np.broadcast_to(adv[:, None], (3, 7)), rtol=1e-6)


@pytest.mark.parametrize("ratio, adv, zero", [
    (1.27, 1.0, False), (1.29, 1.0, True),  # clip_high 0.28 bounds increases of good tokens
    (0.81, -1.0, False), (0.79, -1.0, True),  # clip_low 0.2 bounds decreases of bad tokens
    (0.5, 1.0, False), (2.0, -1.0, False),  # the pessimistic side is never clipped
])
def test_decoupled_clip(ratio, adv, zero):
    old = jnp.zeros((1, 1))
    logp = jnp.log(jnp.full((1, 1), ratio))
    g = surrogate_grad(logp, old, jnp.asarray([adv]))
    assert (float(g[0, 0]) == 0.0) == zero
    assert bool(grpo.clipped_surrogate(logp, old, jnp.asarray([adv]), 0.2, 0.28)[1][0, 0]) == zero


@pytest.mark.parametrize("lo, hi", [(0.2, 0.28), (0.0, 0.28), (0.2, 0.0), (0.0, 0.0)])
def test_surrogate_gradient_is_torch_ppos_on_clip_bounds(lo, hi):
    """d loss / d logp is -A x ratio where PPO keeps the token, 0 where a clip removes it, as torch's clamp and
    where-free min/max give verl, also on a ratio that sits exactly on a clip bound: on-policy (ratio 1) with
    clip_low or clip_high 0 the whole policy gradient, not the 0.75 of it JAX's tie-splitting min and clip gave."""
    rng = np.random.default_rng(3)
    old = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    log_ratio = rng.normal(scale=0.4, size=(4, 8))
    log_ratio[:, :3] = 0.0  # on-policy tokens
    logp = old + jnp.asarray(log_ratio, jnp.float32)
    adv = jnp.asarray([1.3, -0.7, 0.4, -2.0])
    _, clipped, dual = grpo.clipped_surrogate(logp, old, adv, lo, hi, clip_ratio_c=3.0)
    grad = jax.grad(lambda lp: grpo.clipped_surrogate(lp, old, adv, lo, hi, 3.0)[0].sum())(logp)
    ratio = np.exp(np.asarray(logp - old))
    want = np.where(np.asarray(clipped | dual), 0.0, -np.asarray(adv)[:, None] * ratio)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad[:, :3], -np.broadcast_to(np.asarray(adv)[:, None], (4, 3)), rtol=1e-6)


def verl_policy_loss(logp, old, adv, lo, hi, c):
    """verl's compute_policy_loss ("vanilla"), per token, in numpy: clamp, PPO clip, dual clip for A < 0."""
    ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
    clip_pg_losses1 = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi))
    return np.where(adv < 0, np.minimum(-adv * c, clip_pg_losses1), clip_pg_losses1)


def test_dual_clip_matches_verl_and_bounds_negative_advantage_tokens():
    """Off-policy, a token the policy has made far likelier under a negative advantage loses at most c x |A|,
    with no gradient (verl's clip_ratio_c); a log-ratio of 100 stays finite."""
    rng = np.random.default_rng(2)  # its own: with the module's, the draws (and dual.sum()) depend on the tests run before
    old = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    logp = old + jnp.asarray(rng.normal(scale=1.5, size=(4, 6)), jnp.float32).at[0, 0].set(100.0)
    adv = jnp.asarray([-1.5, -0.3, 0.8, 2.0])
    loss, clipped, dual = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28, clip_ratio_c=3.0)
    want = verl_policy_loss(np.asarray(logp), np.asarray(old), np.asarray(adv)[:, None], 0.2, 0.28, 3.0)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    ratio = np.exp(np.asarray(logp - old, np.float64))  # e**100 overflows float32
    np.testing.assert_array_equal(dual, (np.asarray(adv)[:, None] < 0) & (ratio > 3.0))
    assert dual[0, 0] and dual.sum() >= 2 and np.isfinite(np.asarray(loss)).all()
    grad = jax.grad(lambda lp: grpo.clipped_surrogate(lp, old, adv, 0.2, 0.28, 3.0)[0].sum())(logp)
    assert np.all(np.asarray(grad)[np.asarray(dual)] == 0.0) and np.isfinite(np.asarray(grad)).all()
    # off (0): the pessimistic side is unbounded, as before
    off = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28)[0]
    assert float(off[0, 0]) > 3.0 * 1.5


def test_kl_estimators():
    logp = jnp.asarray(RNG.normal(size=(4, 9)), jnp.float32)
    ref = logp + jnp.asarray(RNG.normal(scale=0.3, size=(4, 9)), jnp.float32)
    k3 = grpo.kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all()
    np.testing.assert_allclose(grpo.kl_penalty(logp, logp, "k3"), 0.0, atol=1e-7)
    np.testing.assert_allclose(grpo.kl_penalty(logp, ref, "k1"), logp - ref)
    # k3's gradient vanishes at the reference
    g = jax.grad(lambda lp: grpo.kl_penalty(lp, logp, "k3").sum())(logp)
    np.testing.assert_allclose(g, 0.0, atol=1e-6)
    # both are unbiased estimates of KL(p || q) over samples of p
    p = jnp.asarray([0.5, 0.3, 0.2])
    q = jnp.asarray([0.2, 0.5, 0.3])
    exact = float(jnp.sum(p * jnp.log(p / q)))
    for est in ("k1", "k3"):
        expected = float(jnp.sum(p * grpo.kl_penalty(jnp.log(p), jnp.log(q), est)))
        assert expected == pytest.approx(exact, rel=1e-5)
    with pytest.raises(ValueError, match="k2"):
        grpo.kl_penalty(logp, ref, "k4")
    # k2's gradient is the KL's in expectation on-policy: sum_x p(x) d/dtheta k2 = d/dtheta KL(p_theta || q)
    theta = jnp.log(p)  # logits of a softmax policy
    for est in ("k2", "k1+", "k3+"):
        surrogate = jax.grad(lambda t: jnp.sum(jax.lax.stop_gradient(jax.nn.softmax(t))
                                               * grpo.kl_penalty(jax.nn.log_softmax(t), jnp.log(q), est)))(theta)
        exact_grad = jax.grad(lambda t: jnp.sum(jax.nn.softmax(t) * (jax.nn.log_softmax(t) - jnp.log(q))))(theta)
        np.testing.assert_allclose(surrogate, exact_grad, rtol=1e-5, atol=1e-6, err_msg=est)
    # the straight-through forms keep their estimator's value
    for est in ("k1", "k3"):
        np.testing.assert_allclose(grpo.kl_penalty(logp, ref, est + "+"), grpo.kl_penalty(logp, ref, est), rtol=1e-6)
    # abs: |log p - log q| with torch's gradient sign(x), 0 at the reference: jnp.abs's 1 there pushed every sampled
    # token down on the first step (reference = policy), where verl's update is the one without KL (review)
    np.testing.assert_allclose(grpo.kl_penalty(logp, ref, "abs"), jnp.abs(logp - ref), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda lp: grpo.kl_penalty(lp, logp, "abs").sum())(logp), 0.0)
    np.testing.assert_allclose(jax.grad(lambda lp: grpo.kl_penalty(lp, ref, "abs").sum())(logp), jnp.sign(logp - ref))


def test_aggregation_modes():
    vals = jnp.asarray([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = jnp.asarray([[1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    assert float(grpo.aggregate(vals, mask, "token", mask.sum())) == pytest.approx(8 / 5)
    assert float(grpo.aggregate(vals, mask, "sequence", 2.0)) == pytest.approx((1 + 4) / 2)
    assert float(grpo.aggregate(vals, mask, "sequence_sum", 2.0)) == pytest.approx((4 + 4) / 2)  # verl seq-mean-token-sum
    assert float(grpo.aggregate(vals, mask, "sequence_sum_norm", 2.0, 8.0)) == pytest.approx((4 + 4) / 2 / 8)  # Dr. GRPO
    # splitting rows into micro-batches and adding their shares gives the whole-batch value
    x = jnp.asarray(RNG.normal(size=(8, 6)), jnp.float32)
    m = jnp.asarray(RNG.random((8, 6)) < 0.6, jnp.float32)
    for mode, norm in (("token", m.sum()), ("sequence", 8.0), ("sequence_sum", 8.0), ("sequence_sum_norm", 8.0)):
        whole = grpo.aggregate(x, m, mode, norm, 6.0)
        parts = sum(grpo.aggregate(x[i : i + 2], m[i : i + 2], mode, norm, 6.0) for i in range(0, 8, 2))
        assert float(parts) == pytest.approx(float(whole), rel=1e-5)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        grpo.aggregate(x, m, "batch", 1.0)


def test_recomputed_logprobs_match_the_engine():
    """The trainer's full-sequence forward (left-padded prompts) scores sampled tokens as the sampler did."""
    model = tiny_model()
    engine = RolloutEngine(model, CFG, progress=False)
    reqs = [Request(p, max_new_tokens=10, temperature=0.7, seed=i) for i, p in enumerate(prompts(4, seed=9))]
    out = engine.generate(reqs)
    P, C = 16, 12
    tokens = np.zeros((4, P + C), np.int32)
    pad = np.zeros(4, np.int32)
    for i, (r, c) in enumerate(zip(reqs, out)):
        pad[i] = P - len(r.prompt_ids)
        tokens[i, pad[i] : P] = r.prompt_ids
        tokens[i, P : P + len(c.tokens)] = c.tokens
    assert len(set(pad.tolist())) > 1
    graphdef, state = nnx.split(model)
    fn = jax.jit(update.sequence_logprobs, static_argnums=(0, 4, 5, 6))
    logp, ent = fn(graphdef, nnx.to_pure_dict(state), tokens, pad, C, 0.7)
    for i, c in enumerate(out):
        np.testing.assert_allclose(logp[i, : len(c.tokens)], c.logprobs, rtol=1e-4, atol=1e-4)
    assert np.isfinite(logp).all() and (ent >= 0).all()
    remat = fn(graphdef, nnx.to_pure_dict(state), tokens, pad, C, 0.7, True)
    np.testing.assert_allclose(remat[0], logp, atol=1e-6)


def test_schedules():
    cfg = OptimConfig(learning_rate=1.0, schedule="cosine", warmup_steps=2)
    tx_lr = [update.learning_rate(cfg, 10, i) for i in range(10)]
    assert tx_lr[0] == 0 and tx_lr[2] == pytest.approx(1.0) and tx_lr[-1] < 0.1
    assert update.learning_rate(OptimConfig(learning_rate=0.5), 10, 7) == 0.5
    # the optimizer's own schedule agrees with the logged one
    tx = update.policy_optimizer(OptimConfig(learning_rate=1.0, schedule="linear", max_grad_norm=0.0), 4)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    deltas = []
    for _ in range(4):
        upd, state = tx.update({"w": jnp.ones(())}, state, params)
        deltas.append(-float(upd["w"]))
    want = [update.learning_rate(OptimConfig(learning_rate=1.0, schedule="linear"), 4, i) for i in range(4)]
    np.testing.assert_allclose(deltas, want, rtol=1e-3, atol=1e-6)
    assert isinstance(tx, optax.GradientTransformation)


def verl_kl_penalty(logp, ref, estimator):
    """verl's kl_penalty's value in numpy: "kl"/"k1", "mse"/"k2", "abs", "low_var_kl"/"k3" (log-ratio clamped to
    +-20, value to +-10); its "+" forms have their base's value."""
    estimator = estimator.rstrip("+")
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * np.square(logp - ref)
    if estimator == "abs":
        return np.abs(logp - ref)
    kl = np.clip(ref - logp, -20.0, 20.0)
    return np.clip(np.exp(kl) - kl - 1.0, -10.0, 10.0)


def test_kl_matches_verl_and_stays_finite():
    """Off-policy a sampled token can drift far from the reference: verl's low_var_kl clamps the log-ratio (no
    overflow to inf) and the estimate (a bounded penalty, no gradient past it); ours is the same function."""
    logp = jnp.asarray([[-0.5, -1.0, -3.0, -120.0, -0.1, -2.0]])
    ref = jnp.asarray([[-0.6, -4.0, -0.2, -1.0, -30.0, -2.0]])
    for est in grpo.KL_ESTIMATORS:
        np.testing.assert_allclose(grpo.kl_penalty(logp, ref, est), verl_kl_penalty(np.asarray(logp), np.asarray(ref), est),
                                   rtol=1e-4, atol=1e-6)
    value, grad = jax.value_and_grad(lambda lp: grpo.grpo_loss(
        lp, lp, jnp.asarray([1.0]), jnp.ones_like(lp), clip_low=0.2, clip_high=0.28, aggregation="token",
        normalizer=6.0, ref_logp=ref, kl_coef=0.1)[0])(logp)
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()


def _reference_logp(graphdef, params, rows, width, temperature, entropy=False):
    """log p(completion) [N, width] (0 past each completion's end) by the engine's prefill: each row's prompt and
    completion from slot 0 (no left padding), positions = slots, causal attention; with `entropy`, also each
    position's entropy."""
    model = nnx.merge(graphdef, params)
    N, L = len(rows), max(len(p) + len(c) for p, c in rows)
    seq = np.zeros((N, L), np.int32)
    first = np.zeros((N, width), np.int32)  # slot whose logits predict completion token t: len(prompt) - 1 + t
    target = np.zeros((N, width), np.int32)
    for i, (prompt, completion) in enumerate(rows):
        seq[i, : len(prompt) + len(completion)] = prompt + completion
        first[i] = len(prompt) - 1 + np.arange(width)
        target[i, : len(completion)] = completion
    first = np.minimum(first, L - 1)
    logits, _, _ = model(jnp.asarray(seq), jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (N, L)),
                         KVCache.zeros(model.cfg, N, L, jnp.float32), jnp.zeros(N, jnp.int32))
    logp = jax.nn.log_softmax(jnp.take_along_axis(logits, jnp.asarray(first)[..., None], axis=1) / temperature, axis=-1)
    live = np.arange(width)[None] < np.asarray([len(c) for _, c in rows])[:, None]
    out = jnp.where(live, jnp.take_along_axis(logp, jnp.asarray(target)[..., None], axis=-1)[..., 0], 0.0)
    return (out, -jnp.sum(jnp.exp(logp) * logp, axis=-1)) if entropy else out


def _reference_loss(params, graphdef, ref_params, rows, old, adv, aggregation, lo, hi, c, kl_coef, temperature,
                    entropy_coeff):
    """The whole mini-batch's GRPO loss written out from verl's definitions (compute_policy_loss_vanilla,
    kl_penalty low_var_kl, agg_loss token-mean / seq-mean-token-mean / seq-mean-token-sum, the entropy bonus) and
    Dr. GRPO's for sequence_sum_norm (a mean over sequences of token sum / LENGTH_SCALE; verl's agg_loss sums over
    the micro-batch's sequences, a loss its micro-batch size times ours)."""
    width = old.shape[1]
    mask = jnp.asarray(np.arange(width)[None] < np.asarray([len(c) for _, c in rows])[:, None], jnp.float32)
    lp, entropy = _reference_logp(graphdef, params, rows, width, temperature, entropy=True)
    ref = jax.lax.stop_gradient(_reference_logp(graphdef, ref_params, rows, width, temperature))
    ratio = jnp.exp(jnp.clip(lp - old, -20.0, 20.0))
    a = adv[:, None]
    loss1 = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - lo, 1 + hi))
    pg = jnp.where(a < 0, jnp.minimum(-a * c, loss1), loss1)
    d = jnp.clip(ref - lp, -20.0, 20.0)
    kl = jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)

    def agg(x):
        if aggregation == "token":
            return jnp.sum(x * mask) / jnp.sum(mask)
        if aggregation == "sequence":
            return jnp.mean(jnp.sum(x * mask, axis=1) / jnp.sum(mask, axis=1))
        return jnp.mean(jnp.sum(x * mask, axis=1) / (LENGTH_SCALE if aggregation == "sequence_sum_norm" else 1.0))

    return agg(pg) + kl_coef * agg(kl) - entropy_coeff * agg(entropy)


LENGTH_SCALE = 16.0


@pytest.mark.parametrize("aggregation", ["token", "sequence", "sequence_sum_norm"])  # sequence_sum: the norm x 16 (test_aggregation_modes)
def test_accumulated_off_policy_step_matches_verl_loss_on_the_whole_minibatch(aggregation):
    """4 micro-batches of left-padded prompts and right-padded completions, off-policy old log-probs (PPO clip
    and dual clip both active), a reference policy with k3 KL: the accumulated gradient is the gradient of verl's
    loss over the whole mini-batch (normalised over all its tokens / sequences, not per micro-batch), with the
    layers rematerialised as training runs them."""
    rng = np.random.default_rng(1)
    model = Decoder(TINY, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    ref_params = jax.tree.map(lambda p: p * 0.9, params)
    N, P, C, T = 8, 8, 12, 0.7
    rows = [(rng.integers(0, TINY.vocab_size, rng.integers(2, P + 1)).tolist(),
             rng.integers(0, TINY.vocab_size, n).tolist()) for n in (1, 12, 3, 7, 12, 2, 5, 9)]
    tokens = np.zeros((N, P + C), np.int32)
    pad, mask = np.zeros(N, np.int32), np.zeros((N, C), np.float32)
    for i, (prompt, completion) in enumerate(rows):  # as Trainer.build_batch lays a batch out
        pad[i] = P - len(prompt)
        tokens[i, pad[i] : P], tokens[i, P : P + len(completion)] = prompt, completion
        mask[i, : len(completion)] = 1.0
    true = np.asarray(_reference_logp(graphdef, params, rows, C, T))
    old = (true + rng.normal(scale=0.8, size=(N, C)) * mask).astype(np.float32)  # padding slots: garbage ratios
    old[mask == 0] = 50.0
    adv = rng.normal(size=N).astype(np.float32)
    opts = update.StepOptions(T, 0.2, 0.28, 3.0, aggregation, 0.05, "k3", remat=True, on_policy=False,
                              length_scale=LENGTH_SCALE, entropy_coeff=0.01)
    tx = optax.sgd(1.0)  # new params = params - gradient
    K = 4
    batch = update.GRPOBatch(tokens.reshape(K, N // K, -1), pad.reshape(K, -1), mask.reshape(K, N // K, -1),
                             adv.reshape(K, -1), old.reshape(K, N // K, -1))
    step = jax.jit(update.train_step, static_argnums=(0, 1, 2))
    new, _, metrics = step(graphdef, tx, opts, params, tx.init(params), ref_params, batch)
    assert 0 < float(metrics["clip_fraction"]) < 1 and 0 < float(metrics["dual_clip_fraction"]) < 1

    value, grad = jax.jit(jax.value_and_grad(_reference_loss), static_argnums=(1, 3, 6, 7, 8, 9, 10, 11, 12))(
        params, graphdef, ref_params, tuple((tuple(p), tuple(c)) for p, c in rows), jnp.asarray(old), jnp.asarray(adv),
        aggregation, 0.2, 0.28, 3.0, 0.05, T, 0.01)
    assert float(metrics["loss"]) == pytest.approx(float(value), rel=1e-4)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grad))
    jax.tree.map(lambda g, p, n: np.testing.assert_allclose(p - n, g, atol=2e-4 * scale), grad, params, new)


def test_first_off_policy_minibatch_has_ratio_one():
    """minibatches_per_step > 1: the old log-probs the trainer recomputes (jit_logprobs, before any update) make
    the first mini-batch's importance ratio 1: no token clipped, and the same update as the on-policy step."""
    rng = np.random.default_rng(2)
    model = Decoder(TINY, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
    K, M, P, C, T = 2, 4, 8, 16, 0.6
    tokens = rng.integers(0, TINY.vocab_size, (K * M, P + C)).astype(np.int32)
    pad = rng.integers(0, P - 1, K * M).astype(np.int32)
    mask = (np.arange(C)[None] < rng.integers(1, C + 1, K * M)[:, None]).astype(np.float32)
    adv = rng.normal(size=K * M).astype(np.float32)
    logp_fn = update.jit_logprobs(graphdef, T, shardings, mesh, M)
    old = np.concatenate([np.asarray(logp_fn(params, tokens[i : i + M], pad[i : i + M], mask[i : i + M]))
                          for i in range(0, K * M, M)])
    batch = update.GRPOBatch(tokens.reshape(K, M, -1), pad.reshape(K, M), mask.reshape(K, M, -1), adv.reshape(K, M),
                             old.reshape(K, M, -1))
    tx = optax.sgd(1.0)
    step = jax.jit(update.train_step, static_argnums=(0, 1, 2))
    outs = []
    for on_policy in (False, True):
        opts = update.StepOptions(T, 0.2, 0.28, 3.0, "token", 0.0, "k3", remat=True, on_policy=on_policy)
        outs.append(step(graphdef, tx, opts, params, tx.init(params), None, batch))
    (off, _, m_off), (on, _, m_on) = outs
    assert float(m_off["clip_fraction"]) == 0.0 and float(m_off["dual_clip_fraction"]) == 0.0
    want = -float(np.sum(adv[:, None] * mask) / mask.sum())  # ratio 1: the loss is -mean advantage over tokens
    assert float(m_off["loss"]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert float(m_off["grad_norm"]) == pytest.approx(float(m_on["grad_norm"]), rel=1e-4)
    scale = max(float(jnp.abs(p - n).max()) for p, n in zip(jax.tree.leaves(params), jax.tree.leaves(on)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4 * scale), off, on)


def test_gradient_clipping_is_global_norm_before_adamw():
    """optim.max_grad_norm clips the whole (accumulated) gradient by its global norm before AdamW, as verl's
    clip_grad_norm_: every leaf scaled by the same max_norm / norm, not leaf by leaf, not the update."""
    # A huge Adam eps makes the first update -lr x g / eps: linear in the gradient AdamW receives.
    cfg = OptimConfig(learning_rate=1.0, max_grad_norm=1.0, eps=1e6)
    tx = update.policy_optimizer(cfg, 10)
    params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
    grads = {"a": jnp.asarray([3.0, 0.0, 0.0]), "b": jnp.asarray([0.0, 4.0])}  # global norm 5, leaf norms 3 and 4
    upd, _ = tx.update(grads, tx.init(params), params)
    for k in grads:
        np.testing.assert_allclose(-np.asarray(upd[k]) * cfg.eps, np.asarray(grads[k]) / 5.0, rtol=1e-5)


def test_clipping_on_or_off_keeps_the_optimizer_states_layout():
    """A run stopped on NaN advises setting optim.max_grad_norm; with clipping off the optimizer chain had one entry
    fewer, so its checkpoint refused the resume that followed the advice (found by review)."""
    params = {"w": jnp.ones((3, 2))}
    off, on = (jax.tree.structure(update.policy_optimizer(OptimConfig(max_grad_norm=m), 4).init(params)) for m in (0.0, 1.0))
    assert off == on
