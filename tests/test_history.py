"""Drafting from history: the device matcher, the host store, trie merging, and lossless engines."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.greedy import greedy_generate
from helpers.tiny import CFG, TINY, prompts, tiny_model

from fastrl_jax.checkpoint import write_arrays
from fastrl_jax.config import ConfigError, SpecConfig, load_config
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout import speculative
from fastrl_jax.rollout.engine import Request, RolloutEngine
from fastrl_jax.rollout.history import (
    SEPARATOR,
    GroupCorpus,
    HistoryStore,
    MatchSettings,
    build_corpus,
    prompt_key,
    propose,
)

S1 = 24
EMPTY = [SEPARATOR] * 16


def table(rows, groups, corpora=None, settings=MatchSettings(match_tokens=4, min_match=2, spec_factor=2.0), draft=6):
    """propose() on rows given as token lists (each row's last token is its current one)."""
    history = np.zeros((len(rows), S1), np.int32)
    for b, r in enumerate(rows):
        history[b, : len(r)] = r
    length = np.array([len(r) - 1 for r in rows], np.int32)
    corpus = np.array(corpora or [EMPTY] * len(rows), np.int32)
    tokens, n = propose(jnp.asarray(history), jnp.asarray(length), jnp.asarray(groups, jnp.int32),
                        jnp.asarray(corpus), draft, settings)
    return [t[: int(k)] for t, k in zip(np.asarray(tokens).tolist(), np.asarray(n))], np.asarray(tokens)


def test_a_row_drafts_what_followed_its_suffix_in_a_siblings_text():
    sibling = [5, 6, 7, 8, 9, 10, 11, 12]
    row = [1, 2, 7, 8]  # ends with "7 8": the sibling continued with 9 10 11 12
    drafts, raw = table([row, sibling], groups=[0, 0])
    assert drafts[0] == [9, 10, 11, 12]  # match of 2 tokens x spec_factor 2 = 4 drafts
    assert (raw[0, 4:] == -1).all()  # past the draft: -1
    # Other groups are invisible; a row never drafts its own current suffix.
    drafts, _ = table([row, sibling], groups=[0, 1])
    assert drafts[0] == []


def test_the_longest_match_wins_and_the_draft_grows_with_it():
    row = [3, 4, 5, 6]
    short = [9, 6, 20, 21, 22, 23, 24, 25, 26, 27]  # "6" then 20...: a 1-token match
    long = [4, 5, 6, 30, 31, 32, 33, 34, 35, 36]  # "4 5 6" then 30...: a 3-token match
    drafts, _ = table([row, short, long], groups=[0, 0, 0])
    assert drafts[0] == [30, 31, 32, 33, 34, 35]  # 3 x 2 = 6 drafts, all the chain holds
    drafts, _ = table([row, short], groups=[0, 0])
    assert drafts[0] == []  # a single-token match is below min_match


def test_among_equal_matches_the_latest_that_gives_the_wanted_draft_wins_and_drafts_stop_at_what_is_known():
    row = [7, 8]
    older = [7, 8, 1, 1, 1, 1, 7, 8, 2, 2, 2, 2, 7, 8, 3]  # three matches of "7 8", the last followed by one token
    drafts, _ = table([row, older], groups=[0, 0])
    assert drafts[0] == [2, 2, 2, 2]  # 2 x 2 wanted: the latest match that 4 tokens follow
    drafts, _ = table([row, [7, 8, 2, 3]], groups=[0, 0])
    assert drafts[0] == [2, 3]  # only what the sibling has written so far (its text does not end as the match does)


# A row caught in a loop (degenerate repetition until max_new_tokens: the RL long tail). Its latest match sits just
# before its end, followed by one period of the loop; that period repeats past the end (found by review: a row drafted
# one period per step, [5] of 6 wanted in a period-1 loop, whatever a sibling wrote).

def test_a_looping_row_drafts_a_full_chain():
    assert table([[3] + [5] * 20], [0])[0][0] == [5] * 6
    assert table([[3] + [5, 6] * 10], [0])[0][0] == [5, 6] * 3
    assert table([[3] + [5, 6, 7] * 7], [0])[0][0] == [5, 6, 7] * 2
    assert table([[3, 5, 6, 7, 5, 6, 7]], [0])[0][0] == [5, 6, 7] * 2  # two periods in: a 3-token match, 6 drafts


def test_a_sibling_in_the_same_loop_and_an_earlier_completion_give_a_full_chain():
    # The sibling has written 20 tokens of the loop: its end matches too, and its earlier positions have 6 tokens after.
    drafts, _ = table([[3] + [5] * 4, [3] + [5] * 20], [0, 0])
    assert drafts == [[5] * 6, [5] * 6]
    # An earlier completion that looped: its latest match is one token before its end; an earlier one gives the chain.
    corpus = build_corpus([40, 41, 42], [[5] * 12], size=16, prompt_tail=2)
    drafts, _ = table([[40, 41, 42, 5, 5]], groups=[0], corpora=[corpus])
    assert drafts[0] == [5] * 6
    # A sibling whose text ended otherwise gives only what it wrote: past its end it need not repeat.
    drafts, _ = table([[1, 5, 6, 7], [5, 6, 7, 5, 9]], [0, 0])
    assert drafts[0] == [5, 9]


def test_the_corpus_holds_earlier_completions_behind_the_prompt_tail():
    prompt = [40, 41, 42]
    corpus = build_corpus(prompt, [[50, 51, 52, 53], [60, 61, 62, 63]], size=16, prompt_tail=2)
    assert corpus.tolist() == [41, 42, 50, 51, 52, 53, -1, 41, 42, 60, 61, 62, 63, -1, -1, -1]
    assert build_corpus(prompt, [[50] * 5, [60] * 6], size=10, prompt_tail=2).tolist()[:8] == [41, 42] + [60] * 6
    # A newest completion too long for the row does not hide the older ones that fit (its start takes the room left).
    assert build_corpus(prompt, [[50] * 3, [60] * 20], size=10, prompt_tail=2).tolist() == [41, 42, 50, 50, 50, -1,
                                                                                             41, 42, 60, -1]
    # A row that has just read its prompt and sampled 60 drafts the newest earlier completion's next tokens.
    drafts, _ = table([[40, 41, 42, 60]], groups=[0], corpora=[corpus])
    assert drafts[0] == [61, 62, 63]  # "41 42 60" matched: up to 6 drafts, the entry ends after 3


def test_a_match_at_an_entrys_end_does_not_hide_one_that_continues():
    """A completion cut by its length limit (or by the corpus) ends mid-text; the row reaching the same text must draft
    what followed it in an entry that goes on, not nothing from the newer, cut one (equally long and later)."""
    prompt = [40, 41, 42]
    corpus = build_corpus(prompt, [[50, 51, 52, 53, 54, 55], [50, 51, 52]], size=16, prompt_tail=2)
    drafts, _ = table([[40, 41, 42, 50, 51, 52]], groups=[0], corpora=[corpus])
    assert drafts[0] == [53, 54, 55]
    # A longer match at the cut entry's end loses to a shorter one that continues.
    corpus = build_corpus(prompt, [[7, 51, 52, 60, 61], [50, 51, 52]], size=16, prompt_tail=2)
    drafts, _ = table([[40, 41, 42, 50, 51, 52]], groups=[0], corpora=[corpus])
    assert drafts[0] == [60, 61]


def _propose_reference(history, length, group, corpus, max_draft, settings):
    """propose() spelled out: every place a row's suffix may match, the longest one that a token follows; among equally
    long ones the one followed by the most of the wanted tokens, then the latest: the table after the corpus, a later
    position after an earlier one (then a later row). In a table row whose last tokens are the match, what follows the
    match repeats past the row's end."""
    B = len(history)
    tokens, n = np.full((B, max_draft), -1), np.zeros(B, int)

    def suffix(r):
        return [int(history[r][length[r] - j]) for j in range(min(settings.match_tokens, length[r] + 1))]

    for b in range(B):
        query = suffix(b)
        texts = [((0, 0), [t if t != SEPARATOR else None for t in corpus[b]])]
        texts += [((1, r), list(history[r][: length[r] + 1])) for r in range(B) if group[r] == group[b]]
        found = []
        for (where, r), text in texts:
            same_end = 0
            if where == 1:
                while same_end < min(len(query), len(suffix(r))) and query[same_end] == suffix(r)[same_end]:
                    same_end += 1
            for p in range(len(text) - 1):
                run = 0
                while run < len(query) and p - run >= 0 and text[p - run] == query[run]:
                    run += 1
                follow = []
                for t in text[p + 1:]:
                    if t is None or len(follow) == max_draft:
                        break
                    follow.append(t)
                if follow and where == 1 and run <= same_end:
                    follow = [follow[i % len(follow)] for i in range(max_draft)]
                wanted = min(int(settings.spec_factor * run), max_draft) if run >= settings.min_match else 0
                if follow:
                    found.append(((run, min(wanted, len(follow)), where, p, r), follow))
        (run, k, *_), follow = max(found, key=lambda f: f[0]) if found else ((0, 0), [])
        tokens[b, :k], n[b] = follow[:k], k
    return tokens, n


def test_propose_equals_a_reference_on_random_tables():
    rng = np.random.default_rng(0)
    settings = MatchSettings(match_tokens=4, min_match=2, spec_factor=1.5)
    for _ in range(60):  # a small vocabulary: many matches of every length, loops in rows
        history = rng.integers(0, 3, (3, 12)).astype(np.int32)
        length, group = rng.integers(0, 12, 3).astype(np.int32), rng.integers(0, 2, 3).astype(np.int32)
        corpus = rng.integers(-1, 3, (3, 20)).astype(np.int32)
        tokens, n = propose(jnp.asarray(history), jnp.asarray(length), jnp.asarray(group), jnp.asarray(corpus), 5, settings)
        want_tokens, want_n = _propose_reference(history, length, group, corpus, 5, settings)
        np.testing.assert_array_equal(np.asarray(n), want_n)
        np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
        # the text past every row's last token is never read: sd steps match over the window only (speculative.draft)
        window = jnp.asarray(history[:, : length.max() + 1])
        cut = propose(window, jnp.asarray(length), jnp.asarray(group), jnp.asarray(corpus), 5, settings)
        np.testing.assert_array_equal(np.asarray(cut[0]), want_tokens)


def same_store(a: HistoryStore, b: HistoryStore) -> bool:
    x, y = a.arrays(), b.arrays()
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def test_store_bounds_tokens_per_prompt_and_prompts_and_round_trips(tmp_path):
    store = HistoryStore(tokens_per_prompt=10, max_prompts=2)
    store.add([1], [1, 2, 3, 4])
    store.add([1], [5, 6, 7, 8])
    store.add([1], [9, 9, 9])  # 11 tokens: the oldest completion leaves
    assert store.completions([1]) == [[5, 6, 7, 8], [9, 9, 9]]
    store.add([2], [7])
    store.completions([1])  # prompt 1 used last: prompt 2 is the least recently used
    store.add([3], [8])
    assert store.completions([2]) == [] and len(store) == 2
    write_arrays(tmp_path / "h.npz", store.arrays())
    back = HistoryStore(10, 2)
    back.load(tmp_path / "h.npz")
    assert same_store(back, store) and back.completions([3]) == [[8]]
    assert store.summary() == {"tokens_per_prompt": 10, "max_prompts": 2, "prompts": 2, "tokens": 8}
    # Into a smaller store (a resume with smaller sd.history bounds): what adding the completions would keep.
    small, added = HistoryStore(3, 2), HistoryStore(3, 2)
    small.load(tmp_path / "h.npz")
    for key_prompt in ([1], [3]):
        for completion in store.completions(key_prompt):
            added.add(key_prompt, completion)
    assert same_store(small, added) and small.arrays()["tokens"].tolist() == [9, 9, 9, 8]
    # A checkpoint from before 2026-11-27 holds the store in its JSON.
    legacy = HistoryStore(10, 2)
    legacy.restore({"tokens_per_prompt": 10, "max_prompts": 2, "entries": [
        [prompt_key([1]), [[5, 6, 7, 8], [9, 9, 9]]], [prompt_key([3]), [[8]]]]})
    assert same_store(legacy, back)
    np.savez(tmp_path / "bad.npz", keys=np.asarray(["a"]), counts=np.asarray([2]), lengths=np.asarray([1]),
             tokens=np.asarray([5], np.int32))
    with pytest.raises(ValueError, match="1 prompts, 2 completions of 1 tokens, but 1 counts, 1 lengths and 1 tokens"):
        legacy.load(tmp_path / "bad.npz")
    # A completion longer than the bound keeps its start: the corpus puts it right behind the prompt's tail
    store.add([4], list(range(100, 115)))
    assert store.completions([4]) == [list(range(100, 110))]
    # Token arrays (a data pipeline's numpy ids) are sequences too; an empty completion adds nothing.
    store.add(np.array([4]), np.array([7, 8], np.int32))
    store.add([4], np.zeros(0, np.int32))
    assert store.completions([4]) == [[7, 8]]  # the 10-token start before it leaves: 12 tokens > 10


def test_a_completion_as_long_as_the_store_bound_still_feeds_the_corpus():
    """The store keeps a long completion's start (and drops the older ones for it); the corpus, as large as the
    store's bound, must put that start behind the prompt's tail rather than leave the prompt's corpus empty."""
    prompt = [40, 41, 42]
    store = HistoryStore(tokens_per_prompt=16, max_prompts=4)
    store.add(prompt, [70, 71, 72])
    store.add(prompt, list(range(100, 130)))  # a long-tail completion: its first 16 tokens stay, alone
    corpus = build_corpus(prompt, store.completions(prompt), size=16, prompt_tail=2)
    assert corpus.tolist() == [41, 42, *range(100, 113), SEPARATOR]
    drafts, _ = table([[40, 41, 42, 100]], groups=[0], corpora=[corpus])
    assert drafts[0] == [101, 102, 103, 104, 105, 106]  # "41 42 100" matched: 3 x 2 drafts
    # Room left behind whole entries takes the start of the newest one that did not fit, in its place in time.
    assert build_corpus(prompt, [[50] * 3, [60] * 20, [80]], size=14, prompt_tail=2).tolist() == \
        [41, 42, 50, 50, 50, -1, 41, 42, 60, -1, 41, 42, 80, -1]


def test_group_corpus_collects_finished_siblings():
    text = GroupCorpus([[1, 2], [3], [1, 2]], None, size=12, prompt_tail=2)
    assert text.group_of == [0, 1, 0]
    assert (text.rows([0, 1]) == SEPARATOR).all()
    text.dirty = False
    text.finished(2, [7, 8, 9])
    assert text.dirty
    rows = text.rows([0, -1, 1])
    assert rows[0, :6].tolist() == [1, 2, 7, 8, 9, -1] and (rows[1:] == SEPARATOR).all()


def test_merged_trie_drops_repeated_nodes_and_keeps_every_path():
    # EAGLE tree a: root -> 5 -> 6, root -> 9. History chain b: root -> 5 -> 7 -> 8.
    a = speculative.Tree(tokens=jnp.array([[1, 5, 9, 6]]), parents=jnp.array([[-1, 0, 0, 1]]),
                         depth=jnp.array([[0, 1, 1, 2]]), valid=jnp.ones((1, 4), bool),
                         source=jnp.array([[0, 1, 1, 1]]))
    b = speculative.chain_tree(jnp.array([1]), jnp.array([[5, 7, 8]]), jnp.array([3]))
    t = speculative.merge_trees(a, b)
    assert t.tokens.tolist() == [[1, 5, 9, 6, 5, 7, 8]]
    assert t.valid.tolist() == [[True, True, True, True, False, True, True]]  # b's 5 repeats a's
    assert t.parents.tolist()[0][5:] == [1, 5]  # 7 hangs under a's 5
    assert t.depth.tolist() == [[0, 1, 1, 2, 1, 2, 3]]
    assert t.source.tolist()[0][:2] == [0, speculative.EAGLE | speculative.HISTORY]
    assert t.source.tolist()[0][5:] == [speculative.HISTORY] * 2


def test_strategy_notation():
    assert speculative.Strategy.parse("h8") == speculative.Strategy(0, 0, 1, 8)
    fused = speculative.Strategy.parse("3/1/4+h8")
    assert fused.label == "3/1/4+h8" and fused.num_nodes == 12 and fused.pending == 9 and fused.uses_drafter
    assert speculative.Strategy.parse("plain") is speculative.PLAIN and speculative.PLAIN.is_plain
    cfg = load_config(None, ["sd.mode=adaptive", "sd.strategies=['h6', [3, 1, 4], '3/1/4+h6']",
                             "sd.group_live_batch_ranges=[[7, 1, 2], [4, 3, 5], [10, 6, 8]]"])
    assert list(cfg.sd.strategies) == ["h6", "3/1/4", "3/1/4+h6"]
    with pytest.raises(ConfigError, match=r"sd.strategies\[0\]: 'x6' is not"):
        load_config(None, ["sd.strategies=['x6']"])
    with pytest.raises(ConfigError, match="sd.strategies names 3/1/4 twice"):  # two arms sharing one reward window
        load_config(None, ["sd.strategies=['3/1/4', 'h6', [3, 1, 4]]"])
    with pytest.raises(ConfigError, match="sd.history.spec_factor must be > 0"):
        load_config(None, ["sd.history.spec_factor=0"])
    with pytest.raises(ConfigError, match=r"sd.history.min_match \(9\) must be <= sd.history.match_tokens \(8\)"):
        load_config(None, ["sd.history.min_match=9"])  # a match is at most match_tokens long: it would never draft


# ---- engines ---------------------------------------------------------------------------------

SD_CFG = dataclasses.replace(CFG, length_buckets=(48, 96))
ONE_ROW = dataclasses.replace(SD_CFG, batch_buckets=(1,))  # siblings run one after another
TWO_ROWS = dataclasses.replace(SD_CFG, batch_buckets=(1, 2))  # a finished sibling's text serves the next rows
FOUR_ROWS = dataclasses.replace(SD_CFG, batch_buckets=(4,))  # one batch bucket: fewer programs to compile


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def repeated_requests(n_prompts, samples, temperature=0.0, max_new=24, seed=7):
    """Several samples per prompt: the siblings the history drafter feeds on."""
    return [Request(p, max_new_tokens=max_new - 2 * (i % 3), temperature=temperature, top_p=0.95, seed=100 * i + j)
            for i, p in enumerate(prompts(n_prompts, seed=seed)) for j in range(samples)]


@pytest.mark.parametrize("spec", ["h6", "3/2/6+h4"])
def test_history_and_fused_greedy_equal_plain_decoding(model, spec):
    drafter = Drafter(TINY, nnx.Rngs(5)) if "/" in spec else None
    engine = RolloutEngine(model, ONE_ROW, sd=SpecConfig(mode="on", strategies=(spec,)), drafter=drafter, progress=False)
    reqs = repeated_requests(3, 3)
    out = engine.generate(reqs)
    for r, o in zip(reqs, out):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)
    # Greedy siblings repeat each other: the later ones are drafted from the earlier ones' text.
    assert engine.stats.drafts_history > 0 and engine.stats.acceptance_length() > 1.5


@pytest.fixture(scope="module")
def plain_four(model):
    return RolloutEngine(model, FOUR_ROWS, progress=False)


@pytest.mark.parametrize("spec", ["h6", "3/2/6+h4"])
def test_history_coupled_sampling_equals_plain_sampling(model, plain_four, spec):
    drafter = Drafter(TINY, nnx.Rngs(5)) if "/" in spec else None
    reqs = repeated_requests(3, 4, temperature=0.8)
    plain = plain_four.generate(reqs)
    engine = RolloutEngine(model, FOUR_ROWS, sd=SpecConfig(mode="on", strategies=(spec,)), drafter=drafter, progress=False)
    out = engine.generate(reqs)
    assert [a.tokens for a in plain] == [b.tokens for b in out]
    np.testing.assert_allclose([x for a in plain for x in a.logprobs], [x for b in out for x in b.logprobs], atol=1e-4)
    assert engine.stats.sd_steps > 0


def test_fused_rejection_sampling_runs_and_is_greedy_at_temperature_zero(model):
    sd = SpecConfig(mode="on", strategies=("3/2/6+h4",), accept="rejection")
    engine = RolloutEngine(model, TWO_ROWS, sd=sd, drafter=Drafter(TINY, nnx.Rngs(5)), progress=False)
    greedy = repeated_requests(2, 3)
    for r, o in zip(greedy, engine.generate(greedy)):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)
    assert engine.stats.drafts_history > 0  # the later siblings' drafts were accepted
    sampled = repeated_requests(2, 3, temperature=0.8)
    out = engine.generate(sampled)
    assert all(len(o.tokens) == r.max_new_tokens and max(o.tokens) < TINY.vocab_size for r, o in zip(sampled, out))


def test_rejection_sampling_stops_where_a_request_ends_and_reports_the_policys_logprobs(model):
    """sd.accept='rejection' with history drafts that siblings' text gets accepted, greedy and sampled rows (top-k,
    top-p), stop ids and budgets that can end inside an accepted run: no token after the first stop id, none past
    max_new_tokens, and each token's log-prob the policy's, temperature-scaled, teacher-forced (found by review)."""
    import jax

    from fastrl_jax.models.decoder import KVCache

    p = prompts(1, seed=7, lo=6)[0]
    stops = np.random.default_rng(0).integers(0, TINY.vocab_size, 12)
    reqs = [Request(p, max_new_tokens=[40, 17, 23][i % 3], temperature=[0.0, 0.3, 0.6][i % 3], top_k=[0, 0, 8][i % 3],
                    top_p=[1.0, 0.9, 1.0][i % 3], seed=1000 + i, stop_ids=(int(stops[i]),)) for i in range(12)]
    sd = SpecConfig(mode="on", strategies=("h6",), accept="rejection")
    engine = RolloutEngine(model, dataclasses.replace(CFG, length_buckets=(48, 96), batch_buckets=(1, 2)), sd=sd,
                           progress=False)
    out = engine.generate(reqs)
    assert engine.stats.sd_steps > 0 and engine.stats.drafts_history > 0
    assert {o.finish_reason for o in out} == {"stop", "length"}
    for r, o in zip(reqs, out):
        assert 1 <= len(o.tokens) <= r.max_new_tokens and not set(o.tokens[:-1]) & set(r.stop_ids)
        assert len(o.tokens) == r.max_new_tokens if o.finish_reason == "length" else o.tokens[-1] in r.stop_ids
        seq = jnp.asarray([list(r.prompt_ids) + o.tokens], jnp.int32)
        logits, _, _ = model(seq, jnp.arange(seq.shape[1])[None], KVCache.zeros(TINY, 1, 128, jnp.float32),
                             jnp.zeros(1, jnp.int32))
        logp = jax.nn.log_softmax(logits[0] / (r.temperature or 1.0), -1)
        n = len(r.prompt_ids)
        np.testing.assert_allclose(o.logprobs, [logp[n - 1 + i, t] for i, t in enumerate(o.tokens)], rtol=1e-3, atol=1e-3)


def test_earlier_rollouts_feed_the_next_one(model):
    """The same prompts again (a later RL step): the store's completions are drafted from at once."""
    store = HistoryStore(tokens_per_prompt=512, max_prompts=16)
    sd = SpecConfig(mode="on", strategies=("h8",))
    engine = RolloutEngine(model, SD_CFG, sd=sd, progress=False, history=store)
    reqs = repeated_requests(4, 1)  # one sample per prompt: no sibling to draft from
    first = engine.generate(reqs)
    before = engine.stats.drafts_history
    store.add_all((r.prompt_ids, c.tokens) for r, c in zip(reqs, first))
    again = engine.generate(reqs)
    assert [c.tokens for c in again] == [c.tokens for c in first]
    assert engine.stats.drafts_history > before + 20  # greedy repeats itself: most tokens drafted


def looping_model(period: int) -> nnx.Module:
    """A model whose greedy text falls into the loop 5, 6, ..., 4 + period at once: layers that add nothing to the
    residual, token t embedded as unit vector t % hidden, and a head from each of those to its successor in the loop."""
    model = tiny_model()
    model.layers.wo.set_value(jnp.zeros_like(model.layers.wo.get_value()))
    model.layers.w_down.set_value(jnp.zeros_like(model.layers.w_down.get_value()))
    H, V = TINY.hidden_size, TINY.vocab_size
    model.embed.set_value(jnp.eye(V, H))
    head = np.zeros((H, V), np.float32)
    head[np.arange(H), [5 + (i - 4) % period if 5 <= i < 5 + period else 5 for i in range(H)]] = 1.0
    model.lm_head.set_value(jnp.asarray(head))
    return model


def test_a_looping_row_is_drafted_whole_chains_and_decodes_as_plain():
    """A row looping until max_new_tokens (the RL long tail) gets h6's 6 drafts per step once its match is 3 tokens
    long, all accepted: 5.1 tokens per step over 72 tokens, where drafting one period (3 tokens) a step gave 3.4."""
    model = looping_model(3)
    engine = RolloutEngine(model, ONE_ROW, sd=SpecConfig(mode="on", strategies=("h6",)), progress=False)
    reqs = [Request(p, max_new_tokens=72) for p in prompts(2, seed=3)]
    for r, o in zip(reqs, engine.generate(reqs)):
        assert o.tokens == greedy_generate(model, r.prompt_ids, r.max_new_tokens)
        assert o.tokens[:6] == [5, 6, 7, 5, 6, 7]
    assert engine.stats.acceptance_length() > 4.5
