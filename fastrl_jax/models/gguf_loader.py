"""Reads a GGUF file (llama.cpp's format) as an HF config dict, float32 HF tensors and a tokenizer.

Everything goes through the `gguf` package, never torch (a dev-only dependency): transformers'
own GGUF reader imports torch at module top, so only its torch-free tokenizer conversion is reused.
Supported architectures are the decoder families: llama, qwen2, qwen3.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# GGUF tensor name -> HF parameter name; `{i}` is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The transformers-style config dict (LlamaConfig / Qwen2Config / Qwen3Config keys) of a GGUF file."""
    reader = _open(path)
    return _config(reader, Path(path))


def read_gguf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor, dequantized to float32, under its HF name and in PyTorch Linear layout [out, in]."""
    path = Path(path)
    reader = _open(path)
    config = _config(reader, path)
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, path)
        # ggml lists dimensions fastest-moving first, numpy the other way round.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = np.array(values, dtype=np.float32).reshape(shape)  # a copy: the reader's data is a read-only memmap
        if config["model_type"] == "llama":
            values = _unpermute_rope_rows(name, values, config)
        tensors[name] = values
    return tensors


def load_gguf_tokenizer(path: str | Path):
    """A transformers `PreTrainedTokenizerFast` rebuilt from the vocabulary, merges and template in the GGUF."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = _open(path)
    fields = reader.fields
    # Mirrors transformers' `get_gguf_tokenizer`, reading the metadata with `gguf` instead.
    grouped = {
        group: {
            name: fields[f"tokenizer.{key}"].contents()
            for key, name in renames.items()
            if f"tokenizer.{key}" in fields
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # Older sentencepiece files carry no flag, and llama.cpp adds BOS unless told otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        field = fields.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][field.contents()] if field is not None else None

    architecture = fields["general.architecture"].contents()
    backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra_kwargs)


def _open(path: str | Path) -> gguf.GGUFReader:
    """The file's reader; the one place a missing or damaged file becomes a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    stat = path.stat()
    try:
        return _reader(path.resolve(), stat.st_size, stat.st_mtime_ns)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        # A short download or a stray file fails deep inside the reader's memmap parsing.
        raise ValueError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}): it is corrupt or truncated. "
            f"Delete it so it is fetched again."
        ) from e


@functools.lru_cache(maxsize=1)
def _reader(path: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    # Parsing the header takes seconds (each vocabulary string becomes its own numpy view, ~150 MB
    # of Python objects for a 49k vocabulary) and loading a model parses it three times: config,
    # tensors, tokenizer. One file is kept; size and mtime in the key make a replaced file re-read.
    return gguf.GGUFReader(path)


_REQUIRED = object()


def _config(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    fields = reader.fields

    def meta(key: str, default: Any = None) -> Any:
        if key in fields:
            return fields[key].contents()
        if default is _REQUIRED:
            raise ValueError(f"{path} has no {key!r} in its metadata, so it does not describe a whole model")
        return default

    arch = meta("general.architecture", _REQUIRED)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path} holds a {arch!r} model; supported GGUF architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    if "rope_freqs.weight" in shapes:
        # Llama 3.1-style scaling is baked into per-frequency factors rather than stated in
        # metadata; ignoring them would silently change every logit.
        raise ValueError(
            f"{path} stores RoPE frequency factors (rope_freqs.weight, Llama 3.1 style), which the GGUF "
            f"loader does not read; load the model's HF checkpoint directory instead"
        )
    num_heads = meta(f"{arch}.attention.head_count", _REQUIRED)
    config = {
        "model_type": arch,
        "vocab_size": meta(f"{arch}.vocab_size") or shapes["token_embd.weight"][0],
        "hidden_size": meta(f"{arch}.embedding_length", _REQUIRED),
        "intermediate_size": meta(f"{arch}.feed_forward_length", _REQUIRED),
        "num_hidden_layers": meta(f"{arch}.block_count", _REQUIRED),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta(f"{arch}.attention.head_count_kv", num_heads),
        # From the q projection itself: converters differ in which head-size keys they write.
        "head_dim": shapes["blk.0.attn_q.weight"][0] // num_heads,
        "rms_norm_eps": meta(f"{arch}.attention.layer_norm_rms_epsilon", _REQUIRED),
        "rope_theta": meta(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta(f"{arch}.context_length", _REQUIRED),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
    }
    rope_scaling = _rope_scaling(meta, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(meta, arch: str) -> dict[str, Any] | None:
    """HF's rope_scaling dict from llama.cpp's `rope.scaling.*` keys, or None when unscaled."""
    kind = meta(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": meta(f"{arch}.rope.scaling.factor")}
    optional = {
        "original_max_position_embeddings": "rope.scaling.original_context_length",
        "beta_fast": "rope.scaling.yarn_beta_fast",
        "beta_slow": "rope.scaling.yarn_beta_slow",
    }
    for hf_key, gguf_key in optional.items():
        if (value := meta(f"{arch}.{gguf_key}")) is not None:
            scaling[hf_key] = value
    return scaling


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    # Dropping a tensor we do not know would load a different model than the file describes.
    raise ValueError(f"{path} holds tensor {gguf_name!r}, which has no place in a llama/qwen2/qwen3 decoder")


def _unpermute_rope_rows(name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation for llama-architecture files.

    llama.cpp's converter (`LlamaModel.permute`) reorders each head's rows of q_proj and k_proj,
    weights and biases alike, from HF's rotate-half RoPE layout to interleaved pairs: within a
    head, row 2j+s came from HF row s*(head_dim/2)+j. Qwen2/Qwen3 files keep HF's layout.
    """
    if ".self_attn.q_proj." in name:
        heads = config["num_attention_heads"]
    elif ".self_attn.k_proj." in name:
        heads = config["num_key_value_heads"]
    else:
        return values
    rows = values.shape[0]
    return values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
