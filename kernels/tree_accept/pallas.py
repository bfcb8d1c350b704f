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
    padded = pl.cdiv(B, rows) * rows
    # Padding rows accept nothing, so their walk stops at the root; they are sliced off.
    args = [jnp.pad(a.astype(jnp.int32), ((0, padded - B), (0, 0))) for a in (acceptable, parents)]
    spec = pl.BlockSpec((rows, N), lambda i: (i, 0))
    path = pl.pallas_call(
        _walk_kernel,
        out_shape=jax.ShapeDtypeStruct((padded, N), jnp.int32),
        grid=(padded // rows,),
        in_specs=[spec, spec],
        out_specs=spec,
        interpret=interpret,
        name="tree_walk",
    )(*args)[:B]
    return path, jnp.sum(path >= 0, axis=1, dtype=jnp.int32) - 1
