"""Choosing a reduced draft vocabulary (EAGLE-3's d2t/t2d) from token frequencies."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def select_draft_vocab(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> np.ndarray:
    """The `size` most frequent token ids (ties and never-seen ids by ascending id), `always` included;
    sorted int32 [size]. counts: [vocab] occurrences, e.g. SampleBuffer.token_counts."""
    counts = np.asarray(counts)
    vocab = len(counts)
    always = sorted({int(t) for t in always})
    if not 1 <= size <= vocab or len(always) > size or any(not 0 <= t < vocab for t in always):
        raise ValueError(f"need 1 <= draft vocabulary size ({size}) <= vocab ({vocab}) and {len(always)} "
                         "always-kept ids in range that fit")
    score = counts.astype(np.float64)
    score[always] = np.inf
    order = np.lexsort((np.arange(vocab), -score))  # by count descending, then id
    return np.sort(order[:size]).astype(np.int32)


def coverage(counts: np.ndarray, draft_vocab: np.ndarray) -> float:
    """Fraction of counted token occurrences whose id is in draft_vocab."""
    total = counts.sum()
    return float(counts[draft_vocab].sum() / total) if total else 0.0
