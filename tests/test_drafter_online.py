"""Online drafter training on idle rollout replicas: it runs while other replicas decode, changes no
rollout token, hands the devices back within the bound, and loses no sample or optimizer step; the
teacher-forced acceptance estimate matches a step-by-step drafting oracle."""

import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.tiny import TINY, tiny_model
from helpers.tiny_run import tiny_overrides

from fastrl_jax.config import load_config
from fastrl_jax.drafter.buffer import SampleBuffer
from fastrl_jax.drafter.online import SpotTrainer, aligned_blocks
from fastrl_jax.drafter.train import chain_acceptance
from fastrl_jax.models.drafter import Drafter, policy_features
from fastrl_jax.models.loading import load_model
from fastrl_jax.rl.workers import RolloutWorkers
from fastrl_jax.rollout.engine import Request
from fastrl_jax.rollout.sampling import SamplingParams
from fastrl_jax.rollout.speculative import coupled_logp
from fastrl_jax.sharding import make_mesh


def test_aligned_blocks():
    assert aligned_blocks(4, 4) == [(0, 1, 2, 3), (0, 1), (2, 3), (0,), (1,), (2,), (3,)]
    assert aligned_blocks(4, 2) == [(0, 1), (2, 3), (0,), (1,), (2,), (3,)]
    assert aligned_blocks(3, 4) == [(0, 1), (0,), (1,), (2,)]
    assert aligned_blocks(1, 3) == [(0,)]


@nnx.jit
def _draft(drafter, policy, tokens, feats, positions, cache, start, mask):
    return drafter(policy, tokens, feats, positions, cache, start, mask=mask)


def _prefix(drafter, policy, tokens, feats, kv):
    """The drafter over the true entries 0 .. S-2 in slots 0 .. S-2 of a kv-slot cache."""
    S = len(tokens)
    mask = (jnp.arange(kv)[None, :] <= jnp.arange(S - 1)[:, None])[None]
    return _draft(drafter, policy, jnp.asarray(tokens)[None, 1:], feats[None, : S - 1], jnp.arange(S - 1)[None],
                  drafter.empty_cache(1, kv), jnp.zeros(1, jnp.int32), mask)


def _engine_draft(drafter, logits, temperature, seed, position):
    """The token draft_tree puts first for logits [K] of the token at `position`: the drafter's argmax, or at
    temperature > 0 its Gumbel-coupled guess of what the policy samples there (speculative.coupled_logp)."""
    params = SamplingParams(jnp.asarray([temperature], jnp.float32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.float32),
                            jnp.asarray([seed], jnp.uint32))
    ids = drafter.token_ids(jnp.arange(logits.shape[-1]))
    scores = coupled_logp(logits[None], params, jnp.asarray([position], jnp.int32), ids)
    return int(drafter.token_ids(jnp.argmax(scores[0])))


def _oracle_accepted(drafter, policy, tokens, feats, a, depth, temperature=0.0, seed=0):
    """Drafts accepted at anchor a, drafting one entry at a time through the drafter's KV cache as the
    engine's chain (1-wide tree) drafts for a row sampling at `temperature` with `seed`.

    Every call has the same shapes (fast eagerly): the true entries fill slots 0 .. S-2, chain entry j
    goes to slot S-1+j and sees the true entries <= a and the chain entries before it."""
    S = len(tokens)
    kv = S - 1 + depth
    logits, pred, cache = _prefix(drafter, policy, tokens, feats, kv)
    logits, pred = logits[:, a : a + 1], pred[:, a : a + 1]
    accepted = 0
    for j in range(depth):
        if a + j + 2 >= S:
            break
        draft = _engine_draft(drafter, logits[0, 0], temperature, seed, a + j + 2)
        if draft != int(tokens[a + j + 2]):
            break
        accepted += 1
        slot = S - 1 + j
        mask = ((jnp.arange(kv) <= a) | ((jnp.arange(kv) >= S - 1) & (jnp.arange(kv) <= slot)))[None, None]
        logits, pred, cache = _draft(drafter, policy, jnp.asarray([[draft]]), pred, jnp.asarray([[a + j + 1]]), cache,
                                     jnp.asarray([slot], jnp.int32), mask)
    return accepted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_acceptance_matches_step_by_step_drafting(temperature):
    """Sampled rows draft the Gumbel-coupled guess, not the argmax (the chain's drafts at T = 1 differ from the
    argmax almost everywhere here): the estimate must count what the engine's chain would accept."""
    policy = tiny_model()
    drafter = Drafter(TINY, nnx.Rngs(1), draft_vocab=np.arange(0, 128, 2))
    S, depth, seed = 14, 3, 7
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(S, TINY.hidden_size)), jnp.float32)
    feats = policy_features(policy, hidden)
    # Tokens the drafter partly predicts: each x_{a+2} is its depth-0 draft at anchor a (causal: the
    # entries after a do not change it), except every fourth.
    tokens = np.asarray(rng.integers(0, 128, S), np.int32)
    for a in range(S - 2):
        logits, _, _ = _prefix(drafter, policy, tokens, feats, S - 1 + depth)
        if a % 4 != 3:
            tokens[a + 2] = _engine_draft(drafter, logits[0, a], temperature, seed, a + 2)
    tokens = jnp.asarray(tokens)
    mask = np.arange(S) >= 3
    batch = {"tokens": tokens[None], "hidden": hidden[None], "loss_mask": jnp.asarray(mask)[None],
             "positions": jnp.arange(S)[None], "segments": jnp.ones((1, S), jnp.int32),
             "temperature": jnp.full((1, S), temperature, jnp.float32), "seeds": jnp.full((1, S), seed, jnp.uint32)}
    accepted, anchors = nnx.jit(chain_acceptance, static_argnums=3)(drafter, policy, batch, depth)
    anchor_list = [a for a in range(S - 2) if mask[a + 2]]
    expected = sum(_oracle_accepted(drafter, policy, tokens, feats, a, depth, temperature, seed) for a in anchor_list)
    assert int(anchors) == len(anchor_list)
    assert int(accepted) == expected
    assert expected >= len(anchor_list) // 2  # the construction makes most depth-0 drafts right


def _counts(opt_state) -> set[int]:
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return {int(v) for path, v in leaves if "count" in jax.tree_util.keystr(path)}


@pytest.mark.parametrize("kind", ["eagle3"])  # EAGLE's online training: the GRPO tests in test_rl_trainer.py
def test_idle_replicas_train_the_drafter_without_changing_the_rollout(tmp_path: Path, kind):
    """8 devices as 4 replicas x fsdp 2; replica 0 gets a long request, the others short ones."""
    cfg = load_config(None, [f"drafter_train.kind={kind}",
        *tiny_overrides(tmp_path), "mesh.data=4", "mesh.fsdp=2", "sd.mode=adaptive", "sd.threshold_live_batch=1",
        "rollout.steps_per_call=1", "drafter_online.min_buffer_tokens=8", "drafter_online.batch_rows=4",
        "drafter_online.seq_len_tokens=32", "drafter_online.preempt_bound_s=5.0", "drafter_train.unroll_steps=1",
    ])
    mesh = make_mesh(cfg.mesh)
    model, _ = load_model(cfg.model.path, mesh, cfg.model.dtype)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    drafter = Drafter(model.cfg, nnx.Rngs(0), kind=kind)
    workers = RolloutWorkers(cfg, graphdef, params, mesh, drafter, keep_hidden=True)
    spot = SpotTrainer(cfg, drafter, graphdef, params, mesh, seed=0)
    assert spot.buffer.hidden_size == drafter.feature_size == model.cfg.hidden_size * (3 if kind == "eagle3" else 1)
    # Its master weights and starting copy are sharded over the mesh (fsdp), not whole on the default device.
    for tree in (spot.params, spot.frozen):
        first = [s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == jax.devices()[0]]
        assert sum(first) < sum(x.nbytes for x in jax.tree.leaves(tree))

    # Group g of 4 requests runs on replica g: replica 0 decodes 48 tokens, the others 2.
    requests = [Request([1 + g, 2, 3, 4 + i], 48 if g == 0 else 2, 1.0, seed=10 * g + i) for g in range(4) for i in range(4)]
    slow = lambda live: time.sleep(0.01)  # noqa: E731 (a decode step takes >= 10 ms, so the tail is long)
    plain, _ = workers.generate(requests, 4, between_steps=slow)
    assert spot.add(requests, plain, step=1) == sum(len(c.tokens) for c in plain)
    # A first rollout phase asks for the step programs of the blocks its idle replicas form; they
    # compile on a host thread while those devices wait, so that phase may train little or not at all.
    spot.begin(params)
    workers.generate(requests, 4, replica_done=spot.lend, between_steps=slow)
    spot.end()
    spot.wait_compiled()
    assert spot._programs and all(set(b) <= {1, 2, 3} for b in spot._programs)
    buffered = [s.tokens.copy() for s in spot.buffer._seqs]
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(spot.params))
    steps_before = spot.steps_done

    spot.begin(params)
    out, _ = workers.generate(requests, 4, replica_done=spot.lend, between_steps=slow)
    report = spot.end()
    trace, lent = spot.phase_trace

    assert [c.tokens for c in out] == [c.tokens for c in plain], "spot training changed the rollout"
    assert report["drafter_steps"] == len(trace) > 0
    lent_at = dict(lent)
    last_done = max(lent_at.values())
    assert lent_at[0] == last_done, "replica 0 holds the long request"
    for start, _, block in trace:  # every step ran on replicas that had finished their share
        assert all(r in lent_at and lent_at[r] <= start for r in block)
    assert any(e < last_done for _, e, _ in trace), "no drafter step overlapped decoding"
    assert max(e - s for s, e, _ in trace) <= cfg.drafter_online.preempt_bound_s
    assert report["drafter_preempt_s"] <= cfg.drafter_online.preempt_bound_s
    # Nothing lost: the buffer is as it was, and every finished step is in the optimizer state.
    assert [s.tokens.tolist() for s in spot.buffer._seqs] == [b.tolist() for b in buffered]
    assert spot.steps_done == steps_before + report["drafter_steps"] and _counts(spot.opt_state) == {spot.steps_done}
    after = nnx.to_pure_dict(spot.params)
    assert any(not np.allclose(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    assert np.isfinite(report["drafter_loss"])

    # The next rollout uses the trained drafter and still produces the same tokens.
    workers.update_drafter(spot.drafter())
    again, stats = workers.generate(requests, 4)
    assert [c.tokens for c in again] == [c.tokens for c in plain]
    assert 1.0 <= spot.acceptance(requests, plain, step=1) <= 1 + cfg.drafter_online.eval_depth


def test_buffer_sampling_leaves_the_buffer_intact():
    buf = SampleBuffer(1000, 4, keep_steps=1)
    rng = np.random.default_rng(0)
    for step in (1, 2):
        for _ in range(3):
            n = int(rng.integers(4, 12))
            buf.add(rng.integers(0, 50, n), rng.normal(size=(n - 1, 4)), np.arange(n) >= 2, step)
    before = [(s.tokens.tolist(), s.step) for s in buf._seqs]
    batch = buf.sample(np.random.default_rng(1), 2, 16)
    assert [(s.tokens.tolist(), s.step) for s in buf._seqs] == before
    assert batch.tokens.shape == (2, 16)


@pytest.mark.parametrize("override, message", [
    ("drafter_online.tail_time_share=1.0", "tail_time_share"),
    ("drafter_online.tail_budget=spent", "tail_budget"),
    ("drafter_online.seq_len_tokens=4", "seq_len_tokens >= 8"),
    ("drafter_online.batch_rows=0", "batch_rows must be >= 1"),
])
def test_online_config_validation(override, message):
    from fastrl_jax.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def _one_replica_spot(tmp_path: Path):
    """(config, policy parameters, spot trainer, 4 requests, their completions with hidden states) of the tiny model
    on one replica, tail_budget 'saved'."""
    cfg = load_config(None, [*tiny_overrides(tmp_path), "mesh.fsdp=-1", "sd.mode=adaptive", "drafter_online.tail_budget=saved",
                             "drafter_online.min_buffer_tokens=8", "drafter_online.batch_rows=2",
                             "drafter_online.seq_len_tokens=32", "drafter_train.unroll_steps=1"])
    mesh = make_mesh(cfg.mesh)
    model, _ = load_model(cfg.model.path, mesh, cfg.model.dtype)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    drafter = Drafter(model.cfg, nnx.Rngs(0))
    requests = [Request([1, 2, 3, 4 + i], 8, 1.0, seed=i) for i in range(4)]
    completions, _ = RolloutWorkers(cfg, graphdef, params, mesh, drafter, keep_hidden=True).generate(requests, 4)
    return cfg, params, SpotTrainer(cfg, drafter, graphdef, params, mesh, seed=0), requests, completions


def test_one_replica_spends_on_drafter_steps_only_what_speculation_saved(tmp_path: Path):
    """tail_budget 'saved': a tail step needs seconds in the bank (what speculation saved, less the
    estimates), and the steps' seconds come out of it; 'share' trains whatever the bank holds."""
    cfg, params, spot, requests, completions = _one_replica_spot(tmp_path)
    spot.add(requests, completions, step=1)

    def phase():
        spot.begin(params)
        spot.tail_step(1)
        return spot.end()

    assert phase()["drafter_steps"] == 0  # nothing saved yet
    spot.deposit(5.0)
    report = phase()
    assert report["drafter_steps"] == 1 and report["drafter_bank_s"] == pytest.approx(5.0 - report["drafter_spot_s"])
    spot.deposit(-10.0)  # speculation cost more than it saved
    assert phase()["drafter_steps"] == 0
    spot.cfg = dataclasses.replace(spot.cfg, tail_budget="share")
    assert phase()["drafter_steps"] == 1


def test_a_failed_step_compile_with_one_replica_is_raised(tmp_path: Path, monkeypatch):
    """One replica compiles the drafter step on the calling thread: its failure (or Ctrl-C) is the constructor's,
    not a later KeyError."""
    cfg = load_config(None, [*tiny_overrides(tmp_path), "mesh.fsdp=-1"])
    mesh = make_mesh(cfg.mesh)
    model, _ = load_model(cfg.model.path, mesh, cfg.model.dtype)
    graphdef, state = nnx.split(model)

    def fail(self, block):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(SpotTrainer, "_compile", fail)
    with pytest.raises(RuntimeError, match="compile failed"):
        SpotTrainer(cfg, Drafter(model.cfg, nnx.Rngs(0)), graphdef, nnx.to_pure_dict(state), mesh, seed=0)


def test_the_sample_buffer_saved_with_a_checkpoint_comes_back_and_a_damaged_one_starts_empty(tmp_path: Path, monkeypatch,
                                                                                              capsys):
    cfg = load_config(None, [*tiny_overrides(tmp_path), "mesh.fsdp=-1", "drafter_online.min_buffer_tokens=0"])
    mesh = make_mesh(cfg.mesh)
    model, _ = load_model(cfg.model.path, mesh, cfg.model.dtype)
    graphdef, state = nnx.split(model)
    monkeypatch.setattr(SpotTrainer, "_compile", lambda self, block: None)  # no drafter step runs here
    spot = SpotTrainer(cfg, Drafter(model.cfg, nnx.Rngs(0)), graphdef, nnx.to_pure_dict(state), mesh, seed=0)
    H, rng, where = spot.buffer.hidden_size, np.random.default_rng(0), tmp_path / "drafter_buffer"
    assert not spot.ready()  # an empty buffer has nothing to sample, even with min_buffer_tokens 0
    for step in (1, 2, 3):
        spot.buffer.add(rng.integers(0, 50, 9), rng.normal(size=(8, H)), np.arange(9) >= 3, step, 0.7, 11 + step)
        assert spot.ready()
        spot.save_buffer(where, step, keep=[step - 1])  # the checkpoints on disk: the previous step's
    spot.buffer.add(rng.integers(0, 50, 9), rng.normal(size=(8, H)), np.arange(9) >= 3, 4)  # after the last save
    spot.close()
    assert sorted(f.name for f in where.iterdir()) == ["2.npz", "3.npz"]  # step 1's went with its checkpoint

    again = SpotTrainer(cfg, Drafter(model.cfg, nnx.Rngs(0)), graphdef, nnx.to_pure_dict(state), mesh, seed=0)
    again.restore_buffer(where, 3)
    saved, back = spot.buffer.arrays(), again.buffer.arrays()
    assert back["steps"].tolist() == [1, 2, 3] and back["seeds"].tolist() == [12, 13, 14]
    for key in saved:  # all but the sequence added after the save
        np.testing.assert_array_equal(back[key], saved[key][: len(back[key])], err_msg=key)
    (where / "2.npz").write_bytes((where / "2.npz").read_bytes()[:100])  # cut short
    for step, why in ((2, "2.npz is unreadable"), (5, "none was saved with it")):
        again.restore_buffer(where, step)
        assert again.buffer.num_tokens == 0 and why in capsys.readouterr().err

    # A run saved on several processes (a buffer file each, process_N/) and resumed on one takes one, not nothing.
    (where / "process_0").mkdir()
    (where / "3.npz").rename(where / "process_0" / "3.npz")
    again.restore_buffer(where, 3)
    assert again.buffer.arrays()["steps"].tolist() == [1, 2, 3]


def test_an_online_drafter_saved_over_the_mesh_loads_on_fewer_devices(tmp_path: Path):
    """The online drafter is sharded over the run's mesh (SpotTrainer), and so is the drafter of a run's checkpoint;
    eval / generate / export-drafter --drafter RUN on a machine of fewer devices read it onto one (Orbax refused the
    other topology, which load_drafter reported as 'not a drafter checkpoint for this policy')."""
    import subprocess
    import sys

    from helpers.cli import cpu_env

    from fastrl_jax.config import MeshConfig
    from fastrl_jax.models.drafter_io import save_drafter
    from fastrl_jax.sharding import shardings_for

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, params, rest = nnx.split(Drafter(TINY, nnx.Rngs(3)), nnx.Param, ...)
    params = jax.device_put(params, shardings_for(params, mesh))
    save_drafter(tmp_path / "d", nnx.merge(graphdef, params, rest))
    code = ("import jax, numpy as np; from helpers.tiny import TINY; from fastrl_jax.models.drafter_io import load_drafter; "
            f"d = load_drafter({str(tmp_path / 'd')!r}, TINY); print(len(jax.devices()), float(np.abs(d.fc[...]).sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cpu_env(1), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    devices, total = out.stdout.split()[-2:]
    assert devices == "1" and float(total) == pytest.approx(float(jnp.abs(params["fc"][...]).sum()), rel=1e-6)


@pytest.mark.parametrize("overrides, mesh_data, message", [  # min_buffer_tokens: the config refuses it
    (["drafter_online.min_idle_replicas=2"], 2, "min_idle_replicas"),
])
def test_settings_under_which_the_drafter_never_trains_are_refused(tmp_path: Path, monkeypatch, overrides, mesh_data,
                                                                     message):
    """A buffer that never reaches min_buffer_tokens, or replicas never idle in the number asked for while others
    still decode, used to leave online training on in name only: no step, no error, a frozen drafter."""
    from fastrl_jax.config import ConfigError
    from fastrl_jax.rl.trainer import train

    cfg = load_config(None, [*tiny_overrides(tmp_path), f"mesh.data={mesh_data}", "mesh.fsdp=-1", "sd.mode=adaptive",
                             *overrides])

    def load_policy(*args):
        raise AssertionError("the run loaded its policy before refusing the settings")

    with monkeypatch.context() as m, pytest.raises(ConfigError, match=message):  # a run says so before it loads anything
        m.setattr("fastrl_jax.rl.trainer.load_policy", load_policy)
        train(cfg)
    mesh = make_mesh(cfg.mesh)
    model, _ = load_model(cfg.model.path, mesh, cfg.model.dtype)
    graphdef, state = nnx.split(model)
    monkeypatch.setattr(SpotTrainer, "_compile", lambda self, block: None)  # no drafter step runs here
    with pytest.raises(ConfigError, match=message):
        SpotTrainer(cfg, Drafter(model.cfg, nnx.Rngs(0)), graphdef, nnx.to_pure_dict(state), mesh, seed=0)


def test_a_step_of_several_rollouts_reports_the_loss_of_all_its_drafter_steps():
    """rl.filter_groups draws several rollout batches per RL step: the step's drafter loss is the mean over every
    drafter step they ran (it was the last batch's alone, NaN when that one ran none)."""
    from fastrl_jax.drafter.online import merge_reports

    def report(steps, loss):
        return {"drafter_bank_s": 1.0 * steps, "drafter_steps": steps, "drafter_spot_s": 0.5 * steps,
                "drafter_loss": loss, "drafter_preempt_s": 0.25, "drafter_replicas_lent": steps,
                "drafter_buffer_tokens": 100}

    merged = report(0, float("nan"))
    for batch in (report(2, 4.0), report(1, 1.0), report(0, float("nan"))):
        merged = merge_reports(merged, batch)
    assert merged["drafter_steps"] == 3 and merged["drafter_spot_s"] == 1.5 and merged["drafter_preempt_s"] == 1.0
    assert merged["drafter_loss"] == pytest.approx(3.0)
    assert merged["drafter_buffer_tokens"] == 100 and merged["drafter_bank_s"] == 0.0  # the last phase's
    assert merge_reports({}, report(1, 2.0)) == report(1, 2.0)
    assert np.isnan(merge_reports(report(0, float("nan")), report(0, float("nan")))["drafter_loss"])


def test_the_first_acceptance_estimate_compiles_apart_from_what_the_bank_pays(tmp_path):
    """The estimate's program compiled at its first call, inside the time track_drafter charged to the bank as a
    cost of speculation: 2.27 s against 6 ms (tiny model), enough to keep tail training off for many steps (found by
    review). Its compile is counted apart (estimate_compile_s), which the trainer leaves out of the charge."""
    _, _, spot, requests, completions = _one_replica_spot(tmp_path)
    first = spot.acceptance(requests, completions, 1)
    compiled = spot.estimate_compile_s
    assert compiled > 0 and spot.acceptance(requests, completions, 1) == first
    assert spot.estimate_compile_s == compiled  # compiled once
