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


def test_an_evaluation_leaves_the_adaptive_bandit_as_training_left_it():
    """The trainer evaluates on its rollout workers: the held-out rollout must not add its rewards to the
    adaptive-SD bandit nor advance its exploration RNG, or the next training rollouts choose other strategies
    than a run without evaluations. Nor does it gather the hidden states the online drafter trainer has the
    engines keep (~28 GiB of host memory for the 7B config's 500 held-out prompts), which training gets back."""
    import dataclasses

    from flax import nnx
    from helpers.tiny import CFG, prompts, tiny_model

    from fastrl_jax.rl.evaluate import eval_requests, evaluate
    from fastrl_jax.rl.workers import RolloutWorkers
    from fastrl_jax.rollout.speculative import PLAIN
    from fastrl_jax.sharding import make_mesh

    cfg = load_config(None, ["sd.mode=adaptive", "sd.strategies=['h3']", "sd.threshold_live_batch=16",
                             "sd.patience_host_steps=1", "sd.compile_in_background=false",
                             "sd.group_live_batch_ranges=[[4, 1, 16]]", "mesh.fsdp=-1"])
    cfg = dataclasses.replace(cfg, rollout=CFG)
    graphdef, state = nnx.split(tiny_model())
    workers = RolloutWorkers(cfg, graphdef, nnx.to_pure_dict(state), make_mesh(cfg.mesh), None, keep_hidden=True)
    chooser = workers.replicas[0].engine.chooser
    chooser.record(chooser.strategies[0], 2, 1e9)  # what training taught it so far: speculate
    chooser.record(PLAIN, 2, 1.0)
    chooser.rng.random()
    before = chooser.state()

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    held_out = prompts(3)
    requests = eval_requests(held_out, 2, 16, 0.7, 0, 1.0, cfg.seed, [])
    generate, seen = workers.generate, []
    workers.generate = lambda *args, **kwargs: seen.append(out := generate(*args, **kwargs)) or out
    result = evaluate(workers, Tokenizer(), [{"answer": "5"}] * len(held_out), requests, 2)
    assert result["acceptance_length"] is not None  # speculation ran, so the bandit was asked and paid
    assert chooser.state() == before
    assert all(c.hidden_states is None for c in seen[0][0]) and workers.replicas[0].engine.return_hidden


def test_eval_leaves_out_the_prompts_training_leaves_out(tmp_path, capsys):
    """The trainer's in-run evaluation drops held-out prompts longer than the largest prompt bucket (with a warning);
    `eval` must score the same set with the same seeds, not refuse the run, or it cannot repeat its eval_accuracy."""
    from helpers.tiny_run import tiny_overrides

    from fastrl_jax.cli import _eval_requests
    from fastrl_jax.data.prompts import record_prompt_ids
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.rl.evaluate import eval_requests
    from fastrl_jax.rollout.requests import prompt_margin

    cfg = load_config(None, tiny_overrides(tmp_path))  # prompts of one character a token, buckets up to 16
    records = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+" * 20 + "1=", "answer": "21"},
               {"prompt": "44+4=", "answer": "48"}]
    margin = prompt_margin(cfg.sd)
    tokenizer, kept, requests = _eval_requests(cfg, resolve_model_path(cfg.model.path), records, 2, 1.0, 8)
    assert kept == [records[0], records[2]] and "1 of 3 evaluation prompts are longer" in capsys.readouterr().err
    prompts = [record_prompt_ids(r, tokenizer, cfg.data.instruction, cfg.data.chat_template) for r in kept]
    assert requests == eval_requests(prompts, 2, 8, 1.0, cfg.rl.top_k, cfg.rl.top_p, cfg.seed, requests[0].stop_ids)

    # A prompt within the prompt buckets whose max_new_tokens leaves it no room in the largest length bucket is left
    # out too, as the trainer leaves it out (trainer.fitting); eval refused the whole set over it
    assert len(prompts[0]) < len(prompts[1])
    max_new = cfg.rollout.length_buckets[-1] - margin - len(prompts[0])
    _, kept, _ = _eval_requests(cfg, resolve_model_path(cfg.model.path), records, 2, 1.0, max_new)
    assert kept == [records[0]]
    assert f"2 of 3 evaluation prompts are longer than the room max_new_tokens ({max_new}) leaves" in capsys.readouterr().err


def test_eval_scores_the_set_the_trainer_scored_whatever_its_sd(tmp_path):
    """The trainer leaves out the eval prompts that leave no room for max_new_tokens and its sd's draft tree; `eval`
    computed that limit with its own --sd (off by default), so it scored prompts training left out, and an eval of a
    run with SD on scored another set than the run's eval_accuracy (review)."""
    from helpers.tiny_run import tiny_overrides

    from fastrl_jax import cli
    from fastrl_jax.config import save_config
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.tokenizer import load_tokenizer
    from fastrl_jax.rl.evaluate import held_out_records
    from fastrl_jax.rl.trainer import fitting

    held_out = tmp_path / "heldout.jsonl"  # prompts of 4 .. 16 tokens
    held_out.write_text("".join(json.dumps({"prompt": "1+" * k + "1=", "answer": str(k + 1)}) + "\n" for k in range(1, 8)))
    run_cfg = load_config(None, [*tiny_overrides(tmp_path), f"data.eval_source={held_out}", "rl.max_new_tokens=16",
                                 "rollout.length_buckets=[32]", "rollout.prompt_buckets=[16]", "sd.mode=on",
                                 "sd.strategies=['4/2/8']"])
    save_config(run_cfg, tmp_path / "config.yaml")
    tokenizer = load_tokenizer(resolve_model_path(run_cfg.model.path))  # the trainer's set (prompt_sources)
    trained_on = fitting(run_cfg, tokenizer, held_out_records(run_cfg, run_cfg.rl.eval_prompts), "eval")
    for sd in ("off", "on"):
        args = cli.build_parser().parse_args(["eval", "--config", str(tmp_path / "config.yaml"), "--sd", sd])
        cfg, path = cli._eval_policy_config(args, ["rollout.warm_up=false", f"sd.mode={args.sd!r}"])
        prompts, samples, temperature, max_new = cli._eval_settings(args, cfg)
        _, records, _ = cli._eval_requests(cfg, path, held_out_records(cfg, prompts), samples, temperature, max_new)
        assert 0 < len(records) == len(trained_on) < 7 and records == trained_on, sd
