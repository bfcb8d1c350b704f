"""A tiny random Llama and its rollout config: the model most fast tests run."""

import numpy as np
from flax import nnx

from fastrl_jax.config import RolloutConfig
from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import Decoder

TINY = ModelConfig(
    family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,
    tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
)
CFG = RolloutConfig(
    batch_buckets=(1, 4, 16), length_buckets=(32, 64), prompt_buckets=(8, 16), steps_per_call=8,
    compile_cache_dir="", warm_up=False,
)


def tiny_model(seed=0) -> Decoder:
    """A random model with confident next-token distributions, so greedy has no near-ties."""
    model = Decoder(TINY, nnx.Rngs(seed))
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and var.get_value().ndim >= 2:
            var.set_value(var.get_value() * 8.0)
    return model


def prompts(n, seed=0, lo=2, hi=16):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, rng.integers(lo, hi + 1)).tolist() for _ in range(n)]
