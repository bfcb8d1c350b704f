"""Two CPU processes (gloo collectives) run a GRPO step on one mesh spanning both, and agree with one
process holding the same mesh."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import cpu_env, free_port
from helpers.tiny_run import tiny_overrides

from fastrl_jax.metric_sink import read_metrics

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def test_two_processes_one_mesh(tmp_path):
    # mesh data=2 (one rollout replica per process) x fsdp=2 (two devices in each process); adaptive SD, so each
    # checkpoint holds the drafter every process keeps on one local device (Orbax refused it from several processes)
    overrides = [*tiny_overrides(tmp_path, steps=2), "mesh.data=2", "mesh.fsdp=2", "rl.checkpoint_every_steps=1",
                 "sd.mode=adaptive"]
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fastrl_jax.cli", "train", *overrides, f"rl.out_dir={tmp_path / 'multi'}",
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            env=cpu_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    single = subprocess.run(
        # SD off: the same rollouts (speculation is lossless), without compiling its programs again
        [sys.executable, "-m", "fastrl_jax.cli", "train", *overrides, f"rl.out_dir={tmp_path / 'single'}", "sd.mode=off"],
        env=cpu_env(4), cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    multi = read_metrics(tmp_path / "multi" / "metrics.jsonl")
    one = read_metrics(tmp_path / "single" / "metrics.jsonl")
    assert [m["step"] for m in multi] == [1, 2]
    for a, b in zip(multi, one):
        for key in ("reward_mean", "reward_std", "len_mean", "tokens"):
            assert a[key] == b[key], key
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    assert (tmp_path / "multi" / "checkpoints" / "2").is_dir()
