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
import numpy as np


def copy_bandwidth_gbs(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Measured host memory copy bandwidth in GB/s (read + write counted once, as a decode step reads
    its weights once): the best of `repeats` copies of nbytes."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


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
    """The facts, measured now (the copy bandwidth takes about a second)."""
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
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(pages * page_size / 2**30, 1),
        "copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "backend": jax.default_backend(),
        "devices": sorted({d.device_kind for d in jax.devices()}),
        "device_count": jax.device_count(),
        "versions": versions,
    }
