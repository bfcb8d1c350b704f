"""The tree-accept walk as one Pallas kernel (GPU through Triton, TPU through Mosaic; CPU tests with
interpret=True): the whole walk in one launch, where the reference's while_loop runs a few small
XLA kernels per tree level. Same contract as reference.walk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Rows per program. Each program walks its rows' trees in registers: [rows, N] int32 tiles.
BLOCK_ROWS = {"gpu": 16, "tpu": 8, "interpret": 8}


def _walk_kernel(acceptable_ref, parents_ref, path_ref):
    acceptable, parents = acceptable_ref[...] != 0, parents_ref[...]
    rows, N = parents.shape
    node = lax.broadcasted_iota(jnp.int32, (rows, N), 1)

    # 2-D [rows, 1] carries and a min-reduction instead of an argmax or gather keep the body to ops
    # every Pallas backend lowers.
    def body(i, carry):
        cur, alive, path = carry
        first = jnp.min(jnp.where(acceptable & (parents == cur), node, N), axis=1, keepdims=True)
        alive = jnp.where(first < N, alive, 0)
        cur = jnp.where(alive != 0, first, cur)
        path = jnp.where((node == i) & (alive != 0), cur, path)
        return cur, alive, path

    init = (jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows, 1), jnp.int32), jnp.where(node == 0, 0, -1))
    _, _, path = lax.fori_loop(1, N, body, init)
    path_ref[...] = path


@functools.partial(jax.jit, static_argnames=("interpret", "platform", "block_rows"))
def walk(acceptable: jax.Array, parents: jax.Array, *, interpret: bool = False, platform: str | None = None,
         block_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """reference.walk as a Pallas kernel. interpret=True runs it anywhere (tests); otherwise it needs a
    GPU or TPU (platform: the lowering target, default JAX's backend) and raises NotImplementedError
    elsewhere."""
    platform = "interpret" if interpret else platform or jax.default_backend()
    if platform not in BLOCK_ROWS:
        raise NotImplementedError(f"the pallas walk compiles for GPU or TPU, not {platform!r}; use pallas_interpret here")
    B, N = parents.shape
    if acceptable.shape != (B, N):
        raise ValueError(f"walk: acceptable has shape {acceptable.shape}, expected parents' shape {(B, N)}")
    rows = min(block_rows or BLOCK_ROWS[platform], B)
    if rows < 1:
        raise ValueError(f"walk: block_rows must be >= 1, got {block_rows}")
    width = N
    # Pallas's Triton lowering takes only arrays whose sizes are powers of two; the interpreter runs
    # the GPU's padded layout, so the CPU tests check it.
    if platform in ("gpu", "interpret"):
        rows, width = _next_power_of_two(rows), _next_power_of_two(N)
    padded = pl.cdiv(B, rows) * rows
    # Padding rows and nodes accept nothing: a padding row's walk stops at the root, and no walk
    # reaches a padding node (a path visits at most the N real nodes). Both are sliced off.
    args = [jnp.pad(a.astype(jnp.int32), ((0, padded - B), (0, width - N))) for a in (acceptable, parents)]
    spec = pl.BlockSpec((rows, width), lambda i: (i, 0))
    path = pl.pallas_call(
        _walk_kernel,
        out_shape=jax.ShapeDtypeStruct((padded, width), jnp.int32),
        grid=(padded // rows,),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=interpret,
        compiler_params=_compiler_params(platform),
        name="tree_walk",
    )(*args)[:B, :N]
    return path, jnp.sum(path >= 0, axis=1, dtype=jnp.int32) - 1


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _compiler_params(platform: str):
    """Triton on a GPU: without its parameters Pallas picks the Mosaic GPU lowering, which rejects this
    kernel (cross-lowered from CPU, tests/test_accept.py)."""
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    return None
