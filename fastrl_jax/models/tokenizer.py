"""Loads a model's tokenizer (from a GGUF file or an HF checkpoint dir) and its stop token ids."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: Path):
    """A transformers tokenizer for the .gguf file or HF checkpoint directory at `path`."""
    path = Path(path)
    if path.suffix == ".gguf":
        from fastrl_jax.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def stop_ids(model_cfg, tokenizer) -> tuple[int, ...]:
    """The token ids that end a completion: the model config's EOS ids and the tokenizer's."""
    return tuple(sorted(set(model_cfg.eos_token_ids) | ({tokenizer.eos_token_id} - {None})))
