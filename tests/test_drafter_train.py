"""Drafter loss alignment (entry t sees f_t and x_{t+1}, predicts f_{t+1}), the train step, and resume."""

import dataclasses
import json
import os
import re
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.checkpoints import damage
from helpers.tiny import TINY, tiny_model

from fastrl_jax.checkpoint import checkpoint_steps
from fastrl_jax.config import Config, ConfigError, DrafterTrainConfig, RolloutConfig, TrainingStopped
from fastrl_jax.drafter import warmup
from fastrl_jax.drafter.train import LossSettings, drafter_loss, drafter_optimizer, make_train_step, smooth_l1
from fastrl_jax.models.decoder import KVCache
from fastrl_jax.models.drafter import Drafter, policy_features
from fastrl_jax.models.drafter_io import load_drafter

S, P = 12, 9  # sequence length; the one token to learn is x_P


@pytest.fixture(scope="module")
def policy():
    return tiny_model()


def make_batch(seed=0, width=TINY.hidden_size):
    rng = np.random.default_rng(seed)
    mask = np.zeros((1, S), bool)
    mask[0, P] = True
    return {
        "tokens": jnp.asarray(rng.integers(0, TINY.vocab_size, (1, S)), jnp.int32),
        "hidden": jnp.asarray(rng.normal(size=(1, S, width)) * 3, jnp.float32),
        "loss_mask": jnp.asarray(mask),
        "positions": jnp.arange(S, dtype=jnp.int32)[None],
        "segments": jnp.ones((1, S), jnp.int32),
        "temperature": jnp.zeros((1, S), jnp.float32),
        "seeds": jnp.zeros((1, S), jnp.uint32),
    }


def expected_terms(drafter, policy, batch, t):
    """Entry t alone after entries 0..t-1, run as drafting runs it: (f_t, x_{t+1}) -> pred vs f_{t+1}."""
    f = policy_features(policy, batch["hidden"])
    logits, pred, _ = drafter(policy, batch["tokens"][:, 1 : t + 2], f[:, : t + 1], batch["positions"][:, : t + 1],
                              drafter.empty_cache(1, t + 1), jnp.zeros(1, jnp.int32))
    target = f[:, t + 1]
    l1 = smooth_l1(pred[:, t] - target).mean()
    p = jax.nn.softmax(target @ drafter.head_weight(policy).T, -1)
    ce = -(p * jax.nn.log_softmax(logits[:, t], -1)).sum()
    return float(l1), float(ce), pred


@pytest.mark.parametrize("vocab", [None, np.arange(0, 128, 3)])
def test_loss_alignment_position_t_predicts_t_plus_1(policy, vocab):
    drafter = Drafter(TINY, nnx.Rngs(1), draft_vocab=vocab)
    batch = make_batch()
    loss, m = drafter_loss(drafter, policy, batch, jax.random.key(0), LossSettings(ce_weight=0.1))
    l1, ce, _ = expected_terms(drafter, policy, batch, P - 2)
    assert float(m["entries"]) == 1
    np.testing.assert_allclose([float(m["hidden_l1_0"]), float(m["ce_0"])], [l1, ce], rtol=1e-5)
    np.testing.assert_allclose(float(loss), l1 + 0.1 * ce, rtol=1e-5)


def test_loss_depends_on_the_right_positions(policy):
    drafter = Drafter(TINY, nnx.Rngs(1))
    batch = make_batch()
    settings = LossSettings()

    def loss_with(name, index, value):
        b = dict(batch)
        b[name] = b[name].at[0, index].set(value)
        return float(drafter_loss(drafter, policy, b, jax.random.key(0), settings)[0])

    base = float(drafter_loss(drafter, policy, batch, jax.random.key(0), settings)[0])
    # x_P is learnt through the policy's distribution at f_{P-1}: neither x_P nor anything later matters.
    for name, index, value in [("tokens", P, 5), ("tokens", P + 1, 6), ("hidden", P, 9.0), ("hidden", P + 2, 9.0)]:
        assert loss_with(name, index, value) == pytest.approx(base, rel=1e-6), (name, index)
    # The target f_{P-1}, the input token x_{P-1} and the input feature f_{P-2} all matter.
    for name, index, value in [("hidden", P - 1, 9.0), ("tokens", P - 1, int(batch["tokens"][0, P - 1]) ^ 1),
                               ("hidden", P - 2, 9.0)]:
        assert loss_with(name, index, value) != pytest.approx(base, rel=1e-6), (name, index)


def test_unrolled_step_sees_what_a_depth_two_draft_node_sees(policy):
    """Unroll step 1 at anchor a = P-3: entry (pred_a, x_{P-1}) at position P-2 after the true entries
    0..a, predicting f_{P-1}; computed here with the drafter cache as draft_tree does."""
    drafter = Drafter(TINY, nnx.Rngs(2))
    batch = make_batch(1)
    _, m = drafter_loss(drafter, policy, batch, jax.random.key(0), LossSettings(unroll_steps=2))
    a = P - 3
    f = policy_features(policy, batch["hidden"])
    cache = drafter.empty_cache(1, P)
    _, pred, cache = drafter(policy, batch["tokens"][:, 1 : a + 2], f[:, : a + 1], batch["positions"][:, : a + 1],
                             cache, jnp.zeros(1, jnp.int32))
    logits, pred2, _ = drafter(policy, batch["tokens"][:, a + 2 : a + 3], pred[:, a : a + 1],
                               jnp.full((1, 1), a + 1, jnp.int32), cache, jnp.full((1,), a + 1, jnp.int32))
    target = f[:, P - 1]
    np.testing.assert_allclose(float(m["hidden_l1_1"]), float(smooth_l1(pred2[:, 0] - target).mean()), rtol=1e-5)
    p = jax.nn.softmax(target @ drafter.head_weight(policy).T, -1)
    np.testing.assert_allclose(float(m["ce_1"]), float(-(p * jax.nn.log_softmax(logits[:, 0], -1)).sum()), rtol=1e-5)


def test_packed_segments_do_not_see_each_other(policy):
    drafter = Drafter(TINY, nnx.Rngs(1))
    batch = make_batch()
    packed = dict(batch)
    # A second sequence packed in front of the first must not change the first's loss.
    prefix = make_batch(5)
    prefix["loss_mask"] = jnp.zeros_like(prefix["loss_mask"])
    for k in ("tokens", "hidden", "loss_mask"):
        packed[k] = jnp.concatenate([prefix[k], batch[k]], 1)
    packed["positions"] = jnp.concatenate([batch["positions"], batch["positions"]], 1)
    packed["segments"] = jnp.concatenate([jnp.ones((1, S), jnp.int32), 2 * jnp.ones((1, S), jnp.int32)], 1)
    settings = LossSettings(unroll_steps=2)
    a = drafter_loss(drafter, policy, batch, jax.random.key(0), settings)[0]
    b = drafter_loss(drafter, policy, packed, jax.random.key(0), settings)[0]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)


def train_30_steps(graphdef, params, rest, pg, ps, batch):
    """30 optimizer steps on one batch: (params, losses, the last step's metrics)."""
    opt = drafter_optimizer(3e-3, 2, 30, 0.0, 1.0)
    step = make_train_step(opt, LossSettings(input_noise=0.05, unroll_steps=2))
    state, losses = opt.init(params), []
    for i in range(30):
        params, state, m = step(graphdef, params, rest, state, pg, ps, batch, jax.random.key(i))
        losses.append(float(m["loss"]))
    return params, losses, m


@pytest.mark.parametrize("total_steps", [10, None])
def test_without_warm_up_the_first_step_runs_at_the_full_learning_rate(total_steps):
    """warmup_steps 0 means no warm-up (as the policy's schedule reads it): the first update used to run at
    learning rate 0, a step spent on nothing; with a warm-up, the rate climbs from 0 to the peak at warmup_steps."""
    params = {"x": jnp.zeros(3)}

    def first_update(warmup_steps, count=0):
        opt = drafter_optimizer(1e-2, warmup_steps, total_steps, 0.0, 0.0)
        state = opt.init(params)
        for _ in range(count + 1):
            updates, state = opt.update({"x": jnp.ones(3)}, state, params)
        return float(updates["x"][0])

    assert first_update(0) == pytest.approx(-1e-2, rel=1e-3)  # Adam's first step moves by the rate itself
    assert first_update(4) == 0.0 and first_update(4, count=4) == pytest.approx(-1e-2, rel=1e-3)


def test_train_step_learns_and_trains_only_the_drafter(policy):
    drafter = Drafter(TINY, nnx.Rngs(3), draft_vocab=np.arange(64))
    batch = make_batch()
    batch["loss_mask"] = jnp.ones((1, S), bool)
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
    pg, ps = nnx.split(policy)
    policy_before = jax.tree.map(np.asarray, nnx.to_pure_dict(ps))
    params, losses, _ = train_30_steps(graphdef, params, rest, pg, ps, batch)
    assert losses[-1] < 0.5 * losses[0]
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), before, nnx.to_pure_dict(params))
    assert changed["fc"] and changed["layers"]["wq"]
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, policy_before, nnx.to_pure_dict(ps))))
    np.testing.assert_array_equal(nnx.merge(graphdef, params, rest).draft_vocab[...], np.arange(64))


@pytest.mark.parametrize("vocab", [None, np.arange(0, 128, 2)])
def test_eagle3_loss_is_cross_entropy_with_training_time_test(policy, vocab):
    """EAGLE-3: step 0 at anchor a = P-2 runs (F_a, x_{a+1}) from the 3H layer features and scores
    x_P; the training-time-test step 1 at anchor a = P-3 feeds the drafter's own output for entry a+1
    (as a depth-2 draft node runs) and scores x_P too. Nothing else counts."""
    drafter = Drafter(TINY, nnx.Rngs(4), draft_vocab=vocab, kind="eagle3")
    batch = make_batch(width=3 * TINY.hidden_size)
    label = int(drafter.draft_index(batch["tokens"][0, P]))
    if label < 0:  # keep the learned token inside the draft vocabulary
        batch["tokens"] = batch["tokens"].at[0, P].set(int(drafter.token_ids(jnp.int32(1))))
        label = 1
    f, tok, pos = batch["hidden"], batch["tokens"], batch["positions"]

    def run(a):  # entries 0 .. a on the true features
        return drafter(policy, tok[:, 1 : a + 2], f[:, : a + 1], pos[:, : a + 1], drafter.empty_cache(1, a + 2),
                       jnp.zeros(1, jnp.int32))

    logits0 = run(P - 2)[0][0, P - 2]
    _, pred, cache = run(P - 3)
    logits1 = drafter(policy, tok[:, P - 1 : P], pred[:, P - 3 : P - 2], pos[:, P - 2 : P - 1], cache,
                      jnp.full((1,), P - 2, jnp.int32))[0][0, 0]
    ce0, ce1 = (float(-jax.nn.log_softmax(x)[label]) for x in (logits0, logits1))
    one = drafter_loss(drafter, policy, batch, jax.random.key(0), LossSettings(unroll_steps=1))[0]
    np.testing.assert_allclose(float(one), ce0, rtol=1e-4)
    loss, m = drafter_loss(drafter, policy, batch, jax.random.key(0), LossSettings(unroll_steps=2, unroll_decay=0.5))
    np.testing.assert_allclose(float(m["ce_1"]), ce1, rtol=1e-4)
    np.testing.assert_allclose(float(loss), (ce0 + 0.5 * ce1) / 1.5, rtol=1e-4)
    assert "hidden_l1_0" not in m


def test_eagle3_train_step_learns(policy):
    drafter = Drafter(TINY, nnx.Rngs(3), draft_vocab=np.arange(64), kind="eagle3")
    batch = make_batch(width=3 * TINY.hidden_size)
    batch["tokens"] = batch["tokens"] % 64
    batch["loss_mask"] = jnp.ones((1, S), bool)
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    _, losses, m = train_30_steps(graphdef, params, rest, *nnx.split(policy), batch)
    assert losses[-1] < 0.5 * losses[0] and float(m["acc_0"]) > 0.5


def test_eagle3_learns_the_policys_logits_from_tokens_sampled_at_a_temperature(policy):
    """A token sampled at temperature T comes from softmax(l / T) of the policy's logits l, and drafting ranks a
    sampled row's candidates by softmax(d / T) of the drafter's logits d (speculative.coupled_logp). Trained on
    many samples after one fixed context, the drafter must learn d = l, not l / T (which drafts as if the policy
    sampled at T^2: at T = 0.7 and ~1 nat of entropy, 0.90 instead of 0.97 of first drafts accepted)."""
    T, rows, n = 0.5, 8, 16  # n sequences (x_0 x_1 x_2 | x_3) per row; x_3 is sampled
    drafter = Drafter(TINY, nnx.Rngs(0), kind="eagle3")
    context = jnp.asarray([[5, 17, 40]])
    logits, feats, _ = policy(context, jnp.arange(3)[None], KVCache.zeros(TINY, 1, 3), jnp.zeros(1, jnp.int32),
                              capture=drafter.feature_layers)
    p = np.asarray(jax.nn.softmax(logits[0, 2] / T), np.float64)
    p /= p.sum()
    batch = {"hidden": jnp.tile(jnp.concatenate([feats[0], jnp.zeros_like(feats[0, :1])]), (rows, n, 1)),
             "loss_mask": jnp.tile(jnp.asarray([False, False, False, True]), (rows, n)),
             "positions": jnp.tile(jnp.arange(4), (rows, n)),
             "segments": jnp.repeat(jnp.arange(1, n + 1), 4)[None].repeat(rows, 0),
             "temperature": jnp.full((rows, 4 * n), T), "seeds": jnp.zeros((rows, 4 * n), jnp.uint32)}
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    pg, ps = nnx.split(policy)
    opt = drafter_optimizer(1e-2, 10, 100, 0.0, 1.0)
    state = opt.init(params)
    step = make_train_step(opt, LossSettings(unroll_steps=1))
    rng = np.random.default_rng(0)
    for i in range(100):
        x = rng.choice(TINY.vocab_size, size=(rows, n, 1), p=p)
        tokens = np.concatenate([np.broadcast_to([5, 17, 40], (rows, n, 3)), x], -1).reshape(rows, 4 * n)
        params, state, _ = step(graphdef, params, rest, state, pg, ps, batch | {"tokens": jnp.asarray(tokens, jnp.int32)},
                                jax.random.key(i))
    trained = nnx.merge(graphdef, params, rest)
    d = trained(policy, context[:, 1:], feats[:, :2], jnp.arange(2)[None], trained.empty_cache(1, 2),
                jnp.zeros(1, jnp.int32))[0][0, 1]
    kl = float(jnp.sum(p * (jnp.log(p) - jax.nn.log_softmax(d / T))))
    assert kl < 0.1, kl  # d = l / T: KL ~0.8 here


class FakeTokenizer:
    eos_token_id = 3


def run_config(tmp_path, name, steps=4, checkpoint_every=2):
    prompts = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    prompts.write_text("".join(json.dumps({"prompt_ids": rng.integers(4, 128, 6).tolist()}) + "\n" for _ in range(6)))
    rollout = RolloutConfig(batch_buckets=(8,), length_buckets=(48,), prompt_buckets=(8,), steps_per_call=8,
                            compile_cache_dir="", warm_up=False)
    dt = DrafterTrainConfig(
        out_dir=str(tmp_path / name), prompts=str(prompts), num_prompts=6, max_new_tokens=24, draft_vocab_size=32,
        steps=steps, batch_rows=2, seq_len_tokens=32, warmup_steps=1, learning_rate=1e-3, log_every_steps=1,
        eval_every_steps=0, eval_prompts=0, checkpoint_every_steps=checkpoint_every, keep_checkpoints=2, tensorboard=False,
        unroll_steps=2, buffer_max_tokens=4096,
    )
    return Config(rollout=rollout, drafter_train=dt)


def test_resume_continues_the_same_run(policy, tmp_path, monkeypatch):
    whole = warmup.train_drafter(run_config(tmp_path, "whole"), policy, FakeTokenizer(), progress=False)
    assert whole["data"]["sequences"] == 6

    real = warmup.make_train_step

    def crashing(*args):
        step, calls = real(*args), []

        def wrapped(*a):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt  # killed during step 3, after the step-2 checkpoint
            return step(*a)

        return wrapped

    def interrupted(cfg):
        monkeypatch.setattr(warmup, "make_train_step", crashing)
        with pytest.raises(KeyboardInterrupt):
            warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
        monkeypatch.setattr(warmup, "make_train_step", real)

    cfg = run_config(tmp_path, "killed")
    interrupted(cfg)
    # Interrupted (Ctrl-C, SIGTERM) before its first checkpoint is due: the finished steps are saved on the way out.
    interrupted(run_config(tmp_path, "late", checkpoint_every=4))
    assert checkpoint_steps(tmp_path / "late") == [2]
    warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)

    a = load_drafter(tmp_path / "whole" / "drafter", TINY)
    b = load_drafter(tmp_path / "killed" / "drafter", TINY)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    assert a.draft_vocab[...].shape == (32,)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the killed run's lines were kept up to its checkpoint, then continued

    # Killed the same way with checkpoints at steps 1 and 2, the latest damaged: the rerun falls back to step 1,
    # sets step 2 aside and runs it again (its line too), and keep-k does not prune the good step.
    cfg = run_config(tmp_path, "damaged", checkpoint_every=1)
    interrupted(cfg)
    damage(tmp_path / "damaged" / "checkpoints" / "2")
    warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    c = load_drafter(tmp_path / "damaged" / "drafter", TINY)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(c))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "damaged" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert sorted(int(p.name) for p in (tmp_path / "damaged" / "checkpoints").iterdir() if p.name.isdigit()) == [3, 4]


def test_a_stop_signal_ends_training_after_its_step_with_that_step_saved(policy, tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) during a step lets the step finish and saves it, whenever the checkpoint is due: before,
    one landing as a step returned lost the steps since the last checkpoint. Ctrl-C twice stops at once."""
    real = warmup.make_train_step

    def signalled(times):
        def make(*args):
            step, calls = real(*args), []

            def wrapped(*a):
                calls.append(1)
                if len(calls) == 3:
                    for _ in range(times):
                        os.kill(os.getpid(), signal.SIGINT)
                return step(*a)

            return wrapped

        return make

    monkeypatch.setattr(warmup, "make_train_step", signalled(1))
    cfg = run_config(tmp_path, "stopped", checkpoint_every=4)
    handler = signal.getsignal(signal.SIGINT)  # Python's, or ignored in a pytest-xdist worker
    with pytest.raises(TrainingStopped, match="SIGINT: stopped after step 3 of 4"):
        warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    assert checkpoint_steps(tmp_path / "stopped") == [3]
    assert signal.getsignal(signal.SIGINT) == handler  # what it was: Ctrl-C acts at once again

    monkeypatch.setattr(warmup, "make_train_step", signalled(2))
    with pytest.raises(KeyboardInterrupt):
        warmup.train_drafter(run_config(tmp_path, "twice", checkpoint_every=4), policy, FakeTokenizer(), progress=False)
    assert checkpoint_steps(tmp_path / "twice") == [2]  # the steps before the one it landed in

    monkeypatch.setattr(warmup, "make_train_step", real)
    warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    whole = warmup.train_drafter(run_config(tmp_path, "whole", checkpoint_every=4), policy, FakeTokenizer(), progress=False)
    a = load_drafter(Path(whole["drafter"]), TINY)
    b = load_drafter(tmp_path / "stopped" / "drafter", TINY)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_an_evaluation_killed_at_a_checkpoint_step_runs_again_on_resume(policy, tmp_path, monkeypatch):
    """The process dies inside step 2's held-out evaluation, a checkpoint step: the evaluation came after the
    checkpoint, so the same command again resumed after step 2 and its evaluation was gone for good (review)."""
    cfg = run_config(tmp_path, "run", steps=4, checkpoint_every=2)
    cfg = dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, eval_every_steps=2))
    calls = []

    def evaluate(self, drafter, step, temperatures=(0.0,)):
        calls.append(step)
        if len(calls) == 1:
            raise KeyboardInterrupt  # killed inside it
        self.sink.write({"step": step, "accept_math_t0": 1.5})
        return {"accept_math_t0": 1.5}

    monkeypatch.setattr(warmup.HeldOutEvaluator, "__call__", evaluate)
    with pytest.raises(KeyboardInterrupt):
        warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "accept_math_t0" in r] == [2, 4]  # 4: the final evaluation


def test_an_interrupted_collection_continues_where_it_stopped(policy, tmp_path, monkeypatch):
    """The collection (~20 min of the default warm-up on a CPU) saves what it collected as it goes: killed midway,
    a rerun generates only the requests after the saved ones and ends with the data of an uninterrupted run. A start
    with other data settings is refused, as for finished data: it deleted the interrupted collection's files (review)."""
    from fastrl_jax.models.tokenizer import stop_ids

    def data(name, engine=warmup.RolloutEngine):
        monkeypatch.setattr(warmup, "RolloutEngine", engine)
        cfg = run_config(tmp_path, name)
        out = tmp_path / name
        out.mkdir(exist_ok=True)
        summary = {}
        warmup.collect_data(cfg, policy, FakeTokenizer(), out / "data.npz", stop_ids(TINY, FakeTokenizer()), summary, False)
        with np.load(out / "data.npz") as f:
            return summary, {k: f[k] for k in f.files}

    class Killed(warmup.RolloutEngine):
        def stream(self, requests, between_steps=None):
            for n, item in enumerate(super().stream(requests, between_steps)):
                if n == 4:
                    raise KeyboardInterrupt
                yield item

    _, whole = data("whole")
    monkeypatch.setattr(warmup, "PARTIAL_SAVE_SECONDS", 0.0)
    with pytest.raises(KeyboardInterrupt):
        data("killed", Killed)
    saved = sorted((tmp_path / "killed" / "data.partial").glob("*.npz"), key=lambda f: int(f.stem))
    assert not (tmp_path / "killed" / "data.npz").exists() and len(saved) >= 2
    cfg = run_config(tmp_path, "killed")
    other = dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, temperature=1.0))
    with pytest.raises(ValueError, match=r"data.partial was collected with other settings: drafter_train.temperature"):
        warmup.check_restart(other, resume=True)
    assert sorted((tmp_path / "killed" / "data.partial").glob("*.npz"), key=lambda f: int(f.stem)) == saved
    saved[-1].write_bytes(saved[-1].read_bytes()[:100])  # a damaged file: its requests are generated again
    summary, again = data("killed")
    assert summary["collect"]["resumed_requests"] == int(saved[-1].stem)
    assert not (tmp_path / "killed" / "data.partial").exists()
    assert whole.keys() == again.keys()
    for k in whole:
        np.testing.assert_allclose(whole[k], again[k], rtol=1e-2, atol=1e-2, err_msg=k)


def test_a_collection_saved_when_interrupted_holds_exactly_the_requests_it_counts(tmp_path):
    """Ctrl-C may land after a completion went into the buffer and before the collection counted its request:
    the save leaves that sequence out (its request is generated again), instead of counting it for another."""
    from fastrl_jax.drafter.buffer import SampleBuffer

    def sequence(i):
        return np.arange(10) + 100 * i, np.zeros((9, TINY.hidden_size)), np.arange(10) >= 4

    buf = SampleBuffer(30, TINY.hidden_size)
    partial = warmup.PartialData(tmp_path / "p", buf)
    for i in range(3):
        buf.add(*sequence(i))
        partial.added(1)
    buf.add(*sequence(3))  # interrupted here: request 3 is in the buffer, not counted
    partial.save()
    back = SampleBuffer(30, TINY.hidden_size)
    assert warmup.PartialData(tmp_path / "p", back).load() == 3
    assert back.arrays()["tokens"][::10].tolist() == [100, 200]  # request 0's was evicted by request 3's


def test_a_resumed_collection_evicts_what_an_uninterrupted_one_evicts(tmp_path):
    """A partial file holds the sequences of its requests that the buffer still holds at the save: where a later one
    had evicted some of them, every older sequence was gone too, and a replay that kept the older ones ended with
    other data than the uninterrupted collection (review: 7 of 300 random interrupt schedules)."""
    from fastrl_jax.drafter.buffer import SampleBuffer

    def sequence(i, n):
        return np.arange(n) + 100 * i, np.zeros((n - 1, TINY.hidden_size)), np.arange(n) >= 1

    def held(buf):  # the requests whose sequences the buffer holds
        a = buf.arrays()
        return [int(a["tokens"][start]) // 100 for start in np.r_[0, np.cumsum(a["lengths"])[:-1]]]

    lengths = [2, 15, 4, 5]  # request 0 is saved alone; request 3 evicts request 1 before the next save
    whole, buf = SampleBuffer(20, TINY.hidden_size), SampleBuffer(20, TINY.hidden_size)
    partial = warmup.PartialData(tmp_path / "p", buf)
    for i, n in enumerate(lengths):
        whole.add(*sequence(i, n))
        buf.add(*sequence(i, n))
        partial.added(1)
        if i == 0:
            partial.save()
    partial.save()  # interrupted here, every request saved
    again = SampleBuffer(20, TINY.hidden_size)
    assert warmup.PartialData(tmp_path / "p", again).load() == 4
    assert held(whole) == [2, 3] and held(again) == held(whole)


def test_damaged_collected_data_is_one_clear_error(policy, tmp_path):
    """A data.npz damaged inside (a bad disk, a copy cut short and patched) is refused with the fix, not a
    zipfile traceback from deep inside numpy."""
    from fastrl_jax.drafter.buffer import SampleBuffer

    out = tmp_path / "damaged"
    out.mkdir()
    buf = SampleBuffer(4096, TINY.hidden_size)
    for i in range(4):
        buf.add(np.arange(10) + i, np.ones((9, TINY.hidden_size)), np.arange(10) >= 4)
    buf.save(out / "data.npz")
    raw = (out / "data.npz").read_bytes()
    (out / "data.npz").write_bytes(raw[:300] + bytes(200) + raw[500:])
    with pytest.raises(ValueError, match=r"data.npz is damaged \(.*\): delete it to collect again"):
        warmup.collect_data(run_config(tmp_path, "damaged"), policy, FakeTokenizer(), out / "data.npz", (3,), {}, False)


def test_checkpoints_past_the_steps_asked_for_are_refused_before_loading(tmp_path):
    """Resumed with fewer drafter_train.steps than its checkpoints reached, a run used to train nothing, save the
    longer-trained drafter under the smaller step count, and evaluate it again at every rerun."""
    cfg = run_config(tmp_path, "past", steps=4)
    (tmp_path / "past" / "checkpoints" / "6").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"checkpoints up to step 6, past drafter_train.steps=4"):
        warmup.check_restart(cfg, resume=True)
    warmup.check_restart(dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, steps=6)), True)


def test_lengths_the_engine_cannot_hold_are_refused_before_loading(tmp_path):
    """A held-out evaluation whose completions and draft tree pass the largest length bucket ran the whole warm-up
    and then reported NaN acceptance: each held-out request failed, and the figure is over the rest (review)."""
    cfg = run_config(tmp_path, "lengths")
    with_eval = lambda **kw: dataclasses.replace(cfg, drafter_train=dataclasses.replace(  # noqa: E731
        cfg.drafter_train, eval_prompts=2, **kw))
    warmup.check_restart(with_eval(eval_max_new_tokens=32), resume=True)  # 32 + 15 draft-tree slots < 48
    with pytest.raises(ConfigError, match=r"drafter_train.eval_max_new_tokens: max_new_tokens \(40\) \+ 15 draft-tree"):
        warmup.check_restart(with_eval(eval_max_new_tokens=40), resume=True)
    with pytest.raises(ConfigError, match=r"drafter_train.max_new_tokens: max_new_tokens \(48\) leaves no room"):
        warmup.check_restart(with_eval(max_new_tokens=48), resume=True)


def test_held_out_prompts_that_cannot_run_are_named_beside_the_figure(capsys):
    import types

    from fastrl_jax.rollout.engine import Completion

    done = [Completion([5], [0.0], "stop"), Completion([], [], "error", error="prompt of 60 tokens exceeds 48")]
    engine = types.SimpleNamespace(generate=lambda reqs: done,
                                   stats=types.SimpleNamespace(acceptance_length=lambda: 2.5))
    assert warmup.acceptance(engine, [[1, 2], [3] * 60], 8, 0.0, (2,)) == 2.5
    assert "1 of 2 held-out prompts cannot run (prompt of 60 tokens exceeds 48)" in capsys.readouterr().err


def test_a_finished_run_run_again_is_left_as_it_is(policy, tmp_path):
    """Run again (resuming is the default), a finished warm-up neither evaluates again (a second final row in
    metrics.jsonl) nor rewrites its summary without the data collection's figures, nor its drafter."""
    cfg = run_config(tmp_path, "done", steps=2)
    assert "collect" in warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    files = {p: p.read_bytes() for p in (tmp_path / "done").rglob("*") if p.is_file()}
    again = warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    assert "collect" in again and again["steps"] == 2
    assert {p: p.read_bytes() for p in (tmp_path / "done").rglob("*") if p.is_file()} == files


def test_eagle3_warm_up_stores_layer_features_and_saves_its_kind(policy, tmp_path):
    cfg = run_config(tmp_path, "e3", steps=2)
    cfg = dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, kind="eagle3"))
    summary = warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    assert summary["data"]["sequences"] == 6
    with np.load(tmp_path / "e3" / "data.npz") as data:
        assert data["hidden"].shape[-1] == 3 * TINY.hidden_size
    back = load_drafter(tmp_path / "e3" / "drafter", TINY)
    assert back.kind == "eagle3" and back.draft_vocab[...].shape == (32,)
    # The same out_dir with settings that collect other data: refused before anything loads, naming them
    # (another kind's checkpoints cannot go on either: the advice names them, found by review)
    for change, named, keep in (({"kind": "eagle"}, "drafter_train.kind (was 'eagle3', now 'eagle')", "and its checkpoints"),
                                ({"max_new_tokens": 25}, "drafter_train.max_new_tokens (was 24, now 25)",
                                 "(its checkpoints then continue")):
        other = dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, **change))
        with pytest.raises(ValueError, match=r"data.npz was collected with other settings: " + re.escape(named)) as e:
            warmup.check_restart(other, resume=True)
        assert keep in str(e.value)
    # Data from before its settings were recorded: a kind whose features it lacks is still named, by width
    (tmp_path / "e3" / "data.json").unlink()
    other = dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, kind="eagle"))
    with pytest.raises(ValueError, match=r"wide; this buffer takes 64 .*drafter_train.kind eagle .*delete .*data.npz"):
        warmup.train_drafter(other, policy, FakeTokenizer(), progress=False)


def test_a_draft_vocabulary_as_large_as_the_policys_is_the_full_one(policy, tmp_path):
    """drafter_train.draft_vocab_size >= the vocabulary (the default 8192 on a small one) drafts over all of it, as
    an untrained drafter of that size does (fresh_draft_vocab), instead of failing after the data is collected."""
    cfg = run_config(tmp_path, "full", steps=1)
    cfg = dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, draft_vocab_size=8192))
    warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    assert load_drafter(tmp_path / "full" / "drafter", TINY).draft_vocab is None


def test_config_errors_name_the_key():
    from fastrl_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="drafter_train.unroll_steps"):
        load_config(None, ["drafter_train.unroll_steps=0"])
    with pytest.raises(ConfigError, match="drafter_train.prompts"):
        load_config(None, ["drafter_train.prompts=data.txt"])
    with pytest.raises(ConfigError, match="drafter_train.kind"):
        load_config(None, ["drafter_train.kind=medusa"])
    assert load_config(None, []).drafter_train.kind == "eagle"
    assert dataclasses.asdict(load_config("configs/smollm2_cpu.yaml").drafter_train)["draft_vocab_size"] > 0


def _every_prompt_too_long(cfg, tmp_path):
    path = tmp_path / "long.jsonl"
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"prompt_ids": rng.integers(4, 128, 12).tolist()}) + "\n" for _ in range(6)))
    return dataclasses.replace(cfg, drafter_train=dataclasses.replace(cfg.drafter_train, prompts=str(path)))


def test_a_collection_where_every_request_fails_says_why_and_keeps_no_data(policy, tmp_path):
    """Every prompt longer than the largest prompt bucket: the run said only 'add rollouts first' and kept an empty
    data.npz that a rerun with rollout settings fixed (not data settings) reused (found by review)."""
    cfg = _every_prompt_too_long(run_config(tmp_path, "long", steps=2), tmp_path)
    with pytest.raises(ValueError, match="added no sequence to train on .*largest prompt bucket"):
        warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    assert not (tmp_path / "long" / "data.npz").exists() and not (tmp_path / "long" / "data.partial").exists()


def test_an_interrupt_as_a_step_returns_ends_with_the_interrupt(policy, tmp_path, monkeypatch, capsys):
    """Ctrl-C landing as a train step returns, before its result is taken: that step has consumed (donated) the state
    the interrupt's save would write; the save raised 'Array has been deleted' over the interrupt (found by review)."""
    cfg = run_config(tmp_path, "late", steps=4, checkpoint_every=4)
    real = warmup.make_train_step

    def interrupted_third(*args):
        step, calls = real(*args), []

        def run(*a):
            out = step(*a)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return out

        return run

    monkeypatch.setattr(warmup, "make_train_step", interrupted_third)
    with pytest.raises(KeyboardInterrupt):
        warmup.train_drafter(cfg, policy, FakeTokenizer(), progress=False)
    assert "interrupted inside step 3, which had taken step 2's state; a resume continues from step 0" in (
        capsys.readouterr().err)
