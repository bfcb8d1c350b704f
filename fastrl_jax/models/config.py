"""Decoder hyper-parameters, built from a Hugging Face config dict, and RoPE frequencies."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from fastrl_jax.kernels.backends import BACKENDS

FAMILIES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One decoder covers the Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm) families."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # (key, value) pairs of HF's rope_parameters, rope_theta and rope_type included; a tuple keeps
    # the config hashable so it can be a static jit argument.
    rope: tuple[tuple[str, Any], ...] = (("rope_type", "default"), ("rope_theta", 10000.0))
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Which tree-attention backend the layers run (kernels/backends.py): 'auto' (the platform's best) or
    # one by name, as HF's attn_implementation; a run setting (model.attention), not the checkpoint's.
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.attention_backend not in ("auto", *BACKENDS):
            raise ValueError(f"attention backend {self.attention_backend!r} is unknown; use auto or one of {', '.join(BACKENDS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        rope_type = dict(self.rope).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        # else a KeyError naming no setting at the first forward (transformers refuses such configs too)
        needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(rope_type, ())
        if missing := [k for k in needed if dict(self.rope).get(k) is None]:
            raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} (config.json's rope_parameters or "
                             f"rope_scaling, a GGUF's rope.scaling.*); it has {dict(self.rope)}")

    @property
    def rope_params(self) -> dict[str, Any]:
        return dict(self.rope)

    @property
    def context_length(self) -> int:
        """The positions the checkpoint is made for: max_position_embeddings, or the original length times a YaRN or
        linear scaling factor where that is more (Qwen2.5's YaRN recipe leaves max_position_embeddings at the
        original); Llama 3's factor is no context ratio (3.2: 8192 x 32 against its 131072)."""
        p = self.rope_params
        extends = p.get("rope_type", p.get("type")) in ("yarn", "linear")
        scaled = int(p.get("original_max_position_embeddings", 0) * (p.get("factor") or 1.0)) if extends else 0
        return max(self.max_position_embeddings, scaled)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Reads a transformers config dict (config.json, `config.to_dict()`, or GGUF metadata mapped to it)."""
        family = d.get("model_type")
        if family not in FAMILIES:
            raise ValueError(
                f"unknown architecture model_type={family!r} (architectures={d.get('architectures')}); "
                f"fastrl-jax supports {', '.join(FAMILIES)}: point the model path at a checkpoint of one of them"
            )
        architectures = d.get("architectures") or []
        if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
            # A reward / classification model's own head (score.weight) would be dropped for the LM head.
            raise ValueError(f"architectures={architectures} is not a causal language model; fastrl-jax loads "
                             f"{family} checkpoints whose config.json names a ...ForCausalLM architecture")
        if quantized := d.get("quantization_config"):  # int8 codes loaded as weights, without their scales: garbage
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
            raise ValueError(f"the checkpoint is quantized (quantization_config: {method}); fastrl-jax trains and "
                             "decodes unquantized weights: load the original (bfloat16 / float32) checkpoint")
        # transformers' rule (Qwen2 / Qwen3): layers from max_window_layers on slide when use_sliding_window, unless
        # layer_types names each layer's kind; with max_window_layers >= num_hidden_layers every layer attends in full
        layers = d.get("layer_types") or ["sliding_attention" if d.get("use_sliding_window")
                                          and i >= d.get("max_window_layers", 28) else "full_attention"
                                          for i in range(d.get("num_hidden_layers", 0))]
        if sliding := [i for i, kind in enumerate(layers) if kind == "sliding_attention"]:
            raise ValueError(f"sliding-window attention in layers {sliding} (use_sliding_window with max_window_layers, "
                             "or layer_types) is not supported")
        if d.get("mlp_bias"):
            raise ValueError("MLP biases (mlp_bias: true) are not supported")
        if family != "qwen2" and d.get("attention_bias"):
            raise ValueError(f"attention biases on {family} (attention_bias: true, q/k/v and o_proj biases) are not supported; "
                             "the layers have Qwen2's q/k/v biases only")
        if d.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' ACT2FN runs SiLU for both
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; the MLP runs SwiGLU (hidden_act: silu)")
        num_heads = d["num_attention_heads"]
        # transformers' defaults where config.json leaves it out: Qwen3Config's 128, else hidden / heads
        head_dim = d.get("head_dim") or (128 if family == "qwen3" else d["hidden_size"] // num_heads)
        # transformers >= 5 nests RoPE settings in rope_parameters; older config.json files use
        # rope_theta + rope_scaling. Either may leave rope_theta at the top level, or out (10000).
        params, scaling = d.get("rope_parameters") or {}, d.get("rope_scaling") or {}
        if params and any(params.get("rope_type" if k == "type" else k) != v for k, v in scaling.items()):
            # A hand-added rope_scaling (Qwen2.5's README adds YaRN so) beside transformers 5's rope_parameters:
            # transformers then reads rope_scaling alone, rope_theta falling back to the top level or 10000.
            raise ValueError(f"config.json sets both rope_parameters ({params}) and rope_scaling ({scaling}), which "
                             "disagree; merge the scaling into rope_parameters and remove rope_scaling")
        rope = dict(params or scaling)
        rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        # transformers' Llama / Qwen default RoPE rotates whole heads whatever this says, vLLM rotates the fraction:
        # engines disagree on what such a checkpoint computes.
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor {partial} is not supported; the layers rotate the whole head "
                             "(partial_rotary_factor: 1.0)")
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings") or _MAX_POSITIONS[family],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            rope=tuple(sorted((k, _hashable(v)) for k, v in rope.items())),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_ids(d.get("eos_token_id")),
        )


# transformers' defaults where config.json leaves max_position_embeddings out (YaRN without an original length
# scales from it)
_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}


def token_ids(value) -> tuple[int, ...]:
    """An HF config's token id field (eos_token_id: one int, a list, or absent) as a tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else (() if value is None else (value,))


def one_or_list(ids: tuple[int, ...]):
    """token_ids' inverse, as config.json writes the field: None, one int, or a list."""
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns (inverse frequencies [head_dim // 2], attention scaling of cos/sin), as HF computes them."""
    p = cfg.rope_params
    dim = int(cfg.head_dim * p.get("partial_rotary_factor", 1.0))
    base = float(p["rope_theta"])
    # In float32 steps as transformers, SGLang and vLLM compute it (torch: arange / dim, pow, 1 / x): the correctly
    # rounded float64 table differed from theirs in the last bit of ~1/3 of the entries, which positions multiply
    # (2e-3 rad at 30000: logits 1.6e-3 apart, relative). torch's float32 pow is not correctly rounded, so one
    # low-frequency entry may still differ by an ulp (Qwen2.5-7B: 9e-7 rad at 30000).
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (base ** exponent.astype(np.float64)).astype(np.float32)).astype(np.float64)
    kind = p.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, p, cfg.max_position_embeddings), 1.0
    return _yarn(inv_freq, base, dim, p, cfg.max_position_embeddings)


def _llama3(inv_freq: np.ndarray, p: dict, max_pos: int) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p.get("original_max_position_embeddings") or max_pos  # transformers' default, as for YaRN
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(inv_freq, base, dim, p, max_pos) -> tuple[np.ndarray, float]:
    old_len = p.get("original_max_position_embeddings") or max_pos
    # As transformers 5 and llama.cpp: the config's factor; without one, the ratio of the two lengths (DeepSeek-V3).
    # (transformers 4.x re-derived it whenever an original length was given, which left Qwen2.5's YaRN unscaled.)
    factor = p.get("factor") or max_pos / old_len

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    freq = inv_freq * extrapolation + (inv_freq / factor) * (1 - extrapolation)
    return freq, float(attention_factor)
