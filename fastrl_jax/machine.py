"""Facts about the machine a benchmark ran on, for its JSON: CPU model and cores, memory, measured copy
bandwidth, JAX backend and devices, and package versions. CPU ratios differ up to 2.6x between our
machines, so a figure means little without them."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np


def _best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of run() (after one untimed call: a jitted function compiles there)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth_gbs(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Measured host memory copy bandwidth in GB/s, bytes read plus bytes written: the best of `repeats`
    copies of nbytes."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


def device_copy_gbs(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Copy bandwidth of the default device in GB/s (read + write; HBM on a GPU): a decode step's floor is the
    bytes it reads / this."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    add_one = jax.jit(lambda x: x + 1)  # reads and writes every byte once
    return 2 * nbytes / _best_seconds(lambda: jax.block_until_ready(add_one(x)), repeats) / 1e9


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matmul rate of the default device (2 n^3 flops per product), in GFLOP/s."""
    a = jnp.ones((n, n), jnp.float32)
    product = jax.jit(lambda x: x @ x)
    return 2 * n**3 / _best_seconds(lambda: product(a).block_until_ready(), repeats) / 1e9


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts() -> dict:
    """The facts, measured now (the copy bandwidth and matmul rate take a few seconds; on an accelerator its own
    memory's copy bandwidth too). CPU ratios (an SD step vs a plain step) differed up to 2.6x between machines,
    the copy bandwidth and the matmul rate the usual cause."""
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "transformers", "torch"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),  # macOS has none
        "memory_gib": round(pages * page_size / 2**30, 1),
        "copy_gbs": round(copy_bandwidth_gbs(), 1),
        "matmul_f32_gflops": round(matmul_gflops(), 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "versions": versions,
    } | ({} if jax.default_backend() == "cpu" else {"device_copy_gbs": round(device_copy_gbs(), 1)})


def facts_after(facts: dict) -> dict:
    """`facts` (machine_facts, taken before a benchmark's runs: after them the load average is the benchmark's own)
    with the load average now, at its end."""
    return facts | {"load_average_after": [round(x, 2) for x in os.getloadavg()]}


def format_machine(facts: dict) -> str:
    """One line of machine_facts for a benchmark's printed report."""
    return (f"{facts['cpu']}, {facts['cores_usable']} of {facts['cpu_count']} cores usable, {facts['backend']} "
            f"({facts['devices']} x {facts['device']}), copy {facts['copy_gbs']} GB/s, "
            f"f32 matmul {facts['matmul_f32_gflops']} GFLOP/s, load {facts['load_average'][0]}")
