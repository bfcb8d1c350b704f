"""Files written whole or not at all: a temporary file beside the target, renamed onto it when complete."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; renamed onto `path` when the block ends, removed
    when it raises. A reader never sees half a file, and a kill mid-write leaves the previous file whole (and at
    most a hidden `.NAME.PID.tmp.SUFFIX` behind; the suffix is kept for writers that add their own, as np.savez)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    """`text` into `path` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def strict_json(value):
    """`value` with every float that is not finite (a ratio of nothing: acceptance without speculative steps) as
    None: json.dumps would write NaN / Infinity, which strict parsers (jq, JavaScript, Go) refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json(path: str | Path, value, indent: int | None = 2) -> None:
    """`value` as strict JSON (strict_json) into `path` through `replacing`."""
    write_text(path, json.dumps(strict_json(value), indent=indent, allow_nan=False) + "\n")
