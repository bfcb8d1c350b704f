"""Compiled programs never read memory no one wrote.

glibc's MALLOC_PERTURB_ fills every fresh allocation with 0x7f bytes (3.4e38 as float32), and the
mmap threshold keeps large buffers on the heap where that applies. A program that reads a buffer
it never wrote then returns inf/NaN instead of the zeros a fresh page happens to hold. XLA CPU's
YNNPACK reduce fusion did so in SmolLM2-shaped prefills (fastrl_jax/__init__.py turns it off):
on a real machine it struck now and then, and a run decoded token 0 everywhere.
"""

import json
import os
import subprocess
import sys

import numpy as np

SCRIPT = r"""
import dataclasses, json, sys
import numpy as np
from flax import nnx
sys.path.insert(0, sys.argv[1])
from helpers.tiny import CFG, TINY
from fastrl_jax.models.decoder import Decoder
from fastrl_jax.rollout.engine import Request, RolloutEngine

# SmolLM2-135M's layer shapes (9 heads, 3 KV heads, head_dim 64), two layers, a small vocabulary.
cfg = dataclasses.replace(TINY, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                          intermediate_size=1536, num_layers=2)
engine = RolloutEngine(Decoder(cfg, nnx.Rngs(0)), dataclasses.replace(
    CFG, batch_buckets=(16,), prompt_buckets=(64,), length_buckets=(128,)), progress=False)
rng = np.random.default_rng(0)
requests = [Request(rng.integers(0, cfg.vocab_size, rng.integers(5, 30)).tolist(), max_new_tokens=4)
            for _ in range(16)]
print(json.dumps([[c.tokens, c.logprobs] for c in engine.generate(requests)]))
"""


def _generate(poison: bool) -> list:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the package's own XLA defaults
    env["JAX_PLATFORMS"] = "cpu"
    if poison:
        env.update(MALLOC_PERTURB_="128", MALLOC_MMAP_THRESHOLD_=str(2**32))
    tests = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tests], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_prefill_and_decode_ignore_uninitialized_memory():
    clean, poisoned = _generate(poison=False), _generate(poison=True)
    assert all(np.isfinite(logprobs).all() for _, logprobs in poisoned)
    assert [tokens for tokens, _ in poisoned] == [tokens for tokens, _ in clean]
    np.testing.assert_array_equal([lp for _, lp in poisoned], [lp for _, lp in clean])
