"""Prompt files: JSON lines, the {"prompt": text} / {"prompt_ids": [ints]} prompt format, and RL prompt
records (JSONL or Parquet with an answer), read whole and checked once so a missing field fails at
start-up with the file and row named."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any


def read_text(path: Path) -> str:
    """A prompt file's text: UTF-8, a leading byte-order mark (Windows editors write one) dropped."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None


def checked_file(path: str | Path, what: str) -> Path:
    """`path` (~ expanded) when it is a file; else FileNotFoundError naming `what` (a directory says so)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise FileNotFoundError(f"{what} {path} is a directory; give a file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found")
    return path


def jsonl_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, line, parsed value) of each non-blank line; invalid JSON names the line."""
    for n, line in enumerate(read_text(path).split("\n"), 1):  # not splitlines: U+2028 etc. may sit inside strings
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON ({e})") from e
        yield n, line, row


def read_prompt_file(path: str | Path, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Token ids per line: `encode(text)` for {"prompt": text}, the ids as given for {"prompt_ids": [...]}."""
    path = checked_file(path, "prompts file")
    prompts = []
    for n, line, row in jsonl_rows(path):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(encode(row["prompt"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt_ids"), list):
            if not row["prompt_ids"] or any(type(t) is not int or t < 0 for t in row["prompt_ids"]):
                raise ValueError(f"{path}:{n}: prompt_ids must be a non-empty list of token ids (ints >= 0), "
                                 f"got {str(row['prompt_ids'])[:80]}")
            prompts.append(row["prompt_ids"])
        else:
            raise ValueError(f'{path}:{n} needs {{"prompt": text}} or {{"prompt_ids": [ints]}}, got {line[:80]!r}')
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _field(row: dict, name: str) -> Any:
    """row[name], or for a dotted name 'a.b' without a key of its own row[a][b]; None where absent."""
    if name in row:
        return row[name]
    for key in name.split("."):
        row = row.get(key) if isinstance(row, dict) else None
    return row


def read_records(path: str | Path, prompt_field: str = "prompt", messages_field: str = "messages",
                 answer_field: str = "answer") -> list[dict[str, Any]]:
    """Reads a .jsonl or .parquet prompt file into records {"prompt"|"messages", "answer"} (with verl's data_source
    and extra_info where a row has them, for a verl compute_score reward); a dotted field name
    names a nested field (verl's files: reward_model.ground_truth, extra_info.question), and a prompt_field
    holding a list of messages (verl's files) is the record's messages."""
    path = checked_file(path, "dataset file")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for i, field in enumerate(table.schema):  # a float32 0.1 widens to 0.10000000149011612: its own digits instead
            if field.type == pa.float32():
                table = table.set_column(i, field.name, pc.cast(pc.cast(table.column(i), pa.string()), pa.float64()))
        rows = table.to_pylist()
    elif path.suffix == ".jsonl":
        rows = [row for _, _, row in jsonl_rows(path)]
    elif path.suffix == ".json":  # one array of records
        try:
            rows = json.loads(read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset file {path} is not valid JSON ({e}); JSON lines go in a .jsonl file") from e
        if not isinstance(rows, list):
            raise ValueError(f"dataset file {path} must hold a JSON array of records, got {type(rows).__name__}")
    else:
        raise ValueError(f"dataset file {path} must be .jsonl, .json (an array) or .parquet, got {path.suffix!r}")
    if not rows:
        raise ValueError(f"dataset file {path} has no records")
    records = []
    for n, row in enumerate(rows, 1):
        where = f"{path} record {n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} is not an object: {str(row)[:80]}")
        answer = _field(row, answer_field)
        if answer is None:
            raise ValueError(f"{where} has no '{answer_field}' (absent or null; set data.answer_field); keys: {sorted(row)}")
        if isinstance(answer, (dict, list)):  # its str() would match no completion: every reward 0, silently
            raise ValueError(f"{where}: '{answer_field}' holds {str(answer)[:80]}, not an answer; name the field inside "
                             f"it, e.g. data.answer_field=reward_model.ground_truth for verl's files")
        if not str(answer).strip():  # names no answer: no completion could earn the reward, or an empty one would
            raise ValueError(f"{where}: '{answer_field}' is blank; give each record its answer")
        if isinstance(answer, (float, Decimal)) and not math.isfinite(answer):  # a missing value in a numeric column
            raise ValueError(f"{where}: '{answer_field}' is {answer}, not an answer; give each record its answer")
        if isinstance(answer, (float, Decimal)):  # str(1e-05) is '1e-05' (a parquet decimal's '1.0E-7'), a form no
            answer = format(Decimal(repr(answer)) if isinstance(answer, float) else answer, "f")  # answer matches
        record = {"answer": str(answer)}
        # verl's files keep the chat messages in their "prompt" field
        prompt, messages = _field(row, prompt_field), _field(row, messages_field)
        chat, turns = (messages_field, messages) if isinstance(messages, list) else (prompt_field, prompt)
        if isinstance(prompt, str):
            if not prompt.strip():  # asks nothing; untemplated, an empty prompt fails the step that draws it
                raise ValueError(f"{where}: '{prompt_field}' is blank; give it its question, or drop the record")
            record["prompt"] = prompt
        elif isinstance(turns, list) and turns:
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in turns):
                raise ValueError(f"{where}: each of '{chat}' must be {{\"role\": str, \"content\": str}}, "
                                 f"got {str(turns)[:80]}")
            if turns[-1]["role"] == "assistant":  # an SFT record: its answer would sit in the prompt
                raise ValueError(f"{where}: '{chat}' ends with an assistant turn, which the prompt would hold (the "
                                 "answer, in an SFT file); drop that turn, so the policy writes it")
            record["messages"] = [{"role": m["role"], "content": m["content"]} for m in turns]
        else:
            raise ValueError(
                f"{where} needs a '{prompt_field}' string or a '{messages_field}' list "
                f"(set data.prompt_field / data.messages_field); keys: {sorted(row)}"
            )
        for key in ("data_source", "extra_info"):  # verl's columns, which its compute_score takes (rl.rewards)
            if row.get(key) is not None:
                record[key] = row[key]
        records.append(record)
    return records
