"""Ahead-of-time compiled program pool, backed by JAX's persistent compilation cache.

Static shapes instead of CUDA graphs: every (phase, batch bucket, length bucket) is one program,
compiled once with `jit(...).lower(...).compile()` and called directly afterwards, so an
unexpected shape is an error rather than a silent recompile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
from jax.sharding import Mesh
from tqdm import tqdm

log = logging.getLogger(__name__)


def enable_persistent_cache(directory: str | os.PathLike) -> Path:
    """Turns on JAX's on-disk compilation cache, so a second process compiles nothing it compiled before.

    Entry points (the CLI, scripts) call it with rollout.compile_cache_dir; it is process-wide JAX
    state, so library code never turns it on by itself. It also starts counting cache hits, which
    ProgramPool reports per program.
    """
    path = Path(directory).expanduser()
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current) != path:  # e.g. JAX_COMPILATION_CACHE_DIR
        log.warning("compilation cache already at %s; keeping it (asked for %s)", current, path)
        path = Path(current)
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _count_cache_hits()
    return path


def compile_error(e: BaseException) -> str:
    """A failed compile in one line for a log: its type and the first line of its message (XLA's run to pages)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__


_POOLS: weakref.WeakSet = weakref.WeakSet()  # every live ProgramPool, for cancel_background_compiles


def cancel_background_compiles() -> None:
    """Drops the compiles every pool has queued on its compile thread (Ctrl-C): at exit Python joins that
    thread after it has run its whole queue, so the process would otherwise compile them all before it
    ends. The compile already running finishes (XLA cannot be stopped midway). A process that goes on (a
    notebook) compiles the cancelled programs again, on a new thread, when next asked for them."""
    for pool in list(_POOLS):
        if pool._thread is not None:
            pool._thread.shutdown(wait=False, cancel_futures=True)
            pool._thread = None
            pool._pending = {k: f for k, f in pool._pending.items() if not f.cancelled()}


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


# The growth in memory maps, as a share of vm.max_map_count, that makes another drop worth it after one that
# left the process near the limit (5% of 65530: ~10 SmolLM2 programs).
MAP_GROWTH = 0.05
MAP_CEILING = 0.95  # past this share of the limit a pool drops whatever an earlier drop left


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the most Linux allows it: vm.max_map_count), or None where /proc
    does not tell."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class ProgramStats:
    key: Hashable
    compile_seconds: float
    temp_bytes: int
    argument_bytes: int
    from_cache: bool  # loaded from the persistent compilation cache instead of compiled
    background: bool = False  # compiled on the pool's compile thread while the caller went on


class ProgramPool:
    """Compiles programs on demand or up front, keyed by a hashable description of their shapes.

    `build(key)` returns (jitted function, example arguments); only their shapes, dtypes and
    shardings matter. `compiler_options(key)` gives the program's XLA options (None: defaults). `mesh`,
    when given, is set around each trace (jax.set_mesh), where ops that run per shard (the attention
    kernels, kernels/tree_attention/api.py) find it.

    XLA CPU maps each compiled kernel's code apart, ~300-370 memory maps per SmolLM2 program, and
    Linux refuses a process more than vm.max_map_count maps (65530 by default): at ~160 such programs
    the next compile failed with "LLVM compilation error: Cannot allocate memory". So before a compile
    that finds the process past `map_share` of the limit, the least recently used half of the
    programs is dropped (with JAX's in-memory copies: jax.clear_caches()); one reached again compiles
    again, from the persistent cache when that is on. `memory_maps` (maps held, limit) is replaceable
    for tests.

    `ready(key)` never blocks: a program not compiled yet starts compiling on the pool's one compile
    thread, and the caller does something else (the engine decodes plainly) until it is. Its seconds
    count apart from compile_seconds(), which are the seconds callers waited. A background compile's
    error is raised to the caller that next asks for that program, never to another.
    """

    def __init__(self, build: Callable[[Hashable], tuple[Callable, tuple]],
                 compiler_options: Callable[[Hashable], dict | None] = lambda key: None,
                 memory_maps: Callable[[], tuple[int, int] | None] = memory_maps, map_share: float = 0.8,
                 mesh: Mesh | None = None):
        self._build = build
        self._compiler_options = compiler_options
        self._mesh = mesh
        self._memory_maps, self._map_share = memory_maps, map_share
        self._programs: dict[Hashable, Callable] = {}  # least recently used first
        self.stats: dict[Hashable, ProgramStats] = {}  # of each key's latest compile
        self._compiles: dict[Hashable, float] = {}  # seconds over each key's compiles, recompiles included
        self._compile_seconds = 0.0
        self.background_seconds = 0.0  # compiling on the compile thread
        self._pending: dict[Hashable, Future] = {}  # compiling on the compile thread
        self._failed: dict[Hashable, BaseException] = {}  # background compiles that failed, not asked for since
        self._thread: ThreadPoolExecutor | None = None
        self.dropped = 0  # programs dropped to stay under the memory-map limit
        _POOLS.add(self)
        self._maps_after_drop = 0  # maps held right after the last drop: what dropping could not free

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._programs

    def get(self, key: Hashable) -> Callable:
        """The program of `key`, compiled first (or its background compile waited for) if need be."""
        self._raise_failed(key)
        if key in self._pending:
            t0 = time.perf_counter()
            self._collect(key)
            self._compile_seconds += time.perf_counter() - t0  # the caller waited that long
        elif key not in self._programs:
            self._make_room(wait=True)
            self._store(key, *self._compiled(key))
            self._compile_seconds += self.stats[key].compile_seconds
        self._programs[key] = self._programs.pop(key)  # now the most recently used
        return self._programs[key]

    def ready(self, key: Hashable) -> bool:
        """Whether `key`'s program can run without compiling; if not, it starts compiling in the background.
        One that can counts as used (the caller is about to run it: a drop must not take it first)."""
        if key in self._programs:
            self._programs[key] = self._programs.pop(key)
            return True
        self._raise_failed(key)
        future = self._pending.get(key)
        if future is None:
            if self._make_room(wait=False):  # a drop is due once the pending compiles end: no more maps meanwhile
                return False
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="compile")
            self._pending[key] = self._thread.submit(self._compiled, key)
            return False
        if not future.done():
            return False
        self._collect(key)
        return True

    def _collect(self, key: Hashable) -> None:
        """Stores the program of a background compile, once it is done (a compile error surfaces here, once:
        the next ask compiles again, as after a failed compile in front of the caller; an interrupted wait
        leaves the compile pending)."""
        try:
            result = self._pending[key].result()
        except Exception:
            del self._pending[key]
            raise
        del self._pending[key]
        self._store(key, *result, background=True)

    def _raise_failed(self, key: Hashable) -> None:
        if key in self._failed:
            raise self._failed.pop(key)

    def warm_up(self, keys: Iterable[Hashable], progress: bool = True) -> None:
        keys = [k for k in keys if k not in self._programs]
        for key in tqdm(keys, desc="compiling programs", file=sys.stderr, disable=not progress or not keys):
            self.get(key)

    def _compiled(self, key: Hashable) -> tuple[Callable, float, bool]:
        """(compiled program, seconds, whether the persistent cache served it); on either thread."""
        fn, args = self._build(key)
        hits = _CacheHits.count
        t0 = time.perf_counter()
        with jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext():
            lowered = fn.lower(*args)
        compiled = lowered.compile(compiler_options=self._compiler_options(key))
        return compiled, time.perf_counter() - t0, _CacheHits.count > hits

    def _store(self, key: Hashable, compiled, seconds: float, from_cache: bool, background: bool = False) -> None:
        memory = compiled.memory_analysis()
        self._programs[key] = compiled
        self._compiles[key] = self._compiles.get(key, 0.0) + seconds
        self.background_seconds += seconds if background else 0.0
        self.stats[key] = ProgramStats(
            key=key,
            compile_seconds=seconds,
            temp_bytes=getattr(memory, "temp_size_in_bytes", 0) if memory else 0,
            argument_bytes=getattr(memory, "argument_size_in_bytes", 0) if memory else 0,
            from_cache=from_cache,
            background=background,
        )

    def _make_room(self, wait: bool) -> bool:
        """Drops the least recently used half of the programs when the process is near its memory-map limit
        (after the running background compile, the queued ones cancelled: JAX's caches are cleared with no
        compile under way; without `wait`, a compile still under way puts the drop off, and it returns True: a drop
        is due; finished ones are collected and take part). Maps a drop did not free belong to something else
        (another engine's pool in this process): the next drop waits until the process holds MAP_GROWTH of the limit
        more than just after this one (or than the least seen since, when something else freed maps), instead of
        emptying the pool at every compile, but never past MAP_CEILING of the limit."""
        maps = self._memory_maps()
        if maps is not None:
            self._maps_after_drop = min(self._maps_after_drop, maps[0])
        if (maps is None or maps[0] < max(self._map_share * maps[1],
                                          min(self._maps_after_drop + MAP_GROWTH * maps[1], MAP_CEILING * maps[1]))
                or len(self._programs) + len(self._pending) < 2):
            return False
        if not wait and not all(future.done() for future in self._pending.values()):
            return True
        t0 = time.perf_counter()
        for key in [k for k, future in self._pending.items() if future.cancel()]:
            del self._pending[key]  # queued, not started: asked for again after the drop, not waited for now
        for key in list(self._pending):
            try:
                self._collect(key)
            except Exception as e:  # noqa: BLE001 - kept for the caller that asks for this program
                log.warning("a background compile of %s failed (%s); raised when that program is asked for next",
                            key, compile_error(e))
                self._failed[key] = e
        self._compile_seconds += time.perf_counter() - t0  # the caller waited for them
        drop = list(self._programs)[: len(self._programs) // 2]
        for key in drop:
            del self._programs[key]
        jax.clear_caches()  # JAX keeps its own reference to every executable it compiled
        gc.collect()
        after = self._memory_maps()
        self._maps_after_drop = after[0] if after else 0
        if not self.dropped:
            log.warning("process at %d of vm.max_map_count=%d memory maps (XLA CPU maps each compiled kernel "
                        "apart): dropped the %d least recently used programs, which recompile when reached "
                        "again; `sysctl -w vm.max_map_count=262144` keeps them", *maps, len(drop))
        self.dropped += len(drop)
        return False

    def compile_seconds(self) -> float:
        """Seconds callers waited for compiles over the pool's life, recompiles of dropped programs
        included (background compiles only for the part a caller waited on; background_seconds has them)."""
        return self._compile_seconds

    def report(self, where: Callable[[Hashable], bool] = lambda key: True) -> str:
        """Programs held, seconds over their keys' compiles (recompiles included) and memory, of the keys
        that satisfy `where`."""
        stats = [s for s in self.stats.values() if where(s.key) and s.key in self._programs]
        total = sum(t for key, t in self._compiles.items() if where(key))
        cached = sum(s.from_cache for s in stats)
        peak_temp = max((s.temp_bytes for s in stats), default=0)
        peak_args = max((s.argument_bytes for s in stats), default=0)
        dropped = f", {self.dropped} dropped near the memory-map limit" if self.dropped else ""
        background = sum(s.background for s in stats)
        background = f", {background} compiled in the background" if background else ""
        return (
            f"{len(stats)} programs ({cached} from the persistent cache) in {total:.1f}s{background}{dropped}, "
            f"largest arguments {peak_args / 2**20:.0f} MiB, largest scratch {peak_temp / 2**20:.0f} MiB"
        )
