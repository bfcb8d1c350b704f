"""Prompt pipelines on grain: JSONL / Parquet files or the built-in math generator -> shuffled, repeated batches.

A record is {"prompt": str} or {"messages": [{"role", "content"}, ...]}, plus "answer" (the
ground truth the reward compares with). File sources are read whole into memory (prompt sets are
small next to the rollouts they drive) and checked once, so a missing field fails at start-up with
the file and row named. The iterator's position is a small JSON dict (grain's iterator state),
saved with every checkpoint so a resumed run continues with the next batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain

from fastrl_jax.data import math_problems
from fastrl_jax.data.prompt_files import jsonl_rows

MATH_SOURCE = "math"
_MATH_LEN = 1 << 30  # the generator is unbounded; grain wants a length


class MathSource:
    """Random-access view of the built-in math problem stream `seed` (grain RandomAccessDataSource)."""

    def __init__(self, seed: int, levels: Sequence[int]):
        self.seed, self.levels = seed, tuple(levels)
        math_problems.problem(seed, 0, self.levels)  # checks the levels now

    def __len__(self) -> int:
        return _MATH_LEN

    def __getitem__(self, index: int) -> dict[str, Any]:
        p = math_problems.problem(self.seed, int(index), self.levels)
        return {"prompt": p.question, "answer": str(p.answer), "level": p.level}


def read_records(path: str | Path, prompt_field: str = "prompt", messages_field: str = "messages",
                 answer_field: str = "answer") -> list[dict[str, Any]]:
    """Reads a .jsonl or .parquet prompt file into records {"prompt"|"messages", "answer"}."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} not found (data.source / data.eval_source)")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = [row for _, _, row in jsonl_rows(path)]
    else:
        raise ValueError(f"dataset file {path} must be .jsonl or .parquet, got {path.suffix!r}")
    if not rows:
        raise ValueError(f"dataset file {path} has no records")
    records = []
    for n, row in enumerate(rows, 1):
        where = f"{path} record {n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} is not an object: {str(row)[:80]}")
        if answer_field not in row or row[answer_field] is None:
            raise ValueError(f"{where} has no '{answer_field}' field (set data.answer_field); keys: {sorted(row)}")
        record = {"answer": str(row[answer_field])}
        if isinstance(row.get(prompt_field), str):
            record["prompt"] = row[prompt_field]
        elif isinstance(row.get(messages_field), list) and row[messages_field]:
            record["messages"] = [{"role": m["role"], "content": m["content"]} for m in row[messages_field]]
        else:
            raise ValueError(
                f"{where} needs a '{prompt_field}' string or a '{messages_field}' list "
                f"(set data.prompt_field / data.messages_field); keys: {sorted(row)}"
            )
        records.append(record)
    return records


def source(spec: str, seed: int, levels: Sequence[int] = math_problems.LEVELS, **fields) -> Any:
    """A grain random-access source: the math generator (spec 'math') or a prompt file."""
    if spec == MATH_SOURCE:
        return MathSource(seed, levels)
    return read_records(spec, **fields)


def prompt_batches(src: Any, batch_size: int, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """Shuffled (per epoch, from `seed`), repeated forever, batched into lists of records."""
    ds = grain.MapDataset.source(src)
    if shuffle and len(src) < _MATH_LEN:  # the generator is random already; a 2^30 permutation is wasted work
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None).batch(batch_size, batch_fn=list)


class PromptIterator:
    """Batches of records with a JSON-able position: `state()` / `restore(state)`."""

    def __init__(self, dataset: grain.MapDataset):
        self._it = iter(dataset)

    def __next__(self) -> list[dict[str, Any]]:
        return next(self._it)

    def __iter__(self):
        return self

    def state(self) -> dict[str, Any]:
        return self._it.get_state()

    def restore(self, state: dict[str, Any]) -> None:
        self._it.set_state(state)


def prompt_ids(record: dict[str, Any], tokenizer, instruction: str = "", chat_template: bool = True) -> list[int]:
    """Token ids of a record's prompt: its messages (or prompt + instruction as one user turn)
    through the tokenizer's chat template, or the plain text when chat_template is False."""
    if "messages" in record:
        messages = list(record["messages"])
    else:
        text = record["prompt"] + (f" {instruction}" if instruction else "")
        messages = [{"role": "user", "content": text}]
    if chat_template and tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tokenizer.encode("\n".join(m["content"] for m in messages))
