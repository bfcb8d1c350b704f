"""RL prompt pipelines on grain: prompt records (a file, or the built-in math generator) -> shuffled,
repeated batches.

A record is {"prompt": str} or {"messages": [{"role", "content"}, ...]}, plus "answer" (the ground
truth the reward compares with); prompt_files.read_records reads and checks a file's. The iterator's
position is a small JSON dict (grain's iterator state), saved with every checkpoint so a resumed
run continues with the next batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain

from fastrl_jax.data import math_problems
from fastrl_jax.data.prompt_files import read_records

MATH_SOURCE = "math"
_MATH_LEN = 1 << 30  # the generator is unbounded; grain wants a length


class MathSource:
    """Random-access view of the built-in math problem stream `seed` (grain RandomAccessDataSource); held_out:
    the held-out questions' stream (math_problems.problem)."""

    def __init__(self, seed: int, levels: Sequence[int], held_out: bool = False):
        self.seed, self.levels, self.held_out = seed, tuple(levels), held_out
        math_problems.problem(seed, 0, self.levels)  # checks the levels now

    def __len__(self) -> int:
        return _MATH_LEN

    def __getitem__(self, index: int) -> dict[str, Any]:
        p = math_problems.problem(self.seed, int(index), self.levels, self.held_out)
        return {"prompt": p.question, "answer": str(p.answer), "level": p.level}


def source(spec: str, seed: int, levels: Sequence[int] = math_problems.LEVELS, **fields) -> Any:
    """A grain random-access source: the math generator (spec 'math') or a prompt file."""
    if spec == MATH_SOURCE:
        return MathSource(seed, levels)
    return read_records(spec, **fields)


def prompt_batches(src: Any, batch_size: int, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """Shuffled (per epoch, from `seed`), repeated forever, batched into lists of records. Each epoch's last
    partial batch is left out (verl's drop_last), so no batch holds a prompt twice; a source smaller than one
    batch fills its batches across epochs."""
    n = len(src)
    ds = grain.MapDataset.source(src)
    if shuffle and n < _MATH_LEN:  # the generator is random already; a 2^30 permutation is wasted work
        ds = ds.shuffle(seed=seed)
    records = ds.repeat(None)  # epoch e's record p at e * n + p, each epoch its own permutation
    if n < batch_size:
        # drop_remainder: the stream never ends, and without it grain sizes an endless stream of 1-record batches at
        # an int too large for an index (rl.prompts_per_step=1 failed)
        return records.batch(batch_size, drop_remainder=True, batch_fn=list)
    per_epoch = n // batch_size

    def batch(i: int, _) -> list[dict[str, Any]]:
        first = i // per_epoch * n + i % per_epoch * batch_size
        return [records[first + k] for k in range(batch_size)]

    return grain.MapDataset.range(per_epoch).repeat(None).map_with_index(batch)


class PromptIterator:
    """Batches of records with a JSON-able position: `state()` / `restore(state)`."""

    def __init__(self, dataset: grain.MapDataset):
        # Read in the caller, as asked: grain's default read 500 batches ahead on 16 threads (32,064 records for
        # one batch of 64), generating problems beside the rollout loop for batches a run may never draw
        self._it = iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    def __next__(self) -> list[dict[str, Any]]:
        return next(self._it)

    def __iter__(self):
        return self

    def state(self) -> dict[str, Any]:
        return self._it.get_state()

    def restore(self, state: dict[str, Any]) -> None:
        self._it.set_state(state)
