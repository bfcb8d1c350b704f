"""Which backend runs an op: a pure choice from (platform, requested, available), and its fallbacks.

Every op in this package has a pure-JAX reference and compiled implementations (Pallas for GPU and
TPU, Triton for NVIDIA GPUs where one exists). `select_backend` orders the candidates: the requested
backend (for "auto", the platform's best), then the next ones down the fallback chain, keeping those
available here and naming the rest with the reason. An op's `api.py` tries them in that order and
logs each fallback once (`log_fallback_once`), so a run on an unexpected machine still works and says
so instead of failing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Sequence

import jax

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "pallas", "pallas_interpret", "triton")

# What each compiled backend needs, for the message when it is not available.
NEEDS = {
    "triton": "an NVIDIA GPU with jax-triton and triton installed (pip install 'fastrl-jax[gpu]')",
    "pallas": "a GPU or TPU",
}

# Tried in order after a backend is unavailable or fails to compile.
FALLBACKS = {
    "triton": ("pallas", "reference"),
    "pallas": ("reference",),
    "pallas_interpret": ("reference",),
    "reference": (),
}


@dataclasses.dataclass(frozen=True)
class Selection:
    """The backends to try, in order (never empty: the reference is always available), and the
    requested ones that are not available here with the reason."""

    order: tuple[str, ...]
    unavailable: tuple[tuple[str, str], ...]


def select_backend(platform: str, requested: str, available: Iterable[str], implemented: Sequence[str] = BACKENDS) -> Selection:
    """The backends an op tries for `requested` ("auto" or one of `implemented`) on `platform`
    ("cpu", "gpu", "tpu"), given the backends `available` on this process.

    "auto" is Triton then Pallas on a GPU, Pallas on a TPU, the reference elsewhere (on CPU XLA fuses
    the reference well and the interpreted Pallas kernel exists for tests). Pure: no JAX calls.
    """
    if requested == "auto":
        requested = {"gpu": "triton", "tpu": "pallas"}.get(platform, "reference")
        if requested not in implemented:
            requested = "pallas"
    if requested not in implemented:
        raise ValueError(f"unknown backend {requested!r}; expected 'auto' or one of {', '.join(implemented)}")
    available = set(available)
    chain = [b for b in (requested, *FALLBACKS[requested]) if b in implemented]
    order = tuple(b for b in chain if b in available)
    unavailable = tuple((b, f"needs {NEEDS.get(b, 'nothing more')}; this process runs on {platform}")
                        for b in chain if b not in available)
    return Selection(order, unavailable)


def available_backends(platform: str | None = None) -> list[str]:
    """Backends that can run on `platform` (default: JAX's default backend); cheap checks, nothing compiled."""
    platform = platform or jax.default_backend()
    names = ["reference", "pallas_interpret"]
    if platform in ("gpu", "tpu"):
        names.append("pallas")
    if platform == "gpu" and triton_importable():
        names.append("triton")
    return names


@functools.cache
def triton_importable() -> bool:
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception:  # jax-triton raises more than ImportError on a CPU-only jaxlib
        return False
    return True


@functools.cache
def log_fallback_once(op: str, backend: str, reason: str) -> None:
    """One warning per (op, backend, reason) over the process: a fallback is reported, not repeated."""
    logger.warning("%s: backend %r unavailable (%s); falling back", op, backend, reason)


def compile_failure(fn: Callable, args: Sequence[jax.ShapeDtypeStruct]) -> str | None:
    """Why `fn` does not compile for these argument shapes, or None. Triton and Mosaic can reject a
    kernel after tracing succeeded; checking first lets the op fall back instead of failing the
    caller's whole program at its compile. Cached per (fn, shapes).

    The kernel is checked whole, outside the caller's mesh: under the training programs' abstract mesh (no
    devices; rl.update.traced_under) a per-shard kernel's shard_map does not compile on its own, and the
    check would turn every compiled backend down. A shard's shapes are the whole's, fewer rows and heads.

    A failure for want of memory (a compile or autotuning while the device is full) is not kept: it may pass
    the next time, and kept it would turn the kernel off for the rest of the process."""
    key = (fn, tuple((tuple(a.shape), str(a.dtype)) for a in args))
    if key not in _COMPILE_CHECKS:
        why = _compile_check(*key)
        if why is not None and any(s in why for s in TRANSIENT):
            return why
        _COMPILE_CHECKS[key] = why
    return _COMPILE_CHECKS[key]


TRANSIENT = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")  # a compile failure that may pass the next time
_COMPILE_CHECKS: dict[tuple, str | None] = {}


def _compile_check(fn: Callable, key: tuple) -> str | None:
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in key]
    try:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            jax.jit(fn).lower(*args).compile()
    except (NotImplementedError, ImportError) as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # Triton / Mosaic errors come as many types, often with IR dumps
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return f"does not compile for {', '.join(f'{s} {d}' for s, d in key)}: {why}"
    return None


def selected(op: str, impls: dict[str, Callable], requested: str) -> Selection:
    """select_backend for op `op` in this process: an unknown name is refused, and each requested backend
    that is unavailable here is logged once."""
    if requested != "auto" and requested not in impls:
        raise ValueError(f"unknown {op} backend {requested!r}; expected 'auto' or one of {', '.join(impls)}")
    selection = select_backend(jax.default_backend(), requested, available_backends(), tuple(impls))
    for name, why in selection.unavailable:
        log_fallback_once(op, name, why)
    return selection


def usable(op: str, impls: dict[str, Callable], requested: str, args: Sequence, compiled: Iterable[str] = ()) -> list[str]:
    """select_backend's order for op `op` without the backends in `compiled` that do not compile for these
    argument shapes (each logged once); the reference, last, always stays."""
    compiled = set(compiled)
    order = []
    for name in selected(op, impls, requested).order:
        why = compile_failure(impls[name], [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]) if name in compiled else None
        if why is None:
            order.append(name)
        else:
            log_fallback_once(op, name, why)
    return order


def dispatch(op: str, impls: dict[str, Callable], requested: str, args: Sequence, compiled: Iterable[str] = ()):
    """Runs op `op` on the first backend of usable() that works: returns (output, backend), and records the
    backend in ran(). impls: backend name -> implementation(*args); NotImplementedError / ImportError from an
    implementation also moves on."""
    for name in usable(op, impls, requested, args, compiled):
        try:
            out = impls[name](*args)
        except (NotImplementedError, ImportError) as e:
            log_fallback_once(op, name, f"{type(e).__name__}: {e}")
            continue
        record(op, name)
        return out, name
    raise AssertionError(f"{op}: the reference backend does not fall back")


_RAN: dict[str, set[str]] = {}


def record(op: str, backend: str) -> None:
    """Notes that op `op` was traced with `backend` (dispatch does; so does a caller that picks the reference)."""
    _RAN.setdefault(op, set()).add(backend)


def ran(clear: bool = False) -> dict[str, list[str]]:
    """The backends each op was traced with in this process (since the last clear): what a benchmark ran, not what
    it asked for."""
    out = {op: sorted(names) for op, names in _RAN.items()}
    if clear:
        _RAN.clear()
    return out
