"""The tree-accept walk op: reference.walk or the Pallas kernel, chosen by kernels/backends.py.

On CPU the reference runs (XLA fuses its loop well); on GPU and TPU the Pallas kernel replaces the
reference's per-level loop of small kernels with one launch. No Triton kernel of its own: on NVIDIA
GPUs the Pallas kernel already lowers through Triton.
"""

from __future__ import annotations

import functools

import jax
from fastrl_jax.kernels import backends
from fastrl_jax.kernels.tree_accept import pallas, reference
from fastrl_jax.kernels.tree_accept.reference import acceptable_children

__all__ = ["acceptable_children", "walk"]

IMPLS = {
    "reference": reference.walk,
    "pallas": pallas.walk,
    "pallas_interpret": functools.partial(pallas.walk, interpret=True),
}


def walk(acceptable: jax.Array, parents: jax.Array, *, backend: str = "auto", with_backend: bool = False):
    """reference.walk's contract; with_backend=True also returns the backend that ran."""
    out, used = backends.dispatch("tree walk", IMPLS, backend, (acceptable, parents), compiled=("pallas",))
    return (out, used) if with_backend else out
