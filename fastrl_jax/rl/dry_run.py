"""`train --dry-run`: the memory each device needs and the programs the engine compiles, from shapes only.

Nothing is allocated: the model is built with eval_shape, the mesh is an AbstractMesh of the
configured sizes, and every figure comes from the shardings the trainer would use (the same
`shardings_for` rules), so a 32B multi-node config can be checked on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections import Counter
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding

from fastrl_jax.config import Config, ConfigError
from fastrl_jax.kernels.backends import BACKENDS, select_backend
from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.decoder import DTYPES, abstract_decoder
from fastrl_jax.models.drafter import Drafter, feature_layers
from fastrl_jax.models.drafter_io import fresh_draft_vocab
from fastrl_jax.models.known_configs import KNOWN, known_config
from fastrl_jax.models.loading import read_model_config
from fastrl_jax.rl.update import TRAIN_LENGTH_QUANTUM, master_rules, train_width
from fastrl_jax.rollout.engine import RolloutEngine
from fastrl_jax.rollout.programs import cache_spec, hidden_spec
from fastrl_jax.rollout.speculative import Strategy
from fastrl_jax.sharding import AXES, mesh_sizes, shardings_for

GiB = 2**30
MEMORY_PARTS = ("params", "grads", "optimizer", "new_params", "reference", "rollout_params", "unrolled_layers", "kv_cache",
                "hidden_states", "drafter_kv_cache", "compaction", "drafter", "drafter_training", "train_logits",
                "train_activations")


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


def abstract_drafter(cfg: Config, mcfg: ModelConfig, dtype: str) -> Drafter:
    """The shapes of the drafter make_drafter builds from the config (drafter_train.kind and its reduced
    draft vocabulary); a checkpoint at rl.drafter_path keeps its own, which the plan does not read."""
    vocab = fresh_draft_vocab(mcfg, cfg.drafter_train.draft_vocab_size)
    return nnx.eval_shape(lambda: Drafter(mcfg, nnx.Rngs(0), DTYPES[dtype], draft_vocab=vocab, kind=cfg.drafter_train.kind))


def _drafter_plan(cfg: Config, mcfg: ModelConfig, mesh: AbstractMesh) -> dict[str, int]:
    """Bytes per device of the drafter: the engines' copy (model.rollout_dtype), and with online training
    (drafter_online.enabled) its master weights (model.dtype), their gradients and the starting copy kept
    for the drift comparison, all sharded as the engines' copy, plus the AdamW moments, which the spot
    trainer keeps whole on every device it lends (drafter/online.py). The policy's embedding and head are
    shared, not counted."""
    if not cfg.sd.uses_drafter():
        return {"drafter": 0, "drafter_training": 0}
    engine = nnx.state(abstract_drafter(cfg, mcfg, cfg.model.engine_dtype), nnx.Param)
    master = nnx.state(abstract_drafter(cfg, mcfg, cfg.model.dtype), nnx.Param)
    sharded = _per_device_bytes(shardings_for(master, mesh), master)
    whole = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(master))
    online = cfg.drafter_online.enabled
    mixed = cfg.model.engine_dtype != cfg.model.dtype  # else the engines draft with the master's buffers
    return {"drafter": _per_device_bytes(shardings_for(engine, mesh), engine) if mixed or not online else 0,
            "drafter_training": 3 * sharded + 2 * whole if online else 0}


def memory_plan(cfg: Config, devices: int | None = None, platform: str | None = None) -> dict[str, float]:
    """Bytes per device of each part of a training run (master parameters, gradients, AdamW moments, the
    update's new parameters, reference, the engines' copy of the policy in model.rollout_dtype, a rollout
    replica's KV cache and hidden states, the drafter and its online training, and the largest micro-batch's
    logits and layer activations). platform: where training runs, which picks its attention backend
    (train_activations); this process's JAX backend by default."""
    mcfg = model_config(cfg.model.path)
    sizes = mesh_shape(cfg, devices)
    mesh = AbstractMesh(tuple(sizes.values()), AXES)
    state = nnx.state(abstract_decoder(mcfg, DTYPES[cfg.model.dtype]))
    params = _per_device_bytes(shardings_for(state, mesh, master_rules(cfg.model)), state)
    mixed = cfg.model.engine_dtype != cfg.model.dtype  # else the engines share the trainer's buffers
    engine_state = nnx.state(abstract_decoder(mcfg, DTYPES[cfg.model.engine_dtype]))
    rollout_params = _per_device_bytes(shardings_for(engine_state, mesh), engine_state) if mixed else 0
    # Unrolled engines (rollout.layer_loop) copy the layer weights into per-layer buffers; planned as on GPUs, where
    # 'auto' unrolls. Of a cast copy (mixed) only the embedding, norm and head then stay (workers.policy_head).
    layers = engine_state["layers"]
    unrolled = _per_device_bytes(shardings_for(layers, mesh), layers) if cfg.rollout.unrolled_layers("gpu") else 0
    rollout_params -= unrolled if mixed else 0
    itemsize = np.dtype(DTYPES[cfg.model.engine_dtype]).itemsize
    B, S = cfg.rollout.batch_buckets[-1], cfg.rollout.length_buckets[-1]
    # The engine's row table lives on each replica's devices, split as RolloutEngine._placed splits it: KV caches
    # and hidden states over rows along fsdp, KV heads and features along tensor, where they divide them.
    replica = AbstractMesh((1, sizes["fsdp"], sizes["tensor"]), AXES)

    def shard(shape, spec) -> tuple[int, ...]:  # a device's share
        return NamedSharding(replica, spec).shard_shape(shape)

    KV, D = mcfg.num_kv_heads, mcfg.head_dim
    kv_shard = shard((mcfg.num_layers, B, KV, S, D), cache_spec(replica, B, KV))
    kv, rows = 2 * math.prod(kv_shard) * itemsize, kv_shard[1]
    # Only EAGLE strategies keep hidden states and a drafter cache (history drafting needs neither); the
    # drafter's cache has the tree steps' scratch slots beyond the longest length bucket (RolloutEngine._empty).
    drafting = cfg.sd.uses_drafter()
    width = mcfg.hidden_size * max(len(feature_layers(cfg.drafter_train.kind, mcfg.num_layers)), 1)
    hidden = math.prod(shard((B, S, width), hidden_spec(replica, B, width))) * itemsize if drafting else 0
    scratch = max((Strategy(*s.parts()).scratch_slots for s in cfg.sd.strategy_list() if s.parts()[0]), default=0)
    drafter_kv = 2 * math.prod(shard((1, B, KV, S + scratch, D), cache_spec(replica, B, KV))) * itemsize if drafting else 0
    # Compaction (programs.resize) builds the next smaller table while the largest one still lives, every row of it
    # on every device (each device takes the rows it holds into it, and a reduce-scatter hands out the rows).
    smaller = max((b for b in cfg.rollout.batch_buckets if b < B), default=0)
    compaction = (kv + hidden + drafter_kv) * smaller // rows
    vocab = _on_tensor(mcfg.vocab_size, sizes)  # the head splits over tensor
    # Only the completion slots go through the head (update.sequence_logprobs), at most rl.max_new_tokens
    # rounded up as Trainer.build_batch rounds them.
    logits = 3 * _train_rows(cfg, sizes) * train_width(cfg.rl.max_new_tokens) * vocab * 4  # logits, log-softmax, gradient
    plan = {
        "devices": math.prod(sizes.values()), **{f"mesh_{k}": v for k, v in sizes.items()},
        "param_count": sum(math.prod(v.shape) for v in jax.tree.leaves(state)),
        # The update step returns new parameters beside the old (only the optimizer state is donated: the
        # engines may hold the old buffers), so both are live at its end.
        "params": params, "grads": params, "optimizer": 2 * params, "new_params": params,
        "reference": params if cfg.rl.kl_coef > 0 else 0,
        "rollout_params": rollout_params, "unrolled_layers": unrolled,
        "kv_cache": kv, "hidden_states": hidden, "drafter_kv_cache": drafter_kv, "compaction": compaction,
        **_drafter_plan(cfg, mcfg, mesh),
        "train_logits": logits,
        "train_activations": train_activations(cfg, mcfg, sizes, platform or jax.default_backend()),
    }
    plan["total"] = sum(plan[k] for k in MEMORY_PARTS)
    return plan


def train_activations(cfg: Config, mcfg: ModelConfig, sizes: dict[str, int], platform: str) -> int:
    """Bytes per device of the update step's layer activations for its longest micro-batch: rows = micro-batch
    rows over data x fsdp, T = P + C slots (P the largest prompt bucket, C rl.max_new_tokens, each rounded up as
    Trainer.build_batch rounds them); heads and the MLP split over tensor where they divide, as their weights.

    One decoder layer keeps for its backward pass (the buffers of the compiled step's layer scan, update.
    sequence_logprobs -> decoder.run_layers) lin = rows x T x (residual + qkv + mlp) in model.dtype:
      residual  7 x hidden: the layer input, both RMSNorms' inputs, scales and outputs, the attention residual
      qkv       2 x heads x head_dim + 4 x kv_heads x head_dim: queries rotated and scaled, keys and values
                before and after their transposes
      mlp       6 x intermediate: gate, up, the SiLU's parts and the product
    and, where the XLA reference runs the attention forward (model.attention on `platform`; auto on CPU),
      scores    2 x rows x heads x T x T float32: the new tokens' scores (training scores no cache window:
                cached_slots 0) and the weights' copy the value contraction reads.
    A Triton / Pallas forward keeps queries, keys and values only; its backward is the reference's, which builds
    the scores one layer at a time. So layer = lin + scores (reference) or lin (a kernel), and the backward pass
    of a layer adds gradients of its size: lin + scores.
    Without rl.remat the scan keeps every layer's tensors: num_layers x layer + lin + scores. With rl.remat each
    layer keeps its input (rows x T x hidden) and the backward pass recomputes one layer:
    num_layers x input + layer + lin + scores.
    """
    T = train_width(cfg.rollout.prompt_buckets[-1]) + train_width(cfg.rl.max_new_tokens)
    rows = _train_rows(cfg, sizes)
    heads, kv_heads, mlp = (_on_tensor(n, sizes) for n in (mcfg.num_heads, mcfg.num_kv_heads, mcfg.intermediate_size))
    itemsize = np.dtype(DTYPES[cfg.model.dtype]).itemsize
    lin = rows * T * (7 * mcfg.hidden_size + (2 * heads + 4 * kv_heads) * mcfg.head_dim + 6 * mlp) * itemsize
    scores = 2 * rows * heads * T * T * 4
    layer = lin + (scores if attention_backend(cfg, platform) == "reference" else 0)
    kept = mcfg.num_layers * (rows * T * mcfg.hidden_size * itemsize if cfg.rl.remat else layer)
    return kept + (layer if cfg.rl.remat else 0) + lin + scores


def _train_rows(cfg: Config, sizes: dict[str, int]) -> int:
    """A device's rows of a training micro-batch: split over data x fsdp."""
    return max(cfg.rl.micro_batch_size // (sizes["data"] * sizes["fsdp"]), 1)


def _on_tensor(n: int, sizes: dict[str, int]) -> int:
    """A device's share of `n` heads / columns where they split over tensor (whole where they do not divide)."""
    return n // (sizes["tensor"] if n % sizes["tensor"] == 0 else 1)


def attention_backend(cfg: Config, platform: str) -> str:
    """The backend the layers' attention forward takes on `platform` for model.attention (kernels/backends.py's
    choice where every backend is installed)."""
    return select_backend(platform, cfg.model.attention, BACKENDS).order[0]


def program_plan(cfg: Config) -> Counter:
    """Engine programs per phase (what warm-up compiles).

    The engine is built on the abstract model (no warm-up, nothing allocated), so the plan is the
    engine's own list of programs.
    """
    mcfg = model_config(cfg.model.path)
    drafter = abstract_drafter(cfg, mcfg, cfg.model.engine_dtype) if cfg.sd.mode != "off" else None
    rollout = dataclasses.replace(cfg.rollout, warm_up=False, compile_cache_dir="")
    engine = RolloutEngine(abstract_decoder(mcfg, DTYPES[cfg.model.engine_dtype]), rollout, sd=cfg.sd, drafter=drafter,
                           progress=False)
    return Counter(k[0] for k in engine.warm_up_keys())


def training_programs(cfg: Config) -> str:
    """The trainer's programs, compiled when first reached: one update step per (prompt, completion) width
    pair of a rollout batch (Trainer.build_batch rounds both up to TRAIN_LENGTH_QUANTUM), and as many
    log-prob programs with rl.minibatches_per_step > 1."""
    p = math.ceil(cfg.rollout.prompt_buckets[-1] / TRAIN_LENGTH_QUANTUM)
    c = math.ceil(cfg.rl.max_new_tokens / TRAIN_LENGTH_QUANTUM)
    kinds = "an update step" + (" and a log-prob program" if cfg.rl.minibatches_per_step > 1 else "")
    return (f"training programs: {kinds} per (prompt, completion) width pair a rollout batch reaches, widths in "
            f"multiples of {TRAIN_LENGTH_QUANTUM} (up to {p} x {c} pairs), each compiled when first reached")


def memory_warning(cfg: Config, devices: int, bytes_limit: int | None) -> str | None:
    """Why a run may not fit when the memory plan per device exceeds what JAX may allocate on one (the device's
    memory_stats()["bytes_limit"]; None on CPU, which plans nothing), else None."""
    total = memory_plan(cfg, devices)["total"] if bytes_limit else 0
    if not bytes_limit or total <= bytes_limit:
        return None
    return (f"the memory plan needs {total / GiB:.1f} GiB a device (`train --dry-run` itemises it) and JAX may allocate "
            f"{bytes_limit / GiB:.1f} GiB of one (XLA_PYTHON_CLIENT_MEM_FRACTION={_memory_fraction():g}): raise the "
            "fraction (up to ~0.95), or shrink the row table (rollout.batch_buckets, rollout.length_buckets) or "
            "rl.micro_batch_size. The plan adds rollout and training parts that do not all live at once, so the run "
            "may still fit")


def _memory_fraction() -> float:
    """The share of a GPU's memory JAX's allocator may take (its documented default 0.75)."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def plan(cfg: Config, devices: int | None = None, platform: str | None = None) -> str:
    """The dry-run report as text; platform as memory_plan's."""
    platform = platform or jax.default_backend()
    m = memory_plan(cfg, devices, platform)
    mcfg = model_config(cfg.model.path)
    lines = [
        f"model {cfg.model.path}: {mcfg.family}, {m['param_count'] / 1e9:.2f}B parameters, trained in "
        f"{cfg.model.dtype}, rollouts in {cfg.model.engine_dtype}",
        f"mesh data={m['mesh_data']} fsdp={m['mesh_fsdp']} tensor={m['mesh_tensor']} ({m['devices']} devices); "
        f"{m['mesh_data']} rollout replica(s) of {m['devices'] // m['mesh_data']} device(s)",
        "memory per device (GiB):",
    ]
    rows_note = f"{_train_rows(cfg, {'data': m['mesh_data'], 'fsdp': m['mesh_fsdp']})} rows per device"
    notes = {
        "params": f"policy ({cfg.model.dtype} master weights), sharded fsdp x tensor"
                  + (" x data" if cfg.model.engine_dtype != cfg.model.dtype else ""),
        "grads": "accumulated over micro-batches",
        "optimizer": "AdamW first and second moments",
        "new_params": "the update step's output parameters, beside the old until it returns",
        "reference": "frozen reference policy (rl.kl_coef > 0)",
        "rollout_params": f"the engines' {cfg.model.engine_dtype} copy (model.rollout_dtype; unrolled: its embedding, "
                          "norm and head)",
        "unrolled_layers": "the engines' per-layer copy of the layer weights (rollout.layer_loop unrolled, or auto on GPUs)",
        "kv_cache": f"rollout KV cache, {cfg.rollout.batch_buckets[-1]} rows x {cfg.rollout.length_buckets[-1]} slots, "
                    f"rows split over fsdp and KV heads over tensor where they divide them",
        "hidden_states": "last-layer hidden states kept for the drafter (EAGLE strategies)",
        "drafter_kv_cache": "drafter's one-layer KV cache (EAGLE strategies)",
        "compaction": "the next smaller row table, built beside the largest when rows finish",
        "drafter": f"the engines' {cfg.model.engine_dtype} drafter (its layer and fc; embedding and head are the policy's)",
        "drafter_training": "online drafter training: master weights, gradients, starting copy, AdamW moments (whole)",
        "train_logits": f"logits of a micro-batch's completion slots (rl.max_new_tokens; estimate), {rows_note}",
        "train_activations": "the update step's layer activations over prompt + completion slots, "
                             + ("each layer's input and one layer's tensors (rl.remat)" if cfg.rl.remat else
                                "every layer's tensors (rl.remat=true keeps one layer's)")
                             + f", attention by {attention_backend(cfg, platform)} on {platform} (estimate)",
    }
    for key, note in notes.items():
        lines.append(f"  {key:<17} {m[key] / GiB:9.3f}  {note}")
    lines.append(f"  {'total':<17} {m['total'] / GiB:9.3f}  needs a device of {m['total'] / _memory_fraction() / GiB:.1f} GiB: "
                 f"JAX allocates at most {_memory_fraction():.0%} of one (XLA_PYTHON_CLIENT_MEM_FRACTION)")
    progs = program_plan(cfg)
    lines.append(f"engine programs: {sum(progs.values())} ({', '.join(f'{k} {v}' for k, v in sorted(progs.items()))}); "
                 f"batch buckets {list(cfg.rollout.batch_buckets)}, length buckets {list(cfg.rollout.length_buckets)}, "
                 f"prompt buckets {list(cfg.rollout.prompt_buckets)}, sd {cfg.sd.mode}")
    lines.append(training_programs(cfg))
    return "\n".join(lines)
