"""Matmul precision and tolerances for the tests that claim parity (kernels vs float64 numpy, our decoder
vs transformers), per backend and dtype.

Parity holds only at a precision we choose: with float32 inputs XLA GPU matmuls default to TF32 (10
mantissa bits), which failed the kernel tests' 1e-5 by 4.5e-4 on an H100 (DESIGN.md). Parity tests
therefore run under `highest()` on every backend (tests/conftest.py applies it to the device subset),
and take their tolerances from `tolerance` and `model_rtol`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# (platform, dtype) -> (rtol, atol) of one op (attention, a matmul chain) against a float64 oracle
# under highest precision. CPU float32 is measured here; GPU and TPU float32 are the same figure
# until scripts/gpu_check.py (its kernel-test section) says otherwise: with TF32 off, a GPU's float32
# dots round like the CPU's, up to summation order. bfloat16 keeps ~3 significant digits anywhere.
_OP = {
    ("cpu", "float32"): (1e-5, 1e-5),
    ("gpu", "float32"): (1e-5, 1e-5),
    ("tpu", "float32"): (1e-5, 1e-5),
    ("cpu", "bfloat16"): (2e-2, 2e-2),
    ("gpu", "bfloat16"): (2e-2, 2e-2),
    ("tpu", "bfloat16"): (2e-2, 2e-2),
}

# (platform, dtype) -> max relative error of a whole model's logits against transformers float32.
_MODEL = {("cpu", "float32"): 1e-4, ("gpu", "float32"): 1e-4, ("tpu", "float32"): 1e-4}


def highest():
    """Context manager: every matmul traced inside runs at full float32 precision (no TF32, no bf16 passes)."""
    return jax.default_matmul_precision("highest")


def _key(dtype, platform: str | None) -> tuple[str, str]:
    return platform or jax.default_backend(), jnp.dtype(dtype).name


def tolerance(dtype=jnp.float32, platform: str | None = None) -> dict[str, float]:
    """{'rtol', 'atol'} for np.testing.assert_allclose of one op in `dtype` on `platform` (default:
    JAX's default backend) against a float64 oracle, under highest()."""
    rtol, atol = _OP[_key(dtype, platform)]
    return {"rtol": rtol, "atol": atol}


def model_rtol(dtype=jnp.float32, platform: str | None = None) -> float:
    """Max relative logit error of a float32 model against transformers' float32 on `platform`, under highest()."""
    return _MODEL[_key(dtype, platform)]
