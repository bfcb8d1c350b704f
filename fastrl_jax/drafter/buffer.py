"""A bounded buffer of (tokens, last-layer hidden states, loss mask) sequences, packed into static batches.

Sequences come from rollouts tagged with the RL step that produced them. The buffer keeps at most
`max_tokens` tokens (oldest sequences leave first) and samples only from the latest `keep_steps`
steps, so online training follows the current policy. A batch packs whole sequences (a longer one
is cropped to a random window) into rows of a fixed length with segment ids, so every train step
has the same shapes and little padding.

Alignment (one sequence of n tokens): tokens x_0 .. x_{n-1}; hidden h_0 .. h_{n-2} (the policy's
hidden state after each token but the last, as the engine returns them); loss_mask [n] marks the
tokens a drafter should learn to predict (the completion). A rollout's sequence also keeps its sampling
temperature and seed, so an acceptance estimate can draft as the engine does for a sampled row
(train.chain_acceptance).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from fastrl_jax.checkpoint import read_arrays, write_arrays

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from fastrl_jax.rollout.engine import Completion, Request


@dataclasses.dataclass
class PackedBatch:
    """Rows of packed sequences; every field's leading shape is [B, S]."""

    tokens: np.ndarray  # [B, S] int32
    hidden: np.ndarray  # [B, S, H] hidden state after each token (zero where the sequence has none)
    loss_mask: np.ndarray  # [B, S] bool, the token is one to predict
    positions: np.ndarray  # [B, S] int32 position of each token in its whole sequence (a crop's too)
    segments: np.ndarray  # [B, S] int32 sequence number within the row, from 1; 0 is padding
    temperature: np.ndarray  # [B, S] float32 the sequence's sampling temperature (0: greedy)
    seeds: np.ndarray  # [B, S] uint32 the sequence's sampling seed (its request's, mod 2**32)

    @classmethod
    def zeros(cls, rows: int, seq_len: int, hidden_size: int) -> PackedBatch:
        """An all-padding batch [rows, seq_len] (also the shapes a compiled train step takes)."""
        shape = (rows, seq_len)
        return cls(tokens=np.zeros(shape, np.int32), hidden=np.zeros((*shape, hidden_size), np.float32),
                   loss_mask=np.zeros(shape, bool), positions=np.zeros(shape, np.int32),
                   segments=np.zeros(shape, np.int32), temperature=np.zeros(shape, np.float32),
                   seeds=np.zeros(shape, np.uint32))


@dataclasses.dataclass
class _Sequence:
    tokens: np.ndarray  # [n] int32
    hidden: np.ndarray  # [n - 1, H]
    loss_mask: np.ndarray  # [n] bool
    step: int
    temperature: float  # the rollout's sampling temperature (0: greedy)
    seed: int  # its sampling seed, uint32


class SampleBuffer:
    """Bounded store of rollout sequences for drafter training (warm-up and online)."""

    def __init__(self, max_tokens: int, hidden_size: int, keep_steps: int = 0, hidden_dtype=np.float16):
        """max_tokens: the most tokens held (memory ~ max_tokens x hidden_size x itemsize);
        keep_steps: sample from the latest this many steps only (0: every step held)."""
        if max_tokens < 2 or hidden_size < 1 or keep_steps < 0:
            raise ValueError(f"need max_tokens >= 2, hidden_size >= 1, keep_steps >= 0; got {max_tokens}, {hidden_size}, {keep_steps}")
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.keep_steps = keep_steps
        self.hidden_dtype = np.dtype(hidden_dtype)
        self._seqs: deque[_Sequence] = deque()
        self._tokens = 0
        self.added = 0  # sequences added over the buffer's life, evicted ones included
        self.skipped = 0  # rollouts add_rollouts left out: longer than max_tokens, or hidden states beyond hidden_dtype
        self._warned: set[str] = set()  # why rollouts were left out, each said once

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def steps(self) -> list[int]:
        return sorted({s.step for s in self._seqs})

    def add(self, tokens, hidden, loss_mask, step: int = 0, temperature: float = 0.0, seed: int = 0) -> None:
        """Adds one sequence: tokens [n], hidden [n - 1, H] (or [n, H], the last row is dropped), loss_mask [n];
        temperature and seed: what sampled its completion (its Request's)."""
        tokens = np.asarray(tokens, np.int32)
        hidden = np.asarray(hidden)
        loss_mask = np.asarray(loss_mask, bool)
        if tokens.ndim != 1 or len(tokens) < 2:
            raise ValueError(f"a sequence needs at least 2 tokens in a 1-d array, got shape {tokens.shape}")
        n = len(tokens)
        if hidden.ndim != 2 or hidden.shape[1] != self.hidden_size or hidden.shape[0] not in (n - 1, n):
            raise ValueError(f"hidden must be [{n - 1}, {self.hidden_size}] for {n} tokens, got {hidden.shape}")
        if loss_mask.shape != (n,):
            raise ValueError(f"loss_mask must be [{n}], got {loss_mask.shape}")
        if n > self.max_tokens:
            raise ValueError(f"a {n}-token sequence does not fit a buffer of {self.max_tokens} tokens")
        if not self._fits(hidden):
            raise ValueError(f"hidden states are not finite or exceed the range of {self.hidden_dtype}")
        self._seqs.append(_Sequence(tokens, hidden[: n - 1].astype(self.hidden_dtype), loss_mask, int(step),
                                    float(temperature), int(seed) % 2**32))
        self.added += 1
        self._tokens += n
        while self._tokens > self.max_tokens:
            self._tokens -= len(self._seqs.popleft().tokens)

    def add_rollouts(self, requests: Sequence[Request], completions: Sequence[Completion], step: int = 0) -> tuple[int, int]:
        """Adds each completed rollout (prompt + completion, the engine's hidden states, the completion
        as loss mask); returns (sequences, completion tokens) added. Requests that failed, kept no hidden
        states or have no token to learn are skipped."""
        sequences = tokens = 0
        for req, out in zip(requests, completions):
            if out.finish_reason == "error" or out.hidden_states is None:
                continue
            seq = list(req.prompt_ids) + list(out.tokens)
            if len(seq) < 3:  # a one-token prompt and answer: nothing to learn (entry t predicts x_{t+2})
                continue
            if len(seq) > self.max_tokens:  # one outlier must not end a training run
                self._skip(f"longer than the buffer's {self.max_tokens} tokens")
                continue
            if not self._fits(out.hidden_states):
                self._skip(f"hidden states not finite or beyond {self.hidden_dtype}'s range")
                continue
            self.add(seq, out.hidden_states, np.arange(len(seq)) >= len(req.prompt_ids), step, req.temperature, req.seed)
            sequences, tokens = sequences + 1, tokens + len(out.tokens)
        return sequences, tokens

    def _skip(self, why: str) -> None:
        self.skipped += 1
        if why not in self._warned:
            self._warned.add(why)
            log.warning("drafter sample buffer: rollouts %s are left out (counted in SampleBuffer.skipped)", why)

    def _fits(self, hidden) -> bool:
        hidden = np.asarray(hidden)
        return bool(np.isfinite(hidden).all()) and np.abs(hidden).max(initial=0) <= np.finfo(self.hidden_dtype).max

    def _eligible(self) -> list[_Sequence]:
        if not self.keep_steps:
            return list(self._seqs)
        recent = set(self.steps[-self.keep_steps :])
        return [s for s in self._seqs if s.step in recent]

    def sample(self, rng: np.random.Generator, rows: int, seq_len: int) -> PackedBatch:
        """Packs randomly drawn sequences into `rows` rows of `seq_len` tokens.

        Sequences are drawn without replacement until every row is full (or the eligible
        sequences run out, then with replacement); one longer than seq_len is cropped to a random
        window, and one that does not fit a row's remaining space ends that row.
        """
        pool = [s for s in self._eligible() if s.loss_mask[2:].any()]  # entry t predicts x_{t+2} (drafter.train)
        if not pool:
            raise ValueError("the sample buffer holds no sequence with a token to learn (add rollouts first)")
        if rows < 1 or seq_len < 3:
            raise ValueError(f"need rows >= 1 and seq_len >= 3, got {rows}, {seq_len}")
        batch = PackedBatch.zeros(rows, seq_len, self.hidden_size)
        order = rng.permutation(len(pool))
        drawn = 0
        for r in range(rows):
            at, segment = 0, 1
            while at < seq_len:
                if drawn == len(order):
                    order, drawn = rng.permutation(len(pool)), 0
                seq = pool[order[drawn]]
                n = len(seq.tokens)
                if n > seq_len - at and at > 0:
                    break
                drawn += 1
                lo = int(rng.integers(0, n - (seq_len - at) + 1)) if n > seq_len - at else 0
                m = min(n - lo, seq_len - at)
                span = slice(at, at + m)
                batch.tokens[r, span] = seq.tokens[lo : lo + m]
                h = seq.hidden[lo : lo + m]  # the last token of an uncropped sequence has no hidden state
                batch.hidden[r, at : at + len(h)] = h
                batch.loss_mask[r, span] = seq.loss_mask[lo : lo + m]
                batch.positions[r, span] = np.arange(lo, lo + m)
                batch.segments[r, span] = segment
                batch.temperature[r, span] = seq.temperature
                batch.seeds[r, span] = seq.seed
                at, segment = at + m, segment + 1
        return batch

    def clear(self) -> None:
        """Drops every held sequence (`added` keeps counting)."""
        self._seqs.clear()
        self._tokens = 0

    def save(self, path: str | Path) -> None:
        """Writes every held sequence to one .npz file (atomically: a temporary file, then a rename)."""
        write_arrays(path, self.arrays())

    def arrays(self, added: range | None = None) -> dict[str, np.ndarray]:
        """What save writes: the held sequences concatenated (a snapshot: later adds leave it as it is); with
        `added`, only those of them whose number in the order of adding (0 for the buffer's first, see
        `added`) is in that range."""
        seqs = list(self._seqs)
        if added is not None:
            first = self.added - len(seqs)  # the number of the oldest held
            seqs = seqs[max(added.start - first, 0) : max(added.stop - first, 0)]
        return dict(
            lengths=np.array([len(s.tokens) for s in seqs], np.int64),
            steps=np.array([s.step for s in seqs], np.int64),
            temperatures=np.array([s.temperature for s in seqs], np.float32),
            seeds=np.array([s.seed for s in seqs], np.uint32),
            tokens=np.concatenate([s.tokens for s in seqs]) if seqs else np.zeros(0, np.int32),
            loss_mask=np.concatenate([s.loss_mask for s in seqs]) if seqs else np.zeros(0, bool),
            hidden=np.concatenate([s.hidden for s in seqs]) if seqs else np.zeros((0, self.hidden_size), self.hidden_dtype),
        )

    def load(self, path: str | Path) -> None:
        """Adds the sequences of a file written by save (in their order, with their steps; a file from before
        sampling settings were kept reads as greedy)."""
        f = read_arrays(path)
        lengths, steps = f["lengths"], f["steps"]
        tokens, loss_mask, hidden = f["tokens"], f["loss_mask"], f["hidden"]
        temperatures = f["temperatures"] if "temperatures" in f else np.zeros(len(lengths), np.float32)
        seeds = f["seeds"] if "seeds" in f else np.zeros(len(lengths), np.uint32)
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(f"{path} holds features {hidden.shape[1]} wide; this buffer takes {self.hidden_size} "
                             "(they were collected for another drafter kind or policy)")
        t = h = 0
        for n, step, temperature, seed in zip(lengths, steps, temperatures, seeds):
            self.add(tokens[t : t + n], hidden[h : h + n - 1], loss_mask[t : t + n], int(step), temperature, seed)
            t, h = t + n, h + n - 1

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] int64: how often each token id occurs among the tokens to learn (loss_mask)."""
        counts = np.zeros(vocab_size, np.int64)
        for s in self._seqs:
            np.add.at(counts, s.tokens[s.loss_mask], 1)
        return counts
