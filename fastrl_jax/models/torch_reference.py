"""The transformers PyTorch model for a checkpoint we load: the reference of parity tests and benchmarks.

Needs PyTorch (the `dev` extra). For GGUF files it is built from the same dequantised tensors our
loader reads (tests/test_gguf.py proves those equal transformers' own GGUF loading, whose
`from_pretrained(gguf_file=...)` path additionally requires `accelerate`).
"""

from __future__ import annotations

from pathlib import Path


def torch_model(path: str | Path):
    """A float32 transformers CausalLM in eval mode for an HF checkpoint dir or a .gguf file."""
    import torch
    import transformers

    path = Path(path)
    if path.suffix != ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from fastrl_jax.models.gguf_loader import read_gguf_config, read_gguf_tensors

    config_dict = read_gguf_config(path)
    config = transformers.AutoConfig.for_model(**config_dict)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: torch.from_numpy(v.copy()) for k, v in read_gguf_tensors(path).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"tensors do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def random_torch_model(config_dict: dict, dtype: str = "float32", device: str = "cpu"):
    """A transformers CausalLM with random weights for an HF config dict (e.g. models.known_configs),
    built directly on `device` in `dtype` ('float32' or 'bfloat16'): a multi-GB model never passes
    through host memory."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()
