"""Files written whole or not at all: a temporary file beside the target, renamed onto it when complete."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; renamed onto `path` when the block ends, removed
    when it raises. A reader never sees half a file, and a kill mid-write leaves the previous file whole and a
    hidden `.NAME.HOST.PID.tmp.SUFFIX` behind (the suffix kept for writers that add their own, as np.savez),
    which the next write of `path` on this host removes once that process is gone (a killed dequantization of
    a GGUF left 0.5 GB in the cache for good)."""
    path = Path(path)
    host = socket.gethostname().replace("/", "_")
    _remove_orphans(path, host)
    tmp = path.with_name(f".{path.name}.{host}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# A temporary untouched this long is no write under way: a writer fills it as it goes.
ORPHAN_AGE_S = 3600


def _remove_orphans(path: Path, host: str) -> None:
    """Removes the temporaries of `path` that processes of this host no longer running left behind, once untouched
    for ORPHAN_AGE_S (another host's, on a shared file system, may be under way; so may a write of another container
    with this host name, whose process ids this one cannot see)."""
    prefix = f".{path.name}.{host}."
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*.tmp{glob.escape(path.suffix)}"):
        pid = tmp.name[len(prefix):].split(".", 1)[0]
        try:
            if pid.isdigit() and not _running(int(pid)) and time.time() - tmp.stat().st_mtime > ORPHAN_AGE_S:
                tmp.unlink()
        except FileNotFoundError:  # removed meanwhile, by its writer's rename or another cleanup
            pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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
