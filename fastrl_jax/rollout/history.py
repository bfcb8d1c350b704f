"""Model-free drafting from history: a row's continuation proposed from text its prompt group wrote before.

RL rollouts repeat themselves: the n samples of a prompt share phrasing, numbers and structure, and
prompts come back in later RL steps. For each row the device matcher finds, among
  - the row's corpus: earlier completions of its prompt (from earlier RL steps, and siblings of this
    rollout that have finished), each behind the prompt's last tokens, and
  - the live rows of its group in the table (siblings still generating, and the row itself),
the longest match of the row's last `match_tokens` tokens that text follows (among equally long ones the one followed
by the most of the wanted tokens, then the latest) and proposes what followed it as a chain of draft tokens, as many as
spec_factor x the match length (at most max_draft). What follows a match in a text that ends as the match does (a row
in a repetition loop, the RL long tail) repeats past that end, period after period. It is a few vectorised compares
inside the compiled step: no host round trip.
The policy verifies every drafted token, so drafting from history is as lossless as any drafter.

`HistoryStore` keeps the earlier completions on the host, per prompt, bounded, as int32 arrays that a
checkpoint saves beside it (arrays / load); the engine writes each row's corpus into the row table at
host visits.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fastrl_jax.checkpoint import read_arrays

SEPARATOR = -1  # between corpus entries and as padding: never equal to a token id


@dataclasses.dataclass(frozen=True)
class MatchSettings:
    """Static settings of the device matcher (part of the compiled program's key)."""

    match_tokens: int = 8  # longest suffix compared (K)
    min_match: int = 2  # shorter matches propose nothing
    spec_factor: float = 2.0  # draft length = spec_factor x match length, at most the strategy's chain


def propose(history: jax.Array, length: jax.Array, group: jax.Array, corpus: jax.Array, max_draft: int,
            settings: MatchSettings) -> tuple[jax.Array, jax.Array]:
    """Draft chains from history for every row of the table.

    Args:
      history: [B, S1] int32 token at every position of each row; history[b, length[b]] is the row's
        last token (the root of its next draft).
      length: [B] int32.
      group: [B] int32 prompt group of each row (rows of one group see each other's text).
      corpus: [B, M] int32 each row's earlier text (prompt tails and completions), SEPARATOR-delimited.
      max_draft: static length D of the chains.

    Returns:
      tokens [B, D] int32 (-1 past each row's draft) and n [B] int32, each row's draft length.
    """
    B, S1 = history.shape
    K = settings.match_tokens
    pos = length[:, None] - jnp.arange(K)[None, :]  # [B, K]: the query, newest token first
    query = jnp.where(pos >= 0, jnp.take_along_axis(history, jnp.maximum(pos, 0), 1), -3)

    # Match lengths ending at each corpus position and at each position of each table row, where a token follows
    # the match: a longer match at an entry's end (a completion cut by its length limit or by the corpus) would
    # otherwise win over one that has a continuation, and the row would draft nothing.
    M = corpus.shape[1]
    corpus_follow = _tokens_after(corpus, max_draft)  # [B, M]
    in_corpus = _run_lengths(corpus[:, :, None], query, ((corpus != SEPARATOR) & (corpus_follow > 0))[:, :, None])[:, :, 0]
    rows_text = jnp.broadcast_to(history.T[None], (B, S1, B))  # [B, S1, Bt]: row r's text at p
    table_ok = (group[None, :] == group[:, None])[:, None, :] & (jnp.arange(S1)[None, :, None] < length[None, None, :])
    in_table = _run_lengths(rows_text, query, table_ok)  # [B, S1, Bt]

    # How many tokens follow each match: in the corpus up to the entry's separator; in a table row up to its length,
    # and without end where the row's own last tokens are the match (the row itself, or a sibling in the same phase
    # of the same loop): after the d tokens up to that end the text ends as it did at the match, so the matcher
    # would find the match again and continue with the same d tokens: a loop's period repeats, draft[i] = draft[i-d].
    # Without it a row stuck in a loop (the RL long tail) drafted one period per step.
    same_end = jnp.sum(jnp.cumprod(query[:, None, :] == query[None, :, :], axis=2), axis=2)  # [B, Bt] common suffix
    periodic = in_table <= same_end[:, None, :]  # [B, S1, Bt]
    table_follow = jnp.where(periodic, max_draft, length[None, None, :] - jnp.arange(S1)[None, :, None])

    # The longest match wins; among equal ones, the one that gives the longest draft (up to the wanted length: a
    # loop's latest match in a sibling or the corpus sits just before the text's end), then the latest (the table
    # after the corpus, later after earlier).
    def key(run, follow):
        return run * (max_draft + 1) + jnp.clip(follow, 0, _wanted(run, max_draft, settings))  # >= 0 off the text

    corpus_key, corpus_best = _latest_max(key(in_corpus, corpus_follow))
    table_key, cell = _latest_max(key(in_table, table_follow).reshape(B, S1 * B))
    is_corpus = corpus_key > table_key
    n = jnp.where(is_corpus, corpus_key, table_key) % (max_draft + 1)

    # What followed the match: the next tokens in the corpus, or in the table row (periodically past its end).
    after = corpus_best[:, None] + 1 + jnp.arange(max_draft)[None, :]  # [B, D]
    from_corpus = jnp.take_along_axis(corpus, jnp.minimum(after, M - 1), 1)
    r, p = cell % B, cell // B  # the table row and position of a table match
    period = jnp.maximum(length[r] - p, 1)[:, None]
    tpos = p[:, None] + 1 + jnp.arange(max_draft)[None, :] % period
    from_table = history[r[:, None], jnp.minimum(tpos, S1 - 1)]
    tokens = jnp.where(is_corpus[:, None], from_corpus, from_table)
    return jnp.where(jnp.arange(max_draft)[None, :] < n[:, None], tokens, -1), n.astype(jnp.int32)


def _wanted(run: jax.Array, max_draft: int, settings: MatchSettings) -> jax.Array:
    """The draft length a match of `run` tokens asks for: spec_factor x run, at most max_draft, none below min_match."""
    wanted = jnp.minimum(jnp.floor(settings.spec_factor * run).astype(jnp.int32), max_draft)
    return jnp.where(run >= settings.min_match, wanted, 0)


def _tokens_after(corpus: jax.Array, most: int) -> jax.Array:
    """For corpus [B, M]: how many tokens follow each position before a separator (or the end), at most `most`."""
    padded = jnp.pad(corpus, ((0, 0), (0, most)), constant_values=SEPARATOR)
    run = jnp.ones(corpus.shape, jnp.int32)
    total = jnp.zeros(corpus.shape, jnp.int32)
    for k in range(1, most + 1):  # a few fused compares: a cumulative min over M is a scan of log M passes
        run = run * (padded[:, k: k + corpus.shape[1]] != SEPARATOR)
        total = total + run
    return total


def _latest_max(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For key [B, N]: each row's largest key and the last index holding it, [B] each, in one pass (one score of key
    and index would overflow int32 on large tables)."""
    def pick(a, b):
        take_b = (b[0] > a[0]) | ((b[0] == a[0]) & (b[1] > a[1]))
        return jnp.where(take_b, b[0], a[0]), jnp.where(take_b, b[1], a[1])

    index = jax.lax.broadcasted_iota(jnp.int32, key.shape, 1)
    return jax.lax.reduce((key, index), (jnp.int32(-1), jnp.int32(-1)), pick, (1,))


def _run_lengths(text: jax.Array, query: jax.Array, end_ok: jax.Array) -> jax.Array:
    """For text [B, P, X] (X texts of P positions per row b) and query [B, K] (newest first): how many
    of the query's tokens match, newest first, ending at each position: [B, P, X] int32, 0 where
    end_ok is False."""
    K = query.shape[1]
    run = jnp.ones(text.shape, jnp.int32)
    total = jnp.zeros(text.shape, jnp.int32)
    for j in range(K):  # text[p - j] against query[j]
        shifted = jnp.pad(text, ((0, 0), (j, 0), (0, 0)), constant_values=-2)[:, : text.shape[1]]
        run = run * (shifted == query[:, j][:, None, None])
        total = total + run
    return jnp.where(end_ok, total, 0)


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A stable key of a prompt (the same ids give the same key in every process and run)."""
    return hashlib.blake2b(np.asarray(prompt_ids, np.int64).tobytes(), digest_size=12).hexdigest()


class HistoryStore:
    """Earlier completions per prompt on the host: the newest first out of its corpus, bounded.

    Per prompt at most `tokens_per_prompt` tokens of completions (oldest dropped first; of one longer
    completion its start, which the corpus puts behind the prompt's tail); at most `max_prompts` prompts
    (the least recently used dropped first).
    """

    def __init__(self, tokens_per_prompt: int, max_prompts: int):
        if tokens_per_prompt < 1 or max_prompts < 1:
            raise ValueError(f"need tokens_per_prompt >= 1 and max_prompts >= 1, got {tokens_per_prompt}, {max_prompts}")
        self.tokens_per_prompt, self.max_prompts = tokens_per_prompt, max_prompts
        # int32 arrays: a full store at the defaults holds 16.8M tokens (67 MB; ~600 MB as Python int lists)
        self._entries: OrderedDict[str, deque[np.ndarray]] = OrderedDict()
        self._held: dict[str, int] = {}  # tokens kept per prompt (a sum over its deque at every add was quadratic)

    def __len__(self) -> int:
        return len(self._entries)

    def completions(self, prompt_ids: Sequence[int]) -> list[list[int]]:
        """The prompt's stored completions, oldest first (marks the prompt as used)."""
        key = prompt_key(prompt_ids)
        if key not in self._entries:
            return []
        self._entries.move_to_end(key)
        return [c.tolist() for c in self._entries[key]]

    def add(self, prompt_ids: Sequence[int], completion: Sequence[int]) -> None:
        self._add(prompt_key(prompt_ids), completion)

    def _add(self, key: str, completion: Sequence[int]) -> None:
        if len(completion) == 0:  # not `not completion`: numpy token arrays have no truth value
            return
        kept = self._entries.setdefault(key, deque())
        self._entries.move_to_end(key)
        # Holds the store to its bounds: of one longer completion its start (what follows the prompt in its corpus
        # entry), then a prompt's newest tokens_per_prompt tokens, then max_prompts prompts.
        kept.append(np.array(completion[: self.tokens_per_prompt], np.int32))
        self._held[key] = self._held.get(key, 0) + len(kept[-1])
        while self._held[key] > self.tokens_per_prompt:
            self._held[key] -= len(kept.popleft())
        while len(self._entries) > self.max_prompts:
            del self._held[self._entries.popitem(last=False)[0]]

    def add_all(self, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> None:
        """(prompt ids, completion ids) pairs, in order."""
        for prompt, completion in pairs:
            self.add(prompt, completion)

    def summary(self) -> dict:
        """A checkpoint's JSON note of the store (its contents go beside it: arrays)."""
        return {"tokens_per_prompt": self.tokens_per_prompt, "max_prompts": self.max_prompts, "prompts": len(self),
                "tokens": sum(self._held.values())}

    def arrays(self) -> dict[str, np.ndarray]:
        """The contents as flat arrays, oldest prompt first (load gives the same store): prompt keys, completions
        per prompt, completion lengths, their tokens back to back."""
        kept = list(self._entries.values())
        flat = [c for k in kept for c in k]
        return {"keys": np.asarray(list(self._entries), dtype=str), "counts": np.asarray([len(k) for k in kept], np.int64),
                "lengths": np.asarray([len(c) for c in flat], np.int64),
                "tokens": np.concatenate(flat) if flat else np.zeros(0, np.int32)}

    def load(self, path: str | Path) -> None:
        """Replaces the contents by a file of arrays() (write_arrays), held to this store's bounds (a larger store's
        file keeps what adding its completions in order would have kept)."""
        f = read_arrays(path)
        keys, counts, lengths, tokens = f["keys"], f["counts"], f["lengths"], f["tokens"]
        if counts.sum() != len(lengths) or lengths.sum() != len(tokens) or len(keys) != len(counts):
            raise ValueError(f"{path}: {len(keys)} prompts, {counts.sum()} completions of {lengths.sum()} tokens, "
                             f"but {len(counts)} counts, {len(lengths)} lengths and {len(tokens)} tokens")
        self._entries, self._held = OrderedDict(), {}
        ends = np.cumsum(lengths)
        i = 0
        for key, n in zip(keys.tolist(), counts.tolist()):
            for j in range(i, i + n):
                self._add(key, tokens[ends[j] - lengths[j]: ends[j]])
            i += n

    def restore(self, state: dict) -> None:
        """The contents of a checkpoint's JSON (before 2026-11-27 the store was saved there whole), held to this
        store's bounds."""
        self._entries, self._held = OrderedDict(), {}
        for key, kept in state["entries"]:
            for completion in kept:
                self._add(key, completion)


def build_corpus(prompt_ids: Sequence[int], completions: Sequence[Sequence[int]], size: int, prompt_tail: int) -> np.ndarray:
    """A row's corpus [size] int32: each completion behind the prompt's last `prompt_tail` tokens (so a
    row that has just read its prompt matches the start of earlier answers), SEPARATOR-delimited, oldest
    first; the newest entries that fit when they do not all (one too long for what is left does not hide
    older ones), and in the room left, the start of the newest one that did not fit (a completion as long
    as the corpus, which a HistoryStore of this size keeps the start of, would otherwise never appear)."""
    tail = list(prompt_ids[-prompt_tail:]) if prompt_tail > 0 else []
    entries = [[*tail, *completion, SEPARATOR] for completion in completions]
    kept, room, cut = [False] * len(entries), size, None
    for i in reversed(range(len(entries))):
        if len(entries[i]) <= room:
            kept[i], room = True, room - len(entries[i])
        elif cut is None:
            cut = i
    if cut is not None and room - 1 > len(tail):  # at least one token of the completion fits
        entries[cut], kept[cut] = entries[cut][: room - 1] + [SEPARATOR], True
    out = [t for entry, keep in zip(entries, kept) if keep for t in entry]
    return np.asarray(out + [SEPARATOR] * (size - len(out)), np.int32)


class GroupCorpus:
    """The text each prompt group of one generate call has written, for the row table's corpus: the
    group's earlier completions (from a HistoryStore) and the ones finished in this call. Requests
    with the same prompt ids form a group."""

    def __init__(self, prompts: Sequence[Sequence[int]], store: HistoryStore | None, size: int, prompt_tail: int):
        self.size, self.prompt_tail = size, prompt_tail
        index: dict[str, int] = {}
        self.group_of = [index.setdefault(prompt_key(p), len(index)) for p in prompts]
        self.prompts: dict[int, Sequence[int]] = {g: p for g, p in zip(self.group_of, prompts)}
        self.texts = {g: store.completions(p) if store is not None else [] for g, p in self.prompts.items()}
        self._rows: dict[int, np.ndarray] = {}  # built corpus per group
        self.dirty = True  # rows changed since the table last received them

    def finished(self, request: int, tokens: Sequence[int]) -> None:
        """A request of this call finished: its siblings may draft from its text."""
        g = self.group_of[request]
        self.texts[g].append(list(tokens))
        self._rows.pop(g, None)
        self.dirty = True

    def rows(self, row_req: Sequence[int]) -> np.ndarray:
        """[B, M] int32 the corpus of each table row (row_req[r]: the request it serves, -1 free)."""
        out = np.full((len(row_req), self.size), SEPARATOR, np.int32)
        for r, i in enumerate(row_req):
            if i >= 0:
                g = self.group_of[i]
                if g not in self._rows:
                    self._rows[g] = build_corpus(self.prompts[g], self.texts[g], self.size, self.prompt_tail)
                out[r] = self._rows[g]
        return out
