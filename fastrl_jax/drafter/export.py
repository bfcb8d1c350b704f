"""Drafter export: a safetensors directory in EAGLE layout that SGLang's LlamaForCausalLMEagle loads.

Layout (as SafeAILab EAGLE checkpoints; no embedding, no head: SGLang takes both from the target):
  config.json        LlamaConfig of the one-layer drafter, architectures ["LlamaForCausalLMEagle"]
  model.safetensors  fc.weight [H, 2H] (input = concat(embed, feature)), fc.bias [H] (zeros),
                     layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight,
                     layers.0.post_attention_layernorm.weight (layer 0 has no input_layernorm),
                     and with a reduced draft vocabulary EAGLE-3's d2t [K] int64 (target id - draft
                     index) and t2d [vocab] bool.
Weights are in torch nn.Linear layout [out, in]; q/k use HF's half-split RoPE layout, as ours do.
Features are the target's last hidden state after its final norm, as SGLang captures them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.models.loading import HFTensor, hf_layer_tensors

_FILE = "model.safetensors"


def _eagle_layer_names(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Our layer parameter -> its EAGLE tensor (the policy's HF name for layer 0 without the "model."
    prefix) and conversions; no input_layernorm (the drafter's layer has none)."""
    if cfg.qkv_bias or cfg.qk_norm:
        raise ValueError(f"EAGLE export supports Llama-style layers only (family {cfg.family} has q/k/v bias or q/k norm)")
    return {ours: hf._replace(template=hf.template.format(0).removeprefix("model."))
            for ours, hf in hf_layer_tensors(cfg).items() if ours != "attn_norm"}


def _layer_tensors(drafter: Drafter) -> dict[str, np.ndarray]:
    """The drafter's layer in torch nn.Linear layout [out, in], under its EAGLE names."""
    p = {k: np.asarray(v)[0] for k, v in nnx.to_pure_dict(nnx.state(drafter.layers, nnx.Param)).items()}
    return {hf.template: hf.to_hf(p[ours]) for ours, hf in _eagle_layer_names(drafter.cfg).items()}


def eagle_config(cfg: ModelConfig, draft_vocab_size: int | None, dtype: str) -> dict:
    rope = cfg.rope_params
    out = {
        "architectures": ["LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bias": False,
        "torch_dtype": dtype,
    }
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        out["rope_scaling"] = scaling
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        out["eos_token_id"] = list(cfg.eos_token_ids)
    if draft_vocab_size is not None:
        out["draft_vocab_size"] = draft_vocab_size
    return out


def export_eagle(drafter: Drafter, policy_cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Writes config.json and model.safetensors to out_dir (created; existing files are replaced)."""
    from safetensors.numpy import save_file

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    fc = np.asarray(drafter.fc[...])  # [2H, H]
    tensors = {"fc.weight": fc.T, "fc.bias": np.zeros(fc.shape[1], fc.dtype), **_layer_tensors(drafter)}
    vocab = None
    if drafter.draft_vocab is not None:
        ids = np.asarray(drafter.draft_vocab[...]).astype(np.int64)
        vocab = len(ids)
        tensors["d2t"] = ids - np.arange(vocab)
        t2d = np.zeros(policy_cfg.vocab_size, bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, str(out / _FILE), metadata={"format": "pt"})
    config = eagle_config(policy_cfg, vocab, str(fc.dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_eagle(path: str | Path, policy_cfg: ModelConfig) -> Drafter:
    """Reads a directory written by export_eagle back into a Drafter for a policy of config policy_cfg."""
    from safetensors.numpy import load_file

    path = Path(path).expanduser()
    if not (path / _FILE).is_file():
        raise FileNotFoundError(f"{path / _FILE} not found (expected a directory written by export-drafter)")
    t = load_file(str(path / _FILE))
    H = policy_cfg.hidden_size
    if t["fc.weight"].shape != (H, 2 * H):
        raise ValueError(f"{path}: fc.weight is {t['fc.weight'].shape}, this policy needs {(H, 2 * H)}")
    if np.any(t.get("fc.bias", 0) != 0):
        raise ValueError(f"{path}: fc.bias is non-zero; this drafter has no fc bias")
    vocab = t["d2t"] + np.arange(len(t["d2t"])) if "d2t" in t else None
    drafter = Drafter(policy_cfg, nnx.Rngs(0), t["fc.weight"].dtype, draft_vocab=vocab)
    values = {ours: hf.to_ours(t[hf.template]) for ours, hf in _eagle_layer_names(drafter.cfg).items()}
    state = nnx.state(drafter.layers, nnx.Param)
    pure = nnx.to_pure_dict(state)
    for name, value in values.items():
        if pure[name].shape[1:] != value.shape:
            raise ValueError(f"{path}: {name} is {value.shape}, this policy needs {pure[name].shape[1:]}")
        pure[name] = value[None]
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(drafter.layers, state)
    drafter.fc.set_value(np.ascontiguousarray(t["fc.weight"].T))
    return drafter
