"""`train --dry-run`: the memory each device needs and the programs the engine compiles, from shapes only.

Nothing is allocated: the model is built with eval_shape, the mesh is an AbstractMesh of the
configured sizes, and every figure comes from the shardings the trainer would use (the same
`shardings_for` rules), so a 32B multi-node config can be checked on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding

from fastrl_jax.config import Config, ConfigError
from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import DTYPES, abstract_decoder
from fastrl_jax.models.drafter import Drafter, feature_layers
from fastrl_jax.models.known_configs import KNOWN, known_config
from fastrl_jax.models.loading import read_model_config
from fastrl_jax.rl.update import master_rules
from fastrl_jax.rollout.engine import RolloutEngine
from fastrl_jax.sharding import AXES, mesh_sizes, shardings_for

GiB = 2**30


@functools.cache  # plan() asks three times; read the checkpoint's config once
def model_config(path: str) -> ModelConfig:
    """The policy's ModelConfig from its config.json / GGUF metadata, else from the known-model table."""
    p = Path(path).expanduser()
    if (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".gguf"):
        return read_model_config(p)
    known = known_config(path)
    if known is None:
        raise ConfigError(f"--dry-run: model.path {path} has no config.json here and is not a known model "
                          f"({', '.join(KNOWN)}); point it at a checkpoint directory")
    return ModelConfig.from_hf_dict(known)


def mesh_shape(cfg: Config, devices: int | None) -> dict[str, int]:
    """Mesh axis sizes for `devices` devices (--devices), or for the product of the configured sizes."""
    if devices is None:
        if -1 in (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor):
            raise ConfigError("--dry-run: a mesh axis is -1; pass --devices N (the job's device count)")
        devices = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor
    return mesh_sizes(cfg.mesh, devices, where="planned (--devices)")


def _per_device_bytes(shardings, abstract_state) -> int:
    total = 0
    for sharding, var in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract_state)):
        assert isinstance(sharding, NamedSharding)
        total += math.prod(sharding.shard_shape(var.shape)) * np.dtype(var.dtype).itemsize
    return total


def memory_plan(cfg: Config, devices: int | None = None) -> dict[str, float]:
    """Bytes per device of each part of a training run (master parameters, gradients, AdamW moments,
    reference, the engines' copy of the policy in model.rollout_dtype, a rollout replica's KV cache and
    hidden states, and the largest micro-batch's logits)."""
    mcfg = model_config(cfg.model.path)
    sizes = mesh_shape(cfg, devices)
    mesh = AbstractMesh(tuple(sizes.values()), AXES)
    state = nnx.state(abstract_decoder(mcfg, DTYPES[cfg.model.dtype]))
    params = _per_device_bytes(shardings_for(state, mesh, master_rules(cfg.model)), state)
    mixed = cfg.model.engine_dtype != cfg.model.dtype  # else the engines share the trainer's buffers
    engine_state = nnx.state(abstract_decoder(mcfg, DTYPES[cfg.model.engine_dtype]))
    rollout_params = _per_device_bytes(shardings_for(engine_state, mesh), engine_state) if mixed else 0
    # Unrolled engines (rollout.layer_loop) copy the layer weights into per-layer buffers beside the
    # stacked ones the drafter trainer reads; planned as on GPUs, where 'auto' unrolls.
    layers = engine_state["layers"]
    unrolled = _per_device_bytes(shardings_for(layers, mesh), layers) if cfg.rollout.unrolled_layers("gpu") else 0
    itemsize = np.dtype(DTYPES[cfg.model.engine_dtype]).itemsize
    B, S = cfg.rollout.batch_buckets[-1], cfg.rollout.length_buckets[-1]
    # The engine keeps its row table (KV cache included) replicated on the replica's devices.
    kv = 2 * mcfg.num_layers * B * mcfg.num_kv_heads * S * mcfg.head_dim * itemsize
    sd = cfg.sd.mode != "off"
    width = mcfg.hidden_size * max(len(feature_layers(cfg.drafter_train.kind, mcfg.num_layers)), 1)
    hidden = B * S * width * itemsize if sd else 0  # stored in the engine's dtype
    drafter_kv = kv // mcfg.num_layers if sd else 0
    rows = max(cfg.rl.micro_batch_size // (sizes["data"] * sizes["fsdp"]), 1)
    vocab = mcfg.vocab_size // (sizes["tensor"] if mcfg.vocab_size % sizes["tensor"] == 0 else 1)  # head split on tensor
    logits = 3 * rows * S * vocab * 4  # logits, log-softmax and their gradient, float32
    plan = {
        "devices": math.prod(sizes.values()), **{f"mesh_{k}": v for k, v in sizes.items()},
        "param_count": sum(math.prod(v.shape) for v in jax.tree.leaves(state)),
        "params": params, "grads": params, "optimizer": 2 * params,
        "reference": params if cfg.rl.kl_coef > 0 else 0,
        "rollout_params": rollout_params, "unrolled_layers": unrolled,
        "kv_cache": kv, "hidden_states": hidden, "drafter_kv_cache": drafter_kv, "train_logits": logits,
    }
    plan["total"] = sum(plan[k] for k in ("params", "grads", "optimizer", "reference", "rollout_params", "unrolled_layers",
                                         "kv_cache", "hidden_states", "drafter_kv_cache", "train_logits"))
    return plan


def program_plan(cfg: Config) -> Counter:
    """Engine programs per phase (what warm-up compiles), plus the trainer's step programs.

    The engine is built on the abstract model (no warm-up, nothing allocated), so the plan is the
    engine's own list of programs.
    """
    mcfg = model_config(cfg.model.path)
    dtype = DTYPES[cfg.model.engine_dtype]
    drafter = (nnx.eval_shape(lambda: Drafter(mcfg, nnx.Rngs(0), dtype, kind=cfg.drafter_train.kind))
               if cfg.sd.mode != "off" else None)
    rollout = dataclasses.replace(cfg.rollout, warm_up=False, compile_cache_dir="")
    engine = RolloutEngine(abstract_decoder(mcfg, dtype), rollout, sd=cfg.sd, drafter=drafter, progress=False)
    counts = Counter(k[0] for k in engine.warm_up_keys())
    counts["train_step"] = len(cfg.rollout.length_buckets)  # one per sequence-length bucket a batch reaches
    return counts


def plan(cfg: Config, devices: int | None = None) -> str:
    """The dry-run report as text."""
    m = memory_plan(cfg, devices)
    mcfg = model_config(cfg.model.path)
    lines = [
        f"model {cfg.model.path}: {mcfg.family}, {m['param_count'] / 1e9:.2f}B parameters, trained in "
        f"{cfg.model.dtype}, rollouts in {cfg.model.engine_dtype}",
        f"mesh data={m['mesh_data']} fsdp={m['mesh_fsdp']} tensor={m['mesh_tensor']} ({m['devices']} devices); "
        f"{m['mesh_data']} rollout replica(s) of {m['devices'] // m['mesh_data']} device(s)",
        "memory per device (GiB):",
    ]
    rows_note = f"{max(cfg.rl.micro_batch_size // (m['mesh_data'] * m['mesh_fsdp']), 1)} rows per device"
    notes = {
        "params": f"policy ({cfg.model.dtype} master weights), sharded fsdp x tensor"
                  + (" x data" if cfg.model.engine_dtype != cfg.model.dtype else ""),
        "grads": "accumulated over micro-batches",
        "optimizer": "AdamW first and second moments",
        "reference": "frozen reference policy (rl.kl_coef > 0)",
        "rollout_params": f"the engines' {cfg.model.engine_dtype} copy (model.rollout_dtype)",
        "unrolled_layers": "the engines' per-layer copy of the layer weights (rollout.layer_loop unrolled, or auto on GPUs)",
        "kv_cache": f"rollout KV cache, {cfg.rollout.batch_buckets[-1]} rows x {cfg.rollout.length_buckets[-1]} slots",
        "hidden_states": "last-layer hidden states kept for the drafter (sd on)",
        "drafter_kv_cache": "drafter's one-layer KV cache (sd on)",
        "train_logits": f"logits of a micro-batch at the longest length bucket (estimate), {rows_note}",
    }
    for key, note in notes.items():
        lines.append(f"  {key:<17} {m[key] / GiB:9.3f}  {note}")
    lines.append(f"  {'total':<17} {m['total'] / GiB:9.3f}")
    progs = program_plan(cfg)
    lines.append(f"programs: {sum(progs.values())} ({', '.join(f'{k} {v}' for k, v in sorted(progs.items()))}); "
                 f"batch buckets {list(cfg.rollout.batch_buckets)}, length buckets {list(cfg.rollout.length_buckets)}, "
                 f"prompt buckets {list(cfg.rollout.prompt_buckets)}, sd {cfg.sd.mode}")
    return "\n".join(lines)
