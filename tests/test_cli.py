"""The `fastrl-jax` command line: generate end to end, and clear errors for bad input."""

import json

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
