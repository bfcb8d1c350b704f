"""Multi-process start-up: jax.distributed.initialize, with gloo collectives when the devices are CPUs."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import jax


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               timeout_s: float = 300.0) -> None:
    """Joins the job: explicit coordinator/num_processes/process_id, or auto-detected (SLURM, TPU pods).

    Must run before any other JAX call. CPU processes need gloo for cross-process collectives. A process other
    than 0 first waits up to timeout_s (JAX's own wait) for an explicit coordinator to answer.
    """
    if coordinator and process_id:
        wait_for_coordinator(coordinator, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    if one_slurm_task_per_node(os.environ):
        # JAX's SLURM detection assumes one process per GPU and shows each process only GPU number
        # SLURM_LOCALID, even with an explicit coordinator (it fills in any unset parameter, the local
        # devices included); a process per node drives every GPU SLURM gave the node. The backends
        # start after this, so they see them all.
        for flag in ("jax_cuda_visible_devices", "jax_rocm_visible_devices"):
            jax.config.update(flag, "all")


def one_slurm_task_per_node(env: Mapping[str, str]) -> bool:
    """Whether this is a SLURM step with one task on each node (and JAX_LOCAL_DEVICE_IDS does not pick the GPUs)."""
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS"))
    nodes = env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES"))
    return "SLURM_JOB_ID" in env and "JAX_LOCAL_DEVICE_IDS" not in env and tasks is not None and tasks == nodes


def host_port(address: str) -> tuple[str, int]:
    """HOST:PORT as (host, port); an IPv6 host in brackets, [::1]:1234 (the form jax.distributed takes), without
    them (they were looked up as part of the name)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once something accepts connections at HOST:PORT (process 0's coordinator), else raises
    ConnectionError naming the fix: JAX's own wait ends the process with a C++ stack trace and
    DEADLINE_EXCEEDED, which names none."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(host_port(address), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"--coordinator {address}: nothing answered for {timeout_s:.0f}s ({e}). Start process 0 "
                    "(--process-id 0) with the same --coordinator, on the host it names, and check that the host name "
                    "resolves and the port is open from this node") from None
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
