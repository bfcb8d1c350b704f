"""Rollout replicas across processes: the split of requests, the gather of completions (errors included) and
stats, the bandit states and the drafter a checkpoint saves, a checkpoint step one process cannot read, and
SLURM start-up. Two CPU processes (gloo) stand in for two hosts; their engines are stand-ins, so only the
workers' bookkeeping runs."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.cli import cpu_env, free_port

ROOT = Path(__file__).parent.parent


class FakeEngine:
    """Answers request r with its seed as the only token; a seed of -1 fails."""

    def __init__(self, index: int):
        self.index = index
        self.chooser = SimpleNamespace(state=lambda: {"replica": index})

    def generate(self, requests, between_steps=None):
        from fastrl_jax.rollout.engine import Completion
        from fastrl_jax.rollout.stats import RolloutStats, StrategyStats

        self.stats = RolloutStats(tokens=len(requests), calls=Counter(decode=self.index + 1),
                                  strategies={"8/4/48": StrategyStats(tokens=3 * len(requests), steps=len(requests))})
        return [Completion([r.seed], [-0.5], "stop") if r.seed >= 0 else
                Completion([], [], "error", error=f"replica {self.index} refused it") for r in requests]


def run_process(port: int, pid: int, out: str) -> None:
    from fastrl_jax.rl.distributed import initialize

    initialize(f"127.0.0.1:{port}", 2, pid)
    import jax
    import numpy as np

    from fastrl_jax.checkpoint import RunCheckpointer
    from fastrl_jax.config import MeshConfig
    from fastrl_jax.rl.workers import RolloutWorkers
    from fastrl_jax.rollout.engine import Request
    from fastrl_jax.sharding import make_mesh, to_host_local, to_replicated

    # The trainer's drafter is host-local (alike on every process); Orbax saves it only as a global array.
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=1))
    drafter = {"fc": jax.numpy.arange(6.0).reshape(2, 3)}
    with RunCheckpointer(Path(out).parent / "checkpoints", keep=1) as ckpt:
        ckpt.save(1, {"drafter": to_replicated(drafter, mesh)})
        ckpt.wait()
        _, arrays, _ = ckpt.restore(1, {"drafter": to_replicated(drafter, mesh)})
    back = to_host_local(arrays["drafter"])["fc"]
    saved = {"values": np.asarray(back).tolist(), "devices": [d.process_index for d in back.devices()]}
    resumed = resume_past_a_shard_one_process_cannot_read(mesh, Path(out).parent / "sharded", pid)

    workers = object.__new__(RolloutWorkers)
    workers.num_replicas = 2
    workers.replicas = [SimpleNamespace(index=pid, engine=FakeEngine(pid))]  # replica i on process i
    # 5 groups of 2 over 2 replicas: groups 0, 2, 4 on process 0, groups 1, 3 on process 1
    requests = [Request([1, 2], max_new_tokens=4, seed=-1 if i == 7 else i) for i in range(10)]
    completions, stats = workers.generate(requests, group_size=2)
    Path(out).write_text(json.dumps({
        "tokens": [c.tokens for c in completions], "finish": [c.finish_reason for c in completions],
        "errors": [c.error for c in completions], "stats": stats.as_dict(),
        "controller": workers.controller_state(), "drafter": saved, "resumed": resumed,
    }))


def resume_past_a_shard_one_process_cannot_read(mesh, directory: Path, pid: int) -> dict:
    """Steps 1 and 2 of an array split over both processes; step 2's data file of process 1's shard is cut short
    (as an interrupted copy leaves it): only process 1 reads that file, yet both must fall back to step 1."""
    import jax
    import numpy as np
    from helpers.checkpoints import damage
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from fastrl_jax.checkpoint import RunCheckpointer

    sharding = NamedSharding(mesh, PartitionSpec("data"))
    rng = np.random.default_rng(0)  # random values: compressed, ones would fit a file too small to damage
    with RunCheckpointer(directory, keep=3) as ckpt:
        for step in (1, 2):
            host = rng.random((2, 256 * 256), np.float32) + step
            ckpt.save(step, {"policy": {"w": jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])}})
    if pid == 0:
        damage(directory / "2" / "policy" / "ocdbt.process_1")
    multihost_utils.sync_global_devices("step 2 damaged")
    target = {"policy": {"w": jax.ShapeDtypeStruct((2, 256 * 256), np.float32, sharding=sharding)}}
    with RunCheckpointer(directory, keep=3) as ckpt:
        step, arrays, _ = ckpt.restore(None, target)
    return {"step": step, "min": float(np.asarray(arrays["policy"]["w"].addressable_data(0)).min())}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> list[dict]:
    """What each of two processes, one replica each, ends a rollout of 5 groups of 2 with."""
    tmp, port = tmp_path_factory.mktemp("replicas"), free_port()
    outs = [tmp / f"p{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, str(port), str(i), str(outs[i])], env=cpu_env(1), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()  # one that waits on a failed peer's collective (a no-op once it has exited)
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(o.read_text()) for o in outs]


def test_completions_come_back_in_request_order(two_processes):
    for r in two_processes:
        assert r["tokens"] == [[i] if i != 7 else [] for i in range(10)]
        assert r["finish"] == ["stop"] * 7 + ["error"] + ["stop"] * 2


def test_a_failed_request_keeps_its_reason(two_processes):
    # the trainer raises it on every process: with the reason, not 'rollout request failed: None'
    for r in two_processes:
        assert r["errors"] == [None] * 7 + ["replica 1 refused it"] + [None] * 2


def test_controller_state_holds_every_replica(two_processes):
    # a checkpoint's JSON is written by process 0 alone: it must hold process 1's bandit too
    for r in two_processes:
        assert r["controller"] == {"0": {"replica": 0}, "1": {"replica": 1}}


def test_stats_sum_every_process(two_processes):
    # the step's metrics, logged by process 0, describe the whole rollout (6 + 4 requests), as on one process
    for r in two_processes:
        s = r["stats"]
        assert s["tokens"] == 10 and s["calls"] == {"decode": 3}
        assert s["strategies"] == {"8/4/48": {"tokens": 30, "steps": 10, "seconds": 0.0}}
        assert s["acceptance_by_strategy"] == {"8/4/48": 3.0}


def test_a_host_local_drafter_checkpoints_from_every_process(two_processes):
    for pid, r in enumerate(two_processes):
        assert r["drafter"] == {"values": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "devices": [pid]}


def test_a_step_one_process_cannot_read_is_skipped_by_every_process(two_processes):
    # each process reads only its own shards: were each to fall back on its own, process 0 would go on from
    # step 2 and process 1 from step 1, one model made of two steps' halves
    for r in two_processes:
        assert r["resumed"]["step"] == 1 and 1 <= r["resumed"]["min"] < 2


def test_slurm_one_task_per_node_sees_every_gpu_of_the_node():
    from fastrl_jax.rl.distributed import one_slurm_task_per_node

    job = {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_NODES": "4"}
    assert one_slurm_task_per_node(job | {"SLURM_STEP_NUM_TASKS": "4"})
    assert not one_slurm_task_per_node(job | {"SLURM_STEP_NUM_TASKS": "32"})  # one process per GPU: JAX's default
    assert not one_slurm_task_per_node(job | {"SLURM_STEP_NUM_TASKS": "4", "JAX_LOCAL_DEVICE_IDS": "0,1"})
    assert not one_slurm_task_per_node({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "4"})


def test_a_coordinator_that_never_answers_is_one_error_that_names_the_fix():
    """JAX's own wait for the coordinator aborts the process with a C++ stack trace (DEADLINE_EXCEEDED)."""
    import socket

    from fastrl_jax.rl.distributed import host_port, wait_for_coordinator

    with socket.socket() as listening:  # process 0's coordinator, up
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        wait_for_coordinator(f"127.0.0.1:{listening.getsockname()[1]}", 5)
    port = free_port()  # nothing there
    with pytest.raises(ConnectionError, match=rf"--coordinator 127.0.0.1:{port}: nothing answered for 1s .*Start process 0"):
        wait_for_coordinator(f"127.0.0.1:{port}", 1)
    assert host_port("[::1]:1234") == ("::1", 1234) and host_port("node-7.cluster:1234") == ("node-7.cluster", 1234)


@pytest.mark.parametrize("explicit", [False, True], ids=["detected", "explicit-coordinator"])
def test_slurm_start_up_leaves_every_gpu_visible(explicit):
    # A one-node, one-task SLURM step as srun sets it up; JAX's detection alone would show the process GPU 0 only.
    # With --coordinator (and --num-processes, --process-id) JAX still detects SLURM for the local devices.
    port = str(free_port())
    env = cpu_env(1) | {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "1",
                        "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "JAX_COORDINATOR_PORT": port}
    args = f"'127.0.0.1:{port}', 1, 0" if explicit else ""
    code = (f"import jax; from fastrl_jax.rl.distributed import initialize; initialize({args}); "
            "v = jax.config.values; print(jax.process_count(), v['jax_cuda_visible_devices'], v['jax_rocm_visible_devices'])")
    out = subprocess.run([sys.executable, "-c", code], check=False, env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", "all", "all"]


if __name__ == "__main__":
    run_process(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
