"""Ahead-of-time compiled program pool, backed by JAX's persistent compilation cache.

Static shapes instead of CUDA graphs: every (phase, batch bucket, length bucket) is one program,
compiled once with `jit(...).lower(...).compile()` and called directly afterwards, so an
unexpected shape is an error rather than a silent recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

import jax
from tqdm import tqdm

log = logging.getLogger(__name__)


def enable_persistent_cache(directory: str | os.PathLike) -> Path:
    """Turns on JAX's on-disk compilation cache, so a second process compiles nothing it compiled before.

    Entry points (the CLI, scripts) call it with rollout.compile_cache_dir; it is process-wide JAX
    state, so library code never turns it on by itself. It also starts counting cache hits, which
    ProgramPool reports per program.
    """
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current) != path:
        log.warning("compilation cache already at %s; keeping it (asked for %s)", current, path)
        return Path(current)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _count_cache_hits()
    return path


class _CacheHits:
    """Programs served by the persistent compilation cache over the process (pools compiling in several
    threads at once may credit a hit to the wrong program: the count only feeds reports)."""

    count = 0

    @classmethod
    def listen(cls, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            cls.count += 1


@functools.cache
def _count_cache_hits() -> None:
    """Registers the hit counter with jax.monitoring, once per process."""
    jax.monitoring.register_event_listener(_CacheHits.listen)


@dataclasses.dataclass
class ProgramStats:
    key: Hashable
    compile_seconds: float
    temp_bytes: int
    argument_bytes: int
    from_cache: bool  # loaded from the persistent compilation cache instead of compiled


class ProgramPool:
    """Compiles programs on demand or up front, keyed by a hashable description of their shapes.

    `build(key)` returns (jitted function, example arguments); only their shapes, dtypes and
    shardings matter. `compiler_options(key)` gives the program's XLA options (None: defaults).
    """

    def __init__(self, build: Callable[[Hashable], tuple[Callable, tuple]],
                 compiler_options: Callable[[Hashable], dict | None] = lambda key: None):
        self._build = build
        self._compiler_options = compiler_options
        self._programs: dict[Hashable, Callable] = {}
        self.stats: dict[Hashable, ProgramStats] = {}

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._programs

    def get(self, key: Hashable) -> Callable:
        if key not in self._programs:
            self._compile(key)
        return self._programs[key]

    def warm_up(self, keys: Iterable[Hashable], progress: bool = True) -> None:
        keys = [k for k in keys if k not in self._programs]
        for key in tqdm(keys, desc="compiling programs", file=sys.stderr, disable=not progress or not keys):
            self._compile(key)

    def _compile(self, key: Hashable) -> None:
        fn, args = self._build(key)
        hits = _CacheHits.count
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile(compiler_options=self._compiler_options(key))
        seconds = time.perf_counter() - t0
        memory = compiled.memory_analysis()
        self._programs[key] = compiled
        self.stats[key] = ProgramStats(
            key=key,
            compile_seconds=seconds,
            temp_bytes=getattr(memory, "temp_size_in_bytes", 0) if memory else 0,
            argument_bytes=getattr(memory, "argument_size_in_bytes", 0) if memory else 0,
            from_cache=_CacheHits.count > hits,
        )

    def compile_seconds(self) -> float:
        return sum(s.compile_seconds for s in self.stats.values())

    def report(self, where: Callable[[Hashable], bool] = lambda key: True) -> str:
        """Count, compile seconds and memory of the programs whose key satisfies `where`."""
        stats = [s for s in self.stats.values() if where(s.key)]
        total = sum(s.compile_seconds for s in stats)
        cached = sum(s.from_cache for s in stats)
        peak_temp = max((s.temp_bytes for s in stats), default=0)
        peak_args = max((s.argument_bytes for s in stats), default=0)
        return (
            f"{len(stats)} programs ({cached} from the persistent cache) in {total:.1f}s, "
            f"largest arguments {peak_args / 2**20:.0f} MiB, largest scratch {peak_temp / 2**20:.0f} MiB"
        )
