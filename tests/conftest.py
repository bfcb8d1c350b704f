"""Test set-up: 8 fake CPU devices for mesh tests (must be set before jax is imported anywhere)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
