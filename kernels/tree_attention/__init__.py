"""Masked (tree) attention: api.py dispatches to reference.py, pallas.py and triton_kernel.py."""
