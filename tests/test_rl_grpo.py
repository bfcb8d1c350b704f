"""GRPO math: properties of advantages, the clipped surrogate, KL and aggregation; log-prob recomputation;
gradient accumulation equals one big batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.config import OptimConfig, RLConfig
from fastrl_jax.models.decoder import Decoder
from fastrl_jax.rl import grpo, update
from fastrl_jax.rollout.engine import Request, RolloutEngine

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


def verl_policy_loss(logp, old, adv, lo, hi, c):
    """verl's compute_policy_loss ("vanilla"), per token, in numpy: clamp, PPO clip, dual clip for A < 0."""
    ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
    clip_pg_losses1 = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi))
    return np.where(adv < 0, np.minimum(-adv * c, clip_pg_losses1), clip_pg_losses1)


def test_dual_clip_matches_verl_and_bounds_negative_advantage_tokens():
    """Off-policy, a token the policy has made far likelier under a negative advantage loses at most c x |A|,
    with no gradient (verl's clip_ratio_c); a log-ratio of 100 stays finite."""
    old = jnp.asarray(RNG.normal(size=(4, 6)), jnp.float32)
    logp = old + jnp.asarray(RNG.normal(scale=1.5, size=(4, 6)), jnp.float32).at[0, 0].set(100.0)
    adv = jnp.asarray([-1.5, -0.3, 0.8, 2.0])
    loss, clipped, dual = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28, clip_ratio_c=3.0)
    want = verl_policy_loss(np.asarray(logp), np.asarray(old), np.asarray(adv)[:, None], 0.2, 0.28, 3.0)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    ratio = np.exp(np.asarray(logp - old))
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
        grpo.kl_penalty(logp, ref, "k2")


def test_aggregation_modes():
    vals = jnp.asarray([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = jnp.asarray([[1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    assert float(grpo.aggregate(vals, mask, "token", mask.sum())) == pytest.approx(8 / 5)
    assert float(grpo.aggregate(vals, mask, "sequence", 2.0)) == pytest.approx((1 + 4) / 2)
    # splitting rows into micro-batches and adding their shares gives the whole-batch value
    x = jnp.asarray(RNG.normal(size=(8, 6)), jnp.float32)
    m = jnp.asarray(RNG.random((8, 6)) < 0.6, jnp.float32)
    for mode, norm in (("token", m.sum()), ("sequence", 8.0)):
        whole = grpo.aggregate(x, m, mode, norm)
        parts = sum(grpo.aggregate(x[i : i + 2], m[i : i + 2], mode, norm) for i in range(0, 8, 2))
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


def test_grad_accumulation_equals_one_batch():
    model = Decoder(TINY, nnx.Rngs(0))  # unscaled: tiny_model's sharp logits amplify float rounding
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    N, S, C = 8, 24, 16
    tokens = RNG.integers(0, TINY.vocab_size, (N, S)).astype(np.int32)
    pad = RNG.integers(0, S - C, N).astype(np.int32)
    mask = (RNG.random((N, C)) < 0.5).astype(np.float32)
    adv = RNG.normal(size=N).astype(np.float32)
    results = []
    for agg in ("token", "sequence"):
        rl = RLConfig(loss_aggregation=agg, micro_batch_size=2, remat=True)
        opts = update.StepOptions.from_config(rl)
        tx = optax.sgd(1.0)  # new params = params - gradient: compares the accumulated gradients
        outs = []
        for K in (1, 4):
            batch = update.GRPOBatch(tokens.reshape(K, N // K, S), pad.reshape(K, N // K), mask.reshape(K, N // K, C),
                                 adv.reshape(K, N // K), np.zeros((K, N // K, C), np.float32))
            step = jax.jit(update.train_step, static_argnums=(0, 1, 2))
            new, _, metrics = step(graphdef, tx, opts, params, tx.init(params), None, batch)
            outs.append((new, metrics))
        (a, ma), (b, mb) = outs
        jax.tree.map(lambda x, y, p: np.testing.assert_allclose(x - p, y - p, atol=1e-4 * float(jnp.abs(y - p).max())), a, b, params)
        assert float(ma["loss"]) == pytest.approx(float(mb["loss"]), rel=1e-4, abs=1e-6)
        assert float(ma["grad_norm"]) == pytest.approx(float(mb["grad_norm"]), rel=1e-4) and float(ma["grad_norm"]) > 0
        results.append(a)
    moved = jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), results[0], params)
    assert max(jax.tree.leaves(moved)) > 0


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
