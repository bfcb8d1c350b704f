"""fastrl-jax: GRPO training for reasoning LLMs with adaptive, lossless speculative decoding."""

__version__ = "0.1.0"
