"""Rollout engine: exactness against a plain decode, batch independence, stops, weights, errors."""

import dataclasses
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.greedy import greedy_generate
from helpers.sampling_reference import sorted_filter
from helpers.tiny import CFG, TINY, prompts, tiny_model
from scipy.stats import chisquare

from fastrl_jax.config import ConfigError, RolloutConfig, SpecConfig
from fastrl_jax.models.decoder import cast_floating
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout.engine import Request, RolloutEngine, pack_prompts, pick_refill, shared_prefix_len
from fastrl_jax.rollout.sampling import SamplingParams, filtered_logits, first_argmax, position_gumbel, sample


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    return RolloutEngine(model, CFG, progress=False)


def test_greedy_matches_plain_decode_with_compaction(engine, model):
    ps = prompts(13, seed=1)
    reqs = [Request(p, max_new_tokens=5 + 3 * i) for i, p in enumerate(ps)]
    out = engine.generate(reqs)
    assert engine.stats.calls["resize"] >= 1  # 13 requests of different lengths shrink 16 -> 4 -> 1
    for r, o in zip(reqs, out):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)
        assert o.finish_reason == "length" and len(o.logprobs) == len(o.tokens)


def sampled_requests(n, seed=0):
    return [
        Request(p, max_new_tokens=6 + (i * 7) % 20, temperature=0.8, top_p=0.9, top_k=20 * (i % 2), seed=100 + i)
        for i, p in enumerate(prompts(n, seed))
    ]


def test_output_independent_of_batch_and_compaction(engine, model):
    reqs = sampled_requests(16)
    batched = engine.generate(reqs)
    no_compaction = RolloutEngine(model, dataclasses.replace(CFG, batch_buckets=(16,)), progress=False)
    fixed = no_compaction.generate(reqs)
    for i in (0, 5, 11):
        alone = engine.generate([reqs[i]])[0]
        assert alone.tokens == batched[i].tokens == fixed[i].tokens
        np.testing.assert_allclose(alone.logprobs, batched[i].logprobs, rtol=1e-4, atol=1e-4)
    assert all(b.tokens == f.tokens for b, f in zip(batched, fixed))


def test_seeds(engine):
    base = Request(prompts(1, seed=3)[0], max_new_tokens=24, temperature=1.0, seed=7)
    a, b, c = engine.generate([base, base, dataclasses.replace(base, seed=8)])
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_stop_and_max_tokens_end_requests_exactly(engine, model):
    p = prompts(1, seed=4)[0]
    free = greedy_generate(model, p, 12)
    stop = free[4]
    first = free.index(stop)
    out = engine.generate([Request(p, max_new_tokens=12, stop_ids=(stop,)), Request(p, max_new_tokens=3)])
    assert out[0].tokens == free[: first + 1] and out[0].finish_reason == "stop"
    assert out[1].tokens == free[:3] and out[1].finish_reason == "length"


def test_new_weights_reuse_compiled_programs(model):
    engine = RolloutEngine(model, CFG, progress=False)
    reqs = [Request(p, max_new_tokens=10) for p in prompts(6, seed=5)]
    before = engine.generate(reqs)
    compiled = len(engine.pool)
    other = tiny_model(seed=1)
    engine.update_weights(other)
    after = engine.generate(reqs)
    assert len(engine.pool) == compiled
    assert [o.tokens for o in after] != [o.tokens for o in before]
    assert after[0].tokens == greedy_generate(other, reqs[0].prompt_ids, 10)


def test_bad_requests_fail_alone(engine):
    good = Request(prompts(1)[0], max_new_tokens=4)
    bad = [
        Request([], max_new_tokens=4),
        Request(list(range(17)), max_new_tokens=4),  # longer than the largest prompt bucket
        Request([1, 2], max_new_tokens=63),  # past the cache
        Request([1, 2], max_new_tokens=4, stop_ids=(TINY.vocab_size,)),
    ]
    out = engine.generate([bad[0], good, *bad[1:]])
    assert out[1].finish_reason == "length" and len(out[1].tokens) == 4
    errors = [o.error for o in (out[0], *out[2:])]
    assert all(o.finish_reason == "error" for o in (out[0], *out[2:]))
    assert "empty" in errors[0] and "prompt bucket" in errors[1] and "KV cache" in errors[2]
    assert "unknown stop token ids [128]" in errors[3]
    # Values no device array holds (an int64 prompt key, an int32 top_k) fail their own request only.
    out = engine.generate([Request([3, 2**70], max_new_tokens=4), good, Request([1, 2], max_new_tokens=4, top_k=2**31)])
    assert [o.finish_reason for o in out] == ["error", "length", "error"]
    assert "prompt token ids must be in [0, 128)" in out[0].error and "top_k < 2**31" in out[2].error
    # Fields of the wrong type are named, not truncated (2.5 tokens) and not a failure of the whole stream.
    typed = [Request([1, 2], stop_ids={7, 9}), Request([1, 2], stop_ids=5), Request([1, 2], max_new_tokens=2.5),
             Request([1, 3.7]), Request("12"), Request([1, 2], max_new_tokens=None), Request([1, 2], top_k=2.5)]
    out = engine.generate([good, *typed])
    assert out[0].finish_reason == "length" and all(o.finish_reason == "error" for o in out[1:])
    assert "stop_ids must be a list of token ids" in out[1].error and "max_new_tokens must be an int" in out[3].error


def test_length_buckets_past_the_models_context_are_warned(caplog):
    """Positions past max_position_embeddings (or a RoPE scaling's reach) ran with no word (found by review)."""
    model = tiny_model()
    model.cfg = dataclasses.replace(model.cfg, max_position_embeddings=48)
    RolloutEngine(model, CFG, progress=False)  # length buckets up to 64
    assert "reach 64 positions, past the 48 the model is made for" in caplog.text
    yarn = dataclasses.replace(model.cfg, max_position_embeddings=32768, rope=(
        ("rope_type", "yarn"), ("rope_theta", 1e6), ("factor", 4.0), ("original_max_position_embeddings", 32768)))
    assert yarn.context_length == 131072  # Qwen2.5's YaRN recipe keeps max_position_embeddings at the original


def test_a_shrunk_table_pads_with_dead_rows(model):
    """A table moved into a smaller batch bucket pads with dead rows, not copies of its last row (jnp.take
    wraps -1): with the last rows the long ones, the calls' tokens are the completions' and no more."""
    from fastrl_jax.rollout import programs

    engine = RolloutEngine(model, CFG, progress=False)  # batch buckets 1, 4, 16
    requests = [Request(p, max_new_tokens=30 if i >= 13 else 2) for i, p in enumerate(prompts(16, seed=1, lo=2, hi=6))]
    out = engine.generate(requests)
    assert engine.stats.calls["resize"] >= 1
    assert sum(c.tokens for c in engine.timeline) + len(requests) == sum(len(o.tokens) for o in out)  # + prefill's
    assert all(c.live <= 3 for c in engine.timeline if c.batch == 4)
    slots = engine._empty(16).replace(live=jnp.arange(16) >= 13, max_new=jnp.arange(16, dtype=jnp.int32))
    slots = slots.replace(params=slots.params.replace(temperature=jnp.ones(16)))  # sampled, no top-k / top-p
    small = programs.resize(slots, jnp.array([13, 14, 15, -1], jnp.int32))
    assert np.asarray(small.live).tolist() == [True, True, True, False] and int(small.max_new[3]) == 0
    # The pad's top_p is 1 (its fill was 0, which turned the top-p filter on for every row of every later step)
    assert np.asarray(small.params.top_p).tolist() == [1.0] * 4


def test_rows_done_at_their_prefill_and_a_short_queue_wait_for_no_call(model):
    """A row whose request ends at its prefill (max_new_tokens 1) is refilled before the next decode call,
    not after it; and with one request queued a call ends when one row frees, whatever refill_rows says."""
    cfg = dataclasses.replace(CFG, batch_buckets=(4,), refill_rows=1, steps_per_call=8)
    ps = prompts(13, seed=2, lo=2, hi=6)
    requests = [Request(p, max_new_tokens=40) for p in ps[:3]] + [Request(p, max_new_tokens=1) for p in ps[3:]]
    engine = RolloutEngine(model, cfg, progress=False)
    assert [i for i, _ in engine.stream(requests)] == [*range(3, 13), 0, 1, 2]  # the short ones first
    cfg = dataclasses.replace(CFG, batch_buckets=(16,), refill_rows=2, steps_per_call=8)
    requests = [Request(p, max_new_tokens=3 if i == 0 else 40) for i, p in enumerate(prompts(17, seed=3, lo=2, hi=6))]
    engine = RolloutEngine(model, cfg, progress=False)
    engine.generate(requests)
    assert engine.timeline[0].steps == 2  # row 0's end frees the row the one queued request needs


def test_rows_done_at_their_prefill_are_collected_before_the_table_shrinks(model):
    """With the queue empty, a row that ended at its prefill (max_new_tokens 1, or a stop id first) is collected
    before the next call: kept, it held the table in a larger batch bucket for a whole call (4 live rows decoded
    at batch 16; adaptive SD could run at a batch bucket outside its strategy's warmed range)."""
    engine = RolloutEngine(model, CFG, progress=False)  # batch buckets 1, 4, 16
    requests = [Request(p, max_new_tokens=1 if i == 4 else 20) for i, p in enumerate(prompts(5, seed=2))]
    out = engine.generate(requests)
    assert [len(o.tokens) for o in out] == [20, 20, 20, 20, 1]
    assert all(c.batch == 4 for c in engine.timeline)


def test_stats_describe_the_latest_stream_only(model):
    """An empty, all-error or abandoned stream does not report the one before; rows that finish at their
    prefill need no decode call; a row counts idle only from the step after its last token."""
    engine = RolloutEngine(model, CFG, progress=False)
    ps = prompts(3, seed=4)
    engine.generate([Request(p, max_new_tokens=6) for p in ps])
    assert engine.stats.tokens == 18 and engine.stats.idle_row_steps == 0  # no queue: no row waited
    engine.generate([Request([], max_new_tokens=4)])
    assert engine.stats.tokens == 0 and engine.timeline == [] and sum(engine.stats.calls.values()) == 0
    stream = engine.stream([Request(p, max_new_tokens=3 + 9 * i) for i, p in enumerate(ps)])
    next(stream)  # the shortest finishes first; the others are abandoned
    stream.close()
    assert engine.stats.tokens == 3
    out = engine.generate([Request(p, max_new_tokens=1) for p in ps])
    assert [len(o.tokens) for o in out] == [1, 1, 1] and engine.stats.calls["decode"] == 0 and engine.timeline == []


def test_request_rules_need_no_model_and_are_the_engines(engine):
    """rollout.requests' rules (what commands check before loading a model) are the engine's: on random
    requests they agree with RolloutEngine.validate, and without a vocabulary only the id check is left out."""
    from fastrl_jax.config import SpecConfig
    from fastrl_jax.rollout.requests import draft_margin, request_problem, sampling_problem

    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        n = int(rng.integers(0, 20))
        r = Request(rng.integers(-2, TINY.vocab_size + 3, n).tolist(), int(rng.integers(-2, 70)),
                    float(rng.choice([-0.5, 0.0, 0.7])), int(rng.choice([-1, 0, 5])), float(rng.choice([0.0, 0.5, 1.0, 1.5])),
                    stop_ids=rng.integers(0, TINY.vocab_size + 2, int(rng.integers(0, 6))).tolist())
        full = request_problem(r, CFG, 0, TINY.vocab_size)
        assert full == engine.validate(r)
        modelless = request_problem(r, CFG)
        assert modelless == full or (modelless is None and ("token ids" in full or "stop token" in full))
        seen.add(full.split(" ")[0] if full else None)
    assert len(seen) >= 5  # the random requests reached most rules
    assert sampling_problem(8, 0.0, 0, 1.0, CFG) is None and "leaves no room" in sampling_problem(64, 0.0, 0, 1.0, CFG)
    assert draft_margin(SpecConfig()) == 0 and draft_margin(SpecConfig(mode="on", verify_tokens=6)) == 5
    adaptive = SpecConfig(mode="adaptive", strategies=((3, 1, 4), (4, 2, 6)), group_live_batch_ranges=((4, 1, 4), (6, 5, 8)))
    assert draft_margin(adaptive) == 5


def test_hidden_states_returned(model):
    engine = RolloutEngine(model, CFG, keep_hidden=True, progress=False)
    p = prompts(1, seed=6)[0]
    out = engine.generate([Request(p, max_new_tokens=5)])[0]
    seq = p + out.tokens[:-1]
    _, hidden, _ = model(jnp.asarray([seq]), jnp.arange(len(seq))[None], _cache(len(seq)), jnp.zeros(1, jnp.int32))
    ref = np.asarray(hidden[0])
    assert out.hidden_states.shape == ref.shape
    assert np.max(np.abs(out.hidden_states - ref)) < 1e-5 * np.max(np.abs(ref))


_COMPILES: list[int] = []  # one entry per backend compile while a test listens (listeners cannot be removed)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: _COMPILES.append(1) if event == "/jax/core/compile/backend_compile_duration" else None)


def test_a_warm_engine_compiles_nothing_during_a_rollout(model):
    """Every program a rollout runs is in the warmed pool: no op-by-op work that compiles for each new table size
    or number of finished rows (an empty table made op by op, outputs gathered for the rows that finished), which
    benchmarks timed as rollout seconds and the pool did not report."""
    cfg = dataclasses.replace(CFG, batch_buckets=(4, 16), length_buckets=(32,), prompt_buckets=(16,), warm_up=True)
    engine = RolloutEngine(model, cfg, keep_hidden=True, progress=False)
    engine.generate([Request(p, max_new_tokens=3) for p in prompts(2, seed=3)])  # gathers hidden states of 2 rows
    before = len(_COMPILES)
    reqs = [Request(p, max_new_tokens=2 + i % 5) for i, p in enumerate(prompts(13, seed=4))]
    out = engine.generate(reqs)
    assert all(o.hidden_states is not None for o in out)
    # At most the hidden-state gather, once per power of two of rows (op by op: 23 compiles here)
    assert len(_COMPILES) - before <= 3


def test_speculation_keeps_hidden_states_on_the_device_unless_asked(model):
    """The table keeps them for the drafter; copying every completion's to the host (~84 MB each at 32B) is for
    a caller that trains the drafter (keep_hidden), not for every engine with a drafter."""
    sd = SpecConfig(mode="on", steps=2, topk=1, verify_tokens=3)
    reqs = [Request(p, max_new_tokens=5) for p in prompts(2, seed=6)]
    outs = [RolloutEngine(model, CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(1)), keep_hidden=keep,
                          progress=False).generate(reqs) for keep in (False, True)]
    assert [o.tokens for o in outs[0]] == [o.tokens for o in outs[1]]
    assert all(o.hidden_states is None for o in outs[0]) and all(o.hidden_states is not None for o in outs[1])


def _cache(n):
    from fastrl_jax.models.decoder import KVCache

    return KVCache.zeros(TINY, 1, n)


_CACHE_PROBE = """
import dataclasses, jax, sys
sys.path.insert(0, "tests")
from helpers.tiny import CFG, tiny_model
from fastrl_jax.rollout.engine import RolloutEngine
from fastrl_jax.rollout.pool import enable_persistent_cache
cfg = dataclasses.replace(CFG, batch_buckets=(4,), length_buckets=(32,), prompt_buckets=(8,), warm_up=True)
enable_persistent_cache(sys.argv[1])  # what the entry points do with rollout.compile_cache_dir
model = tiny_model()
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name == "/jax/compilation_cache/cache_hits"))
engine = RolloutEngine(model, cfg, progress=False)
print(len(engine.pool), sum(hits))
"""


def test_persistent_cache_serves_a_fresh_process(tmp_path):
    """A second process with the same cache directory loads every program from disk."""
    import subprocess
    import sys

    def run(env=None):
        out = subprocess.run(
            [sys.executable, "-c", _CACHE_PROBE, str(tmp_path / "asked")], capture_output=True, text=True, check=True,
            env=env,
        )
        return [int(x) for x in out.stdout.split()]

    programs, first_hits = run()
    assert programs == 3 and first_hits == 0  # decode, prefill, and the empty table's
    assert run() == [3, 3]
    # A directory set before (JAX_COMPILATION_CACHE_DIR) is kept, and small programs are still written to it.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env"))
    assert run(env) == [3, 0] and run(env) == [3, 3]


def test_pool_drops_its_least_recently_used_programs_near_the_memory_map_limit():
    """XLA CPU maps each compiled kernel's code apart; past 0.8 of vm.max_map_count the pool drops the
    least recently used half of its programs before compiling, and a dropped one compiles again."""
    from fastrl_jax.rollout.pool import ProgramPool

    held = [0]

    def build(key):
        return jax.jit(lambda x: x * key), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    x = jnp.ones(4)
    for key in (1, 2, 3, 4):
        pool.get(key)
    pool.get(1)  # now the most recently used: the order is 2, 3, 4, 1
    held[0] = 80
    assert float(pool.get(5)(x)[0]) == 5
    assert [key in pool for key in (1, 2, 3, 4, 5)] == [True, False, False, True, True]
    assert pool.dropped == 2 and "2 dropped near the memory-map limit" in pool.report()
    held[0] = 79
    assert float(pool.get(2)(x)[0]) == 2 and len(pool) == 4 and pool.dropped == 2
    assert pool.report().startswith("4 programs")  # the ones held; 2's two compiles both count in its seconds
    # Maps a drop does not free (another pool's): no drop at every compile, only once they grow again.
    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    held[0] = 0
    for key in (1, 2, 3, 4):
        pool.get(key)
    held[0] = 90
    pool.get(5)
    assert pool.dropped == 2 and len(pool) == 3
    pool.get(6)
    pool.get(7)
    assert pool.dropped == 2 and len(pool) == 5
    held[0] = 95
    pool.get(8)
    assert pool.dropped == 4 and len(pool) == 4


def test_pool_compiles_in_the_background_when_asked_if_a_program_is_ready():
    """ready() never blocks: a missing program compiles on the pool's thread; get() of a program still
    compiling waits for that compile instead of starting another."""
    from fastrl_jax.rollout.pool import ProgramPool

    built = []

    def build(key):
        built.append(key)
        return jax.jit(lambda x: x * key), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build)
    assert not pool.ready(2) and 2 not in pool
    assert float(pool.get(2)(jnp.ones(4))[0]) == 2 and built == [2]
    waited = pool.compile_seconds()  # get(2) waited for the compile under way
    assert 0 < waited and not pool.ready(3)
    while not pool.ready(3):
        time.sleep(0.01)
    assert float(pool.get(3)(jnp.ones(4))[0]) == 3 and built == [2, 3]
    assert pool.stats[2].background and pool.stats[3].background
    assert pool.compile_seconds() == waited  # nobody waited for 3
    assert pool.background_seconds == pytest.approx(pool.stats[2].compile_seconds + pool.stats[3].compile_seconds)
    assert "2 compiled in the background" in pool.report()


def test_ctrl_c_cancels_the_compiles_queued_in_the_background():
    """At exit Python runs a compile thread's whole queue before joining it; after Ctrl-C only the compile
    already running finishes (cli.main calls cancel_background_compiles)."""
    from fastrl_jax.rollout.pool import ProgramPool, cancel_background_compiles

    built, started, release = [], threading.Event(), threading.Event()

    def build(key):
        built.append(key)
        started.set()
        release.wait(30)
        return jax.jit(lambda x: x * key), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build)
    assert not any([pool.ready(1), pool.ready(2), pool.ready(3)])
    started.wait(30)
    thread = pool._thread
    cancel_background_compiles()
    release.set()
    thread.shutdown(wait=True)
    assert built == [1] and pool.ready(1)
    assert not pool.ready(2) and pool.get(2)(jnp.ones(4))[0] == 2  # the process goes on (a notebook): compiled again
    assert built == [1, 2]


def test_a_failed_background_compile_is_raised_for_its_own_program_and_ready_never_waits():
    """A drop near the memory-map limit collects the pending compiles first: one that failed is raised
    to the caller that asks for its program, not to the one whose compile set the drop off; ready()
    puts a drop off rather than wait for a compile under way."""
    from fastrl_jax.rollout.pool import ProgramPool

    held, release = [0], threading.Event()

    def build(key):
        if key == "bad":
            raise ValueError("cannot build bad")
        if key == "slow":
            release.wait(30)
        return jax.jit(lambda x: x * 2), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    pool.get(1), pool.get(2)
    assert not pool.ready("bad")
    held[0] = 80
    assert float(pool.get(3)(jnp.ones(4))[0]) == 2 and pool.dropped == 1  # waited for "bad", dropped 1
    with pytest.raises(ValueError, match="cannot build bad"):
        pool.get("bad")
    held[0] = 95
    assert not pool.ready("slow") and pool.dropped == 2
    held[0] = 100
    assert not pool.ready(4) and not release.is_set() and pool.dropped == 2  # a drop is due, but "slow" is compiling
    release.set()
    assert float(pool.get(4)(jnp.ones(4))[0]) == 2 and float(pool.get(5)(jnp.ones(4))[0]) == 2 and pool.dropped > 2


def test_near_the_memory_map_limit_the_pool_drops_again_and_queues_nothing_it_cannot_map():
    """Found by review: after a drop that freed little (another pool's maps) above 95% of the limit, the next
    drop's threshold lay past the limit itself, so the pool never dropped again; the mark of the last drop only
    rose, though the process freed maps since; and ready() kept queuing compiles while a drop was due (each one a
    compile the process had no maps for: a failed background compile turns its arm off)."""
    from fastrl_jax.rollout.pool import ProgramPool

    held = [0]

    def build(key):
        return jax.jit(lambda x: x + key), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    for key in range(4):
        pool.get(key)
    held[0] = 96  # the drop frees nothing: the maps are another pool's
    pool.get(4)
    assert pool.dropped == 2
    held[0] = 100
    pool.get(5)
    assert pool.dropped > 2
    dropped, held[0] = pool.dropped, 50  # the other pool let its programs go
    pool.get(6)
    held[0] = 97
    pool.get(7)
    assert pool.dropped > dropped
    release = threading.Event()
    slow = ProgramPool(lambda key: (release.wait(30), build(key))[1], memory_maps=lambda: (held[0], 100))
    slow.get(0), slow.get(1)
    held[0] = 0
    assert not slow.ready(10)  # compiling
    held[0] = 99
    assert not any(slow.ready(k) for k in range(11, 16)) and list(slow._pending) == [10]  # a drop is due: none queued
    release.set()


def test_a_finished_background_compile_no_one_asks_for_again_does_not_hold_off_the_drop():
    """ready() near the limit put the drop off while a background compile was pending, and only an ask for that key
    collects it: the engine's speculative keys move on (compaction, a longer length bucket), so a finished compile
    no one asked for again held off every later one, and speculation decoded plainly for the rest of the rollout
    (review)."""
    from fastrl_jax.rollout.pool import ProgramPool

    held = [0]

    def build(key):
        return jax.jit(lambda x: x * key), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    pool.get(1), pool.get(2)
    assert not pool.ready(3)  # compiles in the background, and finishes
    pool._pending[3].result(30)
    held[0] = 96
    assert not pool.ready(4)  # the drop goes ahead (3 collected, then dropped with the older half) and 4 compiles
    assert pool.dropped > 0 and 4 in pool._pending


def test_a_compile_near_the_limit_waits_for_the_running_background_compile_only():
    """A drop collected every pending compile first: get() stalled for the whole background queue (found by review:
    5.3 s for four queued 1-second compiles); the queued ones are cancelled and asked for again later."""
    from fastrl_jax.rollout.pool import ProgramPool

    held, started = [0], threading.Event()

    def build(key):
        if isinstance(key, str):
            started.set()
            time.sleep(1.0)
        return jax.jit(lambda x: x * 2), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    pool.get(0), pool.get(1)
    assert not any(pool.ready(k) for k in ("a", "b", "c", "d"))
    started.wait(30)
    held[0] = 99
    t0 = time.perf_counter()
    assert float(pool.get(2)(jnp.ones(4))[0]) == 2
    assert time.perf_counter() - t0 < 2.5 and pool.dropped == 1
    assert "a" in pool and not any(k in pool for k in "bcd")  # queued, cancelled: compiled when asked for again


def test_a_program_found_ready_is_not_the_next_one_dropped():
    """The engine asks ready() for every program of a speculative call (the step's and the drafter prefill's)
    before it runs them: one found ready counts as used, so starting the other's compile near the memory-map
    limit does not drop it (the call would then wait for its recompile, decoding plainly)."""
    from fastrl_jax.rollout.pool import ProgramPool

    held = [0]

    def build(key):
        return jax.jit(lambda x: x * key), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    for key in (1, 2, 3, 4):
        pool.get(key)
    held[0] = 90
    assert pool.ready(1) and not pool.ready(5)
    assert pool.dropped == 2 and 1 in pool and [k in pool for k in (2, 3, 4)] == [False, False, True]


def test_a_failed_background_compile_is_raised_once_then_compiled_again():
    """The caller that next asks gets a background compile's error, as with a compile that failed in front
    of it; a later ask compiles again (a transient failure, e.g. out of memory, does not stick to the key)."""
    from fastrl_jax.rollout.pool import ProgramPool

    fails = [1]

    def build(key):
        if fails[0]:
            fails[0] -= 1
            raise MemoryError("LLVM compilation error: Cannot allocate memory")
        return jax.jit(lambda x: x * key), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    for ask in ("get", "ready"):
        pool, fails[0] = ProgramPool(build), 1
        assert not pool.ready(3)
        pool._pending[3].exception(30)  # the compile thread is done with it
        with pytest.raises(MemoryError):
            pool.get(3) if ask == "get" else pool.ready(3)
        assert float(pool.get(3)(jnp.ones(4))[0]) == 3, ask


# ---- sampling (pure functions) ----------------------------------------------------------------


def _params(b, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    return SamplingParams(
        temperature=jnp.full(b, temperature, jnp.float32), top_k=jnp.full(b, top_k, jnp.int32),
        top_p=jnp.full(b, top_p, jnp.float32), seed=jnp.full(b, seed, jnp.uint32),
    )


def test_top_k_top_p_keep_the_right_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda **kw: np.isfinite(np.asarray(filtered_logits(logits, _params(1, **kw))))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.5 < 0.7 <= 0.7
    assert kept(top_p=0.71) == [True, True, True, False, False]
    assert kept(top_p=0.1) == [True, False, False, False, False]


def test_top_k_top_p_match_a_sort_on_random_rows():
    rng = np.random.default_rng(0)
    B, V = 64, 300
    logits = rng.normal(0, 2, (B, V)).astype(np.float32)
    logits[::4] = np.round(logits[::4])  # rows with many tied values
    top_k = rng.choice([0, 1, 5, 40, V], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1], B).astype(np.float32)
    # HF's order: temperature, then top-k, then top-p (a nucleus of the unscaled logits passed at T=1 alone: review)
    temperature = rng.choice([0.3, 0.7, 1.0, 1.6], B).astype(np.float32)
    params = SamplingParams(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), jnp.zeros(B, jnp.uint32))
    kept = np.isfinite(np.asarray(filtered_logits(jnp.asarray(logits), params)))
    for b in range(B):
        np.testing.assert_array_equal(kept[b], sorted_filter(logits[b] / temperature[b], top_k[b], top_p[b]),
                                      err_msg=f"row {b}")


def test_sampling_is_position_keyed_and_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    logits = jnp.log(jnp.asarray(probs))[None].repeat(4000, 0)
    tokens, logprobs = sample(logits, _params(4000, seed=3), jnp.arange(4000))
    freq = np.bincount(np.asarray(tokens), minlength=3) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)
    np.testing.assert_allclose(logprobs, np.log(probs)[np.asarray(tokens)], rtol=1e-5)
    # Same (seed, position) in another row and batch gives the same token.
    again, _ = sample(logits[:3], _params(3, seed=3), jnp.arange(5, 8))
    assert np.asarray(again).tolist() == np.asarray(tokens)[5:8].tolist()


def test_position_noise_samples_the_softmax_independently_across_positions_and_seeds():
    """Gumbel-max over the position-keyed noise of 200 seeds x 100 positions: token frequencies follow the
    softmax, and tokens at neighbouring positions of a seed, or at one position of neighbouring
    seeds, are independent (chi-square on the marginal and on the pair tables)."""
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    seeds, positions = np.meshgrid(np.arange(200, dtype=np.uint32), np.arange(100), indexing="ij")
    noise = position_gumbel(jnp.asarray(seeds), jnp.asarray(positions), len(probs))
    tokens = np.asarray(first_argmax(jnp.log(probs) + noise))  # [seed, position]
    assert chisquare(np.bincount(tokens.ravel(), minlength=6), probs * tokens.size).pvalue > 1e-3
    pair_probs = np.outer(probs, probs).ravel()
    for a, b in [(tokens[:, :-1], tokens[:, 1:]), (tokens[:-1], tokens[1:])]:
        pairs = np.bincount((a * 6 + b).ravel(), minlength=36)
        assert chisquare(pairs, pair_probs * a.size).pvalue > 1e-3


def test_position_noise_is_finite_and_keeps_the_filters():
    """The noise's top draw used to round to u = 1.0, noise +inf: seed 0 at position 156 of a 32000-token vocabulary
    drew it, and that token won the argmax even under top_k=1, where it is filtered out (-inf + inf = NaN)."""
    noise = position_gumbel(jnp.uint32(0), jnp.int32(156), 32000)
    assert bool(jnp.isfinite(noise).all())
    logits = jnp.full((1, 32000), -100.0).at[0, 7].set(20.0)
    for top_k, top_p in ((0, 1.0), (1, 1.0), (0, 0.5)):
        tokens, _ = sample(logits, _params(1, seed=0, top_k=top_k, top_p=top_p), jnp.array([156]))
        assert tokens.tolist() == [7], (top_k, top_p)


def test_top_p_one_filters_nothing_whatever_the_batch():
    """top_p 1.0 is off, also in a batch where another row filters: float32's running mass reaches 1.0 before a
    tail of ~1e-8 does, which would drop that tail for this row only when a batch-mate turned filtering on."""
    logits = jnp.array([[0.0, -17.45, -20.0], [0.0, -17.45, -20.0]])
    params = SamplingParams(jnp.ones(2), jnp.array([0, 1], jnp.int32), jnp.ones(2), jnp.zeros(2, jnp.uint32))
    assert np.isfinite(np.asarray(filtered_logits(logits, params)))[0].all()


def test_signed_zeros_tie_in_top_k():
    params = SamplingParams(jnp.ones(1), jnp.array([1], jnp.int32), jnp.ones(1), jnp.zeros(1, jnp.uint32))
    kept = np.isfinite(np.asarray(filtered_logits(jnp.array([[-0.0, 0.0, -1.0, -2.0]]), params)))[0]
    assert kept.tolist() == [True, True, False, False]  # as HF's TopKLogitsWarper keeps both


@pytest.mark.parametrize("shape", [(256, 40), (8, 3, 1000), (64, 512)])
def test_first_argmax_is_argmax(shape):
    x = jax.random.randint(jax.random.key(0), shape, 0, 4).astype(jnp.float32)  # many tied maxima
    x = x.at[0, ..., 7].set(jnp.nan)  # NaN counts as the maximum, as in jnp.argmax
    for chunk in (16, 128):
        np.testing.assert_array_equal(first_argmax(x, chunk), jnp.argmax(x, axis=-1))


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    """8 prompts x 40 greedy tokens equal HF's, except at a near-tie of the top two logits. HF reads each
    prompt and our tokens in one forward pass: its greedy decoding gives our tokens exactly when its argmax
    after every prefix of them is the next one (and at the first that is not, both had the same prefix)."""
    import torch

    from fastrl_jax.data.prompts import chat_prompt_ids
    from fastrl_jax.models.torch_reference import torch_model

    path, model, tokenizer = smollm2.path, smollm2.model, smollm2.tokenizer
    questions = [f"What is {a} plus {b}? Explain step by step." for a, b in zip(range(11, 19), range(40, 48))]
    prompt_ids = [chat_prompt_ids(tokenizer, q) for q in questions]
    cfg = RolloutConfig(batch_buckets=(8,), length_buckets=(128,), prompt_buckets=(64,), steps_per_call=32,
                        compile_cache_dir="", warm_up=False)
    eos = tokenizer.eos_token_id
    ours = RolloutEngine(model, cfg, progress=False).generate(
        [Request(p, max_new_tokens=40, stop_ids=(eos,)) for p in prompt_ids]
    )
    hf = torch_model(path)
    mismatches = []
    for p, o in zip(prompt_ids, ours):
        assert o.finish_reason == "stop" or len(o.tokens) == 40, o.finish_reason
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.tokens])).logits[0, len(p) - 1: len(p) - 1 + len(o.tokens)]
        theirs = logits.argmax(-1).tolist()
        if theirs != o.tokens:
            t = next(i for i, (a, b) in enumerate(zip(theirs, o.tokens)) if a != b)
            top2 = torch.topk(logits[t], 2).values
            mismatches.append((t, float(top2[0] - top2[1])))
    print("mismatches (position, top-2 logit gap):", mismatches)
    assert len(mismatches) <= 1
    assert all(gap < 0.05 for _, gap in mismatches)


@pytest.mark.parametrize("with_decode", [False, True], ids=["prefill", "prefill_with_decode"])
def test_stream_refills_rows_and_matches_one_request_at_a_time(model, with_decode):
    """30 requests of mixed lengths through a 16-row table, refilled 2 rows at a time (by prefills, or
    riding on decode steps): every output is what the request gives alone and what a first-come,
    first-in stream gives, errors come first, and finished rows wait a few steps at most."""
    cfg = dataclasses.replace(CFG, batch_buckets=(1, 2, 16), prompt_buckets=(8, 16, 32), refill_rows=2, steps_per_call=6,
                              prefill_with_decode=with_decode)
    engine = RolloutEngine(model, cfg, progress=False)
    reqs = [Request(p, max_new_tokens=3 + (7 * i) % 19, temperature=0.9 * (i % 2), top_k=10 * (i % 3), seed=i)
            for i, p in enumerate(prompts(30, seed=9))]
    reqs[5] = Request([], max_new_tokens=4)  # cannot run
    order = [i for i, _ in engine.stream(reqs)]
    assert order[0] == 5 and sorted(order) == list(range(30))
    streamed = engine.generate(reqs)
    assert streamed[5].finish_reason == "error"
    prefills = engine.stats.calls["prefill"] + engine.stats.calls["decode_admit"]
    assert prefills < 29 / 1.5  # refills came in batches, not one per finished row
    assert (engine.stats.calls["decode_admit"] > 0) == with_decode
    # Decode calls emit every token but each request's first (its prefill's) and those of the decode steps refills rode on.
    rode = engine.stats.tokens - 29 - sum(e.tokens for e in engine.timeline)
    assert (rode > 0) == with_decode and rode >= 0
    assert 0 < engine.stats.idle_row_steps < 29 * cfg.steps_per_call
    alone = RolloutEngine(model, dataclasses.replace(CFG, batch_buckets=(1,)), progress=False)
    for i in (0, 1, 2, 11, 29):
        single = alone.generate([reqs[i]])[0]
        assert single.tokens == streamed[i].tokens and len(single.tokens) == reqs[i].max_new_tokens
        np.testing.assert_allclose(single.logprobs, streamed[i].logprobs, rtol=1e-4, atol=1e-4)
    # The table stays full while requests wait (less the rows that finished in a decode step a refill rode on).
    print("live rows of the first calls:", [c.live for c in engine.timeline[:3]])
    assert all(c.live >= 16 - cfg.refill_rows * with_decode for c in engine.timeline[:3])
    # Refills picked to fill their packs admit requests out of queue order, and change no output.
    fifo = RolloutEngine(model, dataclasses.replace(cfg, refill_lookahead=0), progress=False)
    assert [i for i, _ in fifo.stream(reqs)] != order
    assert [c.tokens for c in fifo.generate(reqs)] == [c.tokens for c in streamed]
    assert engine.stats.prompt_tokens == fifo.stats.prompt_tokens == sum(len(r.prompt_ids) for r in reqs)


def test_per_row_windows_change_no_output(model):
    """A few long rows would hold every row of the table in the long window: with per-row windows the
    rest read a short one, and every completion stays the same, greedy and sampled."""
    cfg = dataclasses.replace(CFG, batch_buckets=(16,), length_buckets=(16, 32, 48, 64), steps_per_call=4)
    reqs = [Request(p, max_new_tokens=40 if i % 8 == 0 else 3 + i % 5, temperature=0.9 * (i % 2), top_k=5 * (i % 3),
                    seed=i) for i, p in enumerate(prompts(24, seed=11, lo=2, hi=8))]
    plain = RolloutEngine(model, cfg, progress=False).generate(reqs)
    engine = RolloutEngine(model, dataclasses.replace(cfg, window_rows=(1, 2, 4)), progress=False)
    windowed = engine.generate(reqs)
    for a, b in zip(plain, windowed):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    split = [k for k in engine.pool.stats if k[0] == "decode" and len(k) == 5]
    assert split and all(k[3] <= 4 and k[4] < k[2] for k in split), list(engine.pool.stats)
    with pytest.raises(ConfigError, match="window_rows must be an increasing list"):
        dataclasses.replace(cfg, window_rows=(2, 1))


def test_pack_prompts_fills_packs_longest_first_and_keeps_repeats_together():
    lengths = [5, 9, 3, 9, 7, 2]
    prompts_ = [[k] * n for k, n in enumerate(lengths)]
    prompts_[3] = prompts_[1]  # a repeated prompt (a GRPO group's samples) costs its tokens once
    packs = pack_prompts(prompts_, capacity=12)
    assert sorted(i for p in packs for i in p) == list(range(6))
    assert any({1, 3} <= set(p) for p in packs)
    for p in packs:
        assert sum(lengths[i] for i in {tuple(prompts_[i]): i for i in p}.values()) <= 12
    assert packs == [[1, 3, 2], [4, 0], [5]]  # first fit, longest first: 9+3, 7+5, 2


def test_pick_refill_pads_its_pack_less_and_always_takes_the_head():
    buckets = (8, 16, 32)

    def of(*lengths):
        return [[k] * n for k, n in enumerate(lengths)]

    def padding(prompts_, take):
        n = sum(map(len, {tuple(prompts_[i]) for i in take}))
        return min(b for b in buckets if b >= n) - n

    assert pick_refill(of(5, 6, 4, 3, 2), 2, buckets) == [0, 3]  # 5 + 3 fills 8; first come: 5 + 6 pads 11 to 16
    assert pick_refill(of(5, 3, 4, 3), 2, buckets) == [0, 1]  # already no padding: first come, first in
    assert pick_refill(of(2, 9, 9, 9, 6), 2, buckets) == [0, 4]  # 2 + 6 fills 8; 9 + 6 pads less too, but the head goes
    assert pick_refill(of(7, 9, 8, 12), 3, buckets) == [0, 1, 3]  # best swap: 7 + 9 + 12 pads 4, 7 + 12 + 8 pads 5
    repeated = of(5, 6, 4) + [[0] * 5]
    assert pick_refill(repeated, 2, buckets) == [0, 3]  # a repeat of the head adds no tokens: 5 pads to 8 only
    assert pick_refill(of(20, 20, 3, 1), 2, buckets) == [0, 1]  # more than one pack: first come, first in
    assert pick_refill(of(5, 6), 2, buckets) == [0, 1] and pick_refill(of(5), 1, buckets) == [0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows = int(rng.integers(1, 5))
        prompts_ = of(*rng.integers(1, 9, rows + int(rng.integers(0, 6))))
        take = pick_refill(prompts_, rows, buckets)
        assert take[0] == 0 and len(take) == rows == len(set(take))
        assert padding(prompts_, take) <= padding(prompts_, range(rows))


def test_packed_prefill_of_repeated_prompts_matches_one_request_at_a_time(model):
    """Three prompts x 4 samples (a GRPO step): each distinct prompt is prefilled once, in packs of up
    to 32 tokens, and every sample equals what it gives alone, greedy and sampled."""
    cfg = dataclasses.replace(CFG, batch_buckets=(1, 16), prompt_buckets=(8, 16, 32))
    group = prompts(3, seed=12, lo=9, hi=15)
    reqs = [Request(p, max_new_tokens=4 + i % 3, temperature=0.9 * (i % 2), top_k=4 * (i % 3), seed=i)
            for i, p in enumerate(group * 4)]
    engine = RolloutEngine(model, cfg, progress=False)
    streamed = engine.generate(reqs)
    packed = sorted(k[3] for k in engine.pool.stats if k[0] == "prefill")
    assert packed == [16, 32] and engine.stats.calls["prefill"] == 2  # 9..15 tokens each: 2 + 1 per pack
    alone = RolloutEngine(model, dataclasses.replace(cfg, batch_buckets=(1,)), progress=False)
    for r, s in zip(reqs, streamed):
        single = alone.generate([r])[0]
        assert single.tokens == s.tokens
        np.testing.assert_allclose(single.logprobs, s.logprobs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_shared_prompt_prefix_is_prefilled_once_and_changes_no_output(model, kind):
    """Prompts behind a common 10-token prefix (some repeated, as in a GRPO group): the prefix is
    prefilled once (8 tokens, multiples of 4), and tokens and hidden states equal those of
    prefilling whole prompts, greedy and sampled; speculation reads the prefix's hidden states."""
    head = prompts(1, seed=3, lo=10, hi=10)[0]
    reqs = [Request(head + p, max_new_tokens=6 + i % 5, temperature=0.8 * (i % 2), seed=i)
            for i, p in enumerate(prompts(6, seed=4, lo=1, hi=6) * 2)]
    cfg = dataclasses.replace(CFG, prompt_buckets=(8, 16, 24), batch_buckets=(4,), refill_rows=1)
    drafter = Drafter(TINY, nnx.Rngs(5), kind=kind)  # its kind decides the features kept (EAGLE-3: 3 layers)
    whole = RolloutEngine(model, dataclasses.replace(cfg, shared_prefix_min=0), keep_hidden=True, progress=False,
                          feature_layers=drafter.feature_layers)
    shared = RolloutEngine(model, dataclasses.replace(cfg, shared_prefix_min=4), keep_hidden=True, progress=False,
                           feature_layers=drafter.feature_layers)
    assert shared.shared_prefix_len(reqs) == 8 and whole.shared_prefix_len(reqs) == 0
    a, b = whole.generate(reqs), shared.generate(reqs)
    assert shared.stats.calls["prefix"] == 1 and whole.stats.calls["prefix"] == 0
    for r, x, y in zip(reqs, a, b):
        assert x.tokens == y.tokens and len(x.tokens) == r.max_new_tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-4, atol=1e-4)
        # The tiny model's hidden states reach the hundreds; float32 rounding from the two programs' summation
        # orders scales with that (measured 7e-3 on an AVX-512 machine), not with each entry.
        scale = np.abs(y.hidden_states).max()
        np.testing.assert_allclose(x.hidden_states, y.hidden_states, rtol=1e-4, atol=1e-5 * scale)
    sd = RolloutEngine(model, dataclasses.replace(cfg, shared_prefix_min=4), sd=SpecConfig(mode="on", strategies=("3/2/6",)),
                       drafter=drafter, progress=False)
    for r, y in zip(reqs[::2], sd.generate(reqs[::2])):
        assert y.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)
    assert sd.stats.calls["prefix"] == 1 and sd.stats.sd_steps > 0


def test_warm_up_compiles_the_prefills_that_skip_the_prompts_shared_prefix(model):
    """Every stream of prompts behind a common prefix (a chat template's system turn) prefills past it: an engine
    told the prefix (the trainer's and generate's) warms those programs up, and its rollout compiles nothing; the
    no-prefix prefills it warmed before would all have gone unused, and these compiled on the rollout's path."""
    head = prompts(1, seed=3, lo=10, hi=10)[0]
    reqs = [Request(head + p, max_new_tokens=6, temperature=0.8 * (i % 2), seed=i)
            for i, p in enumerate(prompts(6, seed=4, lo=1, hi=6))]
    cfg = dataclasses.replace(CFG, prompt_buckets=(8, 16), batch_buckets=(4,), length_buckets=(32,), refill_rows=1,
                              shared_prefix_min=4, warm_up=True)
    shared = shared_prefix_len(cfg, [r.prompt_ids for r in reqs])
    assert shared == 8
    engine = RolloutEngine(model, cfg, progress=False, shared_prefix=shared)
    warmed = set(engine.pool.stats)
    engine.generate(reqs)
    assert set(engine.pool.stats) == warmed and engine.stats.calls["prefix"] == 1 and engine.stats.calls["prefill"]
    assert all(k[-1] == shared for k in warmed if k[0] in ("prefill", "decode_admit", "prefix"))
    # A stream of one prompt's samples (one GRPO group on a replica) shares all but its last tokens: it skips no
    # more than the engine was told, or it compiled prefix and prefill programs in the rollout (review); the same
    # tokens, since a prefix's length does not change them
    group = [dataclasses.replace(reqs[5], seed=s) for s in range(4)]
    assert shared_prefix_len(cfg, [r.prompt_ids for r in group]) > shared
    tokens = [c.tokens for c in engine.generate(group)]
    assert set(engine.pool.stats) == warmed
    assert tokens == [c.tokens for c in RolloutEngine(model, dataclasses.replace(cfg, warm_up=False),
                                                      progress=False).generate(group)]


def test_a_background_compile_during_update_weights_builds_against_the_weights(model, monkeypatch):
    """update_weights of an unrolled engine holds no state while it cuts the new per-layer copies; a compile on the
    pool's thread (sd.compile_in_background) built its example arguments from that state, failed, and the next
    rollout raised it (found by review). Simulated deterministically: the compile runs inside that window."""
    import fastrl_jax.rollout.engine as engine_mod

    engine = RolloutEngine(model, dataclasses.replace(CFG, layer_loop="unrolled"), progress=False)
    real, seen = engine_mod.unstack_layers, []

    def unstack(state):
        engine.pool._compiled(("decode", 1, 32))  # what the compile thread runs for a pending key
        seen.append("compiled")
        return real(state)

    monkeypatch.setattr(engine_mod, "unstack_layers", unstack)
    engine.update_weights(tiny_model(seed=1))
    assert seen == ["compiled"]


def test_an_unrolled_engine_whose_update_weights_failed_says_so_and_takes_the_next(model, monkeypatch):
    """update_weights of an unrolled engine drops the old per-layer copies before it cuts the new ones; should that fail
    (out of memory, the case the early drop is for; Ctrl-C), a rollout failed deep inside a program call with a
    pytree mismatch (review). It says what happened, and the next update_weights mends it."""
    import fastrl_jax.rollout.engine as engine_mod

    engine = RolloutEngine(model, dataclasses.replace(CFG, layer_loop="unrolled"), progress=False)
    reqs = [Request(p, max_new_tokens=4) for p in prompts(2)]
    real = engine_mod.unstack_layers

    def out_of_memory(state):
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(engine_mod, "unstack_layers", out_of_memory)
    with pytest.raises(MemoryError):
        engine.update_weights(tiny_model(seed=1))
    with pytest.raises(RuntimeError, match="holds no policy weights: its last update_weights failed .* call update_weights"):
        engine.generate(reqs)
    monkeypatch.setattr(engine_mod, "unstack_layers", real)
    with pytest.raises(ValueError, match="cast them first"):  # the dtype check still holds without weights
        engine.update_weights(cast_floating(tiny_model(seed=1), jnp.bfloat16))
    engine.update_weights(tiny_model(seed=1))
    assert [c.tokens for c in engine.generate(reqs)] == [greedy_generate(tiny_model(seed=1), r.prompt_ids, 4) for r in reqs]


def test_a_background_compile_failure_a_drop_collects_is_said(caplog):
    """A drop near the memory-map limit collects pending compiles and keeps a failure for the caller that asks for
    that program; an engine whose live batch moved on never asks again, so it is logged then (found by review)."""
    from fastrl_jax.rollout.pool import ProgramPool

    held = [0]

    def build(key):
        if key == "bad":
            raise ValueError("cannot build bad")
        return jax.jit(lambda x: x * 2), (jax.ShapeDtypeStruct((4,), jnp.float32),)

    pool = ProgramPool(build, memory_maps=lambda: (held[0], 100))
    pool.get(1), pool.get(2)
    assert not pool.ready("bad")
    held[0] = 80
    with caplog.at_level("WARNING"):
        pool.get(3)
    assert "a background compile of bad failed (ValueError: cannot build bad)" in caplog.text
