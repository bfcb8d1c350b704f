"""fastrl-jax: GRPO training for reasoning LLMs with adaptive, lossless speculative decoding."""

import os

__version__ = "0.1.0"

# XLA CPU's YNNPACK reduce fusion (jaxlib 0.10.2) reads memory that no one wrote: with glibc filling
# fresh allocations (MALLOC_PERTURB_), SmolLM2's prefill returns NaN, and on a real machine it did so
# now and then (a CI run decoded token 0 everywhere). The dot and elementwise fusions, which make
# narrow-batch decoding fast, stay on. XLA reads XLA_FLAGS at its first compile, so this must run
# before any; a value the user set wins. tests/test_uninitialized_memory.py guards it.
_YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"
if _YNN_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_YNN_FLAG}=-reduce".strip()
