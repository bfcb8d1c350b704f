"""Reads a GGUF file (llama.cpp's format) as an HF config dict, float32 HF tensors and a tokenizer.

Everything goes through the `gguf` and `tokenizers` packages, never torch (a dev-only dependency):
transformers' own GGUF code imports torch and is private, so only its public tokenizer class is used.
Supported architectures are the decoder families: llama, qwen2, qwen3.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from fastrl_jax import files
from fastrl_jax.models import hub
from fastrl_jax.models.config import one_or_list

log = logging.getLogger(__name__)

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
    return _header_part(Path(path), "config")


DEQUANTIZED_MAX_BYTES = 4 << 30  # larger models are dequantized at every load rather than cached on disk


def read_gguf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor, dequantized to float32, under its HF name and in PyTorch Linear layout [out, in].

    A GGUF in the fastrl-jax cache directory (the fetched SmolLM2) keeps these tensors beside it as
    NAME.f32.safetensors, stamped (_stamp) and written again when the stamp changes: later loads read
    them instead of dequantizing (7 s of a SmolLM2 load on 2 CPU cores)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import save_file

    path = Path(path)
    kept = _kept_copy(path, ".f32.safetensors")
    if kept is None:
        return _dequantize(path)
    stamp = _stamp(path)
    try:
        with safe_open(str(kept), "numpy") as f:
            if f.metadata() == stamp:
                return {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError):  # none kept yet, a damaged copy, or another user's: read the GGUF again
        pass
    tensors = _dequantize(path)
    if sum(v.nbytes for v in tensors.values()) <= DEQUANTIZED_MAX_BYTES:
        contiguous = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
        _save_atomically(kept, "dequantized tensors", lambda out: save_file(contiguous, str(out), metadata=stamp))
    return tensors


def _header_part(path: Path, part: str) -> Any:
    """The "config" dict or the "tokenizer" spec read from the GGUF's header.

    Parsing the header takes seconds (see _reader), so a GGUF in the cache directory keeps both parts
    beside it as NAME.header.json, stamped like its dequantized tensors."""
    kept = _kept_copy(path, ".header.json")
    if kept is None or not path.is_file():
        return _HEADER_PARTS[part](_open(path), path)
    stamp = _stamp(path)
    try:
        header = json.loads(kept.read_text())
        if header["stamp"] == stamp:
            return header[part]
    except (OSError, ValueError, KeyError):
        pass  # none kept yet, or a damaged one: read the GGUF again
    reader = _open(path)
    try:
        header = {"stamp": stamp} | {name: read(reader, path) for name, read in _HEADER_PARTS.items()}
    except ValueError:  # a part the file lacks (a GGUF without a tokenizer): keep nothing, read `part` alone
        return _HEADER_PARTS[part](reader, path)
    _save_atomically(kept, "config and tokenizer", lambda out: out.write_text(json.dumps(header)))
    return header[part]


def _kept_copy(path: Path, suffix: str) -> Path | None:
    """Where what is read from `path` is kept: beside a GGUF in hub.cache_dir(), else nowhere."""
    try:
        return path.with_suffix(suffix) if path.resolve().parent == hub.cache_dir().resolve() else None
    except OSError:
        return None


def _stamp(path: Path) -> dict[str, str]:
    """What a kept copy was read from and how: the GGUF's size, mtime, inode and ctime (a file replaced by one of the same
    size and mtime, `cp -p` or `rsync -a`, has another inode or ctime), this module and the packages it reads with (a
    fix to the reading must not be hidden behind a copy made before it)."""
    stat = path.stat()
    return {"gguf_size": str(stat.st_size), "gguf_mtime_ns": str(stat.st_mtime_ns), "gguf_inode": str(stat.st_ino),
            "gguf_ctime_ns": str(stat.st_ctime_ns), "reader": _READER_VERSION}


_READER_VERSION = ",".join([
    hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
    *(f"{package} {importlib.metadata.version(package)}" for package in ("gguf", "tokenizers")),
])


def _save_atomically(target: Path, what: str, write: Callable[[Path], None]) -> None:
    """Writes beside the target and renames, so a concurrent load never reads half a file; a failed write
    (a full disk) costs only the next load's reading the GGUF again."""
    try:
        with files.replacing(target) as tmp:
            write(tmp)
    except OSError as e:
        print(f"[fastrl-jax] could not keep the {what} at {target} ({e}); the next load reads the GGUF again",
              file=sys.stderr)


def _dequantize(path: Path) -> dict[str, np.ndarray]:
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


def tensor_getter(path: str | Path, tensors: dict[str, np.ndarray]):
    """tensors' lookup for decoder_from_hf_tensors, naming a missing tensor and the file that lacks it."""
    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path} has no tensor {name!r} (its GGUF name differs): it does not describe a whole model; "
                             "convert it again")
        return tensors[name]
    return get


def load_gguf_tokenizer(path: str | Path):
    """A transformers `PreTrainedTokenizerFast` rebuilt from the vocabulary, merges and template in the GGUF.

    The backend is built with the `tokenizers` library the way transformers 5.24 converts a GGUF
    tokenizer: transformers' own GGUF code moves between 5.x releases and imports torch, so of
    transformers only the public tokenizer class is used.
    """
    from transformers import PreTrainedTokenizerFast

    spec = _header_part(Path(path), "tokenizer")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec["backend"]), **spec["settings"])


def _tokenizer_spec(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    """The tokenizer as JSON: its `tokenizers` backend serialized, and PreTrainedTokenizerFast's settings."""
    fields = reader.fields

    def meta(key: str, default: Any = None) -> Any:
        return fields[key].contents() if key in fields else default

    kind, tokens, merges = meta("tokenizer.ggml.model"), meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.merges")
    scores = meta("tokenizer.ggml.scores")
    if tokens is None or kind not in ("gpt2", "llama") or (kind == "llama" and merges is None and scores is None):
        raise ValueError(
            f"{path} holds no usable tokenizer (tokenizer.ggml.model {kind!r}): GGUF tokenizers are built from "
            f"a 'gpt2' (byte-level BPE) or 'llama' (sentencepiece BPE) vocabulary with its merges or scores"
        )
    pre = meta("tokenizer.ggml.pre")
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, merges, pre)
    else:
        backend = _sentencepiece_bpe(tokens, merges, scores)

    # Control tokens (`<|im_end|>`) are matched whole and dropped by skip_special_tokens;
    # user-defined ones (`<think>`) are matched whole and kept. In a byte-level vocabulary a control
    # token spelled outside the byte alphabet is a llama.cpp mislabel, and adding it would grow the
    # vocabulary past the model's embedding.
    token_types = meta("tokenizer.ggml.token_type") or ()
    backend.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        if token_type == gguf.TokenType.CONTROL and (kind != "gpt2" or set(token) <= _BYTE_ALPHABET)
    ])
    vocab = backend.get_vocab()
    backend.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == gguf.TokenType.USER_DEFINED and token in vocab
    ])

    special_tokens = {
        name: tokens[token_id] if (token_id := meta(f"tokenizer.ggml.{key}")) is not None else None
        for name, key in _SPECIAL_TOKEN_IDS.items()
    }
    settings = {
        "chat_template": meta("tokenizer.chat_template"),
        # llama.cpp adds BOS to a sentencepiece or Llama 3 vocabulary unless told otherwise, and older files
        # carry no flag.
        "add_bos_token": meta("tokenizer.ggml.add_bos_token", kind == "llama" or pre in _LLAMA3_NAMES),
        "add_eos_token": meta("tokenizer.ggml.add_eos_token", False),
    }
    return {"backend": backend.to_str(), "settings": settings | special_tokens}


_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


_BYTE_TO_UNICODE = _gpt2_bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_TO_UNICODE.values())


def _byte_level_bpe(tokens: list[str], merges: list[str] | None, pre: str | None) -> Tokenizer:
    """GPT-2-style byte-level BPE ('gpt2' files: SmolLM2, Qwen2/3, Llama 3), split as `pre` names."""
    # A token llama.cpp stored in raw characters outside the byte alphabet (a space, say) is
    # looked up by its byte spelling.
    vocab = {
        token if set(token) <= _BYTE_ALPHABET else "".join(_BYTE_TO_UNICODE[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ")) for merge in merges or ()]
    # Llama 3's vocabularies take a pre-token that is a vocabulary word whole, whatever the merges reach (llama.cpp's
    # ignore_merges, as Llama 3's tokenizer.json)
    backend = Tokenizer(models.BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                   ignore_merges=pre in _LLAMA3_NAMES))
    if (split := _PRE_TOKENIZER_SPLITS.get(pre)) is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGITS_FIRST:  # every digit its own pre-token, then GPT-2's split (SmolLM2's tokenizer.json, llama.cpp)
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
    else:
        if pre not in (None, "default", "gpt2", "gpt-2"):
            log.warning("tokenizer.ggml.pre %r is not one fastrl-jax knows: GPT-2's split is used, which may tokenize some "
                        "text otherwise than the model was trained on", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _NFC:  # Qwen's tokenizer.json normalizes: NFD and NFC spellings of a text are the same ids
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores: list[float] | None) -> Tokenizer:
    """Sentencepiece-style BPE with byte fallback ('llama' files: Llama 2, Mistral, TinyLlama)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = Tokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1),
    ])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies (older files store scores, not merges).

    Every split of a token into two vocabulary tokens, ranked by the whole token's score; ties keep
    vocabulary order. scores: by token (a token listed twice keeps its last score, as in transformers).
    """
    merges = []
    for token, score in scores.items():
        splits = [(token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges += sorted(splits, key=lambda split: (vocab[split[0]], vocab[split[1]]))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


# How byte-level text is split before BPE, by `tokenizer.ggml.pre`: the split the merges were
# learned on (transformers 5.24's table). Names not listed (SmolLM2's "smollm") get GPT-2's split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = frozenset(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "jina-v5-nano", "dbrx", "smaug-bpe"])
_QWEN2_NAMES = frozenset(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"])
_NFC = _QWEN2_NAMES | {"qwen35"}
# llama.cpp's pre-tokenizers that split every digit off before GPT-2's regex
_DIGITS_FIRST = frozenset(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"])
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(_LLAMA3_NAMES, _LLAMA3_SPLIT),
    **dict.fromkeys(_QWEN2_NAMES, _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


def _open(path: str | Path) -> gguf.GGUFReader:
    """The file's reader; the one place a missing or damaged file becomes a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    stat = path.stat()
    try:
        return _reader(path.resolve(), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        # A short download or a stray file fails deep inside the reader's memmap parsing.
        # Only the copy fastrl-jax fetched itself comes back by deleting it; a user's own file does not.
        fetched = path.resolve() == (hub.cache_dir() / hub.SMOLLM2_FILE).resolve()
        fix = "Delete it so it is fetched again." if fetched else "Replace it with a complete copy (download or convert it again)."
        raise ValueError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}): it is corrupt or truncated. {fix}"
        ) from e


@functools.lru_cache(maxsize=1)
def _reader(path: Path, size: int, mtime_ns: int, inode: int, ctime_ns: int) -> gguf.GGUFReader:
    # Parsing the header takes seconds (each vocabulary string becomes its own numpy view, ~150 MB
    # of Python objects for a 49k vocabulary) and loading a model parses it three times: config,
    # tensors, tokenizer. One file is kept; its stat in the key (as _stamp's) makes a replaced file re-read.
    return gguf.GGUFReader(path)


_REQUIRED = object()


def _eos_ids(meta) -> int | list[int] | None:
    """The ids that end a completion, as config.json writes them (one int, or a list): the EOS token, and
    llama.cpp's end-of-turn and end-of-message tokens, at which its generation stops too."""
    ids = (meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    return one_or_list(tuple(dict.fromkeys(t for t in ids if t is not None)))


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

    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise ValueError(f"{path} has no tensor {name}: it does not describe a whole model; convert it again")
        return shapes[name]

    config = {
        "model_type": arch,
        "vocab_size": meta(f"{arch}.vocab_size") or shape("token_embd.weight")[0],
        "hidden_size": meta(f"{arch}.embedding_length", _REQUIRED),
        "intermediate_size": meta(f"{arch}.feed_forward_length", _REQUIRED),
        "num_hidden_layers": meta(f"{arch}.block_count", _REQUIRED),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta(f"{arch}.attention.head_count_kv", num_heads),
        # From the q projection itself: converters differ in which head-size keys they write.
        "head_dim": shape("blk.0.attn_q.weight")[0] // num_heads,
        "rms_norm_eps": meta(f"{arch}.attention.layer_norm_rms_epsilon", _REQUIRED),
        "rope_theta": meta(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta(f"{arch}.context_length", _REQUIRED),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
    }
    # llama.cpp rotates the first rope.dimension_count dimensions of each head; the layers rotate whole heads.
    if (rotated := meta(f"{arch}.rope.dimension_count")) not in (None, config["head_dim"]):
        raise ValueError(f"{path} has {arch}.rope.dimension_count = {rotated}: a partial rotary embedding, which the "
                         f"decoder does not support (it rotates all head_dim = {config['head_dim']} dimensions)")
    rope_scaling = _rope_scaling(meta, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


_HEADER_PARTS = {"config": _config, "tokenizer": _tokenizer_spec}


def _rope_scaling(meta, arch: str) -> dict[str, Any] | None:
    """HF's rope_scaling dict from llama.cpp's `rope.scaling.*` keys, or None when unscaled."""
    # llama.cpp's default type is linear, and older conversions (2023's 16k Vicunas) give only rope.scale_linear
    factor = meta(f"{arch}.rope.scaling.factor") or meta(f"{arch}.rope.scale_linear")
    kind = meta(f"{arch}.rope.scaling.type") or ("linear" if factor not in (None, 0.0, 1.0) else None)
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": factor}
    optional = {
        "original_max_position_embeddings": "rope.scaling.original_context_length",
        "beta_fast": "rope.scaling.yarn_beta_fast",
        "beta_slow": "rope.scaling.yarn_beta_slow",
        "attention_factor": "rope.scaling.yarn_attn_factor",  # else recomputed from the factor: another cos/sin scale
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
