"""Policy models: the Llama / Qwen2 / Qwen3 decoder, its config, loading and tokenizer."""

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import Decoder, KVCache

__all__ = ["Decoder", "KVCache", "ModelConfig"]
