"""Tree-accept walk: the longest root-first path of a draft tree that the policy accepts.

The walk starts at the root (node 0) and, while the current node u has an acceptable child,
moves to the first one in index order. `walk_ref` takes a per-node "acceptable" mask (used by
every accept mode, including rejection sampling); `tree_walk_ref` is the greedy / coupled form,
where child c is acceptable when it is valid and its token equals the target y of its parent
(the policy's argmax or its position-keyed sample after that parent).

`tree_walk_pallas` is the same greedy / coupled walk as a Pallas kernel (one grid step per block
of rows; runs on CPU with interpret=True). The pure-JAX reference is what accept.py uses: on CPU
XLA fuses it well, and it is what the kernel is tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def walk_ref(acceptable: jax.Array, parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Walks from the root through acceptable children, first child in index order at each step.

    Args:
      acceptable: [B, N] bool, node c may be taken when the walk stands at parents[c].
      parents: [B, N] int32 parent index (< node index), -1 for the root and unused nodes.

    Returns:
      path [B, N] int32 node indices root-first, -1 padded; n_accepted [B] int32 nodes after the root.
    """
    B, N = parents.shape
    acceptable = acceptable & (parents >= 0)

    def cond(carry):
        i, _, alive, _ = carry
        return (i < N) & jnp.any(alive)

    def body(carry):
        i, cur, alive, path = carry
        candidates = acceptable & (parents == cur[:, None])
        alive = alive & jnp.any(candidates, axis=1)
        cur = jnp.where(alive, jnp.argmax(candidates, axis=1).astype(jnp.int32), cur)
        path = path.at[:, i].set(jnp.where(alive, cur, -1))
        return i + 1, cur, alive, path

    path = jnp.full((B, N), -1, jnp.int32).at[:, 0].set(0)
    init = (jnp.int32(1), jnp.zeros(B, jnp.int32), jnp.ones(B, bool), path)
    _, _, _, path = lax.while_loop(cond, body, init)
    return path, jnp.sum(path >= 0, axis=1, dtype=jnp.int32) - 1


def tree_walk_ref(y: jax.Array, tokens: jax.Array, parents: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy / coupled walk: child c is taken when valid[c] and tokens[c] == y[parents[c]].

    Args:
      y: [B, N] int32 the policy's target token after each node.
      tokens: [B, N] int32 draft tokens (node 0 holds the root token).
      parents: [B, N] int32 parent index, -1 for the root.
      valid: [B, N] bool, False for padding nodes (never accepted).

    Returns:
      path [B, N] (-1 padded) and n_accepted [B], as walk_ref.
    """
    y_parent = jnp.take_along_axis(y, jnp.maximum(parents, 0), axis=1)
    return walk_ref(valid & (tokens == y_parent), parents)


def _walk_kernel(y_ref, tokens_ref, parents_ref, valid_ref, path_ref):
    y, tokens, parents, valid = y_ref[...], tokens_ref[...], parents_ref[...], valid_ref[...]
    rows, N = y.shape
    node = lax.broadcasted_iota(jnp.int32, (rows, N), 1)

    # 2-D [rows, 1] carries and a one-hot reduction instead of a gather keep the body to ops
    # that every Pallas backend lowers.
    def body(i, carry):
        cur, alive, path = carry
        y_cur = jnp.sum(jnp.where(node == cur, y, 0), axis=1, keepdims=True)
        candidates = (valid != 0) & (parents == cur) & (tokens == y_cur)
        first = jnp.min(jnp.where(candidates, node, N), axis=1, keepdims=True)
        alive = jnp.where(first < N, alive, 0)
        cur = jnp.where(alive != 0, first, cur)
        path = jnp.where((node == i) & (alive != 0), cur, path)
        return cur, alive, path

    init = (jnp.zeros((rows, 1), jnp.int32), jnp.ones((rows, 1), jnp.int32), jnp.where(node == 0, 0, -1))
    _, _, path = lax.fori_loop(1, N, body, init)
    path_ref[...] = path


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def tree_walk_pallas(
    y: jax.Array, tokens: jax.Array, parents: jax.Array, valid: jax.Array, *, block_rows: int = 8, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Pallas version of tree_walk_ref (same arguments and results); interpret=True runs it on CPU."""
    B, N = y.shape
    for name, a in (("tokens", tokens), ("parents", parents), ("valid", valid)):
        if a.shape != (B, N):
            raise ValueError(f"tree_walk_pallas: {name} has shape {a.shape}, expected y's shape {(B, N)}")
    if block_rows < 1:
        raise ValueError(f"tree_walk_pallas: block_rows must be >= 1, got {block_rows}")
    block_rows = min(block_rows, B)
    padded = pl.cdiv(B, block_rows) * block_rows
    # Padding rows are invalid everywhere, so their walk stops at the root; they are sliced off.
    args = [jnp.pad(a.astype(jnp.int32), ((0, padded - B), (0, 0))) for a in (y, tokens, parents, valid)]
    spec = pl.BlockSpec((block_rows, N), lambda i: (i, 0))
    path = pl.pallas_call(
        _walk_kernel,
        out_shape=jax.ShapeDtypeStruct((padded, N), jnp.int32),
        grid=(padded // block_rows,),
        in_specs=[spec] * 4,
        out_specs=spec,
        interpret=interpret,
    )(*args)[:B]
    return path, jnp.sum(path >= 0, axis=1, dtype=jnp.int32) - 1
