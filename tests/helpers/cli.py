"""The `fastrl-jax` command in a subprocess, as a user runs it, and the environment of test subprocesses."""

import os
import socket
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# conftest.py's compile flags for the tests' own process (those this jaxlib knows), for the processes they start.
COMPILE_FLAGS = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                         if not f.startswith("--xla_force_host_platform_device_count"))


def cpu_env(devices: int = 1) -> dict:
    """A test subprocess's environment: `devices` CPU devices, the tests' compile flags, and tests/ importable
    (the tiny runs' reward function)."""
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}",
                JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


def fastrl_jax(*args):
    """Runs the command in a fresh process on one CPU device (the tests' 8 fake devices stay here), compiling
    as every test does (conftest.py)."""
    env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS)
    return subprocess.run([sys.executable, "-m", "fastrl_jax.cli", *args], capture_output=True, text=True, env=env)


def free_port() -> int:
    """A TCP port free on this machine now (a multi-process test's coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
