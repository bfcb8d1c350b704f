"""Tiny random transformers models of each supported family (PyTorch, the `dev` extra), saved as HF
checkpoints: the references of the parity and export round-trip tests."""

from pathlib import Path

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)


def _configs():
    import transformers

    return {
        "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
        "llama3-rope-tied": lambda: transformers.LlamaConfig(
            **TINY, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
        "qwen3-yarn": lambda: transformers.Qwen3Config(
            **TINY, head_dim=24, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64},
        ),
    }


FAMILIES = ("llama", "llama3-rope-tied", "qwen2", "qwen3-yarn")


def random_hf_model(name: str):
    """A float32 transformers CausalLM of config `name`, every weight perturbed (biases and norms included)."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_configs()[name]()).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf


def save_random_hf_model(name: str, path: Path, tokenizer: bool = False):
    """random_hf_model(name) written with save_pretrained (and, with `tokenizer`, a character tokenizer)."""
    hf = random_hf_model(name)
    hf.save_pretrained(path)
    if tokenizer:
        from helpers.tiny_run import write_tokenizer

        write_tokenizer(path)
    return hf
