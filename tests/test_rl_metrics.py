"""Per-step metrics: summaries, the stdout table, JSONL (truncated on resume) and TensorBoard files."""

import io
import math
from pathlib import Path

import pytest

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
        log.log({"step": step, "reward_mean": step / 10})
    log.close()
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
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
    write_text = Path.write_text

    def killed(self, text, *args, **kwargs):  # the process dies half-way through writing the file
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsSink(tmp_path, tensorboard=False, resume_after=2)
    monkeypatch.undo()
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    MetricsSink(tmp_path, tensorboard=False, resume_after=2)  # the resume run again
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_summed_rollout_stats_keep_every_phase():
    """Replicas' stats are summed (RolloutWorkers, bench-sd's rounds): a phase at 0 s (nothing compiled) must stay
    in the sum, as in each part, not vanish as Counter's + drops it."""
    a, b = RolloutStats(tokens=3), RolloutStats(tokens=4)
    a.seconds.update(prefill=0.5, compile=0.0, host=0.25, total=0.75)
    b.seconds.update(prefill=0.25, compile=0.0, host=0.0, total=0.25)
    total = (RolloutStats() + a + b).as_dict()
    assert total["tokens"] == 7
    assert total["seconds"] == {"prefill": 0.75, "compile": 0.0, "host": 0.25, "total": 1.0}
