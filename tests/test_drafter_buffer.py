"""SampleBuffer: memory bound, latest-steps sampling, packing alignment, save/load; draft vocabulary choice."""

import numpy as np
import pytest

from fastrl_jax.drafter.buffer import SampleBuffer
from fastrl_jax.drafter.vocab import coverage, select_draft_vocab

H = 4


def seq(n, start, prompt=2):
    """Tokens start .. start+n-1; hidden row t = token t (so alignment is checkable); completion after `prompt`."""
    tokens = np.arange(start, start + n)
    hidden = np.repeat(tokens[: n - 1, None], H, 1).astype(np.float32)
    return tokens, hidden, np.arange(n) >= prompt


def test_memory_bound_evicts_oldest():
    buf = SampleBuffer(max_tokens=25, hidden_size=H)
    for i in range(5):
        buf.add(*seq(10, 100 * i), step=i)
    assert buf.num_tokens == 20 and len(buf) == 2 and buf.steps == [3, 4]
    with pytest.raises(ValueError, match="does not fit"):
        buf.add(*seq(30, 0))


def test_samples_only_latest_steps():
    buf = SampleBuffer(max_tokens=10_000, hidden_size=H, keep_steps=2)
    for step in range(4):
        for j in range(3):
            buf.add(*seq(6, 1000 * step + 10 * j), step=step)
    batch = buf.sample(np.random.default_rng(0), rows=8, seq_len=16)
    used = batch.tokens[batch.segments > 0]
    assert used.min() >= 2000  # steps 2 and 3 only


def test_packing_keeps_alignment_and_segments():
    buf = SampleBuffer(max_tokens=10_000, hidden_size=H)
    for j in range(5):
        buf.add(*seq(5 + j, 100 * j))
    b = buf.sample(np.random.default_rng(1), rows=3, seq_len=20)
    assert b.tokens.shape == (3, 20) and b.hidden.shape == (3, 20, H)
    for r in range(3):
        for s in set(b.segments[r]) - {0}:
            idx = np.flatnonzero(b.segments[r] == s)
            toks = b.tokens[r, idx]
            assert np.array_equal(np.diff(toks), np.ones(len(toks) - 1))  # one contiguous sequence
            assert np.array_equal(b.positions[r, idx], np.arange(len(idx)))
            # hidden after token t is h_t; the sequence's last token has none (zero)
            np.testing.assert_array_equal(b.hidden[r, idx[:-1], 0], toks[:-1])
            assert np.all(b.hidden[r, idx[-1]] == 0)
            np.testing.assert_array_equal(b.loss_mask[r, idx], (toks % 100) >= 2)
        assert np.all(b.tokens[r, b.segments[r] == 0] == 0)


def test_long_sequences_are_cropped():
    buf = SampleBuffer(max_tokens=10_000, hidden_size=H)
    buf.add(*seq(50, 0))
    b = buf.sample(np.random.default_rng(2), rows=2, seq_len=16)
    assert np.all(b.segments == 1)
    for r in range(2):
        assert np.array_equal(np.diff(b.tokens[r]), np.ones(15))
        np.testing.assert_array_equal(b.hidden[r, :, 0], b.tokens[r])  # inside the sequence every token has h
        np.testing.assert_array_equal(b.positions[r], b.tokens[r])  # a crop keeps its positions in the sequence


def test_save_load_round_trip(tmp_path):
    buf = SampleBuffer(max_tokens=10_000, hidden_size=H, keep_steps=3)
    for i in range(4):
        buf.add(*seq(4 + i, 10 * i), step=i, temperature=0.5 * i, seed=2**32 + i)
    buf.save(tmp_path / "b.npz")
    back = SampleBuffer(max_tokens=10_000, hidden_size=H, keep_steps=3)
    back.load(tmp_path / "b.npz")
    assert back.num_tokens == buf.num_tokens and back.steps == buf.steps
    x = buf.sample(np.random.default_rng(3), 2, 12)
    y = back.sample(np.random.default_rng(3), 2, 12)
    for a, b in zip(vars(x).values(), vars(y).values()):
        np.testing.assert_array_equal(a, b)
    assert {(s.temperature, s.seed) for s in back._seqs} == {(0.5 * i, i) for i in range(4)}


def test_rollouts_keep_their_sampling_settings_per_segment():
    """An acceptance estimate drafts a sampled rollout as the engine did (train.chain_acceptance): each packed
    token carries its sequence's temperature and seed, and its position in the whole sequence."""
    from fastrl_jax.rollout.engine import Completion, Request

    buf = SampleBuffer(max_tokens=100, hidden_size=H)
    requests = [Request([1, 2], 3, temperature=0.7, seed=2**32 + 5), Request([3, 4, 5], 3, temperature=0.0, seed=9)]
    done = [Completion([5, 6, 7], [0.0] * 3, "length", hidden_states=np.ones((4, H), np.float32)),
            Completion([8, 9], [0.0] * 2, "length", hidden_states=np.ones((4, H), np.float32))]
    assert buf.add_rollouts(requests, done) == (2, 5)
    b = buf.sample(np.random.default_rng(0), rows=1, seq_len=10)
    for req, n in zip(requests, (5, 5)):
        idx = np.flatnonzero(b.tokens[0] == req.prompt_ids[0])[0] + np.arange(n)
        np.testing.assert_array_equal(b.temperature[0, idx], np.float32(req.temperature))
        np.testing.assert_array_equal(b.seeds[0, idx], req.seed % 2**32)
        np.testing.assert_array_equal(b.positions[0, idx], np.arange(n))


def test_a_rollout_outside_float16_is_left_out_not_fatal():
    """Online training adds every RL step's rollouts: one with activations beyond float16 must not end the run."""
    from fastrl_jax.rollout.engine import Completion, Request

    buf = SampleBuffer(max_tokens=100, hidden_size=H)
    requests = [Request([1, 2], 3), Request([3, 4], 3)]
    done = [Completion([5, 6, 7], [0.0] * 3, "length", hidden_states=np.full((4, H), 7e4, np.float32)),
            Completion([5, 6, 7], [0.0] * 3, "length", hidden_states=np.ones((4, H), np.float32))]
    assert buf.add_rollouts(requests, done) == (1, 3)
    assert len(buf) == 1 and buf.skipped == 1


def test_a_rollout_longer_than_the_buffer_is_left_out_not_fatal():
    """Online training adds every RL step's rollouts (up to rollout.length_buckets[-1] tokens each): one longer
    than drafter_online.buffer_max_tokens used to raise and end the run."""
    from fastrl_jax.rollout.engine import Completion, Request

    buf = SampleBuffer(max_tokens=8, hidden_size=H)
    requests = [Request([1, 2, 3], 6), Request([1, 2], 3)]
    done = [Completion([4, 5, 6, 7, 8, 9], [0.0] * 6, "length", hidden_states=np.ones((8, H), np.float32)),
            Completion([5, 6, 7], [0.0] * 3, "length", hidden_states=np.ones((4, H), np.float32))]
    assert buf.add_rollouts(requests, done) == (1, 3)
    assert len(buf) == 1 and buf.skipped == 1


def test_sequences_without_a_predictable_token_are_not_sampled():
    """Entry t predicts x_{t+2} (drafter.train): a sequence whose only token to learn is x_1 gives no loss entry,
    so a buffer of such sequences has nothing to train on, said at once instead of batches of zero entries."""
    buf = SampleBuffer(max_tokens=100, hidden_size=H)
    buf.add(*seq(2, 0, prompt=1))
    with pytest.raises(ValueError, match="no sequence with a token to learn"):
        buf.sample(np.random.default_rng(0), 1, 8)
    buf.add(*seq(3, 10, prompt=2))
    b = buf.sample(np.random.default_rng(0), 1, 8)
    assert set(b.tokens[0][b.segments[0] > 0].tolist()) == {10, 11, 12}
    # Rollouts with nothing to learn stay out (an acceptance estimate on them has no anchor: NaN, not a failed sample)
    from fastrl_jax.rollout.engine import Completion, Request

    one = Completion([5], [0.0], "stop", hidden_states=np.ones((1, H), np.float32))
    assert SampleBuffer(max_tokens=100, hidden_size=H).add_rollouts([Request([1], 3)], [one]) == (0, 0)


def test_a_file_of_other_features_is_refused(tmp_path):
    buf = SampleBuffer(max_tokens=100, hidden_size=H)
    buf.add(*seq(6, 0))
    buf.save(tmp_path / "b.npz")
    with pytest.raises(ValueError, match=f"holds features {H} wide; this buffer takes {3 * H}"):
        SampleBuffer(max_tokens=100, hidden_size=3 * H).load(tmp_path / "b.npz")


def test_bad_input_is_rejected():
    buf = SampleBuffer(max_tokens=100, hidden_size=H)
    tokens, hidden, mask = seq(6, 0)
    with pytest.raises(ValueError, match="hidden must be"):
        buf.add(tokens, hidden[:3], mask)
    bad = hidden.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        buf.add(tokens, bad, mask)
    with pytest.raises(ValueError, match="no sequence"):
        buf.sample(np.random.default_rng(0), 1, 8)
    with pytest.raises(ValueError, match=r"at least 2 tokens in a 1-d array, got shape \(\)"):
        buf.add(7, hidden, mask)


def test_draft_vocab_takes_most_frequent_and_always():
    counts = np.array([5, 0, 9, 1, 9, 0, 2])
    vocab = select_draft_vocab(counts, 3, always=[6])
    assert vocab.tolist() == [2, 4, 6]
    assert coverage(counts, vocab) == pytest.approx(20 / 26)
    assert select_draft_vocab(counts, 7).tolist() == list(range(7))
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 8)
