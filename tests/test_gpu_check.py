"""scripts/gpu_check.py in its reduced form on CPU, on the tiny checkpoint: every section runs and records
figures, so the GPU check cannot rot between GPU sessions."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.cli import COMPILE_FLAGS
from helpers.scripts import load_script
from helpers.tiny_run import tiny_overrides

ROOT = Path(__file__).resolve().parent.parent


def test_reduced_gpu_check_runs_every_section(tmp_path):
    overrides = [*tiny_overrides(tmp_path, steps=1),
                 # prompts of the built-in math / chat sets, char by char: longer than the GRPO ones; few
                 # buckets, since every bucket is a program to compile (batch 1: the sections' own engines)
                 "rollout.prompt_buckets=[128]", "rollout.length_buckets=[160]", "rollout.batch_buckets=[4]",
                 "data.math_levels=[1]",
                 "drafter_train.instruction=", "sd.strategies=[[3, 1, 4]]", "sd.group_live_batch_ranges=[[4, 1, 16]]",
                 "sd.threshold_live_batch=16", "sd.patience_host_steps=1", "rollout.steps_per_call=2",
                 f"drafter_train.prompts={tmp_path / 'prompts.jsonl'}"]
    out = tmp_path / "check"
    env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS)  # one CPU device, as on a lent GPU
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])  # the tiny run's reward
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(out), "--reduced",
                           "--budget-s", "1200", "--compile-cache", str(tmp_path / "xla"),  # sections share programs
                           "--config", str(ROOT / "configs" / "smollm2_cpu.yaml"),
                           "--set", *overrides], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    results = json.loads((out / "gpu_check.json").read_text())
    errors = {k: r.get("traceback", r["summary"]) for k, r in results.items() if r["status"] != "ok"}
    assert proc.returncode == 0 and not errors, (errors, proc.stderr[-3000:])
    assert list(results) == ["environment", "kernel_tests", "greedy_vs_hf", "sd_lossless", "plain_decode",
                             "sd_step_profile", "trace", "trained_drafter", "longtail", "grpo", "device_tests", "memory"]
    assert results["environment"]["backend"] == "cpu" and results["environment"]["reduced"]
    for name in ("kernel_tests", "device_tests"):
        r = results[name]
        assert r["passed"] >= 2 and r["failures"] == r["errors"] == 0 and r["exit"] == 0, r
    greedy = results["greedy_vs_hf"]
    assert greedy["identical"] == greedy["prompts"] == 4, greedy  # the tiny model's logits are far from ties
    rows = results["sd_lossless"]["rows"]
    assert {(r["dtype"], r["temperature"]) for r in rows} == {("bfloat16", 0.0), ("bfloat16", 0.7)}  # float32: the suite's
    assert all(r["same_tokens"] == r["requests"] for r in rows), rows
    decode = results["plain_decode"]["rows"]
    assert [(r["layer_loop"], r["batch"]) for r in decode] == [("scan", 1), ("unrolled", 1)]
    assert all(r["tok_s"] > 0 and r["hf_tok_s"] > 0 for r in decode)
    assert results["plain_decode"]["copy_bandwidth_gbs"] > 0 and all(0 < r["floor_fraction"] for r in decode)
    prof = results["sd_step_profile"]["rows"][0]
    assert prof["draft_vocab"] == 64 and prof["sd_step"] > 0 and prof["verify_forward"] > 0
    traced = results["trace"]["runs"]
    assert list(traced) == ["plain", "3/1/4"] and all(r["steps"] > 0 and (out / r["trace"]).stat().st_size > 0
                                                      for r in traced.values()), traced
    drafted = results["trained_drafter"]
    assert drafted["train_drafter_wall_s"] > 0 and (Path(drafted["drafter"]) / "_CHECKPOINT_METADATA").exists()
    assert [(r["strategy"], r["same_tokens"] == r["requests"]) for r in drafted["rows"]] == [("3/1/4", True)]
    assert results["longtail"]["drafter"] == drafted["drafter"] and results["longtail"]["adaptive_vs_plain"] > 0
    assert results["grpo"]["same_token_counts"] and results["grpo"]["runs"]["adaptive"]["sd_share"][0] > 0
    md = (out / "gpu_check.md").read_text()
    assert "| section | status | seconds | result |" in md and "## Plain decode" in md and "## SD step by phase" in md and "## Traced at batch 1" in md


def test_device_summary_charges_idle_time_to_the_op_before_it(tmp_path):
    """A GPU trace's idle stretches (host syncs, launch gaps) are attributed to the op that ended last."""
    gpu_check = load_script("gpu_check")
    op = lambda name, ts, dur, hlo_op: {"ph": "X", "pid": 1, "tid": 2, "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                        "args": {"hlo_module": "jit_decode", "hlo_op": hlo_op}}
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
              op("gemm", 0, 10, "fusion.1"), op("reduce", 5, 10, "fusion.2"),  # overlapping: busy 0-15
              op("MemcpyD2H", 20, 2, "cond.1"), op("gemm", 40, 5, "fusion.3"), op("gemm", 45, 5, "fusion.3")]
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    got = gpu_check.device_summary(path, steps=2)
    assert got["busy_us_per_step"] == (15 + 2 + 10) / 2 and got["span_us_per_step"] == 50 / 2
    assert got["idle_after"] == [{"op": "jit_decode:cond.1", "us_per_step": 9.0},
                                 {"op": "jit_decode:fusion.2", "us_per_step": 2.5}]
    assert got["host_reads_per_step"] == 0.5 and got["kernels_per_step"] == 2.5


def test_plain_decode_cut_by_the_budget_keeps_its_rows(monkeypatch):
    """The budget's alarm in the middle of plain_decode: the engines measured so far stay in the results."""
    import time
    import types

    from helpers.tiny import tiny_model

    gpu_check = load_script("gpu_check")
    calls = []

    def bench_engine(model, prompts, batches, new_tokens, repeats, loop):
        calls.append(loop)
        if len(calls) > 1:
            raise TimeoutError("gpu_check budget of 1s (+15s grace) spent")
        return {b: (100.0 * b,) for b in batches}, 2.0

    monkeypatch.setattr(gpu_check, "_bench_rollout", lambda: types.SimpleNamespace(bench_engine=bench_engine))
    monkeypatch.setattr(gpu_check, "_model", lambda ctx, shape, dtype: (tiny_model(), None))
    args = types.SimpleNamespace(attention=["reference"], layer_loops=["scan", "unrolled"], skip_hf=True, dtype=None,
                                 config=None, set=[])
    ctx = gpu_check.Ctx(args, gpu_check.REDUCED, Path("."), time.monotonic() + 100, {})
    got = gpu_check.plain_decode(ctx)
    assert got["status"] == "cut" and calls == ["scan", "unrolled"] and "(cut: gpu_check budget" in got["summary"]
    assert [(r["layer_loop"], r["batch"], r["tok_s"]) for r in got["rows"]] == [
        ("scan", b, 100.0 * b) for b in gpu_check.REDUCED.decode_batches]
