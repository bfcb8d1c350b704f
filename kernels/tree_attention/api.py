"""Masked (tree) attention: each new token attends to the cache slots its mask row allows.

One op serves the policy's decode, prefill and tree-verify forwards: every new token sees its row's
cached prefix plus its ancestors in the draft tree (decode and prefill are the causal special case).
Backends (kernels/backends.py chooses; shapes in reference.py):

- "reference": pure JAX, the default on CPU, where XLA fuses it well.
- "pallas": a Pallas kernel for GPU (Triton lowering) and TPU (Mosaic); "pallas_interpret" runs the
  same kernel through Pallas's interpreter on any platform, which is how the CPU tests check it.
- "triton": NVIDIA GPUs only, a Triton kernel launched through jax-triton (triton_kernel.py,
  imported only when called, because triton imports only beside a GPU jaxlib).

The compiled backends define no VJP of their own: training differentiates through the reference.
Under a mesh set around the caller's trace (`jax.set_mesh`) they run per shard (`sharded`): XLA has no
partitioning rule for a kernel's custom call and would gather every operand whole onto every device.
"""

from __future__ import annotations

import functools

import jax
from fastrl_jax.kernels import backends
from fastrl_jax.kernels.tree_attention import pallas, reference
from fastrl_jax.kernels.tree_attention.reference import check_shapes, place_new_tokens
from jax.sharding import PartitionSpec as P


def masked_attention(q, k, v, mask, *, backend: str = "auto", with_backend: bool = False):
    """q [B, T, KV, G, D] (already scaled by 1/sqrt(D)), k, v [B, KV, S, D], mask [B, T, S] bool
    -> [B, T, KV, G, D] in q.dtype; with_backend=True returns (output, the backend that ran).

    backend: "auto" or one of kernels.backends.BACKENDS; one that is unavailable here or fails to
    compile hands over to the next (triton -> pallas -> reference) with one logged warning.
    """
    check_shapes(q, k, v, mask)
    out, used = backends.dispatch("attention", IMPLS, backend, (q, k, v, mask), compiled=("pallas", "triton"))
    return (out, used) if with_backend else out


def cached_attention(q, k_cached, v_cached, k_new, v_new, start, mask, *, cached_slots: int | None = None,
                     backend: str = "auto", with_backend: bool = False):
    """Attention of T new tokens over a cache window in which slots [start, start + T) are theirs
    (reference.cached_attention's contract, cached_slots included). The reference scores cached slots
    and new tokens apart; the kernels get the window with the new keys placed in it (and read all of it)."""
    check_shapes(q, k_cached, v_cached, mask)
    # The window's shapes are the cache's: a kernel that does not compile for them leaves the split reference
    order = backends.usable("attention", IMPLS, backend, (q, k_cached, v_cached, mask), compiled=("pallas", "triton"))
    if order[0] == "reference":
        backends.record("attention", "reference")
        out = reference.cached_attention(q, k_cached, v_cached, k_new, v_new, start, mask, cached_slots)
        return (out, "reference") if with_backend else out
    k_win, v_win = (place_new_tokens(c, n, start) for c, n in ((k_cached, k_new), (v_cached, v_new)))
    return masked_attention(q, k_win, v_win, mask, backend=order[0], with_backend=with_backend)


def triton(q, k, v, mask):
    """The jax-triton launch; ImportError where jax-triton / triton do not import, NotImplementedError
    off GPU or for head dims Triton cannot tile."""
    if jax.default_backend() != "gpu":
        raise NotImplementedError(f"the triton backend needs an NVIDIA GPU; JAX's backend is {jax.default_backend()!r}")
    try:
        from fastrl_jax.kernels.tree_attention import triton_kernel  # imports jax_triton and triton
    except Exception as e:  # jax-triton fails in more ways than ImportError on a mismatched jaxlib
        raise ImportError(f"jax-triton / triton do not import: {e}") from e
    return triton_kernel.masked_attention(q, k, v, mask)


# The mesh axes (fastrl_jax.sharding's) a kernel call splits rows and KV heads over, where they divide them.
ROW_AXES, HEAD_AXIS = ("data", "fsdp"), "tensor"


def shard_specs(mesh, batch: int, kv_heads: int):
    """(q / out, k / v, mask) PartitionSpecs of one attention call on `mesh` (an AbstractMesh or Mesh):
    rows over the row axes whose product divides `batch`, KV heads over the head axis where it divides
    `kv_heads`; None when nothing splits (an empty mesh, or every such axis of size 1)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows, n = [], 1
    for axis in ROW_AXES:
        if sizes.get(axis, 1) > 1 and batch % (n * sizes[axis]) == 0:
            rows.append(axis)
            n *= sizes[axis]
    heads = HEAD_AXIS if sizes.get(HEAD_AXIS, 1) > 1 and kv_heads % sizes[HEAD_AXIS] == 0 else None
    if not rows and heads is None:
        return None
    row = rows[0] if len(rows) == 1 else tuple(rows) or None
    return P(row, None, heads), P(row, heads), P(row)


def sharded(kernel):
    """kernel(q, k, v, mask) under jax.shard_map over the mesh set around the caller's trace, split as
    shard_specs says: each device runs its own rows and KV heads (attention is independent across both).
    Without a mesh, or where nothing divides, the kernel runs whole."""

    @functools.wraps(kernel)
    def run(q, k, v, mask):
        mesh = jax.sharding.get_abstract_mesh()
        specs = None if mesh.empty else shard_specs(mesh, k.shape[0], k.shape[1])
        if specs is None:
            return kernel(q, k, v, mask)
        q_spec, kv_spec, mask_spec = specs
        return jax.shard_map(kernel, in_specs=(q_spec, kv_spec, kv_spec, mask_spec), out_specs=q_spec,
                             check_vma=False)(q, k, v, mask)

    return run


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
        _, vjp = jax.vjp(lambda q, k, v: reference.masked_attention(q, k, v, mask), q, k, v)
        return (*vjp(grad), None)

    attention.defvjp(forward, backward)
    return attention


IMPLS = {
    "reference": reference.masked_attention,
    "pallas": _with_reference_vjp(sharded(pallas.masked_attention)),
    "pallas_interpret": _with_reference_vjp(sharded(functools.partial(pallas.masked_attention, interpret=True))),
    "triton": _with_reference_vjp(sharded(triton)),
}
