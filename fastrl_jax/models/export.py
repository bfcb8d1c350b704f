"""Policy export: a Decoder as a Hugging Face checkpoint directory that transformers, vLLM and SGLang load.

The directory holds config.json, generation_config.json, the tokenizer files (chat template
included) and the weights as safetensors: one model.safetensors, or shards with
model.safetensors.index.json above max_shard_bytes. The weights are written tensor by tensor from
the (possibly sharded) parameters: one layer of one stacked parameter is fetched to the host at a
time, converted to HF layout with the inverse of `hf_layer_tensors`, and collected into the current
shard file, so the host holds at most one shard file's tensors and never a second copy of the model.
Everything goes into a hidden sibling directory that is renamed into place when complete, so a
killed export never leaves a directory that looks like a model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from fastrl_jax.models.config import ModelConfig, one_or_list
from fastrl_jax.models.decoder import Decoder
from fastrl_jax.models.loading import hf_layer_tensors

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' conventional shard size
_SINGLE_FILE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
# Keys of a source config.json that our values replace (RoPE is rewritten in one convention).
_REPLACED_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype", "auto_map")


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One HF tensor to write: its name, HF shape, and how to fetch it (host array in HF layout)."""

    name: str
    shape: tuple[int, ...]
    fetch: Callable[[], np.ndarray]


def hf_config(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """config.json for `cfg`: the source checkpoint's config (`base`) with every value we hold written over it."""
    out = {k: v for k, v in (base or {}).items() if k not in _REPLACED_KEYS}
    rope = cfg.rope_params
    out |= {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        # GGUF stores float32: write 1e-05, not 9.999999747378752e-06
        "rms_norm_eps": float(str(np.float32(cfg.rms_norm_eps))), "max_position_embeddings": cfg.max_position_embeddings,
        # transformers' Llama / Qwen configs default to untied; a tied model must say so or load a random head.
        "tie_word_embeddings": cfg.tie_word_embeddings, "rope_theta": rope.get("rope_theta", 10000.0),
        "bos_token_id": cfg.bos_token_id, "eos_token_id": one_or_list(cfg.eos_token_ids), "torch_dtype": dtype,
    }
    if cfg.family != "qwen2":  # Qwen2 always has q/k/v biases; the others say so with attention_bias
        out["attention_bias"] = cfg.qkv_bias
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
    return out


def generation_config(cfg: ModelConfig, stop_ids: Sequence[int], base: dict | None = None) -> dict:
    """generation_config.json: the source's, or one that stops where fastrl-jax stops (`stop_ids`)."""
    if base:
        return dict(base)
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": one_or_list(tuple(stop_ids))}


def _host(x: jax.Array) -> np.ndarray:
    """x on this host, whole: copied off its devices, or gathered from every process's shards."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def tensor_plan(model: Decoder, dtype) -> list[PlannedTensor]:
    """Every HF tensor of `model` in checkpoint order (embedding, layer by layer, final norm, head),
    each fetched alone and cast to `dtype` when written."""
    cfg = model.cfg
    params = nnx.to_pure_dict(nnx.state(model))

    def whole(name: str, array: jax.Array, to_hf=lambda w: w) -> PlannedTensor:
        shape = jax.eval_shape(to_hf, jax.ShapeDtypeStruct(array.shape, array.dtype)).shape
        return PlannedTensor(name, tuple(shape), lambda: np.ascontiguousarray(to_hf(_host(array)).astype(dtype)))

    plan = [whole("model.embed_tokens.weight", params["embed"])]
    layers = hf_layer_tensors(cfg)
    for i in range(cfg.num_layers):
        for ours, hf in layers.items():
            stacked = params["layers"][ours]
            layer = jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype)
            shape = tuple(jax.eval_shape(hf.to_hf, layer).shape)
            fetch = lambda a=stacked, i=i, hf=hf: np.ascontiguousarray(hf.to_hf(_host(a[i])).astype(dtype))  # noqa: E731
            plan.append(PlannedTensor(hf.template.format(i), shape, fetch))
    plan.append(whole("model.norm.weight", params["final_norm"]))
    if not cfg.tie_word_embeddings:  # a tied head is the embedding: transformers ties it from the config
        plan.append(whole("lm_head.weight", params["lm_head"], lambda w: w.T))
    return plan


def shard_plan(plan: list[PlannedTensor], itemsize: int, max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """The tensors split, in order, into files of at most max_shard_bytes (a larger tensor gets a file of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in plan:
        nbytes = math.prod(t.shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def write_weights(plan: list[PlannedTensor], out: Path, dtype, max_shard_bytes: int,
                  on_file: Callable[[str], None] = lambda name: None) -> list[str]:
    """Writes the planned tensors as safetensors shard files (and the index when there are several)
    into `out`, one file at a time; returns the file names. Only process 0 writes; every process
    fetches (a multi-process gather needs them all)."""
    from safetensors.numpy import save_file

    itemsize = np.dtype(dtype).itemsize
    shards = shard_plan(plan, itemsize, max_shard_bytes)
    names = [_SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    writer = jax.process_index() == 0
    for name, shard in zip(names, shards):
        tensors = {t.name: t.fetch() for t in shard}
        if writer:
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            readable_as_umask_allows(out / name)
        del tensors
        on_file(name)
    if len(shards) > 1 and writer:
        index = {"metadata": {"total_size": sum(math.prod(t.shape) * itemsize for t in plan)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (out / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def save_tokenizer(tokenizer, out: Path) -> None:
    """The tokenizer's files (tokenizer.json, tokenizer_config.json, the chat template), readable by
    transformers 4.x too (vLLM and SGLang pin it): transformers 5 names its fast class TokenizersBackend,
    which 4.x does not know; it writes the extra special tokens (Qwen's <|im_start|> ...) as a list under
    extra_special_tokens, where 4.x expects a dict of named tokens and fails to load the tokenizer
    ('list' object has no attribute 'keys'), so they go under additional_special_tokens, which both read;
    and older 4.x reads the chat template only from tokenizer_config.json."""
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        # Only the one key: transformers 5 drops additional_special_tokens when extra_special_tokens is there too
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    if tokenizer.chat_template and "chat_template" not in config:
        config["chat_template"] = tokenizer.chat_template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def readable_as_umask_allows(path: Path) -> None:
    """safetensors creates its files owner-only (0600); give them the mode every other file gets here."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


_INSIDE = ".fastrl-export.partial"  # where an export into an existing empty directory is written


def check_export_dir(out: str | Path, flag: str = "--out") -> Path:
    """`out` as a new export directory: it must not be a file or a non-empty directory, its parent must
    exist, and this process must be able to write where the export goes (inside `out` when it exists: a mount
    point, a directory made for the user in a parent they cannot write). Raises ValueError /
    FileNotFoundError / PermissionError with the fix. A symlink stands for its target (a scratch disk linked into
    a project): the export is written beside the target and the link then shows it."""
    out = Path(out).expanduser().absolute()
    out = out.resolve() if out.is_symlink() else out
    if out.is_file():
        raise ValueError(f"{flag} {out} is a file; give a new directory to export into")
    if out.is_dir() and any(not p.name.startswith(_INSIDE) for p in out.iterdir()):  # a killed export's files aside
        raise ValueError(f"{flag} {out} exists and is not empty; choose a new directory (an export never overwrites)")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{flag} {out}: its parent directory {out.parent} does not exist; create it first")
    where = out if out.is_dir() else out.parent
    if not os.access(where, os.W_OK):
        raise PermissionError(f"{flag} {out}: {where} cannot be written by this user; choose another directory")
    return out


@contextlib.contextmanager
def export_into(out: str | Path, writer: bool = True, flag: str = "--out") -> Iterator[Path]:
    """A hidden directory to write the export directory `out` (check_export_dir's rules) into: beside `out`,
    renamed to it when the block completes, or inside `out` when it exists (emptied into it, config.json last, so
    it never looks like a complete model before it is one); removed when the block fails, so a failed or
    interrupted export leaves nothing that looks like one, nor anything a rerun would refuse. A second export into
    the same `out` while one runs is refused (a lock): it would have removed the first's files as a killed
    export's leftovers. writer: whether this process creates and moves it (process 0 of a multi-process
    export). flag: how errors name `out`."""
    out = check_export_dir(out, flag)
    inside = out.is_dir()
    partial = out / _INSIDE if inside else out.parent / f".{out.name}.partial"
    with _export_lock(partial.with_name(partial.name + ".lock"), out, writer, flag):
        if writer:
            shutil.rmtree(partial, ignore_errors=True)  # a killed export's leftovers
            partial.mkdir()
        try:
            yield partial
        except BaseException:
            if writer:  # another process's failure must not remove the directory process 0 writes
                shutil.rmtree(partial, ignore_errors=True)
            raise
        if writer and inside:
            for p in sorted(partial.iterdir(), key=lambda p: p.name == "config.json"):
                p.rename(out / p.name)
            partial.rmdir()
        elif writer:
            partial.rename(out)


@contextlib.contextmanager
def _export_lock(lock: Path, out: Path, writer: bool, flag: str) -> Iterator[None]:
    """Holds an exclusive lock on the file `lock` (the writer only) for an export into `out`, or raises
    ValueError when another process holds it; `out` is checked again once held (an export that ended while this
    one waited has filled it). The lock file goes when released."""
    if not writer:
        yield
        return
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{flag} {out}: another export into it is running; wait for it to end or choose another "
                             "directory") from None
        try:
            check_export_dir(out, flag)
            yield
        finally:
            lock.unlink(missing_ok=True)


def export_dtype(name: str):
    """The numpy dtype an export named `name` writes (a key of EXPORT_DTYPES); ValueError for another name."""
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {name!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def export_hf(model: Decoder, tokenizer, out: str | Path, *, dtype: str, stop_ids: Sequence[int],
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, base_config: dict | None = None,
              base_generation_config: dict | None = None, on_file: Callable[[str], None] = lambda name: None) -> Path:
    """Writes `model` (float32 or bfloat16 parameters, sharded or not) and `tokenizer` as an HF
    checkpoint directory `out` (new or empty) with weights in `dtype` (a key of EXPORT_DTYPES).
    base_config / base_generation_config: the source checkpoint's files, whose other keys are kept."""
    np_dtype = export_dtype(dtype)
    writer = jax.process_index() == 0
    with export_into(out, writer) as partial:
        write_weights(tensor_plan(model, np_dtype), partial, np_dtype, max_shard_bytes, on_file)
        if writer:
            config = hf_config(model.cfg, dtype, base_config)
            (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            generation = generation_config(model.cfg, stop_ids, base_generation_config)
            (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            save_tokenizer(tokenizer, partial)
    return Path(out).expanduser().absolute()
