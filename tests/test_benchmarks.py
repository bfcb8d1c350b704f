"""The benchmark scripts run end to end on a tiny model, so they cannot rot between real runs."""

import importlib.util
import json
from typing import ClassVar

import pytest
from helpers.checkpoints import kill_writes_half_way
from helpers.scripts import load_script
from helpers.tiny_run import tiny_overrides


@pytest.mark.slow  # four short GRPO runs: about a minute on a quiet 2-core machine
def test_bench_rl_compares_sd_off_and_adaptive_from_the_same_seeds(tmp_path):
    bench_rl = load_script("bench_rl")
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith("rl.steps=")] + ["mesh.fsdp=-1"]
    out = tmp_path / "bench_rl.json"
    sd = ["sd.threshold_live_batch=16", "sd.patience_host_steps=1", "sd.strategies=['2/2/4', 'h3']",
          "sd.group_live_batch_ranges=[[4, 1, 16]]"]
    code = bench_rl.main(["--config", "", "--steps", "2", "--repeats", "1", "--out", str(out), "--set", *overrides, *sd,
                          "drafter_online.min_buffer_tokens=16", "drafter_online.batch_rows=2",
                          "drafter_online.seq_len_tokens=32", "drafter_online.eval_rows=2", "drafter_train.unroll_steps=1"])
    result = json.loads(out.read_text())
    assert code == 0 and result["summary"]["identical_rollouts_and_rewards"]
    assert [len(r["steps"]) for r in result["runs"]["adaptive"]] == [2]
    assert result["summary"]["all_steps"]["step_time_ratio"] > 0 and result["machine"]["cores_usable"] >= 1
    assert max(result["summary"]["sd_share_by_step"]) > 0  # speculation ran
    # Step 1 compiled the rollout programs, and steps 2.. are reported with their compiles subtracted.
    steps = result["runs"]["off"][0]["steps"]
    assert steps[0]["compile_s"] > 0 and all(s["compile_s"] >= s["background_compile_s"] >= 0 for s in steps)
    assert result["summary"]["steps_2_on"]["compile"] == "subtracted"
    assert "compile_s" in result["summary"]["steps_2_on"]["adaptive"]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None  # the [plot] extra; CI installs [dev] only
    assert out.with_suffix(".png").is_file() == has_matplotlib


def _rl_run(digests, rewards, seconds=30.0, sd_share=0.0, compile_s=(), background_s=()):
    """A run's steps; compile_s each step's compiles, of which background_s ran on the pool's thread unwaited."""
    per = seconds / len(digests)
    compile_s = list(compile_s) or [0.0] * len(digests)
    background_s = list(background_s) or [0.0] * len(digests)
    return {"steps": [{"step": i + 1, "rollout_s": per, "update_s": 0.0, "drafter_s": 0.0, "drafter_spot_s": 0.0,
                       "compile_s": c, "background_compile_s": b, "rollout_waited_compile_s": c - b, "step_s": per,
                       "digest": d, "reward_mean": r, "sd_share": sd_share, "acceptance_length": 1.0}
                      for i, (d, r, c, b) in enumerate(zip(digests, rewards, compile_s, background_s))]}


def test_bench_rl_fails_when_adaptive_never_speculated():
    """Identical rollouts prove nothing when the adaptive runs decoded plainly throughout (SD off against itself)."""
    summary = load_script("bench_rl").summary
    off, plain = _rl_run(["a", "b"], [0.5, 0.6]), _rl_run(["a", "b"], [0.5, 0.6])
    tail = _rl_run(["a", "b"], [0.5, 0.6], sd_share=0.25)
    assert not summary([off], [plain])["speculated"]
    assert summary([off, off, off], [plain, tail, plain])["speculated"]


def _fake_bench_rl(monkeypatch, sd_share=0.25, adaptive_digests=("a", "b")):
    """bench_rl with its runs, model and machine faked: what main does around them, in a moment."""
    from types import SimpleNamespace

    import fastrl_jax.machine
    import fastrl_jax.models.loading
    import fastrl_jax.sharding

    bench_rl = load_script("bench_rl")
    ran = []

    def run(cfg, policy, mode, out_dir):
        ran.append(mode)
        digests = list(adaptive_digests) if mode == "adaptive" else ["a", "b"]
        return {"mode": mode, "wall_s": 1.0, **_rl_run(digests, [0.5, 0.6], sd_share=sd_share * (mode == "adaptive"))}

    monkeypatch.setattr(bench_rl, "run", run)
    monkeypatch.setattr(fastrl_jax.models.loading, "load_policy", lambda *a, **k: SimpleNamespace(model=None, tokenizer=None))
    monkeypatch.setattr(fastrl_jax.sharding, "make_mesh", lambda *a, **k: None)
    monkeypatch.setattr(fastrl_jax.machine, "machine_facts", lambda: {"cpu": "fake"})
    monkeypatch.setattr(bench_rl, "plot", lambda *a: False)
    return bench_rl, ran


def test_bench_rl_checks_its_output_before_the_runs_and_writes_it_whole(tmp_path, monkeypatch, capsys):
    bench_rl, ran = _fake_bench_rl(monkeypatch)
    argv = ["--config", "", "--steps", "2", "--set", "rollout.compile_cache_dir=''"]
    with pytest.raises(SystemExit):  # a missing directory is refused before any run, not after all of them
        bench_rl.main([*argv, "--out", str(tmp_path / "missing" / "bench_rl.json")])
    assert "does not exist" in capsys.readouterr().err and ran == []
    out = tmp_path / "bench_rl.json"
    # The modes interleaved, so drift in the machine falls on both; three repeats by default.
    assert bench_rl.main([*argv, "--out", str(out)]) == 0 and ran == ["off", "adaptive"] * 3
    result = json.loads(out.read_text())
    assert result["summary"]["speculated"] and result["resolved_config"]["rl"]["steps"] == 2
    assert result["machine"]["cpu"] == "fake" and len(result["machine"]["load_average_after"]) == 3
    assert result["complete"]
    kill_writes_half_way(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        bench_rl.main([*argv, "--out", str(out)])
    monkeypatch.undo()
    assert json.loads(out.read_text()) == result  # the previous result, whole


def test_bench_rl_keeps_the_runs_that_finished_when_a_later_one_fails(tmp_path, monkeypatch):
    """The JSON was written once after all 2 x --repeats runs (minutes to hours): an OOM in the last lost them all
    (review)."""
    bench_rl, ran = _fake_bench_rl(monkeypatch)
    real_run = bench_rl.run

    def run(cfg, policy, mode, out_dir):
        if len(ran) == 5:
            raise MemoryError("the last run")
        return real_run(cfg, policy, mode, out_dir)

    monkeypatch.setattr(bench_rl, "run", run)
    out = tmp_path / "bench_rl.json"
    with pytest.raises(MemoryError):
        bench_rl.main(["--config", "", "--steps", "2", "--set", "rollout.compile_cache_dir=''", "--out", str(out)])
    kept = json.loads(out.read_text())
    assert not kept["complete"] and [len(kept["runs"][m]) for m in ("off", "adaptive")] == [3, 2]


def test_bench_rl_exits_1_when_adaptive_never_speculated(tmp_path, monkeypatch, capsys):
    bench_rl, _ = _fake_bench_rl(monkeypatch, sd_share=0.0)
    out = tmp_path / "bench_rl.json"
    assert bench_rl.main(["--config", "", "--steps", "2", "--set", "rollout.compile_cache_dir=''", "--out", str(out)]) == 1
    assert "never speculated" in capsys.readouterr().err and not json.loads(out.read_text())["summary"]["speculated"]


def test_bench_rl_ratios_are_medians_of_repeats_with_compiles_subtracted_from_steps_2_on():
    """A program first reached at a later step (a length bucket, an SD arm) compiles inside steps 2.., and the
    first run in a process compiles what later runs get from JAX's caches: steps 2.. are compared without the
    compile seconds, and each figure is the median of the per-repeat ratios (off and adaptive of one repeat)."""
    summary = load_script("bench_rl").summary
    # Repeat 1 (cold): adaptive's step 2 compiles 8 of its 10 s; repeats 2, 3 are warm.
    off = [_rl_run(["a", "b"], [0.5, 0.6], seconds=s) for s in (20.0, 8.0, 8.0)]
    on = [_rl_run(["a", "b"], [0.5, 0.6], seconds=20.0, compile_s=[4.0, 8.0]),
          _rl_run(["a", "b"], [0.5, 0.6], seconds=4.0, compile_s=[0.0, 0.0]),
          _rl_run(["a", "b"], [0.5, 0.6], seconds=5.0, compile_s=[0.0, 1.0])]
    s = summary(off, on)
    late = s["steps_2_on"]
    # per-repeat steps-2.. ratios: 10 / (10 - 8) = 5, 4 / 2 = 2, 4 / (2.5 - 1) = 2.67; their median
    assert late["step_time_ratio_by_repeat"] == pytest.approx([5.0, 2.0, 4.0 / 1.5])
    assert late["step_time_ratio"] == pytest.approx(4.0 / 1.5) and late["rollout_ratio"] == pytest.approx(4.0 / 1.5)
    assert late["compile"] == "subtracted" and late["adaptive"]["compile_s"] == 1.0 and "median" in late["statistic"]
    everything = s["all_steps"]  # as measured: compiles included
    assert everything["compile"] == "included" and everything["step_time_ratio_by_repeat"] == pytest.approx([1.0, 2.0, 1.6])
    assert everything["step_time_ratio"] == pytest.approx(1.6) and s["repeats"] == 3
    assert s["runs_compile_s"]["adaptive"] == [12.0, 0.0, 1.0]
    # A background compile the rollout did not wait for overlapped its plain decoding: not subtracted (it was, and
    # a real tiny run's adaptive rollout came out at -14 s, its ratio null) (review)
    on[2] = _rl_run(["a", "b"], [0.5, 0.6], seconds=5.0, compile_s=[0.0, 9.0], background_s=[0.0, 8.0])
    assert summary(off, on)["steps_2_on"]["step_time_ratio_by_repeat"][2] == pytest.approx(4.0 / 1.5)


def test_bench_rl_counts_each_compile_once_foreground_or_background():
    """A step's compile seconds come from the program pools' per-compile records: a background compile the
    rollout waited on is in its waited seconds too, and must not count twice."""
    from fastrl_jax.rollout.pool import ProgramStats

    compile_seconds = load_script("bench_rl").compile_seconds
    def compiled(key, seconds, background=False):
        return ProgramStats(key, seconds, temp_bytes=0, argument_bytes=0, from_cache=False, background=background)

    old = compiled("a", 5.0)
    before = [old]
    after = [old, compiled("b", 2.0), compiled("c", 3.0, background=True)]
    assert compile_seconds(before, after) == (5.0, 3.0)


def test_bench_rl_refuses_a_missing_drafter_before_any_run(tmp_path, monkeypatch, capsys):
    """rl.drafter_path is loaded by the adaptive runs only: a wrong path failed after the first SD-off run."""
    bench_rl, ran = _fake_bench_rl(monkeypatch)
    with pytest.raises(SystemExit):
        bench_rl.main(["--config", "", "--steps", "2", "--out", str(tmp_path / "o.json"), "--set",
                       "rollout.compile_cache_dir=''", f"rl.drafter_path={tmp_path / 'no_such_drafter'}"])
    assert "no_such_drafter" in capsys.readouterr().err and ran == []


@pytest.mark.parametrize("dtype, status", [("float32", 1), ("bfloat16", 0)])
def test_bench_rl_requires_identical_rollouts_in_float32_only(tmp_path, monkeypatch, dtype, status):
    """With bfloat16 rollouts SD equals plain decoding up to near-ties, and a run that parts at one trains on
    other samples from then on: the runs' difference is reported, and fails the benchmark in float32 only."""
    bench_rl, _ = _fake_bench_rl(monkeypatch, adaptive_digests=("a", "X"))
    out = tmp_path / "bench_rl.json"
    code = bench_rl.main(["--config", "", "--steps", "2", "--out", str(out), "--set", "rollout.compile_cache_dir=''",
                          f"model.rollout_dtype={dtype}"])
    summary = json.loads(out.read_text())["summary"]
    assert code == status and not summary["identical_rollouts_and_rewards"] and summary["dtype"] == dtype


def test_bench_rl_compares_every_run_of_both_modes(capsys):
    """Identical means every run of either mode, step by step (a median run of SD off that differs, or a
    run with a step missing, is not identical); one step has no 'steps 2 on'; an even count of repeats
    has no median run and is refused, as in bench_rollout's median workloads."""
    summary = load_script("bench_rl").summary
    same = _rl_run(["a", "b"], [0.5, 0.6])
    odd_one = _rl_run(["X", "b"], [0.5, 0.6], seconds=31.0)
    assert summary([same, same], [same, same])["identical_rollouts_and_rewards"]
    assert not summary([same, odd_one, same], [same, same, same])["identical_rollouts_and_rewards"]
    assert not summary([same], [_rl_run(["a"], [0.5])])["identical_rollouts_and_rewards"]
    one = _rl_run(["a"], [0.5])
    assert "steps_2_on" not in summary([one], [one])
    for script, argv in (("bench_rl", ["--repeats", "2"]), ("bench_rollout", ["--workload", "stream", "--repeats", "2"])):
        with pytest.raises(SystemExit):
            load_script(script).main(argv)
        assert "odd" in capsys.readouterr().err


def test_stream_bucket_grids():
    """bench_rollout --workload stream's grid options: prompt buckets every --prompt-step tokens up to 384,
    the table sizes given (the table's own always among them), length buckets by 128 past the longest row."""
    from types import SimpleNamespace

    from fastrl_jax.config import RolloutConfig
    from fastrl_jax.rollout.engine import Request

    stream_rollout_config = load_script("bench_rollout").stream_rollout_config
    cfg = SimpleNamespace(rollout=RolloutConfig())
    requests = [Request(list(range(1, 61)), 300), Request(list(range(1, 41)), 100)]
    default = stream_rollout_config(cfg, requests, 64)
    assert default.prompt_buckets == tuple(range(32, 385, 32)) and default.batch_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert default.length_buckets == (128, 256, 384, 512)  # 60 + 300 tokens, and room past the largest pack
    fine = stream_rollout_config(cfg, requests, 64, prompt_step=16, batch_buckets=[48, 1, 16, 24, 128])
    assert fine.prompt_buckets == tuple(range(16, 385, 16)) and fine.batch_buckets == (1, 16, 24, 48, 64)


def _tiny_longtail(requests):
    """bench_rollout's longtail runner, plain decoding, one run, on the tiny model and a one-bucket table."""
    import dataclasses

    from helpers.tiny import CFG, tiny_model

    from fastrl_jax.config import SpecConfig

    cfg = dataclasses.replace(CFG, batch_buckets=(4,), length_buckets=(64,), prompt_buckets=(16,))
    [result] = load_script("bench_rollout").run_longtail([("plain", SpecConfig())], tiny_model(), None, cfg, requests, 1, 1.0)
    return result


def test_longtail_runs_compile_nothing_on_the_clock():
    """bench_rollout --workload longtail times rollouts "compiled before the clock starts": the warm-up must
    cover the programs of the prompts' shared prefix (chat prompts share their template's), or the first
    timed run compiles them (and with --repeats 1 the reported seconds count the compile)."""
    from fastrl_jax.rollout.engine import Request

    result = _tiny_longtail([Request(list(range(10, 22)) + [30 + i, 40 + i], max_new_tokens=8) for i in range(4)])
    assert result["tokens"] == 32 and result["stats"]["calls"]["prefix"] == 1  # the shared prefix ran once
    assert result["stats"]["seconds"]["compile"] == 0
    assert result["all_runs"] == [{"background_compile_s": 0.0, "programs_dropped": 0}]  # nor behind it


def test_longtail_refuses_requests_that_cannot_run():
    """A request the engine refuses (here a negative temperature) comes back as an 'error' completion with no
    tokens: timing such runs would report 0 tok/s, identical outputs and exit 0, as if it had measured something."""
    from fastrl_jax.rollout.engine import Request

    with pytest.raises(ValueError, match=r"\[plain\] request 0 cannot run: .*temperature"):
        _tiny_longtail([Request([5, 6, 7], max_new_tokens=8, temperature=-1.0)])


@pytest.mark.parametrize("flag,argv", [("--requests", ["--workload", "stream", "--requests", "0"]),
                                       ("--samples", ["--workload", "longtail", "--samples", "0"]),
                                       ("--batch-sizes", ["--batch-sizes", "16", "0"]),
                                       ("--batch", ["--workload", "stream", "--batch", "-4"])])
def test_bench_rollout_refuses_counts_below_one_before_loading_anything(flag, argv, capsys):
    """A count below 1 would load the model, then fail deep inside (max() of no requests, a table of no rows)."""
    with pytest.raises(SystemExit):
        load_script("bench_rollout").main(argv)
    assert f"{flag} must be >= 1" in capsys.readouterr().err


def _fake_longtail_runs(modes, model, drafter, rollout_cfg, requests, repeats, drafter_accept):
    """run_longtail's results without running."""
    return [_fake_longtail_run(name, requests) for name, _ in modes]


def _fake_longtail_run(name, requests):
    """A mode's result without running: every request's 6 tokens in 1 s, one plain call."""
    from fastrl_jax.rollout.stats import Call, RolloutStats

    outputs = [[1, 2, 3, 4, 5, 6] for _ in requests]
    return {"name": name, "sd": {}, "seconds": 1.0, "tokens": 6 * len(requests), "stats": RolloutStats().as_dict(),
            "timeline": [Call(1.0, len(requests), 6 * len(requests), False, "")._asdict()], "outputs": outputs,
            "tok_s": 6.0 * len(requests), "all_seconds": [1.0], "start_seconds": 0.0, "programs": "",
            "identical_across_repeats": True}


def test_longtail_writes_its_json_before_the_printout_and_the_plot(tmp_path, monkeypatch):
    """Minutes of rollouts are measured before the report: a failing plot (matplotlib, a font, a full disk)
    must not take the JSON with it."""
    import types

    from helpers.tiny import TINY, tiny_model

    from fastrl_jax.rollout.engine import Request

    bench_rollout = load_script("bench_rollout")
    monkeypatch.setattr(bench_rollout, "load_smollm2",
                        lambda cfg: types.SimpleNamespace(model=tiny_model(), cfg=TINY, tokenizer=None, stop_ids=()))
    monkeypatch.setattr(bench_rollout, "longtail_requests",
                        lambda policy, args: [Request([5, 6, 7, 8 + i], 6, 0.7, seed=i) for i in range(2)])
    monkeypatch.setattr(bench_rollout, "run_longtail", _fake_longtail_runs)

    def failing_plot(*args, **kwargs):
        raise RuntimeError("no plot today")

    monkeypatch.setattr(bench_rollout, "plot_timelines", failing_plot)
    out = tmp_path / "longtail.json"
    with pytest.raises(RuntimeError, match="no plot today"):
        bench_rollout.main(["--workload", "longtail", "--repeats", "1", "--out", str(out), "--on-strategies", "h2",
                            "--set", "rollout.compile_cache_dir="])
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["runs"]] == ["plain", "on h2", "adaptive"]
    assert result["summary"]["adaptive_vs_plain"] == 1.0 and result["summary"]["machine"]["cores_usable"] >= 1
    assert all(r["identical_to_plain"] == 2 and "outputs" not in r for r in result["runs"])
    # what ran, as fields (the workload's prose is for people)
    assert {k: result["summary"][k] for k in ("model", "seed", "problems", "samples", "untimed_first_rollout")} == {
        "model": "smollm2", "seed": 0, "problems": 16, "samples": 4, "untimed_first_rollout": True}


@pytest.mark.parametrize("dtype, status", [("float32", 1), ("bfloat16", 0)])
def test_longtail_requires_identical_outputs_in_float32_and_counts_them_in_bfloat16(tmp_path, monkeypatch, dtype, status):
    """bfloat16 SD equals plain decoding up to near-ties of the top two logits (docs/measurements.md: SmolLM2
    parts at one in 5-8 of 16 answers, on CPU and on an H100): the benchmark counts them there, and fails
    only where exact equality holds, in float32."""
    import types

    from helpers.tiny import TINY, tiny_model

    from fastrl_jax.rollout.engine import Request

    bench_rollout = load_script("bench_rollout")
    monkeypatch.setattr(bench_rollout, "load_smollm2",
                        lambda cfg: types.SimpleNamespace(model=tiny_model(), cfg=TINY, tokenizer=None, stop_ids=()))
    monkeypatch.setattr(bench_rollout, "longtail_requests",
                        lambda policy, args: [Request([5, 6, 7, 8 + i], 6, 0.7, seed=i) for i in range(2)])

    def runs(*args):
        out = _fake_longtail_runs(*args)
        out[-1]["outputs"][1] = [1, 2, 3, 9, 9, 9]  # adaptive: one request parts from plain decoding
        return out

    monkeypatch.setattr(bench_rollout, "run_longtail", runs)
    monkeypatch.setattr(bench_rollout, "plot_timelines", lambda *args, **kwargs: False)
    out = tmp_path / "longtail.json"
    got = bench_rollout.main(["--workload", "longtail", "--repeats", "1", "--out", str(out), "--on-strategies", "h2",
                              "--set", "rollout.compile_cache_dir=", f"model.rollout_dtype={dtype}"])
    summary = json.loads(out.read_text())["summary"]
    assert got == status and summary["dtype"] == dtype and summary["identical_required"] == (dtype == "float32")
    assert [r["identical_to_plain"] for r in json.loads(out.read_text())["runs"]] == [2, 2, 1]


def test_profile_decode_json_holds_the_machine_facts(tmp_path, monkeypatch):
    """A step time means little without the machine's copy bandwidth and matmul rate (fastrl_jax.machine)."""
    profile_decode = load_script("profile_decode")
    monkeypatch.setattr(profile_decode, "run", lambda cfg, layout, b, s, kv_len, steps, ops: {
        "layout": layout, "batch": b, "slots": s, "kv_len": kv_len, "step_ms": 1.0, "compile_s": 0.0})
    out = tmp_path / "profile.json"
    profile_decode.main(["--batch", "1", "--slots", "16", "--kv-len", "16", "--layouts", "stacked", "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 1 and result["machine"]["copy_gbs"] > 0 and result["machine"]["cores_usable"] >= 1


def test_an_accelerators_facts_hold_its_own_memorys_bandwidth(monkeypatch):
    """The batch-1 floor of a GPU run was weight bytes / the host's copy bandwidth, not the HBM's."""
    from fastrl_jax import machine

    assert "device_copy_gbs" not in machine.machine_facts() and machine.device_copy_gbs(2**20, 2) > 0
    monkeypatch.setattr(machine.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(machine, "device_copy_gbs", lambda: 3350.04)
    assert machine.machine_facts()["device_copy_gbs"] == 3350.0


def test_stream_metrics_of_a_stream_without_decode_calls():
    """Requests of one new token each (--max-new-tokens 1) all finish at their prefill: no decode call ran, so
    the rates and live rows of decode calls are unmeasured (NaN), not a ZeroDivisionError after the stream ran."""
    import math
    import types

    from fastrl_jax.rollout.stats import RolloutStats

    stats = RolloutStats(tokens=8, prompt_tokens=80, prompt_slots=96)
    stats.seconds.update(prefill=0.5, compile=0.0, host=0.1, total=0.6)
    metrics = load_script("bench_rollout").stream_metrics(types.SimpleNamespace(stats=stats, timeline=[]), 0.6, 4)
    assert metrics["tokens"] == 8 and metrics["decode_calls"] == 0 and metrics["prefill_share"] == 0.5 / 0.6
    assert all(math.isnan(metrics[k]) for k in ("full_batch_tok_s", "stream_vs_full_batch", "mean_live_rows"))


def test_one_run_claims_no_identical_repeats():
    """With --repeats 1 there is nothing to compare a run's outputs with: 'identical across repeats' would be a run
    compared with itself, true whatever the engine did; the JSON says null (not checked) instead."""
    from fastrl_jax.rollout.engine import Request

    bench_rollout = load_script("bench_rollout")
    requests = [Request(list(range(10, 22)) + [30 + i, 40 + i], max_new_tokens=8) for i in range(4)]
    assert _tiny_longtail(requests)["identical_across_repeats"] is None
    run = {"outputs": [[1, 2], [3]]}
    assert bench_rollout.same_outputs([run]) is None
    assert bench_rollout.same_outputs([run, {"outputs": [[1, 2], [3]]}, run]) is True
    assert bench_rollout.same_outputs([run, {"outputs": [[1, 2], [4]]}, run]) is False


def _no_policy(*args, **kwargs):
    raise AssertionError("loaded the policy before checking the output paths")


@pytest.mark.parametrize("argv", [["--workload", "throughput"], ["--workload", "longtail"], ["--workload", "stream"],
                                  ["--workload", "stream", "--plot", "{tmp}/missing/stream.png"]])
def test_bench_rollout_checks_its_outputs_before_loading_anything(tmp_path, monkeypatch, capsys, argv):
    """An --out (or --plot) in a directory that does not exist was found only when the minutes of rollouts were over."""
    bench_rollout = load_script("bench_rollout")
    monkeypatch.setattr(bench_rollout, "load_smollm2", _no_policy)
    out = tmp_path / ("out.json" if "--plot" in argv else "missing/out.json")
    with pytest.raises(SystemExit):
        bench_rollout.main([a.format(tmp=tmp_path) for a in argv] + ["--out", str(out)])
    assert "does not exist" in capsys.readouterr().err


def test_profile_decode_checks_its_output_first_and_writes_strict_json(tmp_path, monkeypatch, capsys):
    profile_decode = load_script("profile_decode")
    ran = []
    monkeypatch.setattr(profile_decode, "run", lambda cfg, layout, b, s, kv_len, steps, ops: ran.append(b) or {
        "layout": layout, "batch": b, "slots": s, "kv_len": kv_len, "step_ms": float("nan"), "compile_s": 0.0})
    monkeypatch.setattr(profile_decode, "machine_facts", lambda: {"cpu": "fake"})
    argv = ["--batch", "1", "--slots", "16", "--kv-len", "16", "--layouts", "stacked"]
    with pytest.raises(SystemExit):
        profile_decode.main([*argv, "--out", str(tmp_path / "missing" / "profile.json")])
    assert "does not exist" in capsys.readouterr().err and ran == []
    out = tmp_path / "profile.json"
    profile_decode.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text(), parse_constant=_refuse)["rows"][0]["step_ms"] is None  # NaN: null


@pytest.mark.parametrize("argv", [["--slots", "64"], ["--batch", "0"], ["--steps", "0", "--kv-len", "8", "--slots", "8"]])
def test_profile_decode_refuses_sizes_it_cannot_run(monkeypatch, capsys, argv):
    """A cache of fewer slots than attention reads (the default --kv-len is 192) ended in a traceback."""
    profile_decode = load_script("profile_decode")
    monkeypatch.setattr(profile_decode, "run", _no_policy)
    with pytest.raises(SystemExit):
        profile_decode.main(argv)
    assert "below" in capsys.readouterr().err


def _refuse(constant):
    raise ValueError(f"non-strict JSON: {constant}")


class _FakeStreamEngine:
    """RolloutEngine for bench_rollout's stream workload: records how it was made and each generate."""

    made: ClassVar[list] = []  # (keyword arguments, engine) of each made

    def __init__(self, model, rollout_cfg, **kwargs):
        self.pool = __import__("types").SimpleNamespace(warm_up=lambda keys, progress: None)
        self.generated = 0
        _FakeStreamEngine.made.append((kwargs, self))

    def shared_prefix_len(self, requests):
        return 0

    def warm_up_keys(self, shared):
        return []

    def pool_report(self):
        return ""

    def reset_controller(self):
        pass

    def generate(self, requests):
        import types

        self.generated += 1
        return [types.SimpleNamespace(tokens=[1, 2], finish_reason="length") for _ in requests]


# Run 1 has the median seconds, but the highest ratio and prefill share of the three.
_STREAM_RUNS = [{"seconds": 10.0, "ratio": 0.90, "prefill": 0.30}, {"seconds": 9.0, "ratio": 0.70, "prefill": 0.20},
                {"seconds": 11.0, "ratio": 0.80, "prefill": 0.25}]


def _fake_stream(tmp_path, monkeypatch, *argv):
    """bench_rollout --workload stream, 3 runs of canned metrics on a faked engine; (exit status, JSON)."""
    import types

    from helpers.tiny import TINY, tiny_model

    import fastrl_jax.rollout.engine as engine_module
    from fastrl_jax.rollout.engine import Request

    bench = load_script("bench_rollout")
    monkeypatch.setattr(bench, "load_smollm2", lambda cfg: types.SimpleNamespace(model=tiny_model(), cfg=TINY, tokenizer=None))
    monkeypatch.setattr(bench, "stream_requests", lambda policy, args: [Request([5, 6, 7], 2, 0.7, seed=i) for i in range(4)])
    monkeypatch.setattr(engine_module, "RolloutEngine", _FakeStreamEngine)
    monkeypatch.setattr(bench, "plot_stream", lambda *a: False)
    _FakeStreamEngine.made = []
    runs = iter(_STREAM_RUNS)

    def metrics(engine, seconds, batch):
        c = next(runs)
        return {"seconds": c["seconds"], "tokens": 8, "tok_s": 8 / c["seconds"], "full_batch_tok_s": 8 / c["seconds"] / c["ratio"],
                "stream_vs_full_batch": c["ratio"], "prefill_share": c["prefill"],
                **{k: 0.0 for k in bench.STREAM_KEYS if k not in ("tok_s", "full_batch_tok_s", "stream_vs_full_batch",
                                                                  "prefill_share")}}

    monkeypatch.setattr(bench, "stream_metrics", metrics)
    out = tmp_path / "stream.json"
    code = bench.main(["--workload", "stream", "--requests", "4", "--batch", "4", "--repeats", "3", "--out", str(out),
                       "--set", "rollout.compile_cache_dir=", *argv])
    return code, json.loads(out.read_text())


def test_stream_summary_is_each_metrics_median_and_says_what_ran(tmp_path, monkeypatch):
    """'Median of N' for every figure, not the figures of the run whose seconds are the median (a 5-run tiny stream:
    stream_vs_full_batch 0.3541 against a median of 0.3428); the JSON holds what a reader needs to rerun it."""
    import numpy as np

    code, result = _fake_stream(tmp_path, monkeypatch)
    s = result["summary"]
    assert code == 0 and "median" in s["statistic"]
    for key in ("stream_vs_full_batch", "prefill_share", "full_batch_tok_s", "tok_s"):
        assert s[key] == pytest.approx(float(np.median([r[key] for r in result["runs"]]))) and len(s["by_run"][key]) == 3
    assert s["stream_vs_full_batch"] == 0.80 and s["prefill_share"] == 0.25  # the run of median seconds has 0.90, 0.30
    assert {k: s[k] for k in ("repeats", "seed", "temperature", "max_new_tokens", "dtype", "model", "drafter")} == {
        "repeats": 3, "seed": 0, "temperature": 0.7, "max_new_tokens": 512, "dtype": "float32", "model": "smollm2",
        "drafter": None}


def test_stream_runs_every_program_once_untimed_and_keeps_a_random_drafters_eagle_arms_out(tmp_path, monkeypatch):
    """A program's first run pays one-time costs and the adaptive bandit does not count it: one untimed stream before
    the timed ones. A random drafter accepts ~1 token per step: the engine is told so (drafter_accept_prior)."""
    code, result = _fake_stream(tmp_path, monkeypatch, "--sd", "adaptive")
    (kwargs, engine), = _FakeStreamEngine.made
    assert code == 0 and engine.generated == 3 + 1 and result["summary"]["untimed_first_rollout"]
    assert kwargs["drafter_accept"] == 1.0 and kwargs["drafter"] is not None
    assert result["summary"]["sd"] == "adaptive" and result["summary"]["drafter"] == "random"


def test_first_timed_longtail_run_runs_no_program_for_the_first_time(monkeypatch):
    """The warm-up compiles every program but runs none: a first run costs tens of ms more on CPU, and adaptive's
    bandit leaves such a call's arm untried; so run 1 was no repeat of runs 2.. (tiny adaptive: 0.296 / 0.081 /
    0.062 s, first-run calls 11 / 2 / 0). Each figure is then the median over the runs, metric by metric. The modes
    take turns after their first rollouts, so a drifting machine weighs on each alike."""
    import dataclasses

    from helpers.tiny import CFG, tiny_model

    from fastrl_jax.config import SpecConfig
    from fastrl_jax.rollout import engine as E

    firsts, order = [], []
    generate = E.RolloutEngine.generate

    def counted(self, requests, *args, **kwargs):
        before = len(self._ran)
        out = generate(self, requests, *args, **kwargs)
        firsts.append(len(self._ran) - before)
        order.append(self.sd.mode)
        return out

    monkeypatch.setattr(E.RolloutEngine, "generate", counted)
    cfg = dataclasses.replace(CFG, batch_buckets=(4,), length_buckets=(64,), prompt_buckets=(16,))
    requests = [E.Request(list(range(10, 22)) + [30 + i, 40 + i], max_new_tokens=8) for i in range(4)]
    modes = [("plain", SpecConfig()), ("on h2", SpecConfig(mode="on", strategies=("h2",)))]
    results = load_script("bench_rollout").run_longtail(modes, tiny_model(), None, cfg, requests, 3, 1.0)
    assert order == ["off", "on"] + ["off", "on"] * 3, order
    assert firsts[0] > 0 and firsts[1] > 0 and firsts[2:] == [0] * 6, firsts
    for result in results:
        assert result["untimed_first_rollout"] and result["seconds"] == sorted(result["all_seconds"])[1]
        assert result["tok_s"] == sorted(result["all_tok_s"])[1] and len(result["all_timelines"]) == 3


def test_longtail_summary_takes_each_metrics_median_over_the_repeats():
    """Seconds at live batch <= the threshold: the median over the repeats' timelines, not the run of median seconds'."""
    from types import SimpleNamespace

    longtail_summary = load_script("bench_rollout").longtail_summary

    def run(name, tails):
        timelines = [[{"end_s": 1.0, "live": 8}, {"end_s": 1.0 + t, "live": 2}] for t in tails]
        return {"name": name, "seconds": 2.0, "outputs": [[1]], "timeline": timelines[0], "all_timelines": timelines,
                "stats": {"acceptance_length": 1.0, "drafts_per_step": {}}, "acceptance_length": 2.5}

    args = SimpleNamespace(problems=1, samples=1, temperature=0.7, max_new_tokens=4, repeats=3)
    plain, adaptive = run("plain", [0.9, 0.5, 0.7]), run("adaptive", [0.1, 0.4, 0.35])
    s = longtail_summary(args, [plain, adaptive], 4, "random")
    assert plain["seconds_at_live_batch_le_4"] == pytest.approx(0.7) and adaptive["seconds_at_live_batch_le_4"] == pytest.approx(0.35)
    assert s["adaptive_speedup_at_live_batch_le_4"] == pytest.approx(2.0) and s["acceptance"] == {"adaptive": 2.5}


def test_throughput_names_the_configs_model_and_times_its_rollout_settings(tmp_path, monkeypatch):
    """The JSON said 'SmolLM2-135M-Instruct' whatever model.path loaded; the engine took RolloutConfig's defaults,
    so --set rollout.layer_loop=unrolled timed the same engine as without it (review)."""
    import types

    from helpers.tiny import TINY, tiny_model

    import fastrl_jax.data.prompts

    bench_rollout = load_script("bench_rollout")
    monkeypatch.setattr(bench_rollout, "load_smollm2",
                        lambda cfg: types.SimpleNamespace(model=tiny_model(), cfg=TINY, tokenizer=None, path=cfg.model.path))
    monkeypatch.setattr(fastrl_jax.data.prompts, "chat_prompt_ids", lambda tokenizer, text: [5, 6, 7])
    timed = []
    monkeypatch.setattr(bench_rollout, "bench_engine", lambda model, ids, sizes, n, repeats, base:
                        timed.append(base) or ({b: (1.0, []) for b in sizes}, 0.0, ""))
    out = tmp_path / "throughput.json"
    assert bench_rollout.main(["--batch-sizes", "1", "--skip-hf", "--out", str(out), "--set", "rollout.compile_cache_dir=",
                               "model.rollout_dtype=bfloat16", "rollout.layer_loop=unrolled"]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "smollm2 bfloat16"
    assert timed[0].layer_loop == result["rollout"]["layer_loop"] == "unrolled"


def _drift_metrics(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s, "rollout_s": 10.0 + s, "drafter_accept": float("nan") if s == 2 else 1.5,
             "drafter_accept_frozen": 1.5, "drafter_steps": 3 * s, "drafter_spot_s": 1.0, "drafter_loss": 2.0,
             **({"eval_accuracy": 0.25} if s == 3 else {})} for s in (1, 2, 3)]
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_drafter_drift_writes_strict_json_without_matplotlib(tmp_path, monkeypatch, capsys):
    """matplotlib is an extra: the table and the JSON need none (it is imported for the plot alone), and a step's
    unmeasured acceptance (NaN) is null in the JSON, not the NaN a strict reader refuses."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "drift.json"
    assert load_script("plot_drafter_drift").main([str(_drift_metrics(tmp_path)), "-o", str(tmp_path / "d.png"),
                                                   "--out", str(out)]) == 0
    result = json.loads(out.read_text(), parse_constant=_refuse)
    assert [r["accept_online"] for r in result["rows"]] == [1.5, None, 1.5] and result["summary"]["steps_estimated"] == 2
    assert "[plot]" in capsys.readouterr().err and not (tmp_path / "d.png").exists()


def test_plot_rewards_without_matplotlib_writes_its_table_and_json_and_says_the_fix(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "r.png"
    assert load_script("plot_rewards").main([str(_drift_metrics(tmp_path)), "-o", str(png), "--smooth", "2"]) == 1
    captured = capsys.readouterr()
    assert "[plot]" in captured.err and "run" in captured.out and not png.exists()
    (run,) = json.loads(png.with_suffix(".json").read_text())["runs"]
    assert run["reward_smoothed"] == pytest.approx([0.1, 0.15, 0.25]) and run["eval_accuracy"] == [0.25]


def test_plot_rewards_names_a_missing_file_in_one_line(tmp_path, capsys):
    """A wrong path was a traceback (review)."""
    with pytest.raises(SystemExit):
        load_script("plot_rewards").main([str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "r.png")])
    assert "nope.jsonl" in capsys.readouterr().err


def test_plot_rewards_takes_a_run_directory_and_writes_png_without_a_suffix(tmp_path):
    """-o without a suffix failed with "Format 'tmp' is not supported" after the JSON was written (the temporary
    file's name gave matplotlib its format). Review."""
    pytest.importorskip("matplotlib")  # the [plot] extra
    assert load_script("plot_rewards").main([str(_drift_metrics(tmp_path).parent), "-o", str(tmp_path / "reward")]) == 0
    assert (tmp_path / "reward").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "reward").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
