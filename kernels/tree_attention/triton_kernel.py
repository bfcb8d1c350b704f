"""Triton masked (tree) attention for NVIDIA GPUs, launched through jax-triton.

GPU-only: imported lazily by `api.triton`, never at package import, because triton needs a GPU
build to compile and jax-triton imports only beside a CUDA jaxlib (it is imported inside
`masked_attention`). The kernel's arithmetic is tested on
CPU under Triton's interpreter (TRITON_INTERPRET=1, torch tensors) when triton is installed;
the jax-triton launch itself runs only on a GPU.

Unlike the Pallas kernel, raw Triton can gather with pointer arithmetic, so it packs the G
query heads of a KV head and the T new tokens into one row axis (row r = t * G + g, q's own
memory order): a decode step (T = 1) fills G rows of a 16-row tile instead of one, and
nothing is transposed or padded outside the kernel. Ragged T * G and S are handled by masked
loads.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

# Large finite negative rather than -inf: no inf - inf when a whole key block of a row is masked.
MASK_VALUE = tl.constexpr(-0.7 * float(np.finfo(np.float32).max))

# Starting points, not tuned on hardware: rows and keys >= 16 for tl.dot; 64 x 64 tiles with a
# [64, D < 128] float32 accumulator fit 4 warps' registers; [64, 128] takes 8 (num_warps: at 4, sm_90
# ptxas spilled 400 bytes a thread for Qwen2.5-7B's 48-token tree verify).
BLOCK_M_MAX = 64
BLOCK_S = 64
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def masked_attention_kernel(
    q_ptr,  # [B, T, KV, G, D]
    k_ptr,  # [B, KV, S, D]
    v_ptr,  # [B, KV, S, D]
    mask_ptr,  # [B, T, S] int8
    o_ptr,  # [B, T, KV, G, D]
    T: tl.constexpr,
    S: tl.constexpr,
    KV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    F32: tl.constexpr,
):
    """One program per (b, kv head, block of BLOCK_M packed (token, head) rows)."""
    # Offsets in int64 from the batch index on: a cache window of batch 128 x 8 KV heads x 32768
    # slots x head dim 128 is 2**32 elements, past int32; offsets within one row stay int32.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // G
    g = r % G
    row_ok = r < T * G
    d = tl.arange(0, D)

    qo_off = (((b * T + t) * KV + h) * G + g) * D
    q = tl.load(q_ptr + qo_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    kv_base = (b * KV + h) * S * D
    mask_row = (b * T + t) * S

    m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < S
        k = tl.load(k_ptr + kv_base + s[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_base + s[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        valid = tl.load(mask_ptr + mask_row[:, None] + s[None, :], mask=row_ok[:, None] & s_ok[None, :], other=0) != 0
        if F32:  # exact float32 rather than Triton's default TF32
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid, qk, MASK_VALUE)
        m_next = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_next)
        p = tl.where(valid, tl.exp(qk - m_next[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_next
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(o_ptr + qo_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch_params(q_shape, k_shape) -> dict:
    """Static launch parameters (grid and constexprs) for q [B, T, KV, G, D], k [B, KV, S, D]."""
    B, T, KV, G, D = q_shape
    S = k_shape[2]
    if D < 16 or D & (D - 1):
        raise NotImplementedError(f"the Triton kernel needs a power-of-two head dim >= 16, got D={D}")
    block_m = min(BLOCK_M_MAX, max(16, triton.next_power_of_2(T * G)))
    return dict(
        grid=(B, KV, triton.cdiv(T * G, block_m)),
        T=T, S=S, KV=KV, G=G, D=D, BLOCK_M=block_m, BLOCK_S=BLOCK_S,
    )


def num_warps(block_m: int, D: int) -> int:
    """Warps for an accumulator of [block_m, D] float32: 8 from [64, 128] on, so that it stays in registers."""
    return 8 if block_m * D >= 64 * 128 else NUM_WARPS


def masked_attention(q, k, v, mask):
    """Same contract as `reference.masked_attention` (shapes already checked by the caller)."""
    import jax_triton as jt  # here, so that the kernel itself imports (and is tested) without it

    params = launch_params(q.shape, k.shape)
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    # jax-triton 0.4 renamed out_shape= to out_type= (the old name warns).
    out_kw = {"out_type": out} if "out_type" in inspect.signature(jt.triton_call).parameters else {"out_shape": out}
    return jt.triton_call(
        q, k, v, mask.astype(jnp.int8),
        kernel=masked_attention_kernel,
        name="masked_attention",
        num_warps=num_warps(params["BLOCK_M"], q.shape[-1]),
        num_stages=NUM_STAGES,
        F32=q.dtype == jnp.float32,
        **params,
        **out_kw,
    )
