"""HF config.json values of the models the shipped configs name, for planning without the checkpoint.

`fastrl-jax train --dry-run` reads the model's config.json when the checkpoint is there, and
falls back to this table (matched by the checkpoint directory's name) so a cluster config can be
checked on a laptop. Values copied from the models' published config.json files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

KNOWN: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1000000.0,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen2.5-32b": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "smollm2-135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_theta": 100000.0,
        "bos_token_id": 1, "eos_token_id": 2,
    },
}


def known_config(path: str) -> dict[str, Any] | None:
    """The table entry the checkpoint name is, but for its -Instruct / -Base / -Chat ('.../Qwen2.5-7B-Instruct' ->
    qwen2.5-7b); a variant of another name (Qwen2.5-7B-Instruct-1M: other RoPE and context) has none."""
    name = "smollm2-135m" if path == "smollm2" else Path(path).name.lower()
    return KNOWN.get(re.sub(r"-(?:instruct|base|chat)$", "", name))
