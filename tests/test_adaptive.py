"""Adaptive speculative decoding: the controller on synthetic inputs, and the engine switching SD on mid-run."""

import dataclasses
import json
import math
import time

import numpy as np
import pytest
from flax import nnx
from helpers.greedy import greedy_generate
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.config import ConfigError, SpecConfig, load_config
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout.controller import OnOff, StrategyChooser
from fastrl_jax.rollout.engine import Request, RolloutEngine
from fastrl_jax.rollout.speculative import PLAIN, Strategy

# ---- controller (pure) ------------------------------------------------------------------------


def test_on_off_needs_patience_and_turns_off_at_once():
    c = OnOff(threshold=4, patience=3)
    live = [9, 4, 3, 5, 4, 4, 4, 2, 1, 6, 3]
    assert [c.update(b) for b in live] == [False, False, False, False, False, False, True, True, True, False, False]


def test_on_off_does_not_flap_around_the_threshold():
    c = OnOff(threshold=8, patience=2)
    hovering = [8, 9] * 20 + [9, 8] * 20
    assert not any(c.update(b) for b in hovering)
    # A batch shrinking through the threshold switches exactly once.
    c.reset()
    states = [c.update(b) for b in [16, 12, 9, 8, 7, 5, 3, 2, 1]]
    assert sum(a != b for a, b in zip(states, states[1:])) == 1


A, B, C = Strategy(6, 4, 16), Strategy(4, 4, 16), Strategy(3, 2, 6)
RANGES = {16: (1, 2), 6: (3, 8)}


def test_bandit_buckets_by_live_batch():
    chooser = StrategyChooser([A, B, C], RANGES, kind="fixed")
    assert [chooser.choose(b) for b in (1, 2, 3, 8)] == [A, A, C, C]
    assert chooser.choose(9) is None
    overlapping = StrategyChooser([A, C], {16: (1, 4), 6: (4, 8)}, plain_arm=True)
    assert overlapping.arms(overlapping.bucket(4)) == [A, C, PLAIN] and overlapping.arms(overlapping.bucket(5)) == [C, PLAIN]
    with pytest.raises(ValueError, match="1 <= min <= max"):
        StrategyChooser([A, C], {16: (0, 4), 6: (4, 8)})
    with pytest.raises(ValueError, match="one live-batch range per verify_tokens group"):
        StrategyChooser([A, C], {16: (1, 4)})


def _play(kind, means, rounds=300, seed=0, epsilon=0.1, chooser=None):
    """Plays the bucket at live batch 1 with noisy synthetic rewards; returns the chooser."""
    chooser = chooser or StrategyChooser([A, B, C], RANGES, kind=kind, epsilon=epsilon, window=9, seed=seed)
    noise = np.random.default_rng(seed + 1)
    for _ in range(rounds):
        s = chooser.choose(1)
        chooser.record(s, 1, means[s] * (1 + 0.3 * noise.standard_normal()))
    return chooser


@pytest.mark.parametrize("kind", ["beg", "ucb1"])
def test_bandit_finds_the_better_strategy_and_keeps_exploring(kind):
    chooser = _play(kind, {A: 100.0, B: 160.0})
    pulls = chooser.pulls.copy()
    assert pulls[(6,), C] == 0  # other bucket
    assert pulls[(16,), B] > 0.7 * 300  # exploits the better arm
    assert pulls[(16,), A] >= 5  # and still explores the worse one
    # The better arm changes (the policy drifts): the sliding window lets the bandit follow.
    _play(kind, {A: 160.0, B: 100.0}, chooser=chooser)
    assert chooser.pulls[(16,), A] - pulls[(16,), A] > 0.7 * 300


def test_an_arm_that_needs_a_drafter_prefill_to_start_wins_when_its_calls_pay():
    """The engine's reward charges an EAGLE arm the drafter prefill a switch from plain needs. BEG explores a losing arm
    right after plain calls, so every exploring call paid a whole prefill in its few steps (sd.explore_steps) and the
    arm never showed its rate once warm: plain decoding kept the bucket though EAGLE decodes 1.43x its rate (review,
    a model of the engine's calls: 10 ms plain steps, 14 ms SD steps of 2 tokens, a 50 ms prefill)."""
    from fastrl_jax.rollout.engine import arm_reward

    eagle, steps_per_call, explore_steps, prefill_s = Strategy(5, 4, 8), 32, 8, 0.050
    chooser = StrategyChooser([eagle], {8: (1, 8)}, "beg", 0.1, 16, 0, plain_arm=True)
    fresh, tokens, seconds = False, 0.0, 0.0
    for _ in range(1000):
        arm = chooser.choose(4)
        steps = explore_steps if chooser.exploring else steps_per_call
        if arm is PLAIN:
            tok, sec, pre, fresh = steps * 4, steps * 0.010, 0.0, False
        else:
            tok, sec, pre, fresh = steps * 8, steps * 0.014, 0.0 if fresh else prefill_s, True
        chooser.record(arm, 4, arm_reward(tok, 4, sec, pre, steps / steps_per_call if chooser.exploring else 1.0))
        tokens, seconds = tokens + tok, seconds + sec + pre
    assert chooser.pulls[(8,), eagle] > 0.8 * 1000
    assert tokens / seconds / 4 > 1.3 * 100  # tokens / s a row, against plain decoding's 100


def test_a_forgetting_bandit_chooses_as_a_fresh_one():
    """reset_controller's cold start: after forget(seed) the chooser replays a new chooser's choices for
    the same rewards, and keeps the drafter's acceptance estimate."""
    means = {A: 100.0, B: 160.0}
    fresh = _play("beg", means, seed=3)
    used = _play("beg", {A: 160.0, B: 100.0}, seed=5)
    used.drafter_accept = 2.5
    used.forget(3)
    assert used.drafter_accept == 2.5 and not used.pulls
    assert _play("beg", means, chooser=used, seed=3).pulls == fresh.pulls


def test_a_restored_bandit_chooses_as_the_one_it_was_saved_from():
    """A resumed run's controller: state() through JSON and restore() give the saved chooser's later choices."""
    means = {A: 100.0, B: 160.0, PLAIN: 120.0}
    saved = _play("beg", means, seed=3, chooser=StrategyChooser([A, B, C], RANGES, window=9, seed=3, plain_arm=True))
    restored = StrategyChooser([A, B, C], RANGES, window=9, seed=7, plain_arm=True)
    restored.restore(json.loads(json.dumps(saved.state())))
    assert restored.pulls == saved.pulls and restored.rewards == saved.rewards
    assert _play("beg", means, seed=3, chooser=restored).pulls == _play("beg", means, seed=3, chooser=saved).pulls
    fewer = StrategyChooser([A], {16: (1, 4)}, seed=0)  # arms the run no longer has are dropped
    fewer.restore(saved.state())
    assert set(fewer.pulls) == {((16,), A)}


@pytest.mark.parametrize("kind", ["beg", "ucb1"])
def test_plain_decoding_wins_when_speculation_does_not_pay(kind):
    """A random drafter: every strategy earns less than plain decoding, which the bandit then plays."""
    chooser = StrategyChooser([A, B, C], RANGES, kind=kind, window=9, seed=0, plain_arm=True)
    assert PLAIN in chooser.arms((16,)) and PLAIN in chooser.arms((6,))
    chooser = _play(kind, {A: 60.0, B: 70.0, PLAIN: 100.0}, chooser=chooser)
    assert chooser.pulls[(16,), PLAIN] > 0.5 * 300  # more than both strategies together (UCB1 explores more)
    assert chooser.pulls[(6,), PLAIN] == 0  # plain decoding's rewards are kept per bucket


def test_eagle_arms_sit_out_until_the_drafter_is_estimated_to_pay():
    """A randomly initialised drafter accepts ~1 token per step: its arms would only cost compiles and
    explorations, so they wait for an acceptance estimate of sd.min_drafter_accept; history arms do not."""
    H = Strategy(0, 0, 1, 15)  # a history chain verifying 16 tokens: A's group
    chooser = StrategyChooser([A, H, C], RANGES, plain_arm=True, min_drafter_accept=1.3)
    assert chooser.arms((16,)) == [A, H, PLAIN]  # a drafter not estimated yet is trusted
    chooser.drafter_accept = 1.0
    assert chooser.arms((16,)) == [H, PLAIN] and chooser.arms((6,)) == []
    assert chooser.choose(3) is None and {chooser.choose(1) for _ in range(20)} <= {H, PLAIN}
    chooser.drafter_accept = 1.3
    assert chooser.arms((16,)) == [A, H, PLAIN] and chooser.arms((6,)) == [C, PLAIN]


def test_bandit_is_deterministic_given_a_seed():
    means = {A: 100.0, B: 110.0}
    def pulls(seed):
        return _play("beg", means, seed=seed, epsilon=0.3).pulls

    assert pulls(3) == pulls(3) != pulls(4)
    assert _play("fixed", means).pulls[(16,), B] == 0


def test_adaptive_config_is_validated():
    ok = load_config(None, ["sd.mode=adaptive", "sd.strategies=[[6,4,16],[3,2,6]]",
                            "sd.group_live_batch_ranges=[[16,1,2],[6,3,8]]"])
    assert ok.sd.live_batch_ranges() == {16: (1, 2), 6: (3, 8)}
    with pytest.raises(ConfigError, match="give sd.group_live_batch_ranges"):
        SpecConfig(mode="adaptive", strategies=((6, 4, 16), (3, 2, 6)))
    with pytest.raises(ConfigError, match="without gaps"):
        SpecConfig(mode="adaptive", strategies=((6, 4, 16), (3, 2, 6)), group_live_batch_ranges=((16, 1, 2), (6, 4, 8)))
    with pytest.raises(ConfigError, match="one range per verify_tokens group"):
        SpecConfig(mode="adaptive", strategies=((6, 4, 16),), group_live_batch_ranges=((8, 1, 8),))
    with pytest.raises(ConfigError, match=r"sd.strategies\[1\]: verify_tokens=40 exceeds"):
        SpecConfig(mode="adaptive", strategies=((6, 4, 16), (2, 2, 40)))
    with pytest.raises(ConfigError, match="sd.bandit must be one of beg, ucb1, fixed"):
        SpecConfig(bandit="greedy")
    with pytest.raises(ConfigError, match="sd.patience_host_steps must be >= 1"):
        SpecConfig(patience_host_steps=0)


# ---- engine -------------------------------------------------------------------------------------

ADAPTIVE_CFG = dataclasses.replace(CFG, length_buckets=(64,))
# SD at live batch <= 3: the 6-token tree alone at 1, a bandit over two 4-token trees at 2..3 (no plain
# arm, so that the random drafter's trees run; each call waits for its program's compile).
ADAPTIVE = SpecConfig(
    mode="adaptive", threshold_live_batch=3, patience_host_steps=1, compile_in_background=False,
    strategies=((3, 2, 6), (2, 2, 4), (3, 1, 4)), group_live_batch_ranges=((6, 1, 1), (4, 2, 3)), plain_arm=False,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def adaptive_engine(model):
    return RolloutEngine(model, ADAPTIVE_CFG, sd=ADAPTIVE, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False)


def _count_keys(engine, monkeypatch) -> list[tuple]:
    keys = []
    get = engine.pool.get
    monkeypatch.setattr(engine.pool, "get", lambda key: keys.append(key) or get(key))
    return keys


def test_adaptive_greedy_equals_plain_and_never_reruns_the_policy(adaptive_engine, model, monkeypatch):
    engine = adaptive_engine
    keys = _count_keys(engine, monkeypatch)
    reqs = [Request(p, max_new_tokens=5 + 4 * i) for i, p in enumerate(prompts(7, seed=1))]
    out = engine.generate(reqs)
    for r, o in zip(reqs, out):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)
    phases = [k[0] for k in keys]
    # Plain steps while the batch is large, then the drafter starts from stored hidden states:
    # one admission (a prefill per pack of prompts into the new empty table) only, and a draft_prefill before the
    # first speculative step.
    assert phases[:2] == ["empty", "prefill"] and "prefill" not in phases[phases.index("decode"):]
    first_sd = phases.index("sd")
    assert "decode" in phases[:first_sd] and phases[first_sd - 1] == "draft_prefill"
    assert "decode" not in phases[first_sd:]  # the batch never grows back: no flapping
    s = engine.stats
    assert s.steps_plain > 0 and s.steps_sd > 0 and s.calls["draft_prefill"] == 1
    assert s.strategies["2/2/4"].steps > 0
    assert s.strategies["3/2/6"].steps > 0  # the last row alone runs the 6-token tree
    # The timeline accounts for every token but each request's first (sampled by the prefill).
    assert sum(e.tokens for e in engine.timeline) + len(reqs) == s.tokens == sum(len(o.tokens) for o in out)
    assert all(e.speculative == (e.live <= 3) for e in engine.timeline)
    assert all(e.strategy in ("", "3/2/6") or e.live > 1 for e in engine.timeline)
    # The bandit tries both at live batch 2..3: 2/2/4 first, whose first call (its program's first run, not
    # measured) left it untried for one more; its rival's turn came in the next rollout.
    engine.generate(reqs)
    assert engine.stats.strategies["3/1/4"].steps > 0


def test_adaptive_coupled_sampling_is_bit_identical_to_plain(adaptive_engine, model):
    reqs = [
        Request(p, max_new_tokens=6 + 4 * i, temperature=0.8, top_p=0.9, seed=i, stop_ids=(7,))
        for i, p in enumerate(prompts(7, seed=2))
    ]
    plain = RolloutEngine(model, ADAPTIVE_CFG, progress=False).generate(reqs)
    adaptive = adaptive_engine.generate(reqs)
    assert adaptive_engine.stats.steps_sd > 0
    for a, b in zip(plain, adaptive):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)


def test_programs_compile_only_for_the_buckets_a_strategy_covers(adaptive_engine):
    by_strategy = {str(s): b for s, b in adaptive_engine.strategy_buckets().items()}
    assert by_strategy == {str(Strategy(3, 2, 6)): [1], str(Strategy(2, 2, 4)): [4], str(Strategy(3, 1, 4)): [4]}
    keys = adaptive_engine.warm_up_keys()
    assert {(k[1], k[3].verify_tokens) for k in keys if k[0] == "sd"} == {(1, 6), (4, 4)}
    assert {k[1] for k in keys if k[0] == "draft_prefill"} == {1, 4}
    assert {k[1] for k in keys if k[0] == "decode"} == {1, 4, 16}


def _greedy_requests():
    return [Request(p, max_new_tokens=5 + 4 * i) for i, p in enumerate(prompts(7, seed=1))]


def test_a_random_drafter_speculates_only_once_estimated_to_pay(model):
    """drafter_accept=1.0 (make_drafter's random drafter): no EAGLE program compiles, no step speculates,
    until an estimate reaches sd.min_drafter_accept (the trainer's, after an RL step)."""
    sd = dataclasses.replace(ADAPTIVE, plain_arm=True, min_drafter_accept=1.3)
    engine = RolloutEngine(model, ADAPTIVE_CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False,
                           drafter_accept=1.0)
    reqs = _greedy_requests()
    expected = [greedy_generate(model, r.prompt_ids, r.max_new_tokens) for r in reqs]
    assert [o.tokens for o in engine.generate(reqs)] == expected
    assert engine.stats.steps_sd == 0 and not [k for k in engine.pool.stats if k[0] in ("sd", "draft_prefill")]
    engine.update_drafter(Drafter(TINY, nnx.Rngs(6)), accept=float("nan"))  # no estimate: nothing changes
    assert engine.chooser.drafter_accept == 1.0
    engine.set_drafter_accept(1.3)
    assert [o.tokens for o in engine.generate(reqs)] == expected
    assert engine.stats.steps_sd > 0


def test_an_arm_compiles_in_the_background_while_plain_decoding_goes_on(model):
    """sd.compile_in_background: a chosen arm whose programs are not compiled decodes plainly until the
    compile thread has them; outputs never change, and later calls speculate with them."""
    sd = SpecConfig(mode="adaptive", threshold_live_batch=3, patience_host_steps=1, strategies=((2, 2, 4),),
                    plain_arm=True)  # one tree and plain decoding at live batch 1..3
    engine = RolloutEngine(model, ADAPTIVE_CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False)
    reqs = _greedy_requests()
    expected = [greedy_generate(model, r.prompt_ids, r.max_new_tokens) for r in reqs]
    speculated, deadline = False, time.monotonic() + 300  # the compile thread's pace is the machine's
    while not (speculated and engine.chooser.pulls[(4,), PLAIN]) and time.monotonic() < deadline:
        assert [o.tokens for o in engine.generate(reqs)] == expected
        speculated |= engine.stats.steps_sd > 0
    assert speculated and engine.chooser.pulls[(4,), PLAIN] > 0  # the bandit chose plain decoding too
    speculative_programs = [s for k, s in engine.pool.stats.items() if k[0] in ("sd", "draft_prefill")]
    assert speculative_programs and all(s.background for s in speculative_programs)
    assert "compiled in the background" in engine.pool.report()


@pytest.mark.parametrize("kind", ["beg", "ucb1"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_reward_that_is_not_a_number_does_not_steer_the_bandit(kind, bad):
    """One NaN or inf reward for the best arm used to lock it out (BEG's max over medians skips a NaN) or
    make every arm look alike (UCB1's scale became inf) for a window of pulls."""
    fast, slow = Strategy(2, 2, 6), Strategy(3, 2, 6)
    rate = {slow: 10.0, fast: 100.0, PLAIN: 50.0}
    chooser = StrategyChooser([slow, fast], {6: (1, 8)}, kind=kind, epsilon=0.0, plain_arm=True)
    chooser.record(fast, 2, bad)
    picks = []
    for _ in range(40):
        arm = chooser.choose(2)
        picks.append(arm)
        chooser.record(arm, 2, rate[arm])
    assert picks[-20:].count(fast) >= 15


def test_an_arm_whose_background_compile_fails_decodes_plainly(model, caplog):
    """A speculative program that fails to compile on the compile thread failed the whole rollout when the engine next
    asked for it (an RL step lost); the arm now decodes plainly there, said once (found by review), for the rest of
    that rollout: a failure may pass (a drop near the memory-map limit, a device out of memory), and one kept for the
    engine's life turned the arm off for a whole RL run (review)."""
    sd = SpecConfig(mode="adaptive", threshold_live_batch=3, patience_host_steps=1, strategies=((2, 2, 4),),
                    plain_arm=False)
    engine = RolloutEngine(model, ADAPTIVE_CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False)
    ready = engine.pool.ready

    def broken(key):
        if key[0] == "sd":
            raise RuntimeError("ptxas fatal: out of registers")
        return ready(key)

    engine.pool.ready = broken
    reqs = _greedy_requests()
    out = engine.generate(reqs)
    assert [o.tokens for o in out] == [greedy_generate(model, r.prompt_ids, r.max_new_tokens) for r in reqs]
    assert engine.stats.steps_sd == 0 and "failed to compile in the background (RuntimeError: ptxas fatal" in caplog.text
    engine.generate(reqs)
    assert caplog.text.count("failed to compile in the background") == len(engine._failed_compiles)  # once a program
    engine.pool.ready = ready  # the failure passed: compiled again in the background, speculation runs there
    deadline = time.monotonic() + 120
    while engine.generate(reqs) and not engine.stats.steps_sd and time.monotonic() < deadline:
        pass
    assert engine.stats.steps_sd > 0 and not engine._failed_compiles


def test_an_arm_that_cannot_compile_leaves_its_bucket_to_the_other_arms(model):
    """It stayed untried, so the bandit chose it at every host step and each call decoded plainly: the other
    strategy and the plain arm of its bucket were never tried (found by review). It now earns nothing there."""
    sd = SpecConfig(mode="adaptive", threshold_live_batch=3, patience_host_steps=1, strategies=((2, 2, 4), (3, 1, 4)),
                    plain_arm=True)
    engine = RolloutEngine(model, ADAPTIVE_CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False)
    broken_arm, ready = Strategy(2, 2, 4), engine.pool.ready

    def broken(key):
        if key[0] == "sd" and key[3] == broken_arm:
            raise RuntimeError("ptxas fatal: out of registers")
        return ready(key)

    engine.pool.ready = broken
    reqs = [Request(p, max_new_tokens=5 + 4 * i) for i, p in enumerate(prompts(7, seed=1))]
    expected = [greedy_generate(model, r.prompt_ids, r.max_new_tokens) for r in reqs]
    pulls, rivals = engine.chooser.pulls, [((4,), Strategy(3, 1, 4)), ((4,), PLAIN)]
    deadline = time.monotonic() + 300  # the rival tree compiles in the background, at the machine's pace
    while not all(pulls[arm] for arm in rivals) and time.monotonic() < deadline:
        assert [o.tokens for o in engine.generate(reqs)] == expected
    assert all(pulls[arm] for arm in rivals), dict(pulls)
    assert max(engine.chooser.rewards[(4,), broken_arm]) == 0.0


def test_a_programs_first_run_is_not_charged_to_its_arm(model, monkeypatch):
    """The pool compiles ahead of the timing but a program's first run still pays one-time costs (43 against
    0.5 ms for an empty-table call on this CPU; module loading on a GPU), and an arm's first, exploring pull
    is a short call: that reward decided its median while the window held one (found by review). Here every
    program's first run takes 0.5 s more: a reward counting one would be below 100 tokens/s a row."""
    sd = SpecConfig(mode="adaptive", threshold_live_batch=3, patience_host_steps=1, compile_in_background=False,
                    strategies=((3, 2, 6),), plain_arm=True)
    engine = RolloutEngine(model, ADAPTIVE_CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False)
    get, seen = engine.pool.get, set()

    def slow_first_run(key):
        program = get(key)

        def run(*args):
            if key not in seen:
                seen.add(key)
                time.sleep(0.5)
            return program(*args)

        return run

    monkeypatch.setattr(engine.pool, "get", slow_first_run)
    recorded = []
    record = engine.chooser.record
    monkeypatch.setattr(engine.chooser, "record", lambda s, live, r: recorded.append(r) or record(s, live, r))
    engine.generate([Request(p, max_new_tokens=5 + 4 * i) for i, p in enumerate(prompts(7, seed=1))])
    assert recorded and min(recorded) > 100, recorded


def test_new_drafter_weights_get_their_arms_measured_again(model):
    """The bandit kept an EAGLE arm's rewards across update_drafter: earned by the old drafter, they were outvoted
    only by exploring pulls (epsilon / arms of the choices; never at epsilon 0), so a trained drafter's arm kept
    losing to plain decoding (found by review)."""
    tree = Strategy(3, 2, 6)
    sd = SpecConfig(mode="adaptive", threshold_live_batch=3, strategies=("3/2/6", "h5"), plain_arm=True,
                    epsilon=0.0)
    engine = RolloutEngine(model, CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False, drafter_accept=1.5)
    c = engine.chooser
    history = next(s for s in c.strategies if not s.uses_drafter)
    for _ in range(8):  # the old drafter's tree loses to plain decoding
        c.record(tree, 2, 80.0)
        c.record(history, 2, 90.0)
        c.record(PLAIN, 2, 100.0)
    assert c.choose(2) == PLAIN
    engine.update_drafter(Drafter(TINY, nnx.Rngs(6)), accept=3.0)
    assert c.choose(2) == tree and c.exploring  # tried again at once
    assert len(c.rewards[c.bucket(2), history]) == 8  # drafting from history did not change
