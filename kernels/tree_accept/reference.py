"""Tree-accept walk in pure JAX: the longest root-first path of a draft tree that the policy accepts.

The walk starts at the root (node 0) and, while the current node u has an acceptable child, moves to
the first one in index order. `walk` takes a per-node "acceptable" mask, which every accept mode
provides (rejection sampling from its coin flips); `acceptable_children` is the greedy / coupled
mask: child c is acceptable when it is valid and its token equals the target y of its parent (the
policy's argmax or its position-keyed sample after that parent).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def acceptable_children(y: jax.Array, tokens: jax.Array, parents: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, N] bool: valid[c] and tokens[c] == y[parents[c]].

    Args:
      y: [B, N] int32 the policy's target token after each node.
      tokens: [B, N] int32 draft tokens (node 0 holds the root token).
      parents: [B, N] int32 parent index, -1 for the root.
      valid: [B, N] bool, False for padding nodes (never accepted).
    """
    y_parent = jnp.take_along_axis(y, jnp.maximum(parents, 0), axis=1)
    return valid & (tokens == y_parent)


def walk(acceptable: jax.Array, parents: jax.Array) -> tuple[jax.Array, jax.Array]:
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
