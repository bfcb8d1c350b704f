"""Speculative decoding step: a draft tree (EAGLE-2, history, or both fused), one tree-verify forward,
exact acceptance, commit.

Per row, the root is the last emitted token x_L at position L (not yet in the policy cache, whose
length is L). An EAGLE strategy's drafter first consumes its pending entries (h_t, x_{t+1}) for the
tokens emitted by the previous step, the last of which predicts x_{L+1}; then it grows a tree
`steps` deep, each step expanding the top-k children of the k best frontier nodes by cumulative
log-prob, and keeps the best verify_tokens - 1 nodes plus the root. A history strategy drafts a chain
from text the row's prompt group wrote before (history.py). A fused strategy merges both into one
token trie. The policy verifies the tree in one forward (each node sees the prefix and its
ancestors), the accept rule picks the path, and the accepted path's cache entries move to
contiguous slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec

from fastrl_jax.models.decoder import KVCache
from fastrl_jax.rollout import accept as accept_lib
from fastrl_jax.rollout import history as history_lib
from fastrl_jax.rollout.programs import Slots, cache_spec, steps_until_rows_finish
from fastrl_jax.rollout.sampling import SamplingParams, gumbel_at


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A draft shape: an EAGLE tree of depth `steps` (drafter steps) and branching `topk` with
    `verify_tokens` nodes verified (root included), and/or a history chain of up to `history_tokens`
    tokens. steps 0 drafts from history alone; PLAIN (all zero) is plain decoding, an arm of the
    adaptive controller like any other."""

    steps: int = 5
    topk: int = 4
    verify_tokens: int = 8
    history_tokens: int = 0

    def __post_init__(self):
        if self.steps == 0:
            if self.topk or self.verify_tokens != 1 or self.history_tokens < 0:
                raise ValueError(f"a strategy without an EAGLE tree needs topk 0, verify_tokens 1: {self}")
        elif self.topk < 1 or not 2 <= self.verify_tokens <= self.num_candidates + 1 or self.history_tokens < 0:
            raise ValueError(f"need steps >= 1, topk >= 1, 2 <= verify_tokens <= {self.num_candidates + 1}, "
                             f"history_tokens >= 0: {self}")

    @classmethod
    def parse(cls, spec: str) -> Strategy:
        """'plain', 'S/K/V' (EAGLE tree), 'hD' (history chain) or 'S/K/V+hD' (both, fused)."""
        if spec == "plain":
            return PLAIN
        tree, _, chain = spec.partition("+")
        if tree.startswith("h") and not chain:
            tree, chain = "", tree
        steps, topk, verify = (int(x) for x in tree.split("/")) if tree else (0, 0, 1)
        return cls(steps, topk, verify, int(chain[1:]) if chain else 0)

    @property
    def label(self) -> str:
        """'S/K/V', 'hD', 'S/K/V+hD' or 'plain': the notation of configs, stats and timelines."""
        parts = ([f"{self.steps}/{self.topk}/{self.verify_tokens}"] if self.steps else []) + (
            [f"h{self.history_tokens}"] if self.history_tokens else [])
        return "+".join(parts) or "plain"

    @property
    def is_plain(self) -> bool:
        return self.steps == 0 and self.history_tokens == 0

    @property
    def uses_drafter(self) -> bool:
        return self.steps > 0

    @property
    def num_nodes(self) -> int:
        """Tokens one step verifies: the EAGLE tree's (root included) plus the history chain's."""
        return self.verify_tokens + self.history_tokens

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.steps - 1) * self.topk * self.topk

    @property
    def scratch_slots(self) -> int:
        """Drafter cache slots the tree steps use beyond the prefix."""
        return max(self.steps - 1, 0) * self.topk

    @property
    def pending(self) -> int:
        """Most tokens one step emits (accepted drafts + bonus): the drafter entries it leaves pending."""
        return max(self.steps, self.history_tokens) + 1


PLAIN = Strategy(0, 0, 1, 0)


@struct.dataclass
class DraftState:
    """The drafter's side of the row table (batch axis 0; cache axis 1)."""

    cache: KVCache  # [1, B, KV, S + scratch, D]
    pending_tok: jax.Array  # [B, P] x_{t+1} of entries not yet fed to the drafter
    pending_h: jax.Array  # [B, P, F] f_t (Drafter.features of the stored features) of those entries, in the policy's dtype
    n_pending: jax.Array  # [B]

    @classmethod
    def empty(cls, cache: KVCache, pending: int, feature_size: int, dtype=jnp.float32) -> DraftState:
        """No pending entries, over the drafter cache [1, B, KV, S, D]. dtype: the policy's (its
        features are computed in it; a while_loop carry must keep its dtype)."""
        B = cache.k.shape[1]
        return cls(  # separate arrays: the engine donates every leaf of the row table
            cache=cache,
            pending_tok=jnp.zeros((B, pending), jnp.int32),
            pending_h=jnp.zeros((B, pending, feature_size), dtype),
            n_pending=jnp.zeros((B,), jnp.int32),
        )


EAGLE, HISTORY = 1, 2  # Tree.source bits: which drafter proposed a node (both, when the trie merged them)


@struct.dataclass
class Tree:
    tokens: jax.Array  # [B, N]
    parents: jax.Array  # [B, N], -1 for the root
    depth: jax.Array  # [B, N]
    valid: jax.Array  # [B, N]
    source: jax.Array  # [B, N] int32 bits EAGLE | HISTORY; 0 for the root


def chain_tree(root_token: jax.Array, tokens: jax.Array, n: jax.Array) -> Tree:
    """The root and a chain of drafted tokens [B, D], the first n [B] of them valid."""
    B, D = tokens.shape
    idx = jnp.broadcast_to(jnp.arange(D + 1, dtype=jnp.int32), (B, D + 1))
    return Tree(
        tokens=jnp.concatenate([root_token[:, None], jnp.maximum(tokens, 0)], 1),
        parents=idx - 1,
        depth=idx,
        valid=idx <= n[:, None],
        source=jnp.where(idx > 0, HISTORY, 0),
    )


def merge_trees(a: Tree, b: Tree) -> Tree:
    """One token trie of two trees with the same root: a's nodes, then b's. A node of b that repeats a
    node of a (same parent in the trie, same token) becomes invalid, its children hang under a's node,
    and a's node carries both sources; each tree's own siblings must be distinct tokens (EAGLE's top-k
    and a chain are). The trie verifies every distinct path of both trees once."""
    Na, Nb = a.tokens.shape[1], b.tokens.shape[1]
    rows = jnp.arange(a.tokens.shape[0])
    # b's node j (j >= 1) sits at index Na + j - 1; b's root is a's root.
    b_index = jnp.concatenate([jnp.zeros(1, jnp.int32), Na + jnp.arange(Nb - 1, dtype=jnp.int32)])
    parents_b = jnp.where(b.parents[:, 1:] > 0, b_index[jnp.maximum(b.parents[:, 1:], 0)], 0)
    canon = jnp.concatenate([jnp.arange(Na, dtype=jnp.int32)[None].repeat(a.tokens.shape[0], 0),
                             Na + jnp.zeros_like(parents_b)], 1)  # trie node standing for each node
    source = jnp.concatenate([a.source, b.source[:, 1:]], 1)

    def place(j, carry):  # b's nodes in order: parents are placed before their children
        canon, source = carry
        i = Na + j
        parent = canon[rows, parents_b[:, j]]
        same = (a.parents == parent[:, None]) & (a.tokens == b.tokens[:, j + 1][:, None]) & a.valid
        same = same & (jnp.arange(Na)[None] > 0)
        dup = jnp.any(same, 1) & b.valid[:, j + 1]
        node = jnp.where(dup, jnp.argmax(same, 1).astype(jnp.int32), i)
        source = source.at[rows, node].set(source[rows, node] | jnp.where(dup, b.source[:, j + 1], 0))
        return canon.at[:, i].set(node), source

    canon, source = jax.lax.fori_loop(0, Nb - 1, place, (canon, source))
    is_dup = canon[:, Na:] != jnp.arange(Na, Na + Nb - 1)[None]
    return Tree(
        tokens=jnp.concatenate([a.tokens, b.tokens[:, 1:]], 1),
        parents=jnp.concatenate([a.parents, jnp.take_along_axis(canon, parents_b, 1)], 1),
        depth=jnp.concatenate([a.depth, b.depth[:, 1:]], 1),
        valid=jnp.concatenate([a.valid, b.valid[:, 1:] & ~is_dup], 1),
        source=source,
    )


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """[B, N, N] bool: node i sees node j iff j is i or an ancestor of i (parents precede children)."""
    B, N = parents.shape
    eye = jnp.broadcast_to(jnp.eye(N, dtype=bool), (B, N, N))

    def add_parent(i, m):
        p = parents[:, i]
        row = jnp.where((p >= 0)[:, None], jnp.take_along_axis(m, jnp.maximum(p, 0)[:, None, None], 1)[:, 0], False)
        return m.at[:, i].set(m[:, i] | row)

    return jax.lax.fori_loop(1, N, add_parent, eye)


def select_tree(cand_tokens, cand_parents, cand_scores, cand_depth, root_token, n_verify: int) -> Tree:
    """Keeps the n_verify - 1 best candidates (plus the root) as the verify tree.

    Candidates are in breadth-first order with parents before children (parent index -1 is the
    root, otherwise a candidate index). A child never scores above its parent and top_k keeps the
    lower index on ties, so every kept node's ancestors are kept too; sorting the kept indices
    keeps parents before children.
    """
    B, M = cand_tokens.shape
    _, keep = jax.lax.top_k(cand_scores, n_verify - 1)
    keep = jnp.sort(keep, axis=-1)  # [B, N-1]
    # Candidate index -> tree node index (1 + position in keep); the root is node 0.
    where = jnp.zeros((B, M + 1), jnp.int32).at[jnp.arange(B)[:, None], keep + 1].set(jnp.arange(1, n_verify))
    parents = jnp.take_along_axis(where, jnp.take_along_axis(cand_parents, keep, 1) + 1, 1)
    take = lambda a: jnp.take_along_axis(a, keep, 1)  # noqa: E731
    return Tree(
        tokens=jnp.concatenate([root_token[:, None], take(cand_tokens)], 1),
        parents=jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parents], 1),
        depth=jnp.concatenate([jnp.zeros((B, 1), jnp.int32), take(cand_depth)], 1),
        valid=jnp.concatenate([jnp.ones((B, 1), bool), take(cand_scores) > -jnp.inf], 1),
        source=jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.full((B, n_verify - 1), EAGLE, jnp.int32)], 1),
    )


def draft_tree(policy, drafter, ds: DraftState, root_token, root_pos, strategy: Strategy, kv_len: int,
               params: SamplingParams | None = None):
    """Feeds the pending entries, then grows the EAGLE-2 tree. Returns (Tree, drafter cache).

    params: the rows' sampling parameters. Sampled rows rank candidates by the drafter's guess of the
    token the policy will sample (coupled_logp); without params (or at temperature 0) by its log-probs.
    """
    k, steps = strategy.topk, strategy.steps
    B, P = ds.pending_tok.shape
    window = kv_len + strategy.scratch_slots
    # Slot (= entry index) of the first pending entry. A padding row (length 0) has its one pending entry
    # at slot -1: clamped to 0 it sees itself, where it saw nothing and came out NaN into its drafter cache.
    first = jnp.maximum(root_pos - ds.n_pending, 0)
    head = drafter.head_weight(policy)  # gathered once: a reduced draft vocabulary's head rows
    logits, h_out, cache = drafter(
        policy, ds.pending_tok, ds.pending_h, first[:, None] + jnp.arange(P), ds.cache, first, kv_len=window, head=head
    )
    last = (ds.n_pending - 1)[:, None]
    ids = drafter.token_ids(jnp.arange(logits.shape[-1]))  # the token id of each draft-vocabulary entry
    logp = coupled_logp(jnp.take_along_axis(logits, last[:, :, None], 1)[:, 0], params, root_pos + 1, ids)
    h_root = jnp.take_along_axis(h_out, last[:, :, None], 1)[:, 0]

    scores, tokens = jax.lax.top_k(logp, k)  # depth-1 candidates
    tokens = drafter.token_ids(tokens)
    cand = dict(tokens=[tokens], parents=[jnp.full((B, k), -1, jnp.int32)], scores=[scores],
                depth=[jnp.ones((B, k), jnp.int32)])
    frontier = jnp.broadcast_to(jnp.arange(k), (B, k))  # candidate indices of the frontier
    front_h = jnp.broadcast_to(h_root[:, None], (B, k, h_root.shape[-1]))  # inputs: parents' predictions
    front_anc = jnp.zeros((B, k, strategy.scratch_slots), bool)  # ancestors' scratch slots
    slots = jnp.arange(window)[None, :]
    all_tokens, all_scores = tokens, scores
    for s in range(1, steps):
        base = root_pos + (s - 1) * k  # scratch slots of this step's entries
        scratch = jnp.zeros((B, k, strategy.scratch_slots), bool).at[:, :, (s - 1) * k + jnp.arange(k)].set(
            jnp.eye(k, dtype=bool)
        ) | front_anc
        rel = slots - root_pos[:, None]  # scratch index of each window slot
        in_scratch = (rel >= 0) & (rel < strategy.scratch_slots)
        mask = (slots < root_pos[:, None])[:, None, :] | (
            in_scratch[:, None, :]
            & jnp.take_along_axis(scratch, jnp.broadcast_to(jnp.clip(rel, 0, strategy.scratch_slots - 1)[:, None], (B, k, window)), 2)
        )
        depth = s  # frontier nodes sit at depth s, i.e. entry index root_pos - 1 + s
        ftok = jnp.take_along_axis(all_tokens, frontier, 1)
        logits, h_out, cache = drafter(
            policy, ftok, front_h, jnp.broadcast_to((root_pos - 1 + depth)[:, None], (B, k)), cache, base,
            kv_len=window, mask=mask, head=head,
        )
        child_logp = coupled_logp(logits, params, root_pos + depth + 1, ids)  # children at position L + depth + 1
        child_scores, child_tokens = jax.lax.top_k(child_logp, k)  # [B, k, k]
        child_tokens = drafter.token_ids(child_tokens)
        child_scores = child_scores + jnp.take_along_axis(all_scores, frontier, 1)[:, :, None]
        offset = all_tokens.shape[1]
        cand["tokens"].append(child_tokens.reshape(B, k * k))
        cand["parents"].append(jnp.repeat(frontier, k, axis=1))
        cand["scores"].append(child_scores.reshape(B, k * k))
        cand["depth"].append(jnp.full((B, k * k), s + 1, jnp.int32))
        all_tokens = jnp.concatenate([all_tokens, cand["tokens"][-1]], 1)
        all_scores = jnp.concatenate([all_scores, cand["scores"][-1]], 1)
        _, best = jax.lax.top_k(cand["scores"][-1], k)  # next frontier, among this step's children
        parent_slot = best // k
        frontier = offset + best
        front_h = jnp.take_along_axis(h_out, parent_slot[:, :, None], 1)
        front_anc = jnp.take_along_axis(scratch, parent_slot[:, :, None], 1)
    cat = {name: jnp.concatenate(parts, 1) for name, parts in cand.items()}
    tree = select_tree(cat["tokens"], cat["parents"], cat["scores"], cat["depth"], root_token, strategy.verify_tokens)
    return tree, cache


def coupled_logp(logits: jax.Array, params: SamplingParams | None, position: jax.Array, ids: jax.Array) -> jax.Array:
    """Log-probabilities [B, ..., K] to rank draft candidates for position [B] by.

    A sampled row's token will be argmax(logits / T + g) with the position-keyed Gumbel noise g of
    sampling.position_gumbel, which is known before the policy runs. Perturbing the drafter's own
    log-probs with the same noise (Gumbel-max coupling) makes its top candidate its best guess of the
    token the policy will sample rather than the most likely one; the log-softmax of the perturbed
    scores ranks the rest. Greedy rows (and params None) rank by the drafter's log-probs. Acceptance
    is unchanged (the policy still verifies every token), so this only raises the odds a draft is right.
    """
    logp = jax.nn.log_softmax(logits, -1)
    if params is None:
        return logp
    extra = logp.ndim - 2  # middle axes (the frontier's nodes) share the row's noise
    T = params.temperature.reshape(-1, *([1] * (extra + 1)))
    g = gumbel_at(params.seed, position, ids).reshape(logp.shape[0], *([1] * extra), -1)
    perturbed = jax.nn.log_softmax(logp / jnp.where(T > 0, T, 1.0) + g, -1)
    return jnp.where(T > 0, perturbed, logp)


def _move_path(cache: KVCache, start, order):
    """In each row b, slot start[b] + i takes the entry at slot start[b] + order[b, i]. Under a mesh each device
    moves its own rows (the table's rows split as attention splits them): a dynamic slice of a split row axis made
    XLA gather the whole cache onto every device."""
    mesh = jax.sharding.get_abstract_mesh()
    kv = None if mesh.empty else cache_spec(mesh, *cache.k.shape[1:3])
    if kv is None or (kv[1] is None and kv[2] is None):
        return _move_rows(cache, start, order)
    rows = PartitionSpec(kv[1])
    return jax.shard_map(_move_rows, in_specs=(KVCache(k=kv, v=kv), rows, rows), out_specs=KVCache(k=kv, v=kv),
                         check_vma=False)(cache, start, order)


def _move_rows(cache: KVCache, start, order):
    N = order.shape[1]

    def row(b, c):
        at = (0, b, 0, start[b], 0)

        def move(x):
            block = jax.lax.dynamic_slice(x, at, (x.shape[0], 1, x.shape[2], N, x.shape[4]))
            return jax.lax.dynamic_update_slice(x, jnp.take(block, order[b], axis=3), at)

        return KVCache(k=move(c.k), v=move(c.v))

    return jax.lax.fori_loop(0, order.shape[0], row, cache)


def draft(policy, drafter, s: Slots, ds: DraftState | None, strategy: Strategy, kv_len: int,
          match: history_lib.MatchSettings, mode: str) -> tuple[Tree, KVCache | None]:
    """The strategy's draft tree for every row, and the drafter's cache after it (None without EAGLE).

    mode: the accept mode. Only coupled steps rank drafts by the position-keyed sampling noise. A
    rejection step decides positions with other randomness, and a later plain step (adaptive mode mixes
    them) samples the positions it drafted but left undecided with that noise: had the noise ranked the
    drafts, the step's outcome would already depend on it and the plain tokens would be biased. The
    drafter's own ranking also drafts the likelier tokens, which rejection accepts more often.
    """
    tree, dcache = None, None
    if strategy.uses_drafter:
        params = s.params if mode == "coupled" else None
        tree, dcache = draft_tree(policy, drafter, ds, s.token, s.length, strategy, kv_len, params)
    if strategy.history_tokens:
        # The table's text up to the window: a live row holds fewer than kv_len tokens (and a row's last slot is
        # its length), so the [B, S, B] match need not scan the whole max_len (it grew with it: 372 ms a call at 64
        # rows of 32K slots on CPU, review); a finished row's text past the window only drafts less
        tokens, n = history_lib.propose(s.history[:, : kv_len + 1], jnp.minimum(s.length, kv_len), s.group, s.corpus,
                                        strategy.history_tokens, match)
        chain = chain_tree(s.token, tokens, n)
        tree = chain if tree is None else merge_trees(tree, chain)
    return tree, dcache


def sd_step(policy, drafter, s: Slots, ds: DraftState | None, strategy: Strategy, kv_len: int, mode: str,
            match: history_lib.MatchSettings = history_lib.MatchSettings()):
    """One speculative step for every live row: draft, verify, accept, commit."""
    B = s.batch
    rows = jnp.arange(B)
    L = s.length
    tree, dcache = draft(policy, drafter, s, ds, strategy, kv_len, match, mode)
    logits, hidden, cache = policy(
        tree.tokens, L[:, None] + tree.depth, s.cache, L, block_mask=ancestor_mask(tree.parents), kv_len=kv_len,
        capture=s.feature_layers,
    )
    if mode == "rejection":
        acc = accept_lib.accept_rejection(tree.tokens, tree.parents, tree.valid, logits, s.params, L)
    else:
        acc = accept_lib.accept_coupled(tree.tokens, tree.parents, tree.valid, logits, s.params, L)
    N = strategy.num_nodes
    idx = jnp.arange(N)[None, :]
    # Tokens this row may still emit: its budget, and up to (including) the first stop token.
    is_stop = jnp.any(acc.tokens[:, :, None] == s.stop_ids[:, None, :], -1) & (idx < acc.n_tokens[:, None])
    first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1) + 1, N)
    n_emit = jnp.minimum(jnp.minimum(acc.n_tokens, s.max_new - s.n_out), first_stop)
    n_emit = jnp.where(s.live, n_emit, 0)
    emit = idx < n_emit[:, None]
    cols = jnp.where(emit, s.n_out[:, None] + idx, s.out_tokens.shape[1])
    order = jnp.where(idx < acc.n_tokens[:, None], jnp.maximum(acc.path, 0), idx)
    path_hidden = jnp.take_along_axis(hidden, order[:, :, None], 1)  # [B, N, H]
    hid = s.hidden
    if hid is not None:
        hslots = jnp.where(emit, L[:, None] + idx, hid.shape[1])
        hid = hid.at[rows[:, None], hslots].set(path_hidden.astype(hid.dtype), mode="drop")
    n_out = s.n_out + n_emit
    finished = (n_emit < acc.n_tokens) | jnp.any(is_stop & emit, 1) | (n_out >= s.max_new)
    bonus = jnp.take_along_axis(acc.tokens, jnp.maximum(n_emit - 1, 0)[:, None], 1)[:, 0]
    new_slots = s.replace(
        cache=_move_path(cache, L, order),
        hidden=hid,
        token=jnp.where(s.live, bonus, s.token),
        length=L + n_emit,
        n_out=n_out,
        live=s.live & ~finished,
        out_tokens=s.out_tokens.at[rows[:, None], cols].set(acc.tokens, mode="drop"),
        out_logprobs=s.out_logprobs.at[rows[:, None], cols].set(acc.logprobs, mode="drop"),
        history=s.history.at[rows[:, None], jnp.where(emit, L[:, None] + 1 + idx, s.history.shape[1])].set(
            acc.tokens, mode="drop"
        ),
        spec_counts=s.spec_counts + _accepted_by_source(tree, acc, n_emit, s.live),
    )
    if not strategy.uses_drafter:
        return new_slots, ds  # the drafter fell behind: the engine reruns draft_prefill before it drafts again
    P = ds.pending_tok.shape[1]  # >= strategy.pending: the engine sizes it for its largest strategy
    features = drafter.features(policy, path_hidden).astype(ds.pending_h.dtype)
    new_ds = ds.replace(
        cache=dcache,
        pending_tok=jnp.pad(jnp.maximum(acc.tokens, 0), ((0, 0), (0, max(0, P - N))))[:, :P],
        pending_h=jnp.pad(features, ((0, 0), (0, max(0, P - N)), (0, 0)))[:, :P],
        n_pending=jnp.where(s.live, n_emit, ds.n_pending),
    )
    return new_slots, new_ds


def _accepted_by_source(tree: Tree, acc: accept_lib.Accepted, n_emit: jax.Array, live: jax.Array) -> jax.Array:
    """[B, 3] int32 this step's (speculative steps, emitted drafts EAGLE proposed, emitted drafts the
    history proposed); a draft both proposed counts for both."""
    drafts = jnp.minimum(acc.n_accepted, n_emit)  # accepted drafts emitted; token n_accepted is the bonus
    i = jnp.arange(tree.tokens.shape[1])[None, :]
    on_path = (i >= 1) & (i <= drafts[:, None])
    source = jnp.take_along_axis(tree.source, jnp.maximum(acc.path, 0), 1)
    eagle = jnp.sum(on_path & (source & EAGLE != 0), 1)
    hist = jnp.sum(on_path & (source & HISTORY != 0), 1)
    return jnp.stack([live.astype(jnp.int32), eagle, hist], 1).astype(jnp.int32)


def drafter_prefill(policy, drafter, s: Slots, ds: DraftState, kv_len: int) -> DraftState:
    """Rebuilds every row's drafter cache from the stored policy hidden states (no policy forward).

    Entries t = 0 .. L-2 (h_t, x_{t+1}) are run; the last entry (h_{L-1}, x_L) is left pending so
    the next speculative step starts from it.
    """
    B = s.batch
    T = kv_len
    tokens = s.history[:, 1 : T + 1]
    hidden = drafter.features(policy, s.hidden[:, :T])
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    _, _, cache = drafter(policy, tokens, hidden, positions, ds.cache, jnp.zeros(B, jnp.int32), kv_len=T)
    last = jnp.maximum(s.length - 1, 0)
    P = ds.pending_tok.shape[1]
    return ds.replace(
        cache=cache,
        pending_tok=jnp.zeros((B, P), jnp.int32).at[:, 0].set(s.token),
        pending_h=jnp.zeros_like(ds.pending_h).at[:, 0].set(
            drafter.features(policy, jnp.take_along_axis(s.hidden, last[:, None, None], 1)[:, 0]).astype(ds.pending_h.dtype)
        ),
        n_pending=jnp.ones(B, jnp.int32),
    )


def sd_program(graphdef, state, dgraphdef, dstate, s: Slots, max_steps, min_finished, strategy: Strategy, kv_len: int,
               mode: str, match: history_lib.MatchSettings):
    """Speculative steps until min_finished rows finish or max_steps (the host keeps rows inside kv_len)."""
    policy = nnx.merge(graphdef, state)
    drafter = nnx.merge(dgraphdef, dstate) if strategy.uses_drafter else None

    def step(s: Slots) -> Slots:
        s, ds = sd_step(policy, drafter, s.replace(draft=None), s.draft, strategy, kv_len, mode, match)
        return s.replace(draft=ds)

    return steps_until_rows_finish(step, s, max_steps, min_finished)


def drafter_prefill_program(graphdef, state, dgraphdef, dstate, s: Slots, kv_len: int) -> Slots:
    """drafter_prefill for the whole table: after admissions, or when speculation switches on."""
    ds = drafter_prefill(nnx.merge(graphdef, state), nnx.merge(dgraphdef, dstate), s, s.draft, kv_len)
    return s.replace(draft=ds)
