"""Evaluation math: the unbiased pass@k estimator against its definition, the reported k, subsets per
math level; and, slow, `fastrl-jax eval` on SmolLM2 as the README runs it."""

import json
from math import comb
from pathlib import Path

import numpy as np
import pytest

from fastrl_jax.config import load_config
from fastrl_jax.rl.evaluate import format_table, held_out_records, pass_at_k, pass_ks, summarize


def test_pass_at_k_is_the_codex_estimator():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12), (n, c, k)
    big = [pass_at_k(1024, 3, k) for k in (1, 10, 100, 1000)]  # no overflow, and more tries never hurt
    assert big == sorted(big) and big[0] == pytest.approx(3 / 1024) and big[-1] <= 1.0
    for bad in [(4, 5, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_reported_ks():
    assert pass_ks(1) == [1] and pass_ks(2) == [1, 2] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]


def test_summary_per_level():
    correct = np.array([[1, 0], [0, 0], [1, 1]], float)
    lengths = np.array([[10, 20], [30, 40], [50, 60]])
    truncated = np.array([[False, False], [False, True], [False, False]])
    out = summarize([1, 2, 1], correct, lengths, truncated)
    assert list(out) == ["all", "level 1", "level 2"]
    assert out["all"]["pass@1"] == pytest.approx(0.5) and out["all"]["pass@2"] == pytest.approx(2 / 3)
    assert out["level 1"]["pass@1"] == pytest.approx(0.75) and out["level 1"]["prompts"] == 2
    assert out["level 2"]["pass@2"] == 0 and out["level 2"]["truncated"] == 0.5
    assert out["all"]["len_max"] == 60 and out["all"]["len_mean"] == 35 and out["level 1"]["len_p50"] == 35
    assert list(summarize([None, None], correct[:2], lengths[:2], truncated[:2])) == ["all"]  # a file's records
    table = format_table(out).splitlines()
    assert table[0].split() == ["subset", "prompts", "samples", "pass@1", "pass@2", "len", "p50", "p90", "max", "trunc"]
    assert table[2].startswith("level 1") and len(table) == 4


def test_held_out_math_records_are_the_trainers_and_carry_levels():
    cfg = load_config(None, ["data.math_levels=[2, 3]"])
    records = held_out_records(cfg, 20)
    assert len(records) == 20 and {r["level"] for r in records} == {2, 3}
    assert held_out_records(cfg, 5) == records[:5]  # a prefix: more prompts extend the same set


@pytest.mark.slow
def test_eval_smollm2_writes_pass_at_1_and_k(tmp_path):
    from helpers.cli import fastrl_jax

    out = tmp_path / "eval.json"
    config = Path(__file__).parents[1] / "configs" / "smollm2_cpu.yaml"
    run = fastrl_jax("eval", "--config", str(config), "--num-prompts", "4", "--samples", "2",
                     "--max-new-tokens", "48", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[0].split()[:5] == ["subset", "prompts", "samples", "pass@1", "pass@2"]
    result = json.loads(out.read_text())
    assert result["samples"] == 2 and result["temperature"] == 0.7 and result["num_prompts"] == 4
    assert 0 <= result["results"]["all"]["pass@1"] <= result["results"]["all"]["pass@2"] <= 1
    assert sum(v["prompts"] for k, v in result["results"].items() if k.startswith("level")) == 4
    assert all(len(p["completions"]) == 2 for p in result["per_prompt"])
