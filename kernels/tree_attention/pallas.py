"""Pallas tree attention for GPU (Triton lowering) and TPU (Mosaic); runs on CPU with interpret=True.

Same contract as reference.masked_attention: q [B, T, KV, G, D] (scaled), k, v [B, KV, S, D],
mask [B, T, S] bool -> [B, T, KV, G, D] in q.dtype. Tile sizes per platform live in BLOCK_TABLE
beside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from fastrl_jax.kernels.tree_attention.reference import MASK_VALUE, check_shapes
from jax.experimental import pallas as pl


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
# [32, D] in registers for G * D up to 512 (SmolLM2's 3 x 64); above it gpu_blocks halves them
# (sm_90 ptxas of the cross-lowered kernel, G=7 D=128 as Qwen2.5-7B on 4-way tensor parallelism:
# 496-1776 bytes a thread spilled at 32 rows x 4 warps, none at 16 rows x 8 warps). TPU: key blocks
# lane-aligned (128), rows a multiple of the 16-row bf16 sublane tile; each program stages its whole key row [S, D] and mask rows
# [block_t, S] in VMEM, which bounds S (a window that does not fit fails to compile and the
# dispatcher falls back). "interpret" uses small blocks so that CPU tests cover several key
# blocks, the ragged last block and several token blocks.
BLOCK_TABLE: dict[str, BlockConfig] = {
    "gpu": BlockConfig(block_t=32, block_s=64, min_rows=16, min_block_s=16, mask_dtype="int8"),
    "tpu": BlockConfig(block_t=64, block_s=512, min_rows=16, min_block_s=128, mask_dtype="int32"),
    "interpret": BlockConfig(block_t=16, block_s=32, min_rows=8, min_block_s=8, mask_dtype="int8"),
}


def masked_attention(q, k, v, mask, interpret: bool = False, platform: str | None = None):
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
    check_shapes(q, k, v, mask)
    if interpret:
        platform = "interpret"
    elif platform is None:
        platform = jax.default_backend()
    if platform not in BLOCK_TABLE:
        raise NotImplementedError(
            f"the pallas backend compiles for GPU or TPU, not {platform!r}; use pallas_interpret to run it here"
        )
    B, T, KV, G, D = q.shape
    S = k.shape[2]
    cfg = gpu_blocks(G, D) if platform == "gpu" else BLOCK_TABLE[platform]
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
    if m.dtype.itemsize == 1 and m.size > 2**31:
        # Pallas's Triton lowering takes 64-bit offsets only for arrays over 2**32 bytes, but
        # offsets count elements and are signed: a one-byte mask of 2**31 to 2**32 elements
        # would wrap. Two bytes a slot put such a mask over 2**32 bytes.
        m = m.astype(jnp.int16)
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


def gpu_blocks(G: int, D: int) -> BlockConfig:
    """The GPU row of BLOCK_TABLE for G query heads a KV head of dimension D: past G * D = 512 the G float32
    accumulators [block_t, D] take 16 rows with 8 warps (and 32-key blocks from 1024) so that they stay in
    registers (sm_90 ptxas: G=5 and 7 at D=128 spill nothing then, G=8 8 bytes)."""
    cfg = BLOCK_TABLE["gpu"]
    if G * D <= 512:
        return cfg
    return dataclasses.replace(cfg, block_t=16, num_warps=8, block_s=32 if G * D >= 1024 else cfg.block_s)


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
            s = jnp.where(valid, s, MASK_VALUE)
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
            jnp.full((bt, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((bt, 1), jnp.float32),
        )
        for _ in range(G)
    )
    carry = jax.lax.fori_loop(0, n_full, lambda i, c: attend(pl.multiple_of(i * block_s, block_s), c), init)
    if S % block_s:
        carry = attend(S - block_s, carry, first_new=n_full * block_s)
    for g, (acc, _, l) in enumerate(carry):
        o_ref[g] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
