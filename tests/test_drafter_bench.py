"""bench-sd's measurement: every prompt set is timed apart, every batch size generates every prompt
of the set, batch size at a time, and speculative decoding reproduces plain decoding's tokens in
every cell."""

import numpy as np
import pytest
from flax import nnx
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.config import HistoryConfig, SpecConfig, StrategySpec
from fastrl_jax.drafter.bench import run_bench, stop_paying
from fastrl_jax.models.drafter import Drafter


def test_each_set_and_batch_size_runs_every_prompt_and_matches_plain_decoding():
    drafter = Drafter(TINY, nnx.Rngs(1), draft_vocab=np.arange(0, TINY.vocab_size, 2))
    sets = {"a": prompts(3, seed=2, hi=8), "b": prompts(1, seed=3, hi=8)}
    rows = run_bench(
        tiny_model(), drafter, sets, stop_ids=[], base_cfg=CFG, batch_sizes=[1, 2],
        strategies=[StrategySpec("3/1/4")], temperatures=[0.0, 0.7], vocabs=["reduced"], new_tokens=6, repeats=1,
        log=lambda line: None,
    )
    assert sorted((r["prompts"], r["temperature"], r["batch"], r["requests"]) for r in rows) == [
        ("a", 0.0, 1, 3), ("a", 0.0, 2, 4), ("a", 0.7, 1, 3), ("a", 0.7, 2, 4),  # batch 2: the third prompt repeated
        ("b", 0.0, 1, 1), ("b", 0.0, 2, 2), ("b", 0.7, 1, 1), ("b", 0.7, 2, 2)]
    assert all(r["same_tokens"] == r["requests"] for r in rows)
    assert all(1.0 <= r["acceptance_length"] <= 4.0 for r in rows)
    assert set(stop_paying(rows)) == {f"T={t} {s} 3/1/4 reduced" for t in ("0", "0.7") for s in "ab"}


def test_history_strategies_draft_from_earlier_samples_of_a_prompt():
    """Several samples per prompt, greedy (so they repeat each other), no drafter: the history chain
    drafts the later samples from the earlier ones, and every cell still matches plain decoding."""
    rows = run_bench(
        tiny_model(), None, {"a": prompts(2, seed=2, hi=8)}, stop_ids=[], base_cfg=CFG, batch_sizes=[1],
        strategies=[StrategySpec("h4")], temperatures=[0.0], vocabs=["reduced", "full"], new_tokens=12, repeats=1,
        samples_per_prompt=3, log=lambda line: None,
    )
    assert [(r["strategy"], r["vocab"], r["requests"]) for r in rows] == [("h4", "-", 6)]
    assert rows[0]["same_tokens"] == 6 and rows[0]["drafts_per_step"]["history"] > 1.0


def test_by_default_a_drafter_without_a_reduced_vocabulary_is_timed_over_the_full_one():
    rows = run_bench(
        tiny_model(), Drafter(TINY, nnx.Rngs(1)), {"a": prompts(1, seed=2, hi=8)}, stop_ids=[], base_cfg=CFG,
        batch_sizes=[1], strategies=[StrategySpec("3/1/4")], temperatures=[0.0], vocabs=None, new_tokens=4, repeats=1,
        log=lambda line: None,
    )
    assert [(r["vocab"], r["same_tokens"]) for r in rows] == [("full", 1)]


def test_the_configs_accept_rule_and_history_settings_reach_every_cell(monkeypatch):
    """bench-sd --set sd.accept=rejection / sd.history.*: each cell's engine runs the config's rule and history
    settings with the cell's strategy (they were SpecConfig defaults whatever the config said)."""
    from fastrl_jax.drafter import bench

    engines = []

    def recording_engine(*args, **kwargs):
        engines.append(kwargs.get("sd"))
        return bench_engine(*args, **kwargs)

    bench_engine = bench.RolloutEngine
    monkeypatch.setattr(bench, "RolloutEngine", recording_engine)
    sd = SpecConfig(accept="rejection", history=HistoryConfig(min_match=3, corpus_tokens=64))
    rows = run_bench(
        tiny_model(), Drafter(TINY, nnx.Rngs(1)), {"a": prompts(1, seed=2, hi=8)}, stop_ids=[], base_cfg=CFG,
        batch_sizes=[1], strategies=[StrategySpec("3/1/4+h4")], temperatures=[0.0], vocabs=None, new_tokens=4,
        repeats=1, sd=sd, log=lambda line: None,
    )
    cell = engines[-1]
    assert (cell.mode, cell.strategies, cell.accept, cell.history) == ("on", ("3/1/4+h4",), "rejection", sd.history)
    assert rows[0]["same_tokens"] == 1  # greedy: rejection keeps plain decoding's tokens


def test_an_empty_prompt_set_is_named_before_anything_runs():
    with pytest.raises(ValueError, match=r"no prompts to time in \['b'\]"):
        run_bench(None, None, {"a": [[1, 2]], "b": []}, stop_ids=[], base_cfg=CFG, batch_sizes=[1],
                  strategies=[StrategySpec("h4")], temperatures=[0.0], vocabs=["full"], new_tokens=4, repeats=1)


def test_machine_facts_are_measured():
    from fastrl_jax.machine import format_machine, machine_facts

    facts = machine_facts()
    assert facts["copy_gbs"] > 0 and facts["matmul_f32_gflops"] > 0 and 1 <= facts["cores_usable"] <= facts["cpu_count"]
    assert facts["backend"] == "cpu" and "GB/s" in format_machine(facts)


def test_batch_fillers_give_history_drafting_nothing_it_was_not_asked_for(monkeypatch):
    """A batch size that does not divide the set fills its last batch with copies of requests. A copy of an earlier
    batch's request (its prompt, another seed) found that request's answer in the history store and drafted it
    back (greedy: verbatim), so hD strategies 'accepted' more at such batch sizes; a copy of a request of its own
    batch, with its seed, decodes in lockstep with it and learns nothing from it."""
    from fastrl_jax.drafter import bench

    calls = []

    class RecordingEngine(bench.RolloutEngine):
        def generate(self, requests, *args, **kwargs):
            if self.history is not None:
                calls.append([(tuple(r.prompt_ids), r.seed) for r in requests])
            return super().generate(requests, *args, **kwargs)

    monkeypatch.setattr(bench, "RolloutEngine", RecordingEngine)
    rows = run_bench(
        tiny_model(), None, {"a": prompts(3, seed=2, hi=8)}, stop_ids=[], base_cfg=CFG, batch_sizes=[1, 2],
        strategies=[StrategySpec("h4")], temperatures=[0.0], vocabs=["full"], new_tokens=24, repeats=1,
        log=lambda line: None,
    )
    by_batch = {r["batch"]: r for r in rows}
    assert by_batch[2]["requests"] == 4 and by_batch[2]["same_tokens"] == 4
    first, second = [c for c in calls if len(c) == 2][:2]  # batch 2's first run: its two batches
    assert not {p for p, _ in first} & {p for p, _ in second}  # no prompt comes back in a later batch
    assert all(seed == dict(second)[p] for p, seed in second)  # a copy in its batch has its original's seed
    assert by_batch[2]["drafts_per_step"]["history"] < by_batch[1]["drafts_per_step"]["history"] + 0.05
