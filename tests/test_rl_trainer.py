"""The GRPO loop end to end on a tiny random checkpoint: lossless SD, resume after SIGKILL, NaN stop,
checkpoint failure, start-up errors, and the dry-run memory plan against a hand calculation."""

import errno
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.cli import cpu_env
from helpers.tiny_run import tiny_overrides

from fastrl_jax.checkpoint import checkpoint_steps
from fastrl_jax.config import ConfigError, TrainingStopped, load_config
from fastrl_jax.metric_sink import read_metrics
from fastrl_jax.models.drafter_io import load_drafter
from fastrl_jax.models.loading import load_model, read_model_config
from fastrl_jax.models.tokenizer import load_tokenizer
from fastrl_jax.rl import dry_run, update
from fastrl_jax.rl.trainer import NonFiniteLoss, Trainer, _own_bank, preflight
from fastrl_jax.rollout.engine import Completion
from fastrl_jax.sharding import make_mesh

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def make_trainer(tmp: Path, *extra: str, steps: int = 3, resume: bool = False) -> Trainer:
    # 8 fake CPU devices in this process (conftest): the policy trains FSDP-sharded over all of them.
    cfg = load_config(None, [*tiny_overrides(tmp, steps), "mesh.fsdp=-1", *extra])
    model, _ = load_model(cfg.model.path, make_mesh(cfg.mesh), cfg.model.dtype)
    return Trainer(cfg, model, load_tokenizer(Path(cfg.model.path)), resume=resume, stream=open(os.devnull, "w"))


def run_recording(trainer: Trainer):
    rollouts = []
    original = trainer.rollout

    def record(records, step, first=0):
        out = original(records, step, first)
        rollouts.append([(c.tokens, c.finish_reason) for c in out[1]])
        return out

    trainer.rollout = record
    history = trainer.run()
    return rollouts, history, trainer.params


def test_lossless_sd_adaptive_matches_plain_decoding(tmp_path):
    """3 GRPO steps with SD off, and adaptive (random drafter) with online drafter training in the tail:
    identical rollouts and parameters; the drafter's training state survives a resume."""
    common = ["rl.checkpoint_every_steps=0", "rollout.steps_per_call=2"]
    off = run_recording(make_trainer(tmp_path / "off", *common, "sd.mode='off'"))
    sd = [*common, "sd.mode=adaptive", "sd.threshold_live_batch=16", "sd.patience_host_steps=1", "sd.steps=2",
          "sd.topk=2", "sd.verify_tokens=4", "drafter_online.min_buffer_tokens=16", "drafter_online.batch_rows=2",
          "drafter_online.seq_len_tokens=32", "drafter_online.eval_rows=2", "drafter_online.tail_live_batch=16",
          "drafter_online.frozen_eval_every_steps=1", "drafter_train.unroll_steps=1", "rl.checkpoint_every_steps=1",
          "rl.keep_checkpoints=1"]
    trainer = make_trainer(tmp_path / "sd", *sd)
    adaptive = run_recording(trainer)
    assert off[0] == adaptive[0]
    assert sum(m["sd_share"] for m in adaptive[1]) > 0, "speculative decoding never ran"
    assert all(m["sd_share"] == 0 for m in off[1])
    assert adaptive[1][0]["drafter_steps"] == 0  # the buffer fills from step 1's rollouts
    assert sum(m["drafter_steps"] for m in adaptive[1]) > 0, "the drafter never trained in the tail"
    # Estimates of a drafter that trained since the last one (the random drafter's prior stands for step 0).
    trained = np.cumsum([m["drafter_steps"] for m in adaptive[1]])
    estimated = [bool(n) and n != before for n, before in zip(trained, [0, *trained])]
    assert [not np.isnan(m["drafter_accept"]) for m in adaptive[1]] == estimated and any(estimated)
    assert all(1.0 <= m["drafter_accept"] <= 5.0 for m, e in zip(adaptive[1], estimated) if e)
    assert all(1.0 <= m["drafter_accept_frozen"] <= 5.0 for m in adaptive[1] if m["drafter_steps"])
    # The latest estimate reaches the engines: their EAGLE arms compete from sd.min_drafter_accept on.
    last = [m["drafter_accept"] for m, e in zip(adaptive[1], estimated) if e][-1]
    assert {r.engine.chooser.drafter_accept for r in trainer.workers.replicas} == {last}
    resumed = make_trainer(tmp_path / "sd", *sd, resume=True)
    assert resumed.spot.steps_done == trainer.spot.steps_done and resumed.spot.bank_s == trainer.spot.bank_s != 0
    assert adaptive[1][-1]["drafter_bank_s"] == trainer.spot.bank_s  # the step's figure is the bank it saved
    # The acceptance estimate the EAGLE arms gate on comes back too: no prior, no estimate again
    assert {r.engine.chooser.drafter_accept for r in resumed.workers.replicas} == {last}
    assert resumed._estimated_at == trainer._estimated_at == trainer.spot.steps_done
    # The bandit goes on where it was (rewards, pulls, exploration RNG), not from a cold start.
    bandits = [[r.engine.chooser.state() for r in t.workers.replicas] for t in (trainer, resumed)]
    assert bandits[0] == bandits[1] and bandits[0][0]["pulls"]
    # export-drafter / eval --drafter take the run directory: its latest checkpoint's online-trained drafter.
    exported = load_drafter(tmp_path / "sd" / "run", read_model_config(trainer.cfg.model.path))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(exported)),
                 nnx.to_pure_dict(nnx.state(trainer.drafter)))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(resumed.spot.params),
                 nnx.to_pure_dict(trainer.spot.params))
    # Its sample buffer too (DESIGN.md: preemption never loses buffered data), the same sequences of the same steps.
    saved, back = trainer.spot.buffer.arrays(), resumed.spot.buffer.arrays()
    assert saved["lengths"].size and saved.keys() == back.keys()
    # Only the kept checkpoint's buffer file: the final save's own pruning of step 2 left its file behind before.
    assert sorted(p.name for p in (tmp_path / "sd" / "run" / "drafter_buffer").iterdir()) == ["3.npz"]
    for key in saved:
        np.testing.assert_array_equal(back[key], saved[key], err_msg=key)
    for a, b in zip(off[1], adaptive[1]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), off[2], adaptive[2])
    first = make_trainer(tmp_path / "init", *common).params
    moved = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), off[2], first))
    assert max(moved) > 1e-4, "training did not change the parameters"


def test_history_drafting_in_grpo_is_lossless_and_survives_resume(tmp_path):
    """Drafting from history alone (no drafter is made): the same rollouts as SD off, and the store of
    earlier completions comes back from the checkpoint."""
    common = ["rl.checkpoint_every_steps=2", "rollout.steps_per_call=2", "rl.temperature=0.3"]
    off = run_recording(make_trainer(tmp_path / "off", *common, steps=2))
    on = [*common, "sd.mode=on", "sd.strategies=['h4']", "rl.checkpoint_every_steps=1", "rl.keep_checkpoints=1"]
    trainer = make_trainer(tmp_path / "on", *on, steps=2)
    assert trainer.drafter is None and trainer.spot is None
    history = run_recording(trainer)
    assert sorted(p.name for p in (tmp_path / "on" / "run" / "history").iterdir()) == ["2.npz"]  # the kept step's
    assert off[0] == history[0]
    assert sum(m["sd_share"] for m in history[1]) == 2  # every decode step drafted from history
    assert [m["rollout_digest"] for m in off[1]] == [m["rollout_digest"] for m in history[1]]
    assert len(trainer.history) == 8  # the 2 x 4 prompts of the two steps
    resumed = make_trainer(tmp_path / "on", *on, steps=2, resume=True)
    saved, back = trainer.history.arrays(), resumed.history.arrays()
    assert all(np.array_equal(saved[k], back[k]) for k in saved) and len(saved["keys"]) == 8
    # The tokens sit beside the checkpoint (its JSON notes their count); a damaged file starts the store empty.
    (tmp_path / "on" / "run" / "history" / "2.npz").write_bytes(b"damaged")
    again = make_trainer(tmp_path / "on", *on, steps=2, resume=True)
    assert len(again.history) == 0


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, steps=4)
    original = trainer.build_batch

    def poison(requests, completions, advantages):
        out = original(requests, completions, advantages)
        if trainer.step == 2:  # step 3's batch
            out[2][:] = np.nan
        return out

    monkeypatch.setattr(trainer, "build_batch", poison)
    with pytest.raises(NonFiniteLoss, match="at step 3.*last good checkpoint is step 2"):
        trainer.run()
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert load_config(tmp_path / "run" / "config.yaml") == trainer.cfg  # the run says what it ran with


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e39])
def test_a_reward_that_is_not_a_finite_number_is_named(tmp_path, bad):
    """A reward function's NaN / inf for one completion (1e39 is inf in float32) made NaN advantages and a NaN loss,
    and the run stopped advising a lower learning rate (review)."""
    trainer = make_trainer(tmp_path, steps=1)
    calls = []

    def reward(completion, answer, record):
        calls.append(1)
        return bad if len(calls) == 3 else float(len(completion) % 2)

    trainer.reward_fn = reward
    try:
        with pytest.raises(ValueError, match=rf"reward.functions \[.*\] gave {re.escape(str(bad))} for sample 2 of the "
                                             "prompt whose answer is .*: rewards must be finite"):
            trainer.run_step()
    finally:
        trainer.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_run_after_its_step_with_that_step_saved(tmp_path, sig):
    """SIGTERM (a preemption, SLURM's --signal notice before the time limit) or Ctrl-C during step 1 of 3, with
    checkpoints due only every 10 steps: the step finishes, is saved, and the run stops, to be resumed from there
    (Ctrl-C raised where it landed, losing every step since the last checkpoint: up to 19 with the 7B config)."""
    trainer = make_trainer(tmp_path, "rl.checkpoint_every_steps=10", steps=3)
    original, before = trainer.rollout, signal.getsignal(sig)

    def preempted(records, step, first=0):
        os.kill(os.getpid(), sig)  # without the trainer's handler this ends the test process
        return original(records, step, first)

    trainer.rollout = preempted
    with pytest.raises(TrainingStopped, match=rf"{sig.name}: stopped after step 1 of 3; its checkpoint is saved and --resume"):
        trainer.run()
    assert checkpoint_steps(tmp_path / "run") == [1]
    assert signal.getsignal(sig) == before  # the handler is the trainer's only while it runs
    again = make_trainer(tmp_path, "rl.checkpoint_every_steps=10", steps=3, resume=True)
    assert again.step == 1
    again.close()


def test_a_stop_whose_checkpoint_fails_says_so(tmp_path, capsys):
    """A preemption notice during step 1: its checkpoint's write fails behind the training (a full disk). The run
    ends with that error, not with "its checkpoint is saved and --resume continues the run" after "training
    continues" (review)."""
    trainer = make_trainer(tmp_path, "rl.checkpoint_every_steps=10", steps=3)
    original, wait, failed = trainer.rollout, trainer.checkpointer.wait, []

    def preempted(records, step, first=0):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(records, step, first)

    def report():
        wait()
        if failed:
            failed.pop()
            raise OSError(errno.ENOSPC, "No space left on device")

    trainer.rollout = preempted
    trainer.checkpointer.save, trainer.checkpointer.wait = lambda step, *args, **kwargs: failed.append(step), report
    with pytest.raises(OSError, match=r"the final checkpoint \(step 1\) failed \(the disk is full\); no earlier "
                                      r"checkpoint exists: make room in .* and run it again"):
        trainer.run()
    assert "training continues" not in capsys.readouterr().err
    assert checkpoint_steps(tmp_path / "run") == []


def test_prompts_longer_than_the_largest_bucket_are_left_out_at_the_start(tmp_path, caplog):
    """verl's filter_overlong_prompts: said once at the start, not found by the step that draws one hours in."""
    prompts = tmp_path / "long.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)] + [{"prompt": "1+" * 20 + "1=", "answer": "21"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = make_trainer(tmp_path, f"data.source={prompts}", f"data.eval_source={prompts}", "rl.eval_every_steps=1")
    assert trainer.num_records == 6 and len(trainer.eval_records) == 6
    assert f"data.source {prompts}: 1 of 7 prompts are longer than the largest rollout.prompt_buckets (16 tokens)" \
        in caplog.text
    trainer.close()


def test_prompts_leaving_no_room_for_the_completion_are_left_out_at_the_start(tmp_path, caplog):
    """A prompt within the prompt buckets whose max_new_tokens did not fit the largest length bucket passed the
    start and failed the step (or the evaluation, after the update) that drew it."""
    prompts = tmp_path / "long.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)] + [{"prompt": "1+2+3+4+1+2+3=", "answer": "16"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = make_trainer(tmp_path, f"data.source={prompts}", f"data.eval_source={prompts}", "rl.max_new_tokens=49",
                           "sd.mode='off'", "rl.eval_every_steps=1", steps=1)  # room for sd.strategies' tree with SD off too
    assert trainer.num_records == 6 and len(trainer.eval_records) == 6
    assert "1 of 7 prompts are longer than the room max_new_tokens (49) leaves in the largest rollout.length_buckets " \
           "(8 tokens)" in caplog.text
    trainer.run()
    trainer.close()


def test_each_process_scores_a_share_and_all_train_on_the_gathered_scores(tmp_path, monkeypatch):
    """Every process scored every completion itself and trained its own rows on its own scores: a reward that
    differs between hosts (a judge's timeout) mixed two batches silently, and under rl.filter_groups the hosts drew
    different numbers of batches and hung in the next collective. Process 1 of 2, the gather simulated."""
    import fastrl_jax.rl.trainer as trainer_module

    trainer = make_trainer(tmp_path)
    scored = []
    trainer.reward_fn = lambda text, answer, record: scored.append((answer, record)) or 0.5
    monkeypatch.setattr(trainer_module.jax, "process_count", lambda: 2)
    monkeypatch.setattr(trainer_module.jax, "process_index", lambda: 1)
    other = [[(7.0, 1.0)] * 4, None]
    monkeypatch.setattr(trainer_module, "allgather_json", lambda share: [other, share])
    records = [{"answer": "1", "data_source": "a"}, {"answer": "2", "data_source": "b"}]
    completions = [Completion([5 + i], [0.0], "stop") for i in range(8)]  # 2 groups of rl.samples_per_prompt 4
    reward, correct = trainer._rewards(records, completions)
    # its share, completions 1, 3, 5 and 7, each with its prompt's record (a verl compute_score's data_source)
    assert scored == [("1", records[0])] * 2 + [("2", records[1])] * 2
    assert reward.tolist() == [7.0, 0.5] * 4 and correct[::2] == [1.0] * 4
    # A reward that raised on the other process's share is this one's error too (it waited in the gather for good)
    other[:] = [[], "TypeError: a custom reward's bug"]
    with pytest.raises(RuntimeError, match="reward.functions failed on process 0: TypeError: a custom reward's bug"):
        trainer._rewards(records, completions)
    trainer.close()


def test_dapos_overlong_penalty_shapes_the_step_reward(tmp_path):
    trainer = make_trainer(tmp_path, "reward.overlong_buffer=6", "reward.overlong_penalty=0.5", steps=1)
    trainer.reward_fn = lambda completion, answer, record: 0.0
    lengths, rollout = [], trainer.rollout

    def record(records, step, first=0):
        out = rollout(records, step, first)
        lengths.extend(len(c.tokens) for c in out[1])
        return out

    trainer.rollout = record
    metrics = trainer.run_step()
    trainer.close()
    expected = [min(-(n - 6) / 6 * 0.5, 0.0) for n in lengths]  # rl.max_new_tokens 12
    assert min(expected) < 0 and metrics["reward_mean"] == pytest.approx(np.mean(expected))
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer \(12\) must be below rl.max_new_tokens \(12\)"):
        preflight(load_config(None, [*tiny_overrides(tmp_path), "reward.overlong_buffer=12"]), 1)


@pytest.mark.parametrize("filter_groups", [False, True])
def test_dynamic_sampling_trains_only_on_groups_whose_rewards_differ(tmp_path, filter_groups):
    """DAPO's dynamic sampling: prompts with an even answer get reward 0 from every sample (no gradient); with
    rl.filter_groups (on the reward) their groups are dropped and further prompts drawn until 4 groups with a signal
    remain. The dropped groups are the policy's samples all the same: the online drafter's buffer takes every drawn
    rollout."""
    trainer = make_trainer(tmp_path, f"rl.filter_groups={str(filter_groups).lower()}", "rl.max_gen_batches=20",
                           "rl.filter_groups_metric=reward", "sd.mode=adaptive", steps=1)
    trainer.reward_fn = lambda completion, answer, record: float(len(completion) % 3) if int(answer) % 2 else 0.0
    advantages, build = [], trainer.build_batch

    def record(requests, completions, adv):
        advantages.append(adv.reshape(-1, 4))
        return build(requests, completions, adv)

    trainer.build_batch = record
    metrics = trainer.run_step()
    trainer.close()
    silent = int((np.abs(advantages[0]).sum(1) == 0).sum())  # groups without a gradient
    assert len(advantages[0]) == 4
    if filter_groups:
        assert silent == 0 and metrics["gen_batches"] > 1
        assert trainer.spot.buffer.added == metrics["gen_batches"] * 4 * 4  # batches x prompts x samples
        # the engines' rate counts the dropped groups' tokens too (it read ~3x low), the trained count does not
        assert metrics["generated_tokens"] > metrics["tokens"]
        assert metrics["rollout_tokens_per_s"] == metrics["generated_tokens"] / metrics["rollout_s"]
    else:
        assert silent > 0 and "gen_batches" not in metrics  # the draw this test relies on has even answers


def test_dynamic_sampling_filters_on_accuracy_as_dapo_does(tmp_path, monkeypatch, caplog):
    """DAPO (verl's metric=acc) drops a group whose samples are all wrong (or all right) even when a secondary
    reward term (format, the overlong penalty) varies: filtering on the combined reward kept them, and the step
    trained on format or length alone. Here every sample is wrong and the reward varies: no group is kept."""
    import fastrl_jax.rl.trainer as trainer_module

    trainer = make_trainer(tmp_path, "rl.filter_groups=true", "rl.max_gen_batches=2", steps=1)
    with caplog.at_level(logging.WARNING):  # the tiny runs' digit reward is no correctness: said at the start
        preflight(trainer.cfg, 1, files=False)
    assert "reward.functions ['helpers.tiny_run:digit_reward'] leave out" in caplog.text
    trainer.reward_fn = lambda completion, answer, record: float(len(completion) % 3)
    monkeypatch.setattr(trainer_module.rewards, "correctness_reward", lambda completion, answer: 0.0)
    metrics = trainer.run_step()
    trainer.close()
    assert metrics["gen_batches"] == 2 and metrics["accuracy"] == 0.0


def test_a_failed_rollout_is_raised_as_it_is_and_stops_the_drafter_trainer_without_a_report(tmp_path):
    """The spot trainer's end() is a collective on several processes, which the others (still decoding, or waiting
    in the rollout's gather) would not match: after a failed rollout it only stops, and the error is the rollout's."""
    trainer = make_trainer(tmp_path, "sd.mode=adaptive", steps=1)
    try:
        def fail(*args, **kwargs):
            raise MemoryError("RESOURCE_EXHAUSTED on this host")

        trainer.workers.generate = fail
        trainer.spot.end = lambda: pytest.fail("end() ran after a failed rollout")
        with pytest.raises(MemoryError, match="RESOURCE_EXHAUSTED"):
            trainer.run_step()
        assert trainer.spot._stop and trainer.spot._thread is None
    finally:
        trainer.close()


def test_a_run_resumed_on_another_number_of_processes_shares_out_the_drafter_bank():
    assert _own_bank(3.0) == 3.0 and _own_bank([1.0, 2.5]) == 3.5  # one process now: the whole bank


def test_failed_checkpoint_write_keeps_previous(tmp_path, capsys):
    """Step 2's write fails behind the training (Orbax reports it at the next wait): the message names
    step 2, and step 3 is still saved."""
    trainer = make_trainer(tmp_path, steps=3)
    save, wait, failed = trainer.checkpointer.save, trainer.checkpointer.wait, []

    def disk_full(step, *args, **kwargs):
        if step == 2:
            failed.append(step)
            return None
        return save(step, *args, **kwargs)

    def report():
        if failed:
            failed.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        wait()

    trainer.checkpointer.save, trainer.checkpointer.wait = disk_full, report
    directory = trainer.checkpointer.directory
    trainer.run()
    err = capsys.readouterr().err
    assert "checkpoint at step 2 failed (the disk is full); the previous checkpoint (step 1) stays valid" in err
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    assert steps[-1] == 3 and 2 not in steps
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    # A resume that would read the prompt stream at a different batch size is refused, and leaves the run's config.
    saved = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=re.escape("--resume: rl.prompts_per_step (was 4, now 2) changed")):
        make_trainer(tmp_path, "rl.prompts_per_step=2", steps=4, resume=True)
    assert (tmp_path / "run" / "config.yaml").read_text() == saved


def test_a_failed_final_checkpoint_fails_the_run(tmp_path):
    """The last step's write fails behind the training: no later save keeps its weights, so the run ends with
    an error that names the checkpoint left, not with 'training continues' and exit status 0."""
    trainer = make_trainer(tmp_path, steps=2)
    trainer.step = 1
    trainer.save()
    wait, failed = trainer.checkpointer.wait, []

    def report():
        wait()
        if failed:  # Orbax reports a failed write once
            failed.pop()
            raise OSError(errno.ENOSPC, "No space left on device")

    trainer.checkpointer.save, trainer.checkpointer.wait = lambda step, *args, **kwargs: failed.append(step), report
    trainer.step = 2
    trainer.save()
    with pytest.raises(OSError, match=r"the final checkpoint \(step 2\) failed \(the disk is full\); the previous "
                                      r"checkpoint \(step 1\) stays valid: make room in .* and resume with --resume"):
        trainer.close()
    assert trainer.checkpointer is None and checkpoint_steps(tmp_path / "run") == [1]


def test_a_resume_takes_what_the_checkpoint_has_and_names_a_setting_it_does_not_fit(tmp_path, capsys):
    """History drafting off for a step and back on: the resume starts its store fresh from the newest
    step instead of falling back past it (and dropping its metrics); a setting no step fits is named."""
    common = ["rl.keep_checkpoints=4", "rollout.steps_per_call=2"]
    history = ["sd.mode=on", "sd.strategies=['h4']"]
    make_trainer(tmp_path, *common, *history, steps=1).run()
    make_trainer(tmp_path, *common, steps=2, resume=True).run()  # its step 2 holds no history
    again = make_trainer(tmp_path, *common, *history, steps=3, resume=True)
    assert again.step == 2 and len(again.history) == 0
    assert "checkpoint step 2 has no history (off when it was saved): starting fresh" in capsys.readouterr().err
    again.close()
    # A KL penalty needs the reference policy, which no step holds: no step fits, and the change is named
    with pytest.raises(ConfigError, match=re.escape("rl.kl_coef (was 0.0, now 0.01) changed since it was saved")):
        make_trainer(tmp_path, *common, "rl.kl_coef=0.01", steps=3, resume=True)
    assert checkpoint_steps(tmp_path / "run") == [1, 2] and not (tmp_path / "run" / "checkpoints.unreadable").exists()
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]


def test_a_resume_refuses_a_prompt_file_that_changed_and_takes_one_that_moved(tmp_path):
    """A prompt file that gained records since the run started reshuffles the stream its saved position counts in;
    one rewritten with as many other records was resumed, its epoch repeating some prompts and skipping others,
    and the same file at another path (another mount) was refused (review)."""
    prompts = tmp_path / "mine.jsonl"  # not tiny_overrides' prompts.jsonl, which each make_trainer writes again
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8)))
    trainer = make_trainer(tmp_path, f"data.source={prompts}", "sd.mode='off'")
    trainer.save()  # step 0's checkpoint: the data position and the record count
    trainer.close()
    make_trainer(tmp_path, f"data.source={prompts}", "sd.mode='off'", resume=True).close()  # the same file resumes
    with prompts.open("a") as f:
        f.write(json.dumps({"prompt": "What is 9 + 1?", "answer": "10"}) + "\n")
    with pytest.raises(ConfigError, match="holds 9 records that fit rollout.prompt_buckets, 8 when the run started"):
        make_trainer(tmp_path, f"data.source={prompts}", "sd.mode='off'", resume=True)
    lines = prompts.read_text().splitlines(keepends=True)
    prompts.write_text("".join(lines[1:]))  # 8 records again, one of them another
    with pytest.raises(ConfigError, match="as many records that fit as when the run started, but others"):
        make_trainer(tmp_path, f"data.source={prompts}", "sd.mode='off'", resume=True)
    moved = tmp_path / "elsewhere" / "mine.jsonl"
    moved.parent.mkdir()
    moved.write_text("".join(lines[:8]))
    make_trainer(tmp_path, f"data.source={moved}", "sd.mode='off'", resume=True).close()


def test_sd_mode_does_not_change_the_prompts_a_run_trains_and_evaluates_on(tmp_path):
    """Prompts are fitted with room for sd.strategies' draft tree whether or not SD runs: with SD off a run kept
    the prompts within a tree of the limit, a stream of more records (another permutation) and a larger eval set,
    so an SD off / on comparison compared other data (review)."""
    prompts = tmp_path / "mine.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    rows += [{"prompt": "1+2+3+4+1+2+3=", "answer": "16"}, {"prompt": "2+2+3+4+1+2+3=", "answer": "17"}]  # 14 tokens
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"data.source={prompts}", f"data.eval_source={prompts}", "rl.eval_every_steps=1", "rl.max_new_tokens=44"]
    seen = {}
    for mode in ("off", "adaptive"):
        t = make_trainer(tmp_path / mode, *common, f"sd.mode='{mode}'")
        seen[mode] = (t.num_records, len(t.eval_records), [[r["prompt"] for r in next(t.data)] for _ in range(2)])
        t.close()
    assert seen["off"] == seen["adaptive"] and seen["off"][:2] == (6, 6)


def test_a_resume_with_a_new_drafter_path_drafts_with_it(tmp_path, capsys):
    """A drafter trained since the run started (train-drafter), given as rl.drafter_path at a resume: the checkpoint's
    drafter overwrote it, while the engines took the new path's prior for the old weights (review). Without a path
    (an override forgotten) the checkpoint's trained drafter goes on."""
    from fastrl_jax.models.drafter_io import save_drafter

    sd = ["sd.mode=adaptive", "drafter_online.enabled=false"]
    t = make_trainer(tmp_path, *sd)
    saved = nnx.to_pure_dict(nnx.state(t.drafter))
    t.save()
    t.close()
    other = make_trainer(tmp_path / "other", *sd, "seed=1", "rl.checkpoint_every_steps=0")
    new = save_drafter(tmp_path / "new_drafter", other.drafter)
    wanted = nnx.to_pure_dict(nnx.state(other.drafter))
    other.close()

    def drafts_with(trainer, weights):
        now = nnx.to_pure_dict(nnx.state(trainer.drafter))
        return all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), weights, now)))

    capsys.readouterr()
    resumed = make_trainer(tmp_path, *sd, f"rl.drafter_path={new}", resume=True)
    assert drafts_with(resumed, wanted) and not drafts_with(resumed, saved)
    assert f"rl.drafter_path changed since step 0 was saved: drafting with {new}" in capsys.readouterr().err
    resumed.close()
    forgot = make_trainer(tmp_path, *sd, resume=True)  # the checkpoint is still step 0's, with the random drafter
    assert drafts_with(forgot, saved)
    forgot.close()


def test_startup_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="micro_batch_size=6 must be divisible by mesh data x fsdp = 8"):
        make_trainer(tmp_path, "rl.micro_batch_size=6", "rl.prompts_per_step=3")
    with pytest.raises(ValueError, match="unknown reward 'accuracy'; registered rewards: correct, format"):
        make_trainer(tmp_path, "reward.functions=[accuracy]")
    with pytest.raises(FileNotFoundError, match="nothere.jsonl not found"):
        make_trainer(tmp_path, f"data.source={tmp_path / 'nothere.jsonl'}")
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint"):
        cfg = load_config(None, [*tiny_overrides(tmp_path / "r"), "mesh.fsdp=-1"])
        model, _ = load_model(cfg.model.path, make_mesh(cfg.mesh))
        Trainer(cfg, model, load_tokenizer(Path(cfg.model.path)), resume=True)


def train_cmd(overrides, *flags):
    return [sys.executable, "-m", "fastrl_jax.cli", "train", *overrides, *flags]


COMPARED = ("reward_mean", "reward_std", "accuracy", "len_mean", "len_max", "loss", "grad_norm", "clip_fraction", "entropy")


def test_resume_after_sigkill_repeats_the_uninterrupted_run(tmp_path):
    # The three processes share one compilation cache, as runs of one config do (rollout.compile_cache_dir).
    base = [*tiny_overrides(tmp_path, steps=5), f"rollout.compile_cache_dir={tmp_path / 'xla'}"]
    full = subprocess.run(train_cmd([*base, f"rl.out_dir={tmp_path / 'full'}"]), env=cpu_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    killed_dir = tmp_path / "killed"
    overrides = [*base, f"rl.out_dir={killed_dir}"]
    proc = subprocess.Popen(train_cmd(overrides), env=cpu_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not (killed_dir / "checkpoints" / "2").is_dir():  # Orbax renames a step's directory when complete
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(train_cmd(overrides, "--resume"), env=cpu_env(), cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int(resumed.stderr.split("resumed from step ")[1].split()[0])
    assert 2 <= start < 5
    want = {m["step"]: m for m in read_metrics(tmp_path / "full" / "metrics.jsonl")}
    got = {m["step"]: m for m in read_metrics(killed_dir / "metrics.jsonl")}
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in range(start + 1, 6):
        for key in COMPARED:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-9), (step, key)


def _qwen7b_hand_calculation(tensor: int, fsdp: int, itemsize: int) -> int:
    """Bytes per device of Qwen2.5-7B's parameters: every matrix has a hidden (fsdp) dim and a
    heads / kv heads / mlp / vocab (tensor) dim; norms and biases' head dims as noted."""
    V, H, F, L, nh, kv, D = 152064, 3584, 18944, 28, 28, 4, 128
    matrices = V * H * 2 + L * (H * nh * D * 2 + H * kv * D * 2 + 3 * H * F)  # embed, head, q, o, k, v, mlp
    biases = L * (nh * D + 2 * kv * D)  # sharded over heads (tensor) only
    norms = L * 2 * H + H  # replicated
    return itemsize * (matrices // (fsdp * tensor) + biases // tensor + norms)


def _qwen7b_drafter_hand_calculation(tensor: int, itemsize: int) -> tuple[int, int]:
    """Bytes of a Qwen2.5-7B EAGLE drafter's own parameters (fc and one decoder layer; the embedding and head
    are the policy's) per device over `tensor`, and whole."""
    H, F, nh, kv, D = 3584, 18944, 28, 4, 128
    matrices = 2 * H * H + H * nh * D * 2 + H * kv * D * 2 + 3 * H * F  # fc, q, o, k, v, mlp
    biases, norms = nh * D + 2 * kv * D, 2 * H
    return itemsize * (matrices // tensor + biases // tensor + norms), itemsize * (matrices + biases + norms)


def test_dry_run_matches_hand_calculation():
    cfg = load_config(ROOT / "configs" / "qwen2.5_7b_1node.yaml")
    assert (cfg.model.dtype, cfg.model.rollout_dtype) == ("float32", "bfloat16")
    plan = dry_run.memory_plan(cfg)
    assert plan["devices"] == 8 and plan["param_count"] == 7_615_616_512  # Qwen2.5-7B's published size
    # float32 master weights split over fsdp x data (data=2, fsdp=1); the engines' bfloat16 copy replicated
    # along data
    assert plan["params"] == _qwen7b_hand_calculation(tensor=4, fsdp=2, itemsize=4)
    # the engines' per-layer copy (unrolled) and, of the cast copy, the embedding, head and final norm
    embed_head_norm = 2 * (152064 * 3584 * 2 // 4 + 3584)
    assert plan["rollout_params"] == embed_head_norm
    assert plan["optimizer"] == 2 * plan["params"] and plan["grads"] == plan["params"]
    # KV cache of one replica, its 4 KV heads split over tensor=4: 2 x layers x rows x 1 head x slots x head dim x 2 B
    assert plan["kv_cache"] == 2 * 28 * 64 * 1 * 4096 * 128 * 2
    assert plan["hidden_states"] == 64 * 4096 * (3584 // 4) * 2  # the engines' bfloat16, features over tensor=4, sd on
    # resizing 64 rows to 32 builds the half-size table beside the whole one
    assert plan["compaction"] == (plan["kv_cache"] + plan["hidden_states"] + plan["drafter_kv_cache"]) // 2
    # layer_loop auto (unrolled on GPUs, as planned): the engines' per-layer copy of everything but embed, head and
    # final norm; the scan has none
    scan = dry_run.memory_plan(load_config(ROOT / "configs" / "qwen2.5_7b_1node.yaml", ["rollout.layer_loop=scan"]))
    assert scan["unrolled_layers"] == 0 and scan["rollout_params"] == _qwen7b_hand_calculation(tensor=4, fsdp=1, itemsize=2)
    assert plan["unrolled_layers"] == _qwen7b_hand_calculation(tensor=4, fsdp=1, itemsize=2) - embed_head_norm
    assert plan["total"] == scan["total"]  # the layers once either way: stacked under the scan, per layer unrolled
    other = load_config(ROOT / "configs" / "qwen2.5_7b_1node.yaml", ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1",
                                                                      "sd.mode='off'", "rl.kl_coef=0.01"])
    p = dry_run.memory_plan(other)
    assert p["params"] == _qwen7b_hand_calculation(tensor=1, fsdp=8, itemsize=4)
    assert p["reference"] == p["params"] and p["hidden_states"] == 0
    same = dry_run.memory_plan(load_config(ROOT / "configs" / "qwen2.5_7b_1node.yaml", ["model.rollout_dtype="]))
    # One dtype: the engines share the trainer's buffers, so the master weights stay whole along data.
    assert same["params"] == _qwen7b_hand_calculation(tensor=4, fsdp=1, itemsize=4) and same["rollout_params"] == 0
    # The drafter: the engines' bfloat16 copy, and for online training its float32 master, gradients and
    # starting copy (sharded like the engines' copy) and AdamW moments (whole on every device)
    sharded, whole = _qwen7b_drafter_hand_calculation(tensor=4, itemsize=4)
    assert plan["drafter"] == sharded // 2 and plan["drafter_training"] == 3 * sharded + 2 * whole
    assert p["drafter"] == p["drafter_training"] == 0  # sd off
    frozen = dry_run.memory_plan(load_config(ROOT / "configs" / "qwen2.5_7b_1node.yaml", ["drafter_online.enabled=false"]))
    assert frozen["drafter"] == plan["drafter"] and frozen["drafter_training"] == 0
    assert plan["total"] == sum(plan[k] for k in dry_run.MEMORY_PARTS)
    text = dry_run.plan(load_config(ROOT / "configs" / "qwen2.5_32b_multinode.yaml"))
    assert "32 devices" in text and "32.76B parameters" in text and "engine programs:" in text
    assert "drafter_training" in text and "training programs: an update step" in text


def test_dry_run_cli_for_both_gpu_configs():
    for name in ("qwen2.5_7b_1node", "qwen2.5_32b_multinode"):
        out = subprocess.run(train_cmd([], "--config", f"configs/{name}.yaml", "--dry-run"), env=cpu_env(),
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        total = float(out.stdout.split("total")[1].split()[0])
        assert 10 < total < 80, out.stdout  # fits an 80 GB GPU


@pytest.mark.parametrize("override, message", [
    ("rl.samples_per_prompt=1", "rl.samples_per_prompt must be >= 2"),
    ("rl.loss_aggregation=mean", "rl.loss_aggregation must be one of token, sequence"),
    ("rl.kl_estimator=k4", "rl.kl_estimator must be one of k1, k2, k3, abs, k1+, k3+"),
    ("rl.micro_batch_size=5", "must split into rl.minibatches_per_step"),
    ("optim.schedule=step", "optim.schedule must be one of constant, cosine, linear"),
    ("reward.weights=[1.0, 2.0]", "same length"),
    ("data.math_levels=[0]", "data.math_levels must be a non-empty subset"),
    ("rl.temperature=0", "rl.temperature must be in [1e-05, inf), got 0"),
    ("rl.temperature=1e-9", "rl.temperature must be in [1e-05, inf), got 1e-09"),
    ("rl.eval_temperature=-1", "rl.eval_temperature must be 0 (greedy) or in [1e-05, inf)"),
    ("rl.eval_samples=2", "rl.eval_temperature must be > 0 for rl.eval_samples > 1"),
    ("rl.eval_top_p=0", "rl needs 0 < top_p, eval_top_p <= 1 and top_k, eval_top_k >= 0; got 1.0, 0"),
    ("drafter_train.temperature=1e-38", "drafter_train.temperature must be 0 (greedy) or in [1e-05, inf)"),
])
def test_rl_config_validation(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


@pytest.mark.slow
def test_smollm2_grpo_step(tmp_path):
    """The main command (README) on the real SmolLM2-135M, shortened to one step of 2 x 4 math rollouts:
    one device as in the CPU config, adaptive SD with the drafter training online in the tail, a finite
    loss and a checkpoint of the updated weights."""
    overrides = [
        "rl.steps=1", "rl.prompts_per_step=2", "rl.samples_per_prompt=4", "rl.max_new_tokens=32",
        f"rl.out_dir={tmp_path}", "rl.tensorboard=false", "rollout.compile_cache_dir=",
        "drafter_online.seq_len_tokens=64", "drafter_online.eval_rows=4",
        # One program per shape: 8 rows, short prompts and rollouts, one EAGLE strategy against plain decoding.
        "rollout.prompt_buckets=[128]", "rollout.length_buckets=[256]", "rollout.batch_buckets=[8]",
        "sd.strategies=[3/1/4]", "sd.group_live_batch_ranges=[[4, 1, 8]]",
        # The random drafter speculates all the same (by default its arms wait for an estimate that pays).
        "sd.min_drafter_accept=0", "sd.compile_in_background=false",
    ]
    proc = subprocess.run(train_cmd(overrides, "--config", str(ROOT / "configs" / "smollm2_cpu.yaml")), env=cpu_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["len_max"] <= 32 and 0 <= metrics["accuracy"] <= 1
    assert metrics["sd_share"] > 0
    # Step 1's rollouts fill the drafter's buffer: it has not trained, so it is not estimated again.
    assert metrics["drafter_steps"] == 0 and math.isnan(metrics["drafter_accept"])
    assert (tmp_path / "checkpoints" / "1").is_dir()


def test_sampled_evaluation_scores_every_sample_with_the_same_seeds_each_time(tmp_path):
    # Its own top-p and top-k (verl's val_kwargs), not training's
    trainer = make_trainer(tmp_path, "rl.eval_every_steps=1", "rl.eval_prompts=4", "rl.eval_temperature=1.0",
                           "rl.eval_samples=3", "rl.checkpoint_every_steps=0", "rl.top_p=0.5", "rl.top_k=3",
                           "rl.eval_top_p=0.9", "rl.eval_top_k=20", steps=1)
    try:
        seen = []
        generate = trainer.workers.generate

        def record(requests, group_size, **kw):
            completions, stats = generate(requests, group_size, **kw)
            seen.append(([(r.prompt_ids, r.seed, (r.temperature, r.top_p, r.top_k)) for r in requests],
                         [c.tokens for c in completions]))
            return completions, stats

        trainer.workers.generate = record
        accuracy = trainer.evaluate()
        assert trainer.evaluate() == accuracy
        (requests, tokens), (requests_again, tokens_again) = seen
        assert requests == requests_again and tokens == tokens_again
        assert len(requests) == 12 and len({seed for _, seed, _ in requests}) == 12
        assert all(s == (1.0, 0.9, 20) for _, _, s in requests) and requests[0][0] == requests[2][0] != requests[3][0]
        assert len({tuple(t) for t in tokens[:3]}) > 1  # one prompt's samples differ
        history = trainer.run()  # evaluates before step 1 and after it; the rows say how
        assert [(h["step"], h["eval_temperature"]) for h in history] == [(0, 1.0), (1, 1.0)]
        assert history[0]["eval_accuracy"] == accuracy  # the policy before step 1, scored with the same seeds
    finally:
        trainer.close()


def test_weight_handoff_shares_buffers_and_reuses_programs(tmp_path):
    """After an update, each replica's engine holds the trainer's new shards (no copy) and runs them
    through the programs it compiled before."""
    from flax import nnx

    trainer = make_trainer(tmp_path, "mesh.data=2", "mesh.fsdp=4", "rl.checkpoint_every_steps=0", steps=2)
    try:
        records = [{"prompt": "1+2=", "answer": "3"}] * 4
        trainer.rollout(records, 1)
        before = jax.tree.leaves(trainer.params)[0]
        trainer.run_step()
        assert len(trainer.workers.replicas) == 2
        for r in trainer.workers.replicas:
            engine_leaves = jax.tree.leaves(nnx.to_pure_dict(r.engine.state))
            for ours, theirs in zip(jax.tree.leaves(trainer.params), engine_leaves):
                mine = {s.device: s.data.unsafe_buffer_pointer() for s in ours.addressable_shards}
                for s in theirs.addressable_shards:
                    assert s.data.unsafe_buffer_pointer() == mine[s.device]
        assert not np.array_equal(np.asarray(before), np.asarray(jax.tree.leaves(trainer.params)[0]))
        # The pool's programs were compiled ahead of time for the replica shardings; handed-off arrays
        # with any other sharding would make them raise instead of recompiling.
        programs = [dict(r.engine.pool._programs) for r in trainer.workers.replicas]
        trainer.rollout(records, 1)
        for r, before_programs in zip(trainer.workers.replicas, programs):
            assert all(r.engine.pool._programs[k] is p for k, p in before_programs.items())
    finally:
        trainer.close()


def test_tensor_parallel_training_matches_fsdp(tmp_path):
    """The same 2 steps with the policy split over fsdp=8, and over fsdp=4 x tensor=2 (heads, MLP, vocab)."""
    common = ["rl.checkpoint_every_steps=0"]
    fsdp = make_trainer(tmp_path / "a", *common, steps=2).run()
    tp = make_trainer(tmp_path / "b", *common, "mesh.fsdp=4", "mesh.tensor=2", steps=2).run()
    for a, b in zip(fsdp, tp):
        assert a["tokens"] == b["tokens"] and a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)
        for key in ("loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_off_policy_minibatches_recompute_old_logprobs(tmp_path):
    """With 2 mini-batches per step the trainer recomputes the sampling policy's log-probs (the second
    update is off-policy): they equal the engine's, and both updates run."""
    trainer = make_trainer(tmp_path, "rl.minibatches_per_step=2", "rl.checkpoint_every_steps=0", steps=1)
    try:
        records = next(trainer.data)
        requests, completions, _, _ = trainer.rollout(records, 1)
        adv = np.linspace(-1, 1, len(requests)).astype(np.float32)
        tokens, pad, mask, adv, rollout_logp = trainer.build_batch(requests, completions, adv)
        rows = lambda x: update.to_global(x[:8], update.rows_sharding(trainer.mesh, x[:8].shape, 0))  # noqa: E731
        old = np.asarray(trainer._logp_fn(trainer.params, rows(tokens), rows(pad), rows(mask)))
        np.testing.assert_allclose(old * mask[:8], rollout_logp[:8], atol=2e-4)
        metrics = trainer.train(tokens, pad, mask, adv)
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    finally:
        trainer.close()


def test_a_resume_names_the_settings_it_changes_and_keeps_the_config_they_replace(tmp_path, capsys):
    """A resume that forgot the first start's override (rl.temperature=0.5) went on silently and overwrote the run's
    config.yaml, so nothing recorded what step 1 trained with (found by review)."""
    make_trainer(tmp_path, "rl.temperature=0.5", steps=1).run()
    capsys.readouterr()
    make_trainer(tmp_path, steps=2, resume=True).close()
    err = capsys.readouterr().err
    assert "settings changed since step 1 was saved:" in err and "rl.temperature (was 0.5, now 1.0)" in err
    assert load_config(tmp_path / "run" / "config.to_step_1.yaml").rl.temperature == 0.5
    assert load_config(tmp_path / "run" / "config.yaml").rl.temperature == 1.0
    # That start saved no step (a crash); another from step 1 kept its settings as step 1's (review)
    make_trainer(tmp_path, "rl.temperature=0.7", steps=2, resume=True).close()
    assert load_config(tmp_path / "run" / "config.to_step_1.yaml").rl.temperature == 0.5
    assert load_config(tmp_path / "run" / "config.yaml").rl.temperature == 0.7
