"""Accept step of tree speculative decoding: which drafted tokens the policy keeps, and one more.

A draft tree per row has N nodes. Node 0 is the root, the last accepted token, at sequence position
root_pos; parents[c] < c (-1 for the root); padding nodes have valid False and are never accepted.
logits[b, u] is the policy's next-token distribution after node u, i.e. for the token at position
root_pos + depth(u) + 1. Each mode walks from the root and emits the accepted drafts' tokens, then
one token from the policy at the node where the walk stopped (bonus or correction).

- greedy: y(u) = argmax logits[u]; move to the valid child whose token is y(u).
- coupled: the same walk with y(u) the position-keyed sample of sampling.sample at position
  root_pos + depth(u) + 1, so the output is bit-identical to non-speculative sampling with the same
  seed (temperature-0 rows are greedy).
- rejection: recursive rejection sampling with deterministic (one-hot) drafts (SpecInfer / EAGLE):
  at u with target p, visit the valid children in index order and accept child c with probability
  p'(token c), p' being p with the already rejected children's tokens removed and renormalised;
  when all are rejected, emit a token sampled from the final residual. Exact in distribution: every
  position is decided once with its own randomness, and each decision emits x with probability p(x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from fastrl_jax.kernels.tree_accept import api as tree_accept
from fastrl_jax.rollout.sampling import SamplingParams, filtered_logits, first_argmax, sample

# Rejection sampling draws from jax.random: key(seed) folded with this stream id, then with the
# position (the coupled mode's noise is sampling.position_gumbel's hash, another source).
REJECTION_STREAM = 0xFFFFFFFF


@struct.dataclass
class Accepted:
    """One accept step's result per row."""

    path: jax.Array  # [B, N] int32 accepted node indices root-first (path[:, 0] == 0), -1 padded
    n_accepted: jax.Array  # [B] int32 accepted draft nodes; path holds n_accepted + 1 entries
    tokens: jax.Array  # [B, N] int32 emitted: accepted drafts' tokens, then the bonus; -1 padded
    n_tokens: jax.Array  # [B] int32 = n_accepted + 1
    logprobs: jax.Array  # [B, N] float32 log-prob of each emitted token (as sampling.sample); 0 padded


def tree_depth(parents: jax.Array) -> jax.Array:
    """parents [B, N] (parent < node, -1 for the root) -> depth [B, N] int32, root 0."""
    B, N = parents.shape
    rows = jnp.arange(B)

    def body(i, depth):
        parent = parents[:, i]
        d = jnp.where(parent >= 0, depth[rows, jnp.maximum(parent, 0)] + 1, 0)
        return depth.at[:, i].set(d)

    return jax.lax.fori_loop(1, N, body, jnp.zeros((B, N), jnp.int32))


def accept_greedy(tokens: jax.Array, parents: jax.Array, valid: jax.Array, logits: jax.Array) -> Accepted:
    """Greedy accept.

    Args:
      tokens: [B, N] int32 draft tokens (node 0 holds the root token).
      parents: [B, N] int32 parent index, -1 for the root.
      valid: [B, N] bool, False for padding nodes.
      logits: [B, N, V] policy logits after each node.
    """
    y = first_argmax(logits)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return _accept_targets(y, jnp.take_along_axis(logprobs, y[..., None], axis=-1)[..., 0], tokens, parents, valid)


def accept_coupled(
    tokens: jax.Array, parents: jax.Array, valid: jax.Array, logits: jax.Array, params: SamplingParams, root_pos: jax.Array
) -> Accepted:
    """Coupled-sampling accept: greedy's walk on the position-keyed samples of sampling.sample.

    Args as accept_greedy, plus per-row sampling params and root_pos [B] int32, the root's position.
    """
    B, N, V = logits.shape
    positions = root_pos[:, None] + tree_depth(parents) + 1
    y, logprobs = sample(logits.reshape(B * N, V), _per_node(params, N), positions.reshape(B * N))
    return _accept_targets(y.reshape(B, N), logprobs.reshape(B, N), tokens, parents, valid)


def _accept_targets(y, y_logprobs, tokens, parents, valid) -> Accepted:
    """Emits y along the accepted path: an accepted child's token is y of its parent, and the
    bonus is y of the last node, so emitted token i is y[path[i]]."""
    path, n_accepted = tree_accept.walk(tree_accept.acceptable_children(y, tokens, parents, valid), parents)
    rows = jnp.arange(y.shape[0])[:, None]
    on_path = path >= 0
    node = jnp.maximum(path, 0)
    return Accepted(
        path=path,
        n_accepted=n_accepted,
        tokens=jnp.where(on_path, y[rows, node], -1),
        n_tokens=n_accepted + 1,
        logprobs=jnp.where(on_path, y_logprobs[rows, node], 0.0),
    )


def accept_rejection(
    tokens: jax.Array, parents: jax.Array, valid: jax.Array, logits: jax.Array, params: SamplingParams, root_pos: jax.Array
) -> Accepted:
    """Recursive rejection-sampling accept (exact in distribution, not bit-identical to sampling).

    Args as accept_coupled. Temperature-0 rows target the one-hot argmax, which makes the walk and
    the final token exactly accept_greedy's.
    """
    B, N, V = logits.shape
    rows = jnp.arange(B)[:, None]
    node = jnp.arange(N)
    depth = tree_depth(parents)
    greedy = (params.temperature <= 0)[:, None, None]
    one_hot = jnp.arange(V) == first_argmax(logits)[..., None]
    # Unnormalised log p after every node: filtered, temperature-scaled logits.
    target = jnp.where(
        greedy,
        jnp.where(one_hot, 0.0, -jnp.inf),
        filtered_logits(logits.reshape(B * N, V), _per_node(params, N)).reshape(B, N, V),
    )
    log_p = jax.nn.log_softmax(target, axis=-1)

    # q[c] = p_parent(c)(token c). Visiting siblings in index order, the residual when c is tried
    # has lost the mass of the distinct tokens of its earlier siblings; a repeat of an earlier
    # sibling's token has no mass left.
    token_ix = jnp.clip(tokens, 0, V - 1)
    q = jnp.exp(log_p[rows, jnp.maximum(parents, 0), token_ix])
    earlier_sibling = (
        (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :] & (node[None, :] < node[:, None])[None]
    )
    repeat = jnp.any(earlier_sibling & (tokens[:, :, None] == tokens[:, None, :]), axis=-1)
    mass_before = jnp.sum(jnp.where(earlier_sibling & ~repeat[:, None, :], q[:, None, :], 0.0), axis=-1)
    accept_prob = _child_accept_prob(q, mass_before, repeat)

    # A child's test is keyed by the position its token would take and by its node index.
    position_keys = jax.vmap(jax.vmap(_rejection_key))(
        jnp.broadcast_to(params.seed[:, None], (B, N)), root_pos[:, None] + depth
    )
    test_keys = jax.vmap(jax.vmap(lambda k: jax.random.split(k)[0]))(position_keys)
    uniforms = jax.vmap(jax.vmap(lambda k, c: jax.random.uniform(jax.random.fold_in(k, c))))(
        test_keys, jnp.broadcast_to(node, (B, N))
    )
    path, n_accepted = tree_accept.walk(valid & (uniforms < accept_prob), parents)

    # The walk stopped at `last`: every valid child of it was rejected (or it has none), so the
    # final token comes from last's target without those children's tokens.
    last = path[rows[:, 0], n_accepted]
    rejected = valid & (parents == last[:, None])
    residual = target[rows[:, 0], last].at[rows, jnp.where(rejected, token_ix, V)].set(-jnp.inf, mode="drop")
    # Only a rounding miss can reject a set of children covering all of p's mass; fall back to p.
    residual = jnp.where(jnp.any(residual > -jnp.inf, axis=-1, keepdims=True), residual, target[rows[:, 0], last])
    final_key = jax.vmap(lambda s, t: jax.random.split(_rejection_key(s, t))[1])(params.seed, root_pos + n_accepted + 1)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(final_key)
    final = first_argmax(residual + gumbel)

    on_path = path >= 0
    next_node = jnp.concatenate([path[:, 1:], jnp.full((B, 1), -1, jnp.int32)], axis=1)
    emitted = jnp.where(next_node >= 0, tokens[rows, jnp.maximum(next_node, 0)], -1)
    emitted = jnp.where(node[None, :] == n_accepted[:, None], final[:, None], emitted)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature[:, None, None], axis=-1)
    emitted_logprobs = logprobs[rows, jnp.maximum(path, 0), jnp.maximum(emitted, 0)]
    return Accepted(
        path=path,
        n_accepted=n_accepted,
        tokens=emitted,
        n_tokens=n_accepted + 1,
        logprobs=jnp.where(on_path, emitted_logprobs, 0.0),
    )


def _child_accept_prob(q: jax.Array, mass_before: jax.Array, repeat: jax.Array) -> jax.Array:
    """p'(token c) = q[c] / (1 - mass of the earlier rejected siblings' tokens); 0 for a repeat."""
    remaining = 1.0 - mass_before
    return jnp.where(repeat | (remaining <= 0), 0.0, q / jnp.where(remaining > 0, remaining, 1.0))


def _rejection_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), REJECTION_STREAM), position)


def _per_node(params: SamplingParams, N: int) -> SamplingParams:
    """Repeats each row's params for its N nodes (row-major, matching logits.reshape(B * N, V))."""
    return jax.tree.map(lambda a: jnp.repeat(a, N), params)
