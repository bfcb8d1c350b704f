"""Masked (tree) attention: each new token attends to the cache slots its mask row allows.

One function, `masked_attention`, serves the policy's decode, prefill and tree-verify
forwards: every new token sees its row's cached prefix plus its ancestors in the draft tree
(decode and prefill are the causal special case). Behind it sit three implementations:

- `masked_attention_ref`: pure JAX, the default on CPU, where XLA fuses it well.
- `masked_attention_pallas`: a Pallas kernel for GPU (Triton lowering) and TPU (Mosaic);
  runs on CPU with `interpret=True`, which is how the tests check it.
- `masked_attention_triton`: NVIDIA GPUs only, a Triton kernel launched through jax-triton
  (kernels/attention_triton.py, imported only when called).

The dispatcher tries the chosen backend, then the next one on NotImplementedError or
ImportError, and logs each fallback once. The compiled kernels (pallas, triton) are first
compiled once per shape signature, so a Triton / Mosaic lowering failure on the device also
falls back instead of breaking the caller's program. `last_backend()` names the backend that ran.

Shapes (all backends):
  q    [B, T, KV, G, D]  new tokens' queries, already scaled by 1/sqrt(D); G query heads per KV head
  k, v [B, KV, S, D]     the attention window of the cache (new keys already placed in it)
  mask [B, T, S] bool    which slots each new token sees; every (b, t) row has a True
  out  [B, T, KV, G, D]  in q.dtype; the softmax runs over S in float32
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "pallas", "pallas_interpret", "triton")

# Tried in order after the named backend fails with NotImplementedError / ImportError.
_FALLBACKS = {
    "triton": ("pallas", "reference"),
    "pallas": ("reference",),
    "pallas_interpret": ("reference",),
    "reference": (),
}

# A large finite negative instead of -inf: exp(MASK - m) is 0 without inf - inf = nan when a
# whole key block of a row is masked (the flash-attention convention).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

_last_backend: str | None = None
_logged_fallbacks: set[tuple[str, str]] = set()


def masked_attention(q, k, v, mask, *, backend: str = "auto"):
    """q [B, T, KV, G, D] (already scaled by 1/sqrt(D)), k, v [B, KV, S, D], mask [B, T, S] bool
    -> [B, T, KV, G, D] in q.dtype. Softmax over S in float32, masked entries excluded.
    Every (b, t) row has at least one True in mask.

    backend: "auto" (by jax.default_backend(): cpu -> reference, gpu -> triton if jax-triton
    imports else pallas, tpu -> pallas), or one of BACKENDS. A backend that raises
    NotImplementedError or ImportError hands over to the next (triton -> pallas -> reference),
    with one logged warning per (backend, reason).
    """
    _check_shapes(q, k, v, mask)
    if backend == "auto":
        backend = _auto_backend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected 'auto' or one of {', '.join(BACKENDS)}")
    global _last_backend
    for name in (backend, *_FALLBACKS[backend]):
        try:
            if name in _COMPILE_CHECKED:
                _check_compiles(name, q, k, v, mask)
            out = _IMPLS[name](q, k, v, mask)
        except (NotImplementedError, ImportError) as e:
            _log_fallback_once(name, e)
            continue
        _last_backend = name
        return out
    raise AssertionError("unreachable: the reference backend does not fall back")


def cached_attention(q, k_cached, v_cached, k_new, v_new, start, mask, *, backend: str = "auto"):
    """Attention of T new tokens over a cache window in which slots [start, start + T) are theirs.

    q [B, T, KV, G, D] (scaled), k_cached, v_cached [B, KV, S, D] (what slots [start, start + T)
    hold is ignored), k_new, v_new [B, KV, T, D] the new tokens' keys and values, start [B] int32,
    mask [B, T, S] bool as in `masked_attention` (slot start + j stands for new token j).

    The reference backend scores the cached slots and the new tokens apart, under one softmax, and
    so never builds the window with the new keys placed in it, a copy of the whole window at every
    layer (SmolLM2 decode and verify steps on CPU: 4-20% faster without it). The kernels get the
    placed window.
    """
    backend = _auto_backend() if backend == "auto" else backend
    if backend != "reference":
        k_win, v_win = (place_new_tokens(c, n, start) for c, n in ((k_cached, k_new), (v_cached, v_new)))
        return masked_attention(q, k_win, v_win, mask, backend=backend)
    _check_shapes(q, k_cached, v_cached, mask)
    global _last_backend
    _last_backend = "reference"
    B, T, KV, G, D = q.shape
    S = k_cached.shape[2]
    rel = jnp.arange(S)[None, :] - start[:, None]  # [B, S] slot relative to the first new token
    cached_mask = mask & ~((rel >= 0) & (rel < T))[:, None, :]
    slots = start[:, None] + jnp.arange(T)[None, :]  # [B, T] slot of each new token
    idx = jnp.broadcast_to(jnp.minimum(slots, S - 1)[:, None, :], (B, T, T))
    new_mask = jnp.take_along_axis(mask, idx, axis=2) & (slots < S)[:, None, :]

    if T <= SMALL_QUERY_BLOCK:  # decode and tree verification: (batch, kv head) as two batch dimensions

        def scores(k, m):  # [B, KV, G, T, n] float32, masked entries -inf
            s = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
            return s + mask_bias(m)[:, None, None]

        def weighted(p, v):  # sum over the slots of p x v: [B, KV, G, T, D] float32
            return jnp.einsum("bkgts,bksd->bkgtd", p.astype(q.dtype), v, preferred_element_type=jnp.float32)

    else:  # prefill chunks and training sequences: (batch, kv head) flattened into one
        qg = q.transpose(0, 2, 3, 1, 4).reshape(B * KV, G * T, D)

        def scores(k, m):
            s = jax.lax.dot_general(qg, k.reshape(B * KV, -1, D), (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
            return s.reshape(B, KV, G, T, -1) + mask_bias(m)[:, None, None]

        def weighted(p, v):
            p = p.astype(q.dtype).reshape(B * KV, G * T, -1)
            out = jax.lax.dot_general(p, v.reshape(B * KV, -1, D), (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
            return out.reshape(B, KV, G, T, D)

    s_cached, s_new = scores(k_cached, cached_mask), scores(k_new, new_mask)
    m = jax.lax.stop_gradient(jnp.maximum(s_cached.max(-1, keepdims=True), s_new.max(-1, keepdims=True)))
    p_cached, p_new = jnp.exp(s_cached - m), jnp.exp(s_new - m)
    total = p_cached.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)
    out = (weighted(p_cached, v_cached) + weighted(p_new, v_new)) / total
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4)


# The largest query block (new tokens per row) cached_attention contracts with (batch, kv head) as two
# dot batch dimensions; longer blocks flatten them into one. Measured on this CPU, SmolLM2 layers:
# two dimensions made a batch-64 decode step at 640 slots 285 ms instead of 900 (batch 16: 95 vs
# 118), and 128-token blocks 10-25% slower than one flattened dimension.
SMALL_QUERY_BLOCK = 16


def mask_bias(mask: jax.Array) -> jax.Array:
    """0 where mask is True, -inf where False, to add to the scores: XLA CPU's YNNPACK fusion ran a
    jnp.where select after a flattened batched score dot 3-4x slower once the window passed 512
    slots (batch 64, 640 slots: 30 vs 8.7 ms a layer). Adding 0 leaves a score as it was.
    """
    return jnp.where(mask, 0.0, -jnp.inf).astype(jnp.float32)


def place_new_tokens(cached: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cached [B, KV, S, D] with new [B, KV, T, D] in slots [start, start + T) of each row (a select
    that fuses into the window's copy; slots past S are dropped)."""
    B, KV, S, _ = cached.shape
    T = new.shape[2]
    rel = jnp.arange(S)[None, :] - start[:, None]
    in_block = ((rel >= 0) & (rel < T))[:, None, :, None]
    idx = jnp.broadcast_to(jnp.clip(rel, 0, T - 1)[:, None, :, None], (B, KV, S, 1))
    return jnp.where(in_block, jnp.take_along_axis(new, idx, axis=2), cached)


def available_backends() -> list[str]:
    """Backends that can run on this process's default JAX backend (cheap checks, nothing compiled)."""
    platform = jax.default_backend()
    names = ["reference", "pallas_interpret"]
    if platform in ("gpu", "tpu"):
        names.append("pallas")
    if platform == "gpu" and _triton_importable():
        names.append("triton")
    return names


def last_backend() -> str | None:
    """The backend the latest `masked_attention` call ran (set at trace time under jit)."""
    return _last_backend


def masked_attention_ref(q, k, v, mask):
    """Pure-JAX masked attention; same contract as `masked_attention`. (batch, kv head) flattened
    into one dot batch dimension; `cached_attention`, which the decoder calls, picks the form by
    query block length."""
    _check_shapes(q, k, v, mask)
    B, T, KV, G, D = q.shape
    S = k.shape[2]
    qg = q.transpose(0, 2, 3, 1, 4).reshape(B * KV, G * T, D)
    s = jax.lax.dot_general(
        qg, k.reshape(B * KV, S, D), (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32
    ).reshape(B, KV, G, T, S)
    s = s + mask_bias(mask)[:, None, None]
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jax.lax.dot_general(p.reshape(B * KV, G * T, S), v.reshape(B * KV, S, D), (((2,), (1,)), ((0,), (0,))))
    return out.reshape(B, KV, G, T, D).transpose(0, 3, 1, 2, 4)


def masked_attention_triton(q, k, v, mask):
    """NVIDIA-GPU-only Triton kernel through jax-triton; same contract as `masked_attention`.

    Raises ImportError where jax-triton / triton do not import (any CPU-only jaxlib) and
    NotImplementedError off GPU or for head dims Triton cannot tile. Not testable on CPU: the
    kernel's arithmetic is checked under Triton's interpreter when triton is installed
    (tests/test_kernels.py), the jax-triton launch only on a GPU.
    """
    _check_shapes(q, k, v, mask)
    if jax.default_backend() != "gpu":
        raise NotImplementedError(f"the triton backend needs an NVIDIA GPU; JAX's backend is {jax.default_backend()!r}")
    try:
        from fastrl_jax.kernels import attention_triton  # imports jax_triton and triton
    except Exception as e:  # jax-triton fails in more ways than ImportError on a mismatched jaxlib
        raise ImportError(f"jax-triton / triton do not import: {e}") from e
    return attention_triton.masked_attention(q, k, v, mask)


# --------------------------------------------------------------------------------------------
# Pallas kernel


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes of the Pallas kernel on one platform.

    block_t: new tokens per program (grid axis 2); rows are padded to a power of two >= min_rows.
    block_s: key slots per online-softmax step; halved down to min_block_s when S is smaller.
    mask_dtype: how the mask travels into the kernel (Mosaic keeps no bool memrefs; int8 is
      4x less traffic than int32 where the backend loads it natively).
    num_warps, num_stages: Triton launch parameters (GPU only).
    """

    block_t: int
    block_s: int
    min_rows: int
    min_block_s: int
    mask_dtype: str
    num_warps: int = 4
    num_stages: int = 2


# Starting points, not tuned on hardware yet (no accelerator here). GPU: rows and key blocks
# >= 16 because Triton's tl.dot needs M, N, K >= 16; block_t 32 keeps G float32 accumulators
# [32, D] in registers for G up to ~8. TPU: key blocks lane-aligned (128), rows a multiple of
# the 16-row bf16 sublane tile; each program stages its whole key row [S, D] and mask rows
# [block_t, S] in VMEM, which bounds S (a window that does not fit fails to compile and the
# dispatcher falls back). "interpret" uses small blocks so that CPU tests cover several key
# blocks, the ragged last block and several token blocks.
BLOCK_TABLE: dict[str, BlockConfig] = {
    "gpu": BlockConfig(block_t=32, block_s=64, min_rows=16, min_block_s=16, mask_dtype="int8"),
    "tpu": BlockConfig(block_t=64, block_s=512, min_rows=16, min_block_s=128, mask_dtype="int32"),
    "interpret": BlockConfig(block_t=16, block_s=32, min_rows=8, min_block_s=8, mask_dtype="int8"),
}


def masked_attention_pallas(q, k, v, mask, interpret: bool = False, platform: str | None = None):
    """Pallas masked attention; same contract as `masked_attention`.

    Grid (B, KV, token blocks). Each program keeps its queries [G, block_t, D] resident and
    walks the row's keys in blocks of block_s with an online softmax (one float32 accumulator
    per query head of the group, so each key block is read once for all G heads). When S is
    not a multiple of block_s, a last block ending at S re-reads part of the previous one and
    masks the overlap, so the cache is never padded or copied.

    interpret=True runs the kernel through Pallas's interpreter (any platform, tests);
    otherwise it needs a GPU or TPU and raises NotImplementedError elsewhere. platform ("gpu" /
    "tpu", default jax.default_backend()) picks the block table row and the lowering, so that
    the kernel can be exported for an accelerator from a CPU host (jax.export).
    On GPU it lowers through Pallas's Triton backend (jax >= 0.10 defaults to Mosaic GPU, whose
    pallas_call would stage whole key rows in shared memory).
    """
    _check_shapes(q, k, v, mask)
    if interpret:
        platform = "interpret"
    elif platform is None:
        platform = jax.default_backend()
    if platform not in BLOCK_TABLE:
        raise NotImplementedError(
            f"the pallas backend compiles for GPU or TPU, not {platform!r}; use pallas_interpret to run it here"
        )
    cfg = BLOCK_TABLE[platform]
    B, T, KV, G, D = q.shape
    S = k.shape[2]
    if platform == "gpu" and (D < 16 or D & (D - 1)):
        raise NotImplementedError(f"the Pallas GPU kernel needs a power-of-two head dim >= 16, got D={D}")

    t_pad = max(cfg.min_rows, pl.next_power_of_2(T))
    block_t = min(t_pad, cfg.block_t)
    qt = q.transpose(0, 2, 3, 1, 4)  # [B, KV, G, T, D]: small, unlike the cache
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, 0), (0, t_pad - T), (0, 0)))
    # Padded token rows see nothing; the kernel's l == 0 guard keeps them finite, and they are
    # cut off below.
    m = jnp.pad(mask, ((0, 0), (0, t_pad - T), (0, 0))).astype(cfg.mask_dtype)
    if S < cfg.min_block_s:  # only tiny windows are padded; real caches are far longer
        pad = ((0, 0), (0, 0), (0, cfg.min_block_s - S), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        m = jnp.pad(m, ((0, 0), (0, 0), (0, cfg.min_block_s - S)))
        S = cfg.min_block_s
    block_s = cfg.block_s
    while block_s > S:
        block_s //= 2

    kernel = functools.partial(
        _pallas_kernel,
        block_s=block_s,
        precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT,
    )
    q_spec = pl.BlockSpec((None, None, G, block_t, D), lambda b, h, i: (b, h, 0, i, 0))
    kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(B, KV, t_pad // block_t),
        in_specs=[q_spec, kv_spec, kv_spec, pl.BlockSpec((None, block_t, S), lambda b, h, i: (b, i, 0))],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((B, KV, G, t_pad, D), q.dtype),
        interpret=interpret,
        compiler_params=_compiler_params(platform, cfg),
        name="masked_attention",
    )(qt, k, v, m)
    return out[:, :, :, :T].transpose(0, 3, 1, 2, 4)


def _compiler_params(platform: str, cfg: BlockConfig):
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    return None


def _pallas_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, *, block_s: int, precision):
    """One (b, kv head, token block): q_ref/o_ref [G, bt, D], k_ref/v_ref [S, D], mask_ref [bt, S].

    Only features both Pallas GPU (Triton) and TPU (Mosaic) lower: ref indexing with pl.ds,
    2-D iota, fori_loop, dot_general, elementwise jnp and keepdims reductions. The G heads are
    a static Python loop with separate accumulators because Triton cannot slice a register
    tile, and G need not be a power of two.
    """
    G, bt, D = q_ref.shape
    S = k_ref.shape[0]
    n_full = S // block_s
    qs = [q_ref[g] for g in range(G)]
    nt = (((1,), (1,)), ((), ()))  # q [bt, D] . k [bs, D] -> [bt, bs]
    nn = (((1,), (0,)), ((), ()))  # p [bt, bs] . v [bs, D] -> [bt, D]

    def attend(start, carry, first_new=None):
        rows = pl.ds(start, block_s)
        k, v = k_ref[rows, :], v_ref[rows, :]
        valid = mask_ref[:, rows] != 0
        if first_new is not None:  # the ragged last block: slots before first_new are done
            slot = start + jax.lax.broadcasted_iota(jnp.int32, (bt, block_s), 1)
            valid = valid & (slot >= first_new)
        new = []
        for qg, (acc, m, l) in zip(qs, carry):
            s = jax.lax.dot_general(qg, k, nt, precision=precision, preferred_element_type=jnp.float32)
            s = jnp.where(valid, s, _MASK_VALUE)
            m_next = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m - m_next)
            p = jnp.where(valid, jnp.exp(s - m_next), 0.0)
            l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
            pv = jax.lax.dot_general(p.astype(v.dtype), v, nn, precision=precision, preferred_element_type=jnp.float32)
            new.append((alpha * acc + pv, m_next, l))
        return tuple(new)

    init = tuple(
        (
            jnp.zeros((bt, D), jnp.float32),
            jnp.full((bt, 1), _MASK_VALUE, jnp.float32),
            jnp.zeros((bt, 1), jnp.float32),
        )
        for _ in range(G)
    )
    carry = jax.lax.fori_loop(0, n_full, lambda i, c: attend(pl.multiple_of(i * block_s, block_s), c), init)
    if S % block_s:
        carry = attend(S - block_s, carry, first_new=n_full * block_s)
    for g, (acc, _, l) in enumerate(carry):
        o_ref[g] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


# --------------------------------------------------------------------------------------------
# Dispatch helpers


def _check_shapes(q, k, v, mask) -> None:
    """Raises ValueError naming the offending shapes; static, so it costs nothing under jit."""

    def fail(why):
        raise ValueError(
            f"masked_attention: {why}. Expected q [B, T, KV, G, D], k and v [B, KV, S, D], mask [B, T, S] bool; "
            f"got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}, "
            f"mask {tuple(mask.shape)} {mask.dtype}"
        )

    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4 or mask.ndim != 3:
        fail("wrong ranks")
    if k.shape != v.shape:
        fail("k and v shapes differ")
    B, T, KV, G, D = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (B, KV, D):
        fail("k/v batch, kv-head or head-dim size does not match q")
    if mask.shape != (B, T, k.shape[2]):
        fail("mask is not [B, T, S]")
    if mask.dtype != jnp.bool_:
        fail("mask must be bool")
    if not (q.dtype == k.dtype == v.dtype):
        fail("q, k and v dtypes differ")


def _auto_backend() -> str:
    platform = jax.default_backend()
    if platform == "gpu":
        return "triton" if _triton_importable() else "pallas"
    if platform == "tpu":
        return "pallas"
    return "reference"


@functools.cache
def _triton_importable() -> bool:
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception:  # jax-triton raises more than ImportError on a CPU-only jaxlib
        return False
    return True


# Kernels whose lowering can fail after tracing succeeded (Triton / Mosaic reject a shape or an
# op): the dispatcher compiles them once per signature before use, so such a failure falls back
# instead of breaking the caller's whole program at its compile.
_COMPILE_CHECKED = frozenset({"pallas", "triton"})
_compile_failures: dict[tuple, str | None] = {}


def _check_compiles(name: str, q, k, v, mask) -> None:
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, mask)]
    key = (name, *((a.shape, str(a.dtype)) for a in args))
    if key not in _compile_failures:
        try:
            jax.jit(_IMPLS[name]).lower(*args).compile()
            _compile_failures[key] = None
        except (NotImplementedError, ImportError):
            raise
        except Exception as e:  # Triton / Mosaic errors come as many types, often with IR dumps
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            q_aval, S = args[0], args[1].shape[2]
            _compile_failures[key] = f"does not compile for q {q_aval.shape} {q_aval.dtype}, S={S}: {why}"
    if _compile_failures[key] is not None:
        raise NotImplementedError(_compile_failures[key])


def _log_fallback_once(name: str, error: Exception) -> None:
    reason = f"{type(error).__name__}: {error}"
    if (name, reason) not in _logged_fallbacks:
        _logged_fallbacks.add((name, reason))
        logger.warning("masked_attention: backend %r unavailable (%s); falling back", name, reason)


def _with_reference_vjp(fused):
    """`fused`'s forward with the reference's backward: the Pallas and Triton kernels define no VJP,
    and training (the GRPO update, the drafter loss) differentiates through attention."""

    @jax.custom_vjp
    def attention(q, k, v, mask):
        return fused(q, k, v, mask)

    def forward(q, k, v, mask):
        return fused(q, k, v, mask), (q, k, v, mask)

    def backward(residuals, grad):
        q, k, v, mask = residuals
        _, vjp = jax.vjp(lambda q, k, v: masked_attention_ref(q, k, v, mask), q, k, v)
        return (*vjp(grad), None)

    attention.defvjp(forward, backward)
    return attention


_IMPLS = {
    "reference": masked_attention_ref,
    "pallas": _with_reference_vjp(masked_attention_pallas),
    "pallas_interpret": _with_reference_vjp(functools.partial(masked_attention_pallas, interpret=True)),
    "triton": _with_reference_vjp(masked_attention_triton),
}
