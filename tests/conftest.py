"""Shared test set-up.

Mesh tests need 8 devices. On CPU, XLA fakes them, but only if the flag is in XLA_FLAGS
before jax is first imported, and pytest imports conftest.py before any test module.
The suite's time goes mostly into compiling thousands of small programs: tests compile with LLVM's
optimizer at level 1 and XLA's older fusion emitters, which compile them ~1.5x faster than the
default emitters. Level 0 compiles as fast but runs the real model's decode ~4x slower (each layer's
weights are copied out of the stacked scan parameters by unoptimized loops): test_speculative.py took
198.6 s at level 0, 147.2 s at level 0 with the older emitters, 133.8 s at level 1 with them
(docs/measurements.md). On a GPU, tests also skip XLA's gemm autotuning, which times
candidate kernels at every compile (a parity test needs a correct gemm, not the fastest). Test
subprocesses inherit the flags through the environment. Flags are appended so that XLA_FLAGS a
developer already set still apply. Under pytest-xdist the workers share one GPU, so none preallocates
its memory.
"""

import os
import subprocess
import sys

TEST_XLA_FLAGS = {"xla_force_host_platform_device_count": "8", "xla_backend_optimization_level": "1",
                  "xla_cpu_use_fusion_emitters": "false", "xla_gpu_autotune_level": "0"}
# A flag XLA does not know aborts the process, and XLA retires flags like this one with the code they switch.
PROBED = ("xla_cpu_use_fusion_emitters",)


def _xla_knows(flag: str, value: str) -> bool:
    """Whether this jaxlib's XLA accepts `--flag=value` (asked of a child process, once per session: pytest-xdist
    workers inherit the XLA_FLAGS set here)."""
    env = dict(os.environ, XLA_FLAGS=f"--{flag}={value}", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True).returncode == 0


for _flag, _value in TEST_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", "") and (_flag not in PROBED or _xla_knows(_flag, _value)):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import gc  # noqa: E402

import jax  # noqa: E402  (after XLA_FLAGS is set)
import pytest  # noqa: E402
from helpers.precision import highest  # noqa: E402

# The device subset: device-side math a GPU or TPU session repeats (`pytest -m "device and not slow"`,
# docs/gpu.md). Each file runs on one device of any platform, under highest matmul precision.
DEVICE_SUBSET = ("test_kernels.py", "test_accept.py", "test_speculative.py", "test_models.py", "test_bf16.py")


# The longest files (CI log, 2-core Intel Xeon, 2026-11-27), run first: `-n 2 --dist loadfile` hands each worker
# the next file in collection order, so a long file collected late leaves the other worker idle at the end.
LONGEST_FIRST = ("test_gpu_check.py", "test_rl_trainer.py", "test_speculative.py", "test_rl_multiprocess.py",
                 "test_rollout.py", "test_run_dir.py", "test_mixed_precision.py", "test_benchmarks.py",
                 "test_export_policy.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in DEVICE_SUBSET:
            item.add_marker(pytest.mark.device)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order is kept


@pytest.fixture(autouse=True)
def _highest_precision_in_the_device_subset(request):
    """Parity claims hold at a precision we choose: float32 matmuls default to TF32 on a GPU."""
    if request.node.get_closest_marker("device") is None:
        yield
        return
    with highest():
        yield


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32, one device) as the CLI loads it, once per session."""
    from fastrl_jax.config import MeshConfig, ModelSpec
    from fastrl_jax.models.loading import load_policy
    from fastrl_jax.sharding import make_mesh

    return load_policy(ModelSpec(), make_mesh(MeshConfig(), jax.devices()[:1]))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops each test module's compiled programs when it ends. The suite compiles thousands of
    programs in one process; kept, they grew it past 16 GB, which the 24 GiB CI machine cannot
    spare."""
    yield
    jax.clear_caches()
    gc.collect()
