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
    check would turn every compiled backend down. A shard's shapes are the whole's, fewer rows and heads."""
    key = tuple((tuple(a.shape), str(a.dtype)) for a in args)
    return _compile_failure(fn, key)


@functools.cache
def _compile_failure(fn: Callable, key: tuple) -> str | None:
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


def dispatch(op: str, impls: dict[str, Callable], requested: str, args: Sequence, compiled: Iterable[str] = ()):
    """Runs op `op` on the first backend of select_backend that works: returns (output, backend).

    impls: backend name -> implementation(*args). Backends in `compiled` are compile-checked for the
    argument shapes first; NotImplementedError / ImportError from an implementation also moves on.
    """
    selection = selected(op, impls, requested)
    compiled = set(compiled)
    for name in selection.order:
        if name in compiled:
            why = compile_failure(impls[name], [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
            if why is not None:
                log_fallback_once(op, name, why)
                continue
        try:
            return impls[name](*args), name
        except (NotImplementedError, ImportError) as e:
            log_fallback_once(op, name, f"{type(e).__name__}: {e}")
    raise AssertionError(f"{op}: the reference backend does not fall back")
