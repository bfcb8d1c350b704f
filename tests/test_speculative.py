"""Speculative decoding: hand-checked draft trees, and outputs identical to plain decoding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.greedy import greedy_generate
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.config import SpecConfig
from fastrl_jax.models.decoder import KVCache
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout import speculative
from fastrl_jax.rollout.engine import Request, RolloutEngine
from fastrl_jax.rollout.sampling import sample

SD_CFG = dataclasses.replace(CFG, length_buckets=(48, 96))

# Next-token probabilities of a fake drafter that only looks at the entry's token.
TABLE = np.array(
    [
        [0.0, 0.5, 0.3, 0.1, 0.05, 0.05],
        [0.1, 0.0, 0.18, 0.62, 0.05, 0.05],
        [0.7, 0.1, 0.0, 0.1, 0.05, 0.05],
        [0.2, 0.2, 0.2, 0.0, 0.3, 0.1],
        [0.2] * 5 + [0.0],
        [0.2] * 5 + [0.0],
    ]
)


class TableDrafter:
    """Full vocabulary, no head: logits come from TABLE."""

    def head_weight(self, policy):
        return None

    def token_ids(self, index):
        return index

    def __call__(self, policy, tokens, hidden, positions, cache, start, kv_len=None, mask=None, head=None):
        with np.errstate(divide="ignore"):
            logits = jnp.asarray(np.log(TABLE), jnp.float32)[tokens]
        return logits, hidden, cache


table_drafter = TableDrafter()


def test_draft_tree_golden_topk2_steps3():
    """Worked by hand: cumulative probabilities of the ten candidates are
    depth 1: t1 .5, t2 .3; depth 2: under t1: t3 .31, t2 .09; under t2: t0 .21, t1 .03;
    depth 3 (frontier t1>t3 and t2>t0): t4 .093, t0 .062; t1 .105, t2 .063.
    The best five are t1 (.5), t1>t3 (.31), t2 (.3), t2>t0 (.21), t2>t0>t1 (.105)."""
    B, P, H = 1, 4, 8
    ds = speculative.DraftState(
        cache=KVCache(k=jnp.zeros((1, B, 1, 64, 4)), v=jnp.zeros((1, B, 1, 64, 4))),
        pending_tok=jnp.zeros((B, P), jnp.int32),
        pending_h=jnp.zeros((B, P, H)),
        n_pending=jnp.ones(B, jnp.int32),
    )
    strategy = speculative.Strategy(steps=3, topk=2, verify_tokens=6)
    tree, _ = speculative.draft_tree(None, table_drafter, ds, jnp.array([0]), jnp.array([10]), strategy, 32)
    assert tree.tokens.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2, 4]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert tree.valid.all()
    mask = speculative.ancestor_mask(tree.parents)[0]
    assert mask[5].tolist() == [True, False, True, False, True, True]  # itself, t2>t0, t2, root


def test_chain_is_topk_one():
    strategy = speculative.Strategy(steps=3, topk=1, verify_tokens=4)
    ds = speculative.DraftState(
        cache=KVCache(k=jnp.zeros((1, 1, 1, 64, 4)), v=jnp.zeros((1, 1, 1, 64, 4))),
        pending_tok=jnp.zeros((1, 4), jnp.int32), pending_h=jnp.zeros((1, 4, 8)),
        n_pending=jnp.ones(1, jnp.int32),
    )
    tree, _ = speculative.draft_tree(None, table_drafter, ds, jnp.array([0]), jnp.array([10]), strategy, 32)
    assert tree.tokens.tolist() == [[0, 1, 3, 4]] and tree.parents.tolist() == [[-1, 0, 1, 2]]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def drafter(request):
    return Drafter(TINY, nnx.Rngs(5), kind=request.param)


@pytest.fixture(scope="module")
def eagle():
    return Drafter(TINY, nnx.Rngs(5))


# Every tree shape with the EAGLE drafter; EAGLE-3 (the same tree code, another draft layer) on one.
CASES = [("eagle", 3, 1, 4), ("eagle", 3, 2, 6), ("eagle", 2, 3, 7), ("eagle3", 3, 2, 6)]


@pytest.mark.parametrize("kind, steps, topk, verify", CASES)
def test_greedy_equals_plain_decoding(model, kind, steps, topk, verify):
    sd = SpecConfig(mode="on", steps=steps, topk=topk, verify_tokens=verify)
    engine = RolloutEngine(model, SD_CFG, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5), kind=kind), progress=False)
    reqs = [Request(p, max_new_tokens=5 + 4 * i) for i, p in enumerate(prompts(7, seed=1))]
    out = engine.generate(reqs)
    assert engine.stats.calls["resize"] >= 1 and engine.stats.sd_steps > 0
    for r, o in zip(reqs, out):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)


@pytest.mark.parametrize("kind, temperature", [("eagle", 0.7), ("eagle", 1.0), ("eagle3", 0.7)])
def test_coupled_sampling_equals_plain_sampling(model, kind, temperature):
    drafter = Drafter(TINY, nnx.Rngs(5), kind=kind)
    reqs = [
        Request(p, max_new_tokens=14, temperature=temperature, top_p=0.9, seed=i, stop_ids=(7,))
        for i, p in enumerate(prompts(6, seed=2))
    ]
    plain = RolloutEngine(model, SD_CFG, keep_hidden=True, progress=False,
                          feature_layers=drafter.feature_layers).generate(reqs)
    sd = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6)
    spec = RolloutEngine(model, SD_CFG, sd=sd, drafter=drafter, keep_hidden=True, progress=False).generate(reqs)
    for a, b in zip(plain, spec):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
        # The hidden states online drafter training learns from are the plain decoder's (up to float32
        # summation order: verifying 6 tokens and decoding 1 contract differently).
        scale = np.abs(a.hidden_states).max()
        np.testing.assert_allclose(b.hidden_states, a.hidden_states, atol=1e-4 * scale)


def test_unrolled_layer_loop_decodes_what_the_scan_decodes(model, eagle):
    """rollout.layer_loop='unrolled': plain and speculative engines give the scan's
    tokens, log-probs and hidden states for sampled requests, also after update_weights."""
    reqs = [Request(p, max_new_tokens=12, temperature=0.8, seed=i, stop_ids=(7,)) for i, p in enumerate(prompts(5, seed=3))]
    sd = SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6)
    scan_cfg, unrolled_cfg = (dataclasses.replace(SD_CFG, layer_loop=loop) for loop in ("scan", "unrolled"))

    def run(cfg, weights, **kw):
        engine = RolloutEngine(model, cfg, keep_hidden=True, progress=False, **kw)
        engine.update_weights(weights)
        assert isinstance(engine.state["layers"]["w_up"].get_value(), tuple) == (cfg.layer_loop == "unrolled")
        return engine.generate(reqs)

    other = tiny_model(seed=1)  # update_weights hands the engine these
    for kw in ({}, {"sd": sd, "drafter": eagle}):
        for a, b in zip(run(scan_cfg, other, **kw), run(unrolled_cfg, other, **kw)):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            np.testing.assert_array_equal(a.hidden_states, b.hidden_states)


def oracle_draft_tree(policy, drafter, ds, root_token, root_pos, strategy, kv_len, params=None):
    """A perfect drafter behind a decoy: node 1 is a wrong token, nodes 2.. the chain the policy will
    emit (its position-keyed samples; greedy rows: its argmax chain).

    Accepting the chain moves its cache entries one slot down, which the real drafter rarely
    exercises while untrained.
    """
    del drafter, params
    B, n = root_token.shape[0], strategy.verify_tokens
    cache, token, chain = ds.policy_cache, root_token, []
    for d in range(n - 2):
        pos = (root_pos + d)[:, None]
        logits, _, cache = policy(token[:, None], pos, cache, root_pos + d, kv_len=kv_len)
        token = sample(logits[:, 0], ds.params, root_pos + d + 1)[0]
        chain.append(token)
    chain = jnp.stack(chain, 1)
    decoy = (chain[:, :1] + 1) % policy.cfg.vocab_size
    tree = speculative.Tree(
        tokens=jnp.concatenate([root_token[:, None], decoy, chain], 1),
        parents=jnp.broadcast_to(jnp.array([-1, 0, 0, *range(2, n - 1)], jnp.int32), (B, n)),
        depth=jnp.broadcast_to(jnp.array([0, 1, *range(1, n - 1)], jnp.int32), (B, n)),
        valid=jnp.ones((B, n), bool),
        source=jnp.full((B, n), speculative.EAGLE, jnp.int32),
    )
    return tree, ds.cache


def test_accepted_paths_move_the_cache(model, eagle, monkeypatch):
    """With an oracle drafter nearly every draft is accepted, and outputs still equal plain decoding:
    greedy and sampled rows (per-row temperature, top-k, top-p) in one batch, budgets that end inside
    an accepted chain, several stop ids, and prompts up to the largest prompt bucket with budgets up
    to the cache's end (the largest length bucket less the tree's slots)."""
    real_step = speculative.sd_step

    def step_with_oracle(policy, drafter_, s, ds, strategy, kv_len, mode, match):
        monkeypatch.setattr(speculative, "draft_tree", lambda *a: oracle_draft_tree(*a))
        return real_step(policy, drafter_, s, _WithPolicyCache(ds, s.cache, s.params), strategy, kv_len, mode, match)

    monkeypatch.setattr(speculative, "sd_step", step_with_oracle)
    sd = SpecConfig(mode="on", steps=4, topk=1, verify_tokens=5)
    reqs = [Request(p, max_new_tokens=10 + 3 * i) for i, p in enumerate(prompts(5, seed=3))]
    rng = np.random.default_rng(4)
    room = SD_CFG.length_buckets[-1] - (sd.verify_tokens - 1)  # prompt + budget the engine admits
    for i, p in enumerate(prompts(6, seed=13, lo=8)):  # lengths 16, 16, 15, 11, 8, 8: prompt bucket edges
        budget = room - len(p) if i % 3 == 0 else 5 + 4 * i  # the cache's end; or ends mid-chain
        reqs.append(Request(p, max_new_tokens=budget, temperature=[0.0, 0.7, 1.3][i % 3], top_k=[0, 5, 0][i % 3],
                            top_p=[1.0, 0.9, 0.8][i % 3], seed=100 + i, stop_ids=tuple(rng.integers(0, 128, 3).tolist())))
    engine = RolloutEngine(model, SD_CFG, sd=sd, drafter=eagle, progress=False)
    out = engine.generate(reqs)
    plain = RolloutEngine(model, SD_CFG, progress=False).generate(reqs[5:])
    for r, o in zip(reqs[:5], out):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)
    for a, b in zip(plain, out[5:]):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    assert {o.finish_reason for o in plain} == {"stop", "length"}
    assert engine.stats.acceptance_length() > 3.0  # up to 4 per step: 3 chain drafts + bonus


def branched_oracle_tree(policy, drafter, ds, root_token, root_pos, strategy, kv_len, params=None):
    """oracle_draft_tree's chain behind a decoy at every depth (path 0 -> 2 -> 4 -> 6): its accepted entries move
    1, 2 and 3 slots, where the chain's all move 1."""
    B, n = root_token.shape[0], strategy.verify_tokens
    cache, token, chain = ds.policy_cache, root_token, []
    for d in range((n - 1) // 2):
        logits, _, cache = policy(token[:, None], (root_pos + d)[:, None], cache, root_pos + d, kv_len=kv_len)
        token = sample(logits[:, 0], ds.params, root_pos + d + 1)[0]
        chain.append(token)
    toks, parents, depth, prev = [root_token], [-1], [0], 0
    for d, c in enumerate(chain):
        toks += [(c + 1) % policy.cfg.vocab_size, c]  # the decoy first, the policy's token second
        parents += [prev, prev]
        depth += [d + 1, d + 1]
        prev = len(toks) - 1
    tree = speculative.Tree(tokens=jnp.stack(toks, 1), parents=jnp.broadcast_to(jnp.array(parents, jnp.int32), (B, n)),
                            depth=jnp.broadcast_to(jnp.array(depth, jnp.int32), (B, n)), valid=jnp.ones((B, n), bool),
                            source=jnp.full((B, n), speculative.EAGLE, jnp.int32))
    return tree, ds.cache


def test_accepted_branches_move_the_cache(model, eagle, monkeypatch):
    """Paths through a branched tree, their nodes moving by different amounts: the random drafter accepts 3-5 drafts
    in ~100 steps of test_greedy_equals_plain_decoding, and a cache reordered by the first accepted node's offset
    passed it (review)."""
    real_step = speculative.sd_step

    def step_with_oracle(policy, drafter_, s, ds, strategy, kv_len, mode, match):
        monkeypatch.setattr(speculative, "draft_tree", lambda *a: branched_oracle_tree(*a))
        return real_step(policy, drafter_, s, _WithPolicyCache(ds, s.cache, s.params), strategy, kv_len, mode, match)

    monkeypatch.setattr(speculative, "sd_step", step_with_oracle)
    reqs = [Request(p, max_new_tokens=10 + 3 * i) for i, p in enumerate(prompts(5, seed=3))]
    engine = RolloutEngine(model, SD_CFG, sd=SpecConfig(mode="on", steps=3, topk=2, verify_tokens=7), drafter=eagle,
                           progress=False)
    out = engine.generate(reqs)
    assert engine.stats.acceptance_length() > 3.0
    for r, o in zip(reqs, out):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)


class _WithPolicyCache:
    """DraftState plus the policy cache and the rows' sampling parameters, so the oracle can run the policy."""

    def __init__(self, ds, policy_cache, params):
        self._ds, self.policy_cache, self.params = ds, policy_cache, params

    def __getattr__(self, name):
        return getattr(self._ds, name)

    def replace(self, **kw):
        return self._ds.replace(**kw)


def test_a_padding_row_drafts_without_nan(model, eagle):
    """A padding row of the table (length 0; drafter_prefill leaves it one pending entry) drafts finite
    scores and keeps a finite drafter cache: its pending entry had no slot before the root to attend
    to, and an attention row that sees nothing is NaN (0 / 0), which then reached its cache."""
    B, P, H = 2, 3, TINY.hidden_size
    ds = speculative.DraftState(
        cache=eagle.empty_cache(B, 40), pending_tok=jnp.ones((B, P), jnp.int32),
        pending_h=jax.random.normal(jax.random.key(0), (B, P, H)), n_pending=jnp.ones(B, jnp.int32),
    )
    strategy = speculative.Strategy(steps=3, topk=2, verify_tokens=6)
    draft = nnx.jit(speculative.draft_tree, static_argnums=(5, 6))  # one compile: op by op it took 12 s
    tree, cache = draft(model, eagle, ds, jnp.array([0, 5]), jnp.array([0, 9]), strategy, 32)
    assert tree.valid.all()  # NaN scores made every node of the padding row invalid
    assert jnp.isfinite(cache.k).all() and jnp.isfinite(cache.v).all()


def test_sd_needs_a_drafter_and_room_for_the_tree(model, eagle):
    with pytest.raises(ValueError, match="needs a drafter"):
        RolloutEngine(model, SD_CFG, sd=SpecConfig(mode="on"), progress=False)
    narrow = Drafter(TINY, nnx.Rngs(0), draft_vocab=np.arange(3))
    with pytest.raises(ValueError, match=r"branch wider than the drafter's 3-token draft vocabulary"):
        RolloutEngine(model, SD_CFG, sd=SpecConfig(mode="on", steps=2, topk=4, verify_tokens=6), drafter=narrow,
                      progress=False)
    engine = RolloutEngine(model, SD_CFG, sd=SpecConfig(mode="on", steps=3, topk=2, verify_tokens=6),
                           drafter=eagle, progress=False)
    out = engine.generate([Request([1, 2], max_new_tokens=92)])[0]
    assert out.finish_reason == "error" and "draft-tree slots" in out.error


def test_jit_tree_shapes_are_static():
    strategy = speculative.Strategy(steps=5, topk=4, verify_tokens=8)
    assert strategy.num_candidates == 4 + 4 * 16 and strategy.scratch_slots == 16
    with pytest.raises(ValueError):
        speculative.Strategy(steps=1, topk=2, verify_tokens=5)


def test_drafter_checkpoint_round_trip(drafter, tmp_path):
    from fastrl_jax.models.drafter_io import load_drafter, save_drafter

    save_drafter(tmp_path / "d", drafter)
    back = load_drafter(tmp_path / "d", TINY)
    assert back.kind == drafter.kind and back.feature_layers == drafter.feature_layers
    for a, b in zip(jax.tree.leaves(nnx.state(drafter, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="save_drafter"):
        load_drafter(tmp_path / "missing", TINY)


@pytest.mark.slow
def test_smollm2_speculative_greedy_equals_plain(smollm2):
    """The real SmolLM2, 8 prompts x 32 tokens, token for token, with drafts accepted: a fused tree of a random EAGLE
    drafter and history drafting from the first half of each answer (a later RL step's store). With the random
    drafter alone no draft was accepted, so every token was a bonus token, whatever the accepted-path code did, and
    one row in 8 was let differ (review). EAGLE-3 on the tiny model above."""
    from fastrl_jax.data.prompts import chat_prompt_ids
    from fastrl_jax.rollout.history import HistoryStore

    model, model_cfg, tokenizer = smollm2.model, smollm2.cfg, smollm2.tokenizer
    reqs = [Request(chat_prompt_ids(tokenizer, f"Tell me a fact about the number {n}."), max_new_tokens=32)
            for n in range(8)]
    cfg = dataclasses.replace(CFG, batch_buckets=(8,), length_buckets=(128,), prompt_buckets=(64,))
    plain = RolloutEngine(model, cfg, progress=False).generate(reqs)
    store = HistoryStore(tokens_per_prompt=512, max_prompts=16)
    store.add_all((r.prompt_ids, c.tokens[:16]) for r, c in zip(reqs, plain))
    engine = RolloutEngine(model, cfg, sd=SpecConfig(mode="on", strategies=("3/2/6+h4",)),
                           drafter=Drafter(model_cfg, nnx.Rngs(0)), progress=False, history=store)
    spec = engine.generate(reqs)
    assert [a.tokens for a in plain] == [b.tokens for b in spec]
    assert engine.stats.drafts_history + engine.stats.drafts_eagle > 32


def test_coupled_drafting_guesses_the_token_the_policy_will_sample():
    """A drafter whose logits were the policy's would, perturbed with the position-keyed noise, draft
    exactly the tokens coupled sampling emits; ranked by probability alone it drafts the mode."""
    from fastrl_jax.rollout.sampling import SamplingParams

    B, V = 256, 50
    logits = 2.0 * jax.random.normal(jax.random.key(0), (B, V))
    temperature = jnp.where(jnp.arange(B) % 4 == 0, 0.0, 0.7)  # a quarter of the rows greedy
    params = SamplingParams(temperature, jnp.zeros(B, jnp.int32), jnp.ones(B), jnp.arange(B, dtype=jnp.uint32))
    positions = 10 + jnp.arange(B, dtype=jnp.int32)
    sampled, _ = sample(logits, params, positions)
    guess = jnp.argmax(speculative.coupled_logp(logits, params, positions, jnp.arange(V)), -1)
    np.testing.assert_array_equal(guess, sampled)
    mode = jnp.argmax(logits, -1)
    hot = np.asarray(temperature > 0)
    assert np.mean(np.asarray(mode == sampled)[hot]) < 0.8  # the mode misses many samples at T=0.7
    # The frontier's nodes (a middle axis) share their row's noise.
    both = speculative.coupled_logp(jnp.stack([logits, logits], 1), params, positions, jnp.arange(V))
    np.testing.assert_array_equal(jnp.argmax(both, -1), jnp.stack([sampled, sampled], 1))


def test_a_fresh_drafter_scores_a_reduced_vocabulary():
    from fastrl_jax.config import load_config
    from fastrl_jax.models.drafter_io import fresh_draft_vocab, make_drafter

    cfg = load_config(None, ["drafter_train.draft_vocab_size=32"])
    tiny = dataclasses.replace(TINY, eos_token_ids=(100,))
    drafter = make_drafter(cfg, tiny, None)
    assert drafter.draft_vocab_size == 32 and drafter.draft_vocab[...].tolist() == [*range(31), 100]
    assert fresh_draft_vocab(tiny, 0) is None and fresh_draft_vocab(tiny, TINY.vocab_size) is None
