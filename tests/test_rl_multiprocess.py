"""Two CPU processes (gloo collectives) run GRPO steps on one mesh spanning both, and agree with one
process holding the same mesh; the online drafter trains on a process's replica while it waits for the
other, and the copies are merged into one."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import cpu_env, free_port
from helpers.tiny_run import tiny_overrides

from fastrl_jax.metric_sink import read_metrics

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def _two_processes(args: list[str], devices: int = 2) -> list[str]:
    """Runs `python ARGS --coordinator ... --process-id P` as processes 0 and 1; their stderr, after both succeeded."""
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, *args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                          "--process-id", str(i)],
                         env=cpu_env(devices), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [err for _, err in outs]


def test_two_processes_one_mesh(tmp_path):
    # mesh data=2 (one rollout replica per process) x fsdp=2 (two devices in each process); adaptive SD, so each
    # checkpoint holds the drafter every process keeps on one local device (Orbax refused it from several processes).
    # Process 0 reaches each rollout's gather 3 s late: process 1's replica trains the drafter meanwhile, from step 2
    # on (no steps in the rollout tail, so those are the only ones), and process 0 logs the merged report.
    # Two mini-batches a step: the second's old log-probs are read whole on each process (they came back split over
    # both processes' devices, which device_get refused).
    overrides = [*tiny_overrides(tmp_path, steps=2), "mesh.data=2", "mesh.fsdp=2", "rl.checkpoint_every_steps=1",
                 "sd.mode=adaptive", "drafter_online.min_buffer_tokens=1", "drafter_online.tail_time_share=0",
                 "rl.minibatches_per_step=2"]
    train = ["-m", "helpers.slow_gather", "3", "train", *overrides, f"rl.out_dir={tmp_path / 'multi'}"]
    errs = _two_processes(train)
    single = subprocess.run(
        # SD off: the same rollouts (speculation is lossless), without compiling its programs again
        [sys.executable, "-m", "fastrl_jax.cli", "train", *overrides, f"rl.out_dir={tmp_path / 'single'}", "sd.mode=off"],
        env=cpu_env(4), cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    multi = read_metrics(tmp_path / "multi" / "metrics.jsonl")
    one = read_metrics(tmp_path / "single" / "metrics.jsonl")
    assert [m["step"] for m in multi] == [1, 2]
    for a, b in zip(multi, one):
        for key in ("reward_mean", "reward_std", "len_mean", "tokens"):
            assert a[key] == b[key], key
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    assert (tmp_path / "multi" / "checkpoints" / "2").is_dir()
    # Process 1's drafter steps and both sample buffers count in the report; each process saved its own buffer, and
    # both end with one drafter (and optimizer state).
    assert multi[1]["drafter_steps"] > 0 and multi[1]["drafter_buffer_tokens"] > 0
    assert _drafter_digests(errs)[0] == _drafter_digests(errs)[1]
    for p in (0, 1):
        assert (tmp_path / "multi" / "drafter_buffer" / f"process_{p}" / "2.npz").is_file()

    # Both go on from step 2's checkpoint: the merged drafter, its optimizer, each process's own buffer.
    errs = _two_processes([*train, "rl.steps=3", "--resume"])
    assert all("resumed from step 2" in err for err in errs), errs[0][-3000:]
    step3 = read_metrics(tmp_path / "multi" / "metrics.jsonl")[-1]
    assert step3["step"] == 3
    assert step3["drafter_buffer_tokens"] > multi[1]["drafter_buffer_tokens"]  # step 2's rollouts came back too
    assert _drafter_digests(errs)[0] == _drafter_digests(errs)[1]


def _drafter_digests(errs: list[str]) -> list[str]:
    return [next(line.split()[-1] for line in err.splitlines() if line.startswith("drafter digest")) for err in errs]


MERGE = """
import json, sys
from fastrl_jax.rl.distributed import initialize
initialize(sys.argv[1], 2, int(sys.argv[2]))
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fastrl_jax.drafter.online import merge_processes

p, steps = jax.process_index(), json.loads(sys.argv[3])
split = NamedSharding(Mesh(np.array(jax.local_devices()), ("x",)), P("x"))  # a leaf over this process's two devices
mine = {"w": jax.device_put(jnp.full((4, 3), p + 1.0), split), "b": jnp.full(3, 2.0 * (p + 1), jnp.bfloat16),
        "count": jnp.asarray(5 + steps[p])}  # an optimizer's step counter, at 5 when the copies were last one
out = merge_processes(mine, steps)
assert out["w"].sharding == split and out["b"].dtype == jnp.bfloat16, (out["w"].sharding, out["b"].dtype)
print(json.dumps({k: np.asarray(v, np.float32).tolist() for k, v in out.items()}))
"""


@pytest.mark.parametrize("steps", [[3, 1], [2, 0]])
def test_merge_processes_weights_each_copy_by_its_steps(steps):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", MERGE, f"127.0.0.1:{port}", str(i), json.dumps(steps)],
                              env=cpu_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    merged = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert merged[0] == merged[1]  # one drafter on every process
    w = (steps[0] * 1.0 + steps[1] * 2.0) / sum(steps)  # a process that trained none adds nothing
    np.testing.assert_allclose(merged[0]["w"], np.full((4, 3), w), rtol=1e-6)
    np.testing.assert_allclose(merged[0]["b"], np.full(3, 2 * w), rtol=1e-2)
    assert merged[0]["count"] == 5 + sum(steps)  # counters advance by every process's steps
