"""Per-step metrics: summaries, the stdout table, JSONL (truncated on resume) and TensorBoard files."""

import io
import math

import pytest
from helpers.checkpoints import kill_writes_half_way

from fastrl_jax.metric_sink import MetricsSink, read_metrics
from fastrl_jax.rl.step_metrics import MetricsLog, rollout_summary, table_header, table_row
from fastrl_jax.rollout.stats import RolloutStats


def test_rollout_summary():
    stats = RolloutStats(tokens=40, steps_plain=6, steps_sd=2, sd_tokens=12, sd_steps=4)
    stats.seconds["compile"] = 1.5
    m = rollout_summary([1.0, 0.0, 1.0, 0.0], [1, 0, 1, 0], [5, 10, 15, 10], ["stop", "stop", "length", "stop"], stats)
    assert m["reward_mean"] == 0.5 and m["reward_std"] == 0.5 and m["accuracy"] == 0.5
    assert m["len_mean"] == 10 and m["len_p50"] == 10 and m["len_max"] == 15 and 14 < m["len_p99"] <= 15
    assert m["truncated_frac"] == 0.25 and m["tokens"] == 40
    assert m["sd_share"] == 0.25 and m["sd_token_share"] == 0.3 and m["acceptance_length"] == 3.0
    plain = rollout_summary([0.0], [0], [3], ["stop"], RolloutStats(tokens=3, steps_plain=3))
    assert plain["sd_share"] == 0.0 and math.isnan(plain["acceptance_length"])


def test_table_and_sinks(tmp_path):
    row = table_row({"step": 3, "reward_mean": 0.5, "acceptance_length": float("nan")})
    assert len(row) == len(table_header()) and row.split()[0] == "3" and "-" in row
    out = io.StringIO()
    log = MetricsLog(tmp_path, tensorboard=True, stream=out)
    for step in (1, 2, 3):
        log.log({"step": step, "reward_mean": step / 10, "acceptance_length": math.nan})
    log.close()
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    # strict JSON lines (jq and JavaScript refuse NaN): an unmeasured value is null, read back as NaN
    first = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert '"acceptance_length": null' in first and math.isnan(read_metrics(tmp_path / "metrics.jsonl")[0]["acceptance_length"])
    assert len(out.getvalue().splitlines()) == 4  # header + 3 rows
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # a run resumed from step 2 drops what the killed run logged after it
    MetricsLog(tmp_path, tensorboard=False, resume_after=2, stream=io.StringIO()).close()
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert pytest.approx(read_metrics(tmp_path / "metrics.jsonl")[1]["reward_mean"]) == 0.2


def test_a_kill_while_a_resume_rewrites_the_metrics_leaves_them_whole(tmp_path, monkeypatch):
    sink = MetricsSink(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        sink.write({"step": step, "loss": step / 10})
    kill_writes_half_way(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        MetricsSink(tmp_path, tensorboard=False, resume_after=2)
    monkeypatch.undo()
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    MetricsSink(tmp_path, tensorboard=False, resume_after=2)  # the resume run again
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_tensorboard_holds_each_step_once_after_resumes(tmp_path):
    """A resume from step 2 (opened in the same second as the first writer, which wrote over the first's event file),
    then one falling back past a damaged step 3 to step 1 (train-drafter's set_aside: drop_after after the sink
    opened; TensorBoard kept the old step 2 and 3 beside the new ones). Review."""
    from helpers.tensorboard_events import scalars

    sink = MetricsSink(tmp_path)
    for step in (1, 2, 3):
        sink.write({"step": step, "loss": float(step)})
    sink.close()
    sink = MetricsSink(tmp_path, resume_after=2)
    sink.write({"step": 3, "loss": 13.0})
    sink.close()
    assert scalars(tmp_path / "tensorboard")["loss"] == [(1, 1.0), (2, 2.0), (3, 13.0)]
    sink = MetricsSink(tmp_path, resume_after=3)
    sink.drop_after(1)
    for step in (2, 3):
        sink.write({"step": step, "loss": 20.0 + step})
    sink.close()
    assert scalars(tmp_path / "tensorboard")["loss"] == [(1, 1.0), (2, 22.0), (3, 23.0)]
    assert [m["loss"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 22.0, 23.0]


def test_read_metrics_takes_a_run_directory_and_leaves_out_a_line_being_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.5}]


def test_summed_rollout_stats_keep_every_phase():
    """Replicas' stats are summed (RolloutWorkers, bench-sd's rounds): a phase at 0 s (nothing compiled) must stay
    in the sum, as in each part, not vanish as Counter's + drops it."""
    a, b = RolloutStats(tokens=3), RolloutStats(tokens=4)
    a.seconds.update(prefill=0.5, compile=0.0, host=0.25, total=0.75)
    b.seconds.update(prefill=0.25, compile=0.0, host=0.0, total=0.25)
    total = (RolloutStats() + a + b).as_dict()
    assert total["tokens"] == 7
    assert total["seconds"] == {"prefill": 0.75, "compile": 0.0, "host": 0.25, "total": 1.0}


def test_weights_and_biases_gets_the_finite_scalars_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    """Offline (no network): the run's id is kept in the out_dir, so a resumed start logs into the same W&B run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(tmp_path, tensorboard=False, wandb_project="fastrl-test", config={"rl": {"steps": 3}})
    logged = []
    log = sink._wandb.log
    monkeypatch.setattr(sink._wandb, "log", lambda values, step: logged.append((step, values)) or log(values, step=step))
    sink.write({"step": 1, "loss": 0.5, "digest": "ab12", "acceptance_length": math.nan})
    sink.close()
    assert logged == [(1, {"loss": 0.5})]
    run_id = (tmp_path / "wandb_id").read_text().strip()
    again = MetricsSink(tmp_path, tensorboard=False, resume_after=1, wandb_project="fastrl-test")
    assert again._wandb.id == run_id
    again.write({"step": 2, "loss": 0.25})
    again.close()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run_id in name for name in runs)


def test_a_wandb_project_without_the_package_is_refused_before_loading(monkeypatch):
    import importlib.util

    from fastrl_jax.config import ConfigError
    from fastrl_jax.metric_sink import check_wandb

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"rl.wandb_project=p logs to Weights & Biases: pip install 'fastrl-jax\[wandb\]'"):
        check_wandb("rl.wandb_project", "p")
    check_wandb("rl.wandb_project", "")  # off


def test_a_wandb_project_without_a_login_is_refused_before_loading(monkeypatch):
    """With the package but no API key (a fresh node), wandb.init failed after the policy loaded and the run directory
    was made, and the rerun after `wandb login` was refused as a run already there (review). A stand-in wandb module:
    the real one is an optional extra."""
    import importlib.util
    import sys
    import types

    from fastrl_jax.config import ConfigError
    from fastrl_jax.metric_sink import check_wandb

    class UsageError(Exception):
        pass

    def login(verify=False):
        raise UsageError("No API key configured. Use `wandb login` to log in.")

    fake = types.SimpleNamespace(login=login, errors=types.SimpleNamespace(UsageError=UsageError))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(ConfigError, match=r"rl.wandb_project=p: W&B cannot log in \(No API key configured.*\): run "
                                          "`wandb login`, set WANDB_API_KEY or WANDB_MODE=offline"):
        check_wandb("rl.wandb_project", "p")
    check_wandb("rl.wandb_project", "p", login=False)  # a dry run: the job logs in where it runs
    monkeypatch.setenv("WANDB_MODE", "offline")  # logs to files, synced later: no login needed
    check_wandb("rl.wandb_project", "p")
