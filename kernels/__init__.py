"""Pallas / Triton kernels, each beside its pure-JAX reference (imported as fastrl_jax.kernels)."""
