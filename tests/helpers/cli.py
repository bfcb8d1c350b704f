"""The `fastrl-jax` command in a subprocess, as a user runs it."""

import os
import subprocess
import sys


def fastrl_jax(*args):
    """Runs the command in a fresh process on one CPU device (the tests' 8 fake devices stay here), compiling
    without LLVM's optimizer as every test does (conftest.py)."""
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    return subprocess.run([sys.executable, "-m", "fastrl_jax.cli", *args], capture_output=True, text=True, env=env)
