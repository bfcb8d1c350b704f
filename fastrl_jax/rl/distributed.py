"""Multi-process start-up: jax.distributed.initialize, with gloo collectives when the devices are CPUs."""

from __future__ import annotations

import jax


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
    """Joins the job: explicit coordinator/num_processes/process_id, or auto-detected (SLURM, TPU pods).

    Must run before any other JAX call. CPU processes need gloo for cross-process collectives.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
