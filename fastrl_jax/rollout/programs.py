"""The engine's device-side row table and the pure programs over it: prefill, decode, resize.

Each program has static shapes for one (batch bucket, length bucket) and takes the model state as
an argument, so the pool compiles it once and a weight update reuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec

from fastrl_jax.kernels.tree_attention.api import shard_specs
from fastrl_jax.models.decoder import KVCache, attention_mask
from fastrl_jax.rollout.sampling import SamplingParams, sample


@struct.dataclass
class Slots:
    """One row per in-flight request; batch is axis 0 of every field (axis 1 of the cache)."""

    cache: KVCache  # [L, B, KV, S, D]
    token: jax.Array  # [B] int32 last sampled token, not yet in the cache
    length: jax.Array  # [B] int32 tokens in the cache = position of `token`
    live: jax.Array  # [B] bool
    n_out: jax.Array  # [B] int32 completion tokens so far
    max_new: jax.Array  # [B] int32
    stop_ids: jax.Array  # [B, NS] int32, -1 padded
    out_tokens: jax.Array  # [B, C] int32
    out_logprobs: jax.Array  # [B, C] float32
    params: SamplingParams  # each [B]
    # [B, S, F] the drafter's policy features of every cached position (Decoder capture=feature_layers:
    # the last-layer hidden state, F = H, or EAGLE-3's three layers, F = 3H), or None; in the weights'
    # dtype (the dtype the policy computes them in: a wider store would hold no more information)
    hidden: jax.Array | None
    history: jax.Array  # [B, S + 1] int32 token at every position up to and including `token`
    group: jax.Array  # [B] int32 prompt group (rows of one group draft from each other's text)
    spec_counts: jax.Array  # [B, 3] int32 speculative steps, emitted drafts from EAGLE, from history
    idle: jax.Array  # [B] int32 device steps the row waited finished, for its refill
    corpus: jax.Array | None = None  # [B, M] int32 earlier text of each row's group (history drafting)
    draft: Any = None  # speculative.DraftState when an EAGLE drafter speculates
    feature_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())  # what `hidden` captures

    @property
    def batch(self) -> int:
        return self.token.shape[0]

    @classmethod
    def empty(cls, model_cfg, batch: int, max_len: int, num_stop_ids: int, with_hidden: bool, dtype,
              corpus_tokens: int = 0, feature_layers: tuple[int, ...] = ()) -> Slots:
        def zeros_i():  # a fresh buffer per field: donation rejects one buffer passed twice
            return jnp.zeros(batch, jnp.int32)

        return cls(
            cache=KVCache.zeros(model_cfg, batch, max_len, dtype),
            token=zeros_i(),
            length=zeros_i(),
            live=jnp.zeros(batch, bool),
            n_out=zeros_i(),
            max_new=zeros_i(),
            stop_ids=jnp.full((batch, num_stop_ids), -1, jnp.int32),
            out_tokens=jnp.zeros((batch, max_len), jnp.int32),
            out_logprobs=jnp.zeros((batch, max_len), jnp.float32),
            params=SamplingParams(
                temperature=jnp.zeros(batch, jnp.float32),
                top_k=zeros_i(),
                top_p=jnp.ones(batch, jnp.float32),
                seed=jnp.zeros(batch, jnp.uint32),
            ),
            hidden=jnp.zeros((batch, max_len, model_cfg.hidden_size * max(len(feature_layers), 1)), dtype)
            if with_hidden else None,
            history=jnp.zeros((batch, max_len + 1), jnp.int32),
            group=zeros_i(),
            spec_counts=jnp.zeros((batch, 3), jnp.int32),
            idle=zeros_i(),
            corpus=jnp.full((batch, corpus_tokens), -1, jnp.int32) if corpus_tokens else None,
            feature_layers=tuple(feature_layers),
        )


@struct.dataclass
class Admission:
    """New requests for `rows` of the table, their prompts packed back to back into one sequence of N
    tokens (each prompt what follows the shared prefix; requests with the same prompt share one copy).
    Entries with valid=False are padding. Per-request fields [P, ...], packed ones [N]."""

    rows: jax.Array  # [P] int32
    valid: jax.Array  # [P] bool
    offset: jax.Array  # [P] int32 where the request's prompt starts in the pack
    lengths: jax.Array  # [P] int32 prefix + prompt tokens
    max_new: jax.Array  # [P] int32
    stop_ids: jax.Array  # [P, NS] int32
    params: SamplingParams  # each [P]
    group: jax.Array  # [P] int32
    tokens: jax.Array  # [N] int32 the packed prompts, then padding
    positions: jax.Array  # [N] int32 each token's position in its prompt (the shared prefix included)
    segment: jax.Array  # [N] int32 which packed prompt each token belongs to; -1 for padding


@struct.dataclass
class Prefix:
    """Leading prompt tokens every request of a stream shares (the chat template's system turn),
    prefilled once and copied into each admitted row. Lp = 0 when there is none."""

    tokens: jax.Array  # [Lp] int32
    cache: KVCache  # [layers, 1, kv_heads, Lp, head_dim]
    hidden: jax.Array | None  # [1, Lp, F] the table's features (Slots.hidden), kept when the table keeps them


def prefix_program(graphdef, state, tokens: jax.Array, dtype, with_hidden: bool, capture: tuple[int, ...] = ()) -> Prefix:
    """Runs the shared prefix tokens [Lp] once; capture: the table's feature_layers."""
    model = nnx.merge(graphdef, state)
    Lp = tokens.shape[0]
    _, features, cache = model.hidden_and_features(tokens[None], jnp.arange(Lp, dtype=jnp.int32)[None],
                                                   KVCache.zeros(model.cfg, 1, Lp, dtype), jnp.zeros(1, jnp.int32),
                                                   capture=capture)
    return Prefix(tokens=tokens, cache=cache, hidden=features.astype(dtype) if with_hidden else None)


def _finished(token: jax.Array, n_out: jax.Array, slots_or_adm) -> jax.Array:
    stopped = jnp.any(token[:, None] == slots_or_adm.stop_ids, axis=-1)
    return stopped | (n_out >= slots_or_adm.max_new)


def prefill(graphdef, state, slots: Slots, adm: Admission, prefix: Prefix) -> Slots:
    """Runs the packed prompts as one sequence behind the shared prefix (each token sees the prefix and
    the earlier tokens of its own prompt), samples each request's first token from its prompt's last
    position, and writes prefix + prompt into the request's row. Packing pads a call to a prompt bucket
    instead of every prompt to the longest one's."""
    model = nnx.merge(graphdef, state)
    tokens, positions, tmp, start, mask, cached_slots = _pack(model, adm, prefix, slots.cache.k.dtype)
    hidden, features, tmp = model.hidden_and_features(tokens, positions, tmp, start, kv_len=mask.shape[-1], mask=mask,
                                                     capture=slots.feature_layers, cached_slots=cached_slots)
    return _admit_rows(model, slots, adm, prefix, hidden, features, tmp)


def decode_and_admit(graphdef, state, slots: Slots, adm: Admission, prefix: Prefix, kv_len: int) -> Slots:
    """One decode step of the live rows (window kv_len, as `decode`) and the prefill of an admission (as
    `prefill`) in one pass over the weights: the prompts ride on the decode step's weight contractions."""
    model = nnx.merge(graphdef, state)
    s = slots
    decoding = (s.token[:, None], s.length[:, None], s.cache, s.length, attention_mask(s.length, None, 1, kv_len), None)
    (hidden, features, cache), (p_hidden, p_features, tmp) = model.hidden_and_features_together(
        [decoding, _pack(model, adm, prefix, s.cache.k.dtype)], capture=s.feature_layers)
    s = _decoded(model, s, hidden, features, cache)
    return _admit_rows(model, s, adm, prefix, p_hidden, p_features, tmp)


def _pack(model, adm: Admission, prefix: Prefix, dtype):
    """The admission as one row of tokens for the forward: (tokens [1, N], positions [1, N], a cache
    holding the prefix, start [1], mask [1, N, Lp + N], cached slots Lp: only the prefix is cached, so
    attention scores the pack's own slots as new tokens only)."""
    N, Lp = adm.tokens.shape[0], prefix.tokens.shape[0]
    # The pack's cache: prefix, the N packed tokens, and N slots of slack, so that every prompt's
    # N-slot window [Lp + offset, Lp + offset + N) can be cut out for its row (_admit_rows).
    empty = KVCache.zeros(model.cfg, 1, Lp + 2 * N, dtype)
    tmp = KVCache(k=empty.k.at[:, :, :, :Lp].set(prefix.cache.k.astype(dtype)),
                  v=empty.v.at[:, :, :, :Lp].set(prefix.cache.v.astype(dtype)))
    j = jnp.arange(N)
    own = (adm.segment[:, None] == adm.segment[None, :]) & (j[None, :] <= j[:, None])  # padding sees padding
    mask = jnp.concatenate([jnp.ones((N, Lp), bool), own], axis=1)[None]
    return adm.tokens[None], adm.positions[None], tmp, jnp.full(1, Lp, jnp.int32), mask, Lp


def _admit_rows(model, slots: Slots, adm: Admission, prefix: Prefix, hidden, features, tmp: KVCache) -> Slots:
    """Samples each admitted request's first token from the pack's forward (hidden, features [1, N, ...],
    its cache tmp) and writes prefix + prompt into the request's row."""
    P, N, Lp = adm.rows.shape[0], adm.tokens.shape[0], prefix.tokens.shape[0]
    j = jnp.arange(N)
    last = adm.offset + adm.lengths - Lp - 1
    token, logprob = sample(model.logits(hidden[0, last]), adm.params, adm.lengths)
    features = jnp.concatenate([features[0], jnp.zeros_like(features[0])])  # [2N, F], slack as in _pack

    def window(a, p, axis):  # prompt p's N positions of packed `a` along `axis` (slack behind the pack)
        return jax.lax.dynamic_slice_in_dim(a, Lp + adm.offset[p] if axis == 3 else adm.offset[p], N, axis)

    def write(p, tables):
        def put(tables):
            cache, hid = tables
            at = (0, adm.rows[p], 0, 0, 0)
            k = jax.lax.dynamic_update_slice(cache.k, jnp.concatenate([tmp.k[:, :, :, :Lp], window(tmp.k, p, 3)], 3), at)
            v = jax.lax.dynamic_update_slice(cache.v, jnp.concatenate([tmp.v[:, :, :, :Lp], window(tmp.v, p, 3)], 3), at)
            if hid is not None:
                row = window(features, p, 0).astype(hid.dtype)
                if prefix.hidden is not None:
                    row = jnp.concatenate([prefix.hidden[0].astype(hid.dtype), row])
                hid = jax.lax.dynamic_update_slice(hid, row[None], (adm.rows[p], 0, 0))
            return KVCache(k=k, v=v), hid

        return jax.lax.cond(adm.valid[p], put, lambda t: t, tables)

    cache, hid = jax.lax.fori_loop(0, P, write, (slots.cache, slots.hidden))
    # Padding entries point past the table and are dropped by the scatters below.
    rows = jnp.where(adm.valid, adm.rows, slots.batch)

    def set_rows(table, values):
        return table.at[rows].set(values, mode="drop")

    prompts = jnp.concatenate([adm.tokens, jnp.zeros_like(adm.tokens)])[adm.offset[:, None] + j[None, :]]  # [P, N]
    history = slots.history.at[rows, :Lp].set(jnp.broadcast_to(prefix.tokens, (P, Lp)), mode="drop")
    history = history.at[rows, Lp : Lp + N].set(prompts, mode="drop")
    history = history.at[rows, adm.lengths].set(token, mode="drop")

    done = _finished(token, jnp.ones(P, jnp.int32), adm)
    return slots.replace(
        cache=cache,
        hidden=hid,
        token=set_rows(slots.token, token),
        length=set_rows(slots.length, adm.lengths),
        live=set_rows(slots.live, ~done),
        n_out=set_rows(slots.n_out, jnp.ones(P, jnp.int32)),
        max_new=set_rows(slots.max_new, adm.max_new),
        stop_ids=set_rows(slots.stop_ids, adm.stop_ids),
        group=set_rows(slots.group, adm.group),
        spec_counts=set_rows(slots.spec_counts, jnp.zeros((P, 3), jnp.int32)),
        out_tokens=slots.out_tokens.at[rows, 0].set(token, mode="drop"),
        out_logprobs=slots.out_logprobs.at[rows, 0].set(logprob, mode="drop"),
        params=jax.tree.map(set_rows, slots.params, adm.params),
        history=history,
    )


def steps_until_rows_finish(step: Callable[[Slots], Slots], slots: Slots, max_steps: jax.Array,
                            min_finished: jax.Array) -> Slots:
    """Runs step(slots) on device until max_steps steps have run, or min_finished of the rows live at
    the start have finished (all of them, if fewer are live): the loop of plain and speculative decoding
    alike. The host refills finished rows in one (packed) prefill when the loop returns; meanwhile they wait,
    counted in `idle`."""
    started = slots.live
    n_live = jnp.sum(started)
    goal = jnp.minimum(jnp.maximum(min_finished, 1), n_live)

    def cond(carry):
        i, s = carry
        return (i < max_steps) & (n_live - jnp.sum(s.live) < goal) & (n_live > 0)

    def body(carry):
        i, s = carry
        waiting = started & ~s.live  # finished before this step: not the step that emits a row's last token
        s = step(s)
        return i + 1, s.replace(idle=s.idle + waiting)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), slots))[1]


def decode(graphdef, state, slots: Slots, max_steps: jax.Array, min_finished: jax.Array, kv_len: int,
           wide_rows: jax.Array | None = None, narrow: int | None = None) -> Slots:
    """Decodes up to max_steps tokens per live row, returning early once min_finished rows have finished.

    Every live row's length must stay < kv_len (the new token's slot is inside the attention
    window): the host passes max_steps <= kv_len - max(length). With `narrow` (static), only
    wide_rows [n] read kv_len slots and every other live row must stay < narrow.
    """
    model = nnx.merge(graphdef, state)

    def step(s: Slots) -> Slots:
        hidden, features, cache = model.hidden_and_features(
            s.token[:, None], s.length[:, None], s.cache, s.length, kv_len=kv_len, capture=s.feature_layers,
            narrow=None if narrow is None else (wide_rows, narrow))
        return _decoded(model, s, hidden, features, cache)

    return steps_until_rows_finish(step, slots, max_steps, min_finished)


def _decoded(model, s: Slots, hidden, features, cache: KVCache) -> Slots:
    """The table after one decode step: each live row samples its next token from the step's hidden
    state [B, 1, H] and keeps its features and the step's cache; dead rows keep their state."""
    rows = jnp.arange(s.batch)
    token, logprob = sample(model.logits(hidden[:, 0]), s.params, s.length + 1)
    live = s.live
    col = jnp.where(live, s.n_out, s.out_tokens.shape[1])  # dead rows write nowhere
    hid = s.hidden
    if hid is not None:
        hid = hid.at[rows, s.length].set(features[:, 0].astype(hid.dtype))
    n_out = s.n_out + live
    return s.replace(
        cache=cache,
        hidden=hid,
        token=jnp.where(live, token, s.token),
        length=s.length + live,
        n_out=n_out,
        live=live & ~_finished(token, n_out, s),
        out_tokens=s.out_tokens.at[rows, col].set(token, mode="drop"),
        out_logprobs=s.out_logprobs.at[rows, col].set(logprob, mode="drop"),
        history=s.history.at[rows, jnp.where(live, s.length + 1, s.history.shape[1])].set(token, mode="drop"),
    )


def cache_spec(mesh, batch: int, kv_heads: int) -> PartitionSpec:
    """A row table's KV cache [L, B, KV, S, D] on `mesh`, split as attention splits it (the kernels' shard_specs):
    rows over fsdp and KV heads over tensor where they divide, so each device holds its own rows of its own heads."""
    specs = shard_specs(mesh, batch, kv_heads)
    return PartitionSpec(None, *(specs[1] if specs is not None else (None, None)), None, None)


def hidden_spec(mesh, batch: int, features: int) -> PartitionSpec:
    """A row table's kept features [B, S, F]: rows as its caches', features over tensor where they divide (as XLA
    carries them through a call)."""
    return PartitionSpec(cache_spec(mesh, batch, 1)[1], None, "tensor" if features % mesh.shape["tensor"] == 0 else None)


def resize(slots: Slots, index: jax.Array) -> Slots:
    """A table of len(index) rows taking row index[i] of `slots`; index -1 gives an empty dead row."""
    rows = jnp.where(index < 0, slots.batch, index)  # past the end: filled (take wraps -1 to the last row)

    def take(x, axis=0):
        return jnp.take(x, rows, axis=axis, mode="fill", fill_value=0)

    mesh = jax.sharding.get_abstract_mesh()

    def take_cache(c: KVCache) -> KVCache:
        if mesh.empty:
            return KVCache(k=take(c.k, 1), v=take(c.v, 1))
        specs = [cache_spec(mesh, n, c.k.shape[2]) for n in (slots.batch, len(index))]
        return KVCache(k=_take_split_rows(c.k, rows, 1, *specs), v=_take_split_rows(c.v, rows, 1, *specs))

    stop_ids = jnp.where((index >= 0)[:, None], take(slots.stop_ids), -1)
    out = jax.tree.map(take, slots.replace(cache=None, stop_ids=None, draft=None, hidden=None))
    # An empty row's top_p is 1, as in Slots.empty: a fill of 0 would turn top-p filtering on for every row
    top_p = jnp.where(index >= 0, out.params.top_p, 1.0)
    out = out.replace(cache=take_cache(slots.cache), stop_ids=stop_ids, params=out.params.replace(top_p=top_p))
    if slots.hidden is not None:
        F = slots.hidden.shape[-1]
        out = out.replace(hidden=take(slots.hidden) if mesh.empty else _take_split_rows(
            slots.hidden, rows, 0, hidden_spec(mesh, slots.batch, F), hidden_spec(mesh, len(index), F)))
    if slots.draft is not None:
        draft = jax.tree.map(take, slots.draft.replace(cache=None)).replace(cache=take_cache(slots.draft.cache))
        out = out.replace(draft=draft)
    return out


def _take_split_rows(x: jax.Array, rows: jax.Array, axis: int, old: PartitionSpec, new: PartitionSpec) -> jax.Array:
    """jnp.take(x, rows, axis, mode="fill", fill_value=0) of a table array whose rows are split over the mesh as
    `old` says, into rows split as `new` says: each device takes the rows it holds (zeros for the others) and a
    reduce-scatter sums every device's part into each device's own new rows. Left to XLA, the whole new table
    was summed onto every device (an all-reduce: two whole tables of temporaries, more than the layout saves)."""
    src, dst = old[axis], new[axis]
    if src is None and dst is None:  # rows whole (one device, or a batch fsdp does not divide): nothing moves
        return jnp.take(x, rows, axis=axis, mode="fill", fill_value=0)

    def local(x, rows):
        n = x.shape[axis]
        if src is not None:  # rows of other devices, and past the end, are filled with zeros
            rows = rows - jax.lax.axis_index(src) * n
            rows = jnp.where((rows >= 0) & (rows < n), rows, n)
        elif dst is not None:  # every device holds every row: take its own new rows only
            part = rows.shape[0] // jax.lax.psum(1, dst)
            rows = jax.lax.dynamic_slice_in_dim(rows, jax.lax.axis_index(dst) * part, part)
        taken = jnp.take(x, rows, axis=axis, mode="fill", fill_value=0)
        if src is None:
            return taken
        if dst == src:
            return jax.lax.psum_scatter(taken, src, scatter_dimension=axis, tiled=True)
        whole = jax.lax.psum(taken, src)
        if dst is None:
            return whole
        part = whole.shape[axis] // jax.lax.psum(1, dst)
        return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(dst) * part, part, axis)

    return jax.shard_map(local, in_specs=(old, PartitionSpec()), out_specs=new, check_vma=False)(x, rows)
