"""The `fastrl-jax` command line: generate end to end, and clear errors for bad input."""

import json
from pathlib import Path

import pytest
from helpers.cli import fastrl_jax


@pytest.mark.slow
def test_generate_jsonl_round_trip(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n" + json.dumps({"prompt_ids": [1, 504, 3777]}) + "\n")
    out = tmp_path / "out.jsonl"
    run = fastrl_jax("generate", "--model", "smollm2", "--prompts", str(prompts), "--output", str(out),
                     "--max-new-tokens", "8", "--set", "rollout.length_buckets=[128]", "rollout.prompt_buckets=[64]")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[1]["prompt_ids"] == [1, 504, 3777]
    assert all(r["finish_reason"] in ("stop", "length") and 0 < len(r["completion_ids"]) <= 8 for r in rows)
    assert rows[0]["completion"].strip()


def test_bad_input_is_one_clear_line(tmp_path):
    run = fastrl_jax("generate", "--prompt", "hi", "--set", "mesh.tensr=2")
    assert run.returncode == 2
    assert "unknown key 'mesh.tensr' (did you mean 'mesh.tensor'?" in run.stderr
    assert "Traceback" not in run.stderr
    run = fastrl_jax("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert run.returncode == 2 and "nowhere" in run.stderr and "Traceback" not in run.stderr


TINY_ROLLOUT = ["--set", "rollout.length_buckets=[32, 64]", "rollout.prompt_buckets=[8, 16]", "rollout.batch_buckets=[1, 4]",
                "rollout.compile_cache_dir="]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers.tiny_run import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--max-new-tokens", "-5"], "max_new_tokens must be >= 1, got -5"),
    (["--max-new-tokens", "100000"], "max_new_tokens (100000) leaves no room for a prompt in the KV cache (64 slots"),
    (["--temperature", "-1"], "temperature must be 0 (greedy) or in [1e-05, inf), got -1.0"),
    (["--temperature", "1e-38"], "temperature must be 0 (greedy) or in [1e-05, inf), got 1e-38"),
    (["--top-p", "0"], "0 < top_p <= 1; got 0, 0.0"),
    (["--top-p", "1.5"], "0 < top_p <= 1; got 0, 1.5"),
    (["--top-k", "-1"], "0 <= top_k < 2**31"),
    (["--sd", "on", "--max-new-tokens", "60"], "max_new_tokens (60) + 7 draft-tree slots leaves no room"),
    (["--drafter", "{tmp}"], "--drafter applies only to speculative decoding: add --sd on or --sd adaptive"),
    (["--spec-steps", "2", "--spec-topk", "2"], "--spec-steps, --spec-topk apply only to speculative decoding"),
    (["--sd", "on", "--drafter", "{tmp}/none"], "drafter checkpoint {tmp}/none not found"),
    (["--output", "{tmp}/missing/out.jsonl"], "directory {tmp}/missing does not exist; create it first"),
    (["--output", "{tmp}"], "--output {tmp} is a directory"),
    (["--raw", "--prompt", "1+1=1+1=1+1=1+1=1+1=1+1="], "no request can run (request 0: the prompt has 24 tokens, more than "
                                                       "the largest prompt bucket (16)"),
])
def test_generate_refuses_bad_input_before_loading_the_model(tiny_dir, tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    prompt = [] if "--prompt" in args else ["--prompt", "1+1="]
    run = fastrl_jax("generate", "--model", str(tiny_dir), *prompt, "--max-new-tokens", "8", *args, *TINY_ROLLOUT)
    assert run.returncode == 2, run.stderr
    assert message.format(tmp=tmp_path) in run.stderr and "Traceback" not in run.stderr
    assert "loaded" not in run.stderr  # checked before the weights were read


def test_a_batch_with_invalid_requests_writes_the_rest_and_exits_1(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "1+2="}, {"prompt_ids": [3, 500]}, {"prompt_ids": list(range(3, 30))}, {"prompt_ids": [4, 5]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    run = fastrl_jax("generate", "--model", str(tiny_dir), "--raw", "--prompts", str(prompts), "--output", str(out),
                     "--max-new-tokens", "6", *TINY_ROLLOUT)
    assert run.returncode == 1, run.stderr
    assert "2 of 4 requests cannot run (request 1: prompt token ids must be in [0, 128); request 2: the prompt has 27 " \
           "tokens" in run.stderr
    assert "2 of 4 requests failed (requests [1, 2])" in run.stderr and "Traceback" not in run.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in got] == ["length", "error", "error", "length"]
    assert len(got[0]["completion_ids"]) == 6 and len(got[3]["completion_ids"]) == 6
    assert "error" in got[1] and "error" not in got[0]


def test_adaptive_sd_without_a_drafter_says_which_arms_sit_out():
    from fastrl_jax.cli import untrained_drafter_note
    from fastrl_jax.config import load_config

    config = Path(__file__).parents[1] / "configs" / "smollm2_cpu.yaml"
    sd = load_config(config, []).sd  # adaptive: 3/1/4, 2/2/4, h6, 3/1/4+h4, plain arm
    note = untrained_drafter_note(sd, None, "generate")
    assert note.startswith("--sd adaptive without --drafter: the EAGLE arms (3/1/4, 2/2/4, 3/1/4+h4) sit out")
    assert "below sd.min_drafter_accept (1.3), and generate does not train it; h6 and plain decoding compete" in note
    assert untrained_drafter_note(sd, "some/dir", "generate") is None  # a checkpoint is trusted
    eagle_only = load_config(config, ["sd.strategies=['3/1/4']", "sd.group_live_batch_ranges=[]",
                                                          "sd.plain_arm=false"]).sd
    assert "3/1/4) sit out" in untrained_drafter_note(eagle_only, None, "eval")
    assert "; plain decoding runs throughout. Give --drafter DIR" in untrained_drafter_note(eagle_only, None, "eval")
    one_other = load_config(config, ["sd.strategies=['2/2/4', 'h3']", "sd.group_live_batch_ranges=[]",
                                     "sd.plain_arm=false"]).sd
    assert "; h3 runs where speculation would." in untrained_drafter_note(one_other, None, "eval")
    for overrides in (["sd.mode='on'"], ["sd.min_drafter_accept=0"], ["sd.strategies=['h6']", "sd.group_live_batch_ranges=[]"]):
        assert untrained_drafter_note(load_config(config, overrides).sd, None, "generate") is None


def test_train_refuses_what_it_can_before_loading_and_leaves_no_run(tmp_path):
    """Sampling settings no request could run with, an unknown reward, a missing prompt file, stray
    process flags: refused before the model loads, with no run directory written (or moved aside); the
    dry run refuses them too. --set may repeat."""
    import subprocess
    import sys

    from helpers.cli import cpu_env
    from helpers.tiny_run import tiny_overrides

    def fastrl_jax(*args):  # tests/ importable (the tiny run's reward), 3 devices
        return subprocess.run([sys.executable, "-m", "fastrl_jax.cli", *args], capture_output=True, text=True,
                              env=cpu_env(3))

    overrides = [*tiny_overrides(tmp_path), "mesh.fsdp=-1"]  # micro-batches of 8 rows over 3 devices: refused last
    run = tmp_path / "run"
    (tmp_path / "no_answer.jsonl").write_text(json.dumps({"prompt": "1 + 1?", "answer": "2"}) + "\n"
                                              + json.dumps({"prompt": "2 + 2?", "solution": "4"}) + "\n")
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "1+" * 40 + "1=", "answer": "41"}) + "\n")
    for extra, message in [(["rl.max_new_tokens=100"], "max_new_tokens (100) leaves no room for a prompt"),
                           (["reward.functions=[corect]"], "corect"),
                           ([f"data.source={tmp_path / 'none.jsonl'}"], "data.source: no file"),
                           ([f"data.source={tmp_path / 'no_answer.jsonl'}"], "record 2 has no 'answer' (absent or null"),
                           ([], "must be divisible by mesh data x fsdp = 3")]:
        for flags in ([], ["--dry-run", "--devices", "3"]):
            if flags and any(e.startswith("data.source") for e in extra):
                continue  # a dry run plans a cluster's job without its data files
            done = fastrl_jax("train", *overrides, *extra, *flags)
            assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
            assert "loaded" not in done.stderr and not run.exists()
    overrides += ["rl.micro_batch_size=6", "rl.prompts_per_step=3", "rl.samples_per_prompt=2"]
    for extra in ([f"data.source={tmp_path / 'long.jsonl'}"], [f"data.eval_source={tmp_path / 'long.jsonl'}",
                                                               "rl.eval_every_steps=1"]):
        done = fastrl_jax("train", *overrides, *extra)  # found after the policy loaded: a 32B checkpoint's minutes
        assert done.returncode == 2 and "long.jsonl: no prompt fits the largest" in done.stderr, done.stderr
        assert "loaded" not in done.stderr and not run.exists()
    done = fastrl_jax("train", *overrides, "--num-processes", "2", "--process-id", "1")
    assert done.returncode == 2 and "give --coordinator HOST:PORT" in done.stderr and not run.exists()
    done = fastrl_jax("train", "--dry-run", "--devices", "3", *overrides, "--set", "rollout.batch_buckets=[1, 8]",
                      "--set", "rollout.length_buckets=[32, 96]")
    assert done.returncode == 0 and "rollout KV cache, 8 rows x 96 slots" in done.stdout, done.stderr


def test_bench_sd_refuses_bad_flags_before_loading(tmp_path, tiny_dir):
    common = ["bench-sd", "--model", str(tiny_dir), "--strategies", "h4", "--prompt-sets", "--batch-sizes", "1",
              "--out", str(tmp_path / "b.json"), "--plot", ""]
    for extra, message in [(["--prompt-file", str(tmp_path / "none.jsonl")], "--prompt-file: no file"),
                           (["--prompt-sets", "math", "--temperatures", "-1"], "--temperatures must be 0 (greedy) or in"),
                           (["--prompt-sets", "math", "--profile"], "--profile times an EAGLE step's phases")]:
        done = fastrl_jax(*common, *extra)
        assert done.returncode == 2 and message in done.stderr and "loaded" not in done.stderr, done.stderr


INTERRUPT_AFTER_TWO = """
import sys
from fastrl_jax import cli
from fastrl_jax.rollout import engine

stream = engine.RolloutEngine.stream


def two_then_interrupt(self, requests, between_steps=None):
    for n, item in enumerate(stream(self, requests, between_steps)):
        if n == 2:  # Ctrl-C, or SIGTERM from `timeout` / SLURM, after two completions
            raise KeyboardInterrupt
        yield item


engine.RolloutEngine.stream = two_then_interrupt
sys.exit(cli.main(sys.argv[1:]))
"""


def test_an_interrupted_generate_keeps_the_completions_it_finished(tiny_dir, tmp_path):
    """`generate --prompts FILE --output OUT` wrote OUT once, after the last request: an interrupt an hour into a
    10k-prompt file kept nothing (review). The finished completions are written, each with its request's index."""
    import subprocess
    import sys

    from helpers.cli import cpu_env

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 + i, 4, 5]}) + "\n" for i in range(4)))
    out = tmp_path / "out.jsonl"
    run = subprocess.run([sys.executable, "-c", INTERRUPT_AFTER_TWO, "generate", "--model", str(tiny_dir), "--prompts",
                          str(prompts), "--output", str(out), "--max-new-tokens", "4", "--set", "rollout.compile_cache_dir=",
                          "rollout.batch_buckets=[1]", "rollout.length_buckets=[32]", "rollout.prompt_buckets=[8]"],
                         capture_output=True, text=True, env=cpu_env(1))
    assert run.returncode == 130, run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and [r["prompt_ids"] for r in rows] == [[3 + r["index"], 4, 5] for r in rows]
    assert "interrupted: the 2 of 4 completions that finished are in" in run.stderr
