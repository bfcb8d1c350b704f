"""Prompt files: JSON lines, and the {"prompt": text} / {"prompt_ids": [ints]} prompt format."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def jsonl_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, line, parsed value) of each non-blank line; invalid JSON names the line."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON ({e})") from e
        yield n, line, row


def read_prompt_file(path: str | Path, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Token ids per line: `encode(text)` for {"prompt": text}, the ids as given for {"prompt_ids": [...]}."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found")
    prompts = []
    for n, line, row in jsonl_rows(path):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(encode(row["prompt"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt_ids"), list):
            prompts.append([int(t) for t in row["prompt_ids"]])
        else:
            raise ValueError(f'{path}:{n} needs {{"prompt": text}} or {{"prompt_ids": [ints]}}, got {line[:80]!r}')
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
