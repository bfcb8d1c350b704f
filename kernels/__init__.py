"""Ops with backends (imported as fastrl_jax.kernels): each op's api.py dispatches between a pure-JAX
reference, a Pallas kernel and, where one exists, a Triton kernel; backends.py chooses."""
