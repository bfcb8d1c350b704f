"""Builds a sharded Decoder from an HF safetensors checkpoint directory or a GGUF file; `load_policy`
is the one way a command gets its policy, tokenizer and stop ids.

Every tensor is read on the host (memory-mapped where the format allows) and placed shard by
shard onto its target NamedSharding, so the full model never sits on one device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from fastrl_jax import sharding
from fastrl_jax.config import ModelSpec
from fastrl_jax.models.config import ModelConfig, one_or_list, token_ids
from fastrl_jax.models.decoder import DTYPES, Decoder, abstract_decoder
from fastrl_jax.models.hub import resolve_model_path
from fastrl_jax.models.tokenizer import load_tokenizer, stop_ids

log = logging.getLogger(__name__)

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """A loaded policy: the model on its mesh, its tokenizer, and the token ids that end a completion."""

    model: Decoder
    tokenizer: object
    stop_ids: tuple[int, ...]
    path: Path  # the resolved checkpoint directory or .gguf file

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def load_policy(spec: ModelSpec, mesh: Mesh, dtype: str | None = None, tokenizer=None) -> Policy:
    """The policy named by the config's model section (`smollm2`, a .gguf file or an HF checkpoint
    directory) on `mesh`, with its tokenizer (loaded here unless given: a command that checked its
    prompts first has it already); says on stderr how long loading took. dtype: the weights' dtype
    name, spec.dtype (the training dtype) when None; spec.engine_dtype for inference only."""
    t0 = time.perf_counter()
    path = resolve_model_path(spec.path)
    model, model_cfg = load_model(path, mesh, dtype or spec.dtype, spec.attention)
    tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
    print(f"[fastrl-jax] loaded {spec.path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return Policy(model, tokenizer, stop_ids(model_cfg, tokenizer), path)


def load_model(path: str | Path, mesh: Mesh, dtype: str = "float32", attention: str = "auto") -> tuple[Decoder, ModelConfig]:
    """Loads an HF checkpoint directory or a .gguf file onto `mesh`; attention: ModelConfig.attention_backend."""
    path = Path(path)
    cfg = dataclasses.replace(read_model_config(path), attention_backend=attention)
    if path.suffix == ".gguf":
        from fastrl_jax.models import gguf_loader

        tensors = gguf_loader.tensor_getter(path, gguf_loader.read_gguf_tensors(path))
        return decoder_from_hf_tensors(cfg, tensors, mesh, dtype), cfg
    tensors = SafetensorsDir(path)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors.entries and not _equal_by_rows(
            tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")):
        # transformers 5 then keeps the two apart (and warns); tying here would compute other logits.
        raise ValueError(f"{path / 'config.json'} says tie_word_embeddings: true, but the checkpoint's lm_head.weight "
                         "differs from model.embed_tokens.weight: set tie_word_embeddings to false there to load both")
    return decoder_from_hf_tensors(cfg, tensors.get, mesh, dtype), cfg


def read_head_rows(path: str | Path, ids: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the LM head ([K, H]; all of them when None) of an HF checkpoint directory or a .gguf file,
    read alone (memory-mapped): an EAGLE-3 drafter's export needs them and nothing else of the policy."""
    path = Path(path)
    cfg = read_model_config(path)
    if path.suffix == ".gguf":
        from fastrl_jax.models import gguf_loader

        get = gguf_loader.tensor_getter(path, gguf_loader.read_gguf_tensors(path))
    else:
        get = SafetensorsDir(path).get
    head = get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return np.asarray(head if ids is None else head[np.asarray(ids)])


def _equal_by_rows(a: np.ndarray, b: np.ndarray, rows: int = 4096) -> bool:
    """np.array_equal of two memory-mapped matrices, a block of rows at a time (no vocab-sized temporaries)."""
    return a.shape == b.shape and all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, len(a), rows))


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory or a .gguf file, without reading any weights."""
    path = Path(path)
    if path.suffix == ".gguf":
        from fastrl_jax.models import gguf_loader

        return ModelConfig.from_hf_dict(gguf_loader.read_gguf_config(path))
    config = read_hf_config(path)
    # transformers' generate also stops at generation_config.json's EOS ids (Llama-3-Instruct lists <|eot_id|> there)
    generation = read_generation_config(path) or {}
    eos = token_ids(config.get("eos_token_id")) + token_ids(generation.get("eos_token_id"))
    return ModelConfig.from_hf_dict({**config, "eos_token_id": one_or_list(tuple(dict.fromkeys(eos)))})


def read_generation_config(path: Path) -> dict | None:
    """An HF checkpoint directory's generation_config.json, or None without one."""
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from e


def read_hf_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found: the model path must be an HF checkpoint directory "
            "(config.json + *.safetensors) or a .gguf file"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON ({e}); re-download the checkpoint") from e


class SafetensorsDir:
    """Memory-mapped tensors of an HF checkpoint directory, single file or sharded with an index.

    The safetensors package's numpy reader has no bfloat16, which most checkpoints use, so the
    (simple, documented) header is read here and the data memory-mapped with ml_dtypes.
    """

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        files = sorted(set(weight_map.values())) if weight_map else sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            file = path / name
            if not file.is_file():
                raise FileNotFoundError(f"{file} is listed in {index.name} but missing; re-download the checkpoint")
            header, data_start = _read_header(file)
            for key, entry in header.items():
                if key == "__metadata__" or (weight_map and weight_map.get(key) != name):
                    continue  # the index names each tensor's file (a stray copy elsewhere is not it)
                if key in self.entries:  # which one the checkpoint means is unknown: refuse rather than pick
                    raise ValueError(f"tensor {key} is in both {self.entries[key][0].name} and {name} in {path}; remove "
                                     "the stray file (a sharded checkpoint's model.safetensors.index.json names each one's)")
                self.entries[key] = (file, entry, data_start)

    def get(self, key: str) -> np.ndarray:
        if key not in self.entries:
            raise KeyError(f"tensor {key!r} is missing from the checkpoint")
        file, entry, data_start = self.entries[key]
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{file}: tensor {key} has dtype {entry['dtype']}, which fastrl-jax cannot load "
                             f"(it reads {', '.join(_ST_DTYPES)}); convert the checkpoint")
        dtype = np.dtype(_ST_DTYPES[entry["dtype"]])
        return np.memmap(file, dtype=dtype, mode="r", offset=data_start + begin, shape=tuple(entry["shape"]))


def _read_header(file: Path) -> tuple[dict, int]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{file} is truncated or not a safetensors file; re-download it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{file} is truncated or not a safetensors file; re-download it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} has a corrupt header ({e}); re-download it") from e
    data_start = 8 + n
    for key, entry in header.items():
        if key != "__metadata__" and data_start + entry["data_offsets"][1] > size:
            raise ValueError(f"{file} is truncated (tensor {key} runs past the end); re-download it")
    return header, data_start


class HFTensor(NamedTuple):
    """Where one of our stacked layer parameters lives in an HF checkpoint, and how one layer's tensor converts."""

    template: str  # HF per-layer name, `{}` the layer index
    to_ours: Callable[[np.ndarray], np.ndarray]  # HF (torch nn.Linear [out, in]) -> our layout
    to_hf: Callable[[np.ndarray], np.ndarray]  # its inverse


def hf_layer_tensors(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Our stacked layer parameter -> its HF name template and the conversions of one layer's tensor."""
    H, D, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    att = "model.layers.{}.self_attn."
    mlp = "model.layers.{}.mlp."
    same = lambda w: w  # noqa: E731
    transpose = lambda w: w.T  # noqa: E731

    def projection(heads: int) -> tuple:  # [heads * D, H] <-> [H, heads, D]
        return lambda w: w.T.reshape(H, heads, D), lambda w: w.reshape(H, heads * D).T

    def bias(heads: int) -> tuple:  # [heads * D] <-> [heads, D]
        return lambda b: b.reshape(heads, D), lambda b: b.reshape(heads * D)

    names = {
        "attn_norm": HFTensor("model.layers.{}.input_layernorm.weight", same, same),
        "wq": HFTensor(att + "q_proj.weight", *projection(nh)),
        "wk": HFTensor(att + "k_proj.weight", *projection(nkv)),
        "wv": HFTensor(att + "v_proj.weight", *projection(nkv)),
        "wo": HFTensor(att + "o_proj.weight", lambda w: w.T.reshape(nh, D, H), lambda w: w.reshape(nh * D, H).T),
        "mlp_norm": HFTensor("model.layers.{}.post_attention_layernorm.weight", same, same),
        "w_gate": HFTensor(mlp + "gate_proj.weight", transpose, transpose),
        "w_up": HFTensor(mlp + "up_proj.weight", transpose, transpose),
        "w_down": HFTensor(mlp + "down_proj.weight", transpose, transpose),
    }
    if cfg.qkv_bias:
        names["bq"] = HFTensor(att + "q_proj.bias", *bias(nh))
        names["bk"] = HFTensor(att + "k_proj.bias", *bias(nkv))
        names["bv"] = HFTensor(att + "v_proj.bias", *bias(nkv))
    if cfg.qk_norm:
        names["q_norm"] = HFTensor(att + "q_norm.weight", same, same)
        names["k_norm"] = HFTensor(att + "k_norm.weight", same, same)
    return names


def decoder_from_hf_tensors(
    cfg: ModelConfig, get: Callable[[str], np.ndarray], mesh: Mesh, dtype: str = "float32"
) -> Decoder:
    """Builds the Decoder from HF-named tensors, each placed straight onto its NamedSharding."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    np_dtype = np.dtype(DTYPES[dtype])
    abstract = abstract_decoder(cfg, DTYPES[dtype])
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.shardings_for(abstract_state, mesh)

    def read(name: str) -> np.ndarray:
        w = np.asarray(get(name))
        # Quantized codes (their scales live in other tensors); np.floating would refuse ml_dtypes' bfloat16 too
        if np.issubdtype(w.dtype, np.integer):
            raise ValueError(f"checkpoint tensor {name} is {w.dtype}, not floating point: a quantized checkpoint; load "
                             "the original (bfloat16 / float32) one")
        return w

    def whole(name: str, convert=lambda w: w) -> Callable[[], np.ndarray]:
        return lambda: convert(read(name))

    def stacked(template: str, convert) -> Callable[[], np.ndarray]:
        return lambda: np.stack([convert(read(template.format(i))) for i in range(cfg.num_layers)])

    sources: dict[tuple, Callable[[], np.ndarray]] = {
        ("embed",): whole("model.embed_tokens.weight"),
        ("final_norm",): whole("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        sources[("lm_head",)] = whole("lm_head.weight", lambda w: w.T)
    for ours, hf in hf_layer_tensors(cfg).items():
        sources[("layers", ours)] = stacked(hf.template, hf.to_ours)

    flat_abstract = dict(nnx.to_flat_state(abstract_state))
    flat_shardings = dict(nnx.to_flat_state(shardings))
    loaded = {}
    for key, var in flat_abstract.items():
        host = sources[key]().astype(np_dtype)
        if host.shape != var.get_value().shape:
            raise ValueError(
                f"checkpoint tensor for {'.'.join(key)} has shape {host.shape}, the config implies "
                f"{var.get_value().shape}: config.json and the weights disagree"
            )
        target = _sharding_of(flat_shardings[key])
        loaded[key] = var.replace(jax.make_array_from_callback(host.shape, target, lambda idx, h=host: h[idx]))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _sharding_of(leaf):
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf

