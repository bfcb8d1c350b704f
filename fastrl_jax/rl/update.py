"""The policy update: optimizer, sequence log-probs, and one jitted GRPO step with gradient accumulation.

Parameters are a pure dict (nnx.to_pure_dict of the Decoder's state) sharded on the mesh
(fsdp x tensor); a batch is [micro-batches, micro_batch_size, ...] with the micro-batch rows
sharded over (data, fsdp). The step scans over the micro-batches, adds their gradients, and
applies one optax update, so memory follows the micro-batch and the result equals one update on
the whole mini-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fastrl_jax.config import ConfigError, ModelSpec, OptimConfig, RLConfig
from fastrl_jax.models.decoder import KVCache, run_layers
from fastrl_jax.rl import grpo
from fastrl_jax.sharding import DEFAULT_RULES, Rules, named_sharding, training_rows

TRAIN_LENGTH_QUANTUM = 32  # prompt and completion widths of a training batch are multiples of this


def train_width(tokens: int) -> int:
    """`tokens` rounded up to TRAIN_LENGTH_QUANTUM: the prompt or completion width of a training batch that holds
    them (few widths, so few compiled update steps)."""
    return -(-tokens // TRAIN_LENGTH_QUANTUM) * TRAIN_LENGTH_QUANTUM


Params = dict[str, Any]


def master_rules(model: ModelSpec) -> Rules:
    """Sharding rules of the trained parameters (and so of their gradients and AdamW moments).

    When the engines run the trained dtype they share the trainer's buffers, which must then be
    replicated along data, where the rollout replicas live. When they run another dtype
    (model.rollout_dtype) the hand-off copies anyway, so the float32 master weights are split over
    data too ('embed' over fsdp x data, ZeRO-3 style) and the hand-off's cast all-gathers them.
    """
    if model.engine_dtype == model.dtype:
        return DEFAULT_RULES
    return tuple((name, ("fsdp", "data") if name == "embed" else axes) for name, axes in DEFAULT_RULES)


def make_schedule(cfg: OptimConfig, total_updates: int) -> optax.Schedule:
    """Linear warm-up to the peak, then constant, cosine or linear decay to 0 at `total_updates`."""
    peak, warmup = cfg.learning_rate, min(cfg.warmup_steps, max(total_updates - 1, 0))
    decay_steps = max(total_updates - warmup, 1)
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(peak, 0.0, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup]) if warmup else after


def policy_optimizer(cfg: OptimConfig, total_updates: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; the schedule runs over `total_updates` optimizer steps."""
    adamw = optax.adamw(make_schedule(cfg, total_updates), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    # identity when off: the state's layout stays the same, so a resume may turn clipping on (the NaN stop's advice)
    clip = optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm > 0 else optax.identity()
    return optax.chain(clip, adamw)


def learning_rate(cfg: OptimConfig, total_updates: int, update: int) -> float:
    """The learning rate of optimizer step `update` (for logging)."""
    return float(make_schedule(cfg, total_updates)(update))


def optimizer_shardings(tx: optax.GradientTransformation, params: Params, param_shardings: Params, mesh: Mesh):
    """Shardings of tx.init(params): moment buffers follow their parameter, counters are replicated."""
    abstract = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx, lambda _, s: s, abstract, param_shardings, transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def sequence_logprobs(graphdef, params: Params, tokens: jax.Array, pad: jax.Array, completion_len: int,
                      temperature: float, remat: bool = False):
    """Log-probs and entropies of the completion tokens under the policy at `temperature`.

    tokens [B, P + C]: each row is its prompt left-padded into the first P slots (pad[b] pad slots),
    then its completion right-padded into the last C = completion_len. One causal forward without a KV
    cache; positions skip the pads, so they match the rollout's. Only the C completion slots go through
    the LM head. Returns (log p(tokens[:, P:]) [B, C], entropy [B, C]).
    """
    model = nnx.merge(graphdef, params)
    B, S = tokens.shape
    P = S - completion_len
    slots = jnp.arange(S, dtype=jnp.int32)
    positions = jnp.maximum(slots[None, :] - pad[:, None], 0)
    # Causal, pads hidden; a pad slot sees itself so no softmax row is empty (its output is unused).
    mask = (slots[None, :, None] >= slots[None, None, :]) & (slots[None, None, :] >= pad[:, None, None])
    mask = mask | jnp.eye(S, dtype=bool)[None]
    start = jnp.zeros(B, jnp.int32)
    cache = KVCache.zeros(model.cfg, B, S, model.embed.get_value().dtype)  # the layers place new keys in it
    # cached_slots=0: every slot is a new token's own, so the reference attention scores no cached window (it
    # scored all S, masked, doubling the scores' time and memory)
    x = model.embed[tokens]  # traced_under's mesh: each device keeps its own rows through the layers
    hidden, _ = run_layers(model.cfg, model.layers, x, positions, cache, start, mask, remat=remat, cached_slots=0,
                           rows=training_rows(x.shape))
    logits = model.logits(hidden[:, P - 1 : S - 1])  # slot t predicts the token at slot t + 1
    return grpo.token_logprobs(logits, tokens[:, P:], temperature), grpo.entropy(logits, temperature)


@struct.dataclass
class GRPOBatch:
    """One mini-batch, [K micro-batches, M rows, ...]; row = one sampled completion (see sequence_logprobs)."""

    tokens: jax.Array  # [K, M, P + C] int32: left-padded prompt, right-padded completion
    pad: jax.Array  # [K, M] int32 pad slots before each prompt
    mask: jax.Array  # [K, M, C] float32: 1 on completion tokens
    advantages: jax.Array  # [K, M] float32
    old_logp: jax.Array  # [K, M, C] float32 log-probs of the policy that sampled (before this update)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static settings of the jitted step (hashable)."""

    temperature: float
    clip_low: float
    clip_high: float
    clip_ratio_c: float
    aggregation: str
    kl_coef: float
    kl_estimator: str
    remat: bool
    on_policy: bool  # the batch was sampled by exactly these params: old_logp = stop_gradient(logp)
    length_scale: float = 1.0  # sequence_sum_norm's constant divisor (grpo.aggregate)
    entropy_coeff: float = 0.0  # the loss subtracts entropy_coeff x the entropy, aggregated as the loss (verl's)

    @classmethod
    def from_config(cls, rl: RLConfig) -> StepOptions:
        return cls(rl.temperature, rl.clip_low, rl.clip_high, rl.clip_ratio_c, rl.loss_aggregation, rl.kl_coef,
                   rl.kl_estimator, rl.remat, on_policy=rl.minibatches_per_step == 1, length_scale=float(rl.max_new_tokens),
                   entropy_coeff=rl.entropy_coeff)


def _micro_loss(params, graphdef, ref_params, mb: GRPOBatch, normalizer, opts: StepOptions):
    C = mb.mask.shape[-1]
    logp, ent = sequence_logprobs(graphdef, params, mb.tokens, mb.pad, C, opts.temperature, opts.remat)
    old = jax.lax.stop_gradient(logp) if opts.on_policy else mb.old_logp
    ref = None
    if ref_params is not None:
        ref = jax.lax.stop_gradient(sequence_logprobs(graphdef, ref_params, mb.tokens, mb.pad, C, opts.temperature)[0])
    loss, metrics = grpo.grpo_loss(
        logp, old, mb.advantages, mb.mask, clip_low=opts.clip_low, clip_high=opts.clip_high,
        clip_ratio_c=opts.clip_ratio_c, aggregation=opts.aggregation, normalizer=normalizer, ref_logp=ref,
        kl_coef=opts.kl_coef, kl_estimator=opts.kl_estimator, length_scale=opts.length_scale,
    )
    metrics["entropy"] = grpo.aggregate(ent, mb.mask, grpo.per_token_mode(opts.aggregation), normalizer)
    if opts.entropy_coeff:  # an entropy bonus, verl's policy_loss = pg_loss - entropy_coeff x agg_loss(entropy)
        loss = loss - opts.entropy_coeff * grpo.aggregate(ent, mb.mask, opts.aggregation, normalizer, opts.length_scale)
    metrics["loss"] = loss
    return loss, metrics


def train_step(graphdef, tx, opts: StepOptions, params: Params, opt_state, ref_params, batch: GRPOBatch):
    """One optimizer update from a mini-batch; returns (params, opt_state, metrics). Pure; jit it
    with `jit_train_step`."""
    K, M = batch.advantages.shape
    normalizer = jnp.maximum(jnp.sum(batch.mask), 1.0) if opts.aggregation == "token" else float(K * M)
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

    def micro(grads, mb):
        (_, metrics), g = grad_fn(params, graphdef, ref_params, mb, normalizer, opts)
        return jax.tree.map(jnp.add, grads, g), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, metrics = jax.lax.scan(micro, zeros, batch)
    metrics = jax.tree.map(jnp.sum, metrics)  # each micro-batch's share is already normalised
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics["update_norm"] = optax.tree.norm(updates)  # finite loss and gradients can still overflow the weights
    return optax.apply_updates(params, updates), opt_state, metrics


def rows_sharding(mesh: Mesh, shape: tuple[int, ...], row_axis: int) -> NamedSharding:
    """Axis `row_axis` (the sequences of a micro-batch) over (data, fsdp); every other axis replicated."""
    return named_sharding(mesh, tuple("batch" if i == row_axis else None for i in range(len(shape))), shape)


def check_batch_fits_mesh(rl: RLConfig, mesh: Mesh | int) -> None:
    """mesh: the mesh, or its data x fsdp size."""
    rows = mesh if isinstance(mesh, int) else mesh.shape["data"] * mesh.shape["fsdp"]
    if rl.micro_batch_size % rows:
        raise ConfigError(
            f"rl.micro_batch_size={rl.micro_batch_size} must be divisible by mesh data x fsdp = {rows}: "
            "each device trains on an equal share of every micro-batch"
        )


def batch_shardings(mesh: Mesh, micro_batch_size: int) -> GRPOBatch:
    """The sharding of each GRPOBatch field: rows over (data, fsdp), whatever the sequence length."""
    rows = lambda rank: rows_sharding(mesh, (1, micro_batch_size, 1)[:rank], 1)  # noqa: E731
    return GRPOBatch(tokens=rows(3), pad=rows(2), mask=rows(3), advantages=rows(2), old_logp=rows(3))


def jit_train_step(graphdef, tx, opts: StepOptions, param_shardings, opt_shardings, mesh: Mesh, with_ref: bool,
                   micro_batch_size: int):
    """The jitted step with explicit shardings; the optimizer state is donated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    ref_shardings = param_shardings if with_ref else None
    step = traced_under(mesh, functools.partial(train_step, graphdef, tx, opts))
    return jax.jit(
        step,
        in_shardings=(param_shardings, opt_shardings, ref_shardings, batch_shardings(mesh, micro_batch_size)),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(1,),
    )


def jit_logprobs(graphdef, temperature: float, param_shardings, mesh: Mesh, micro_batch_size: int):
    """Jitted completion log-probs of one micro-batch (tokens [M, P + C], pad [M], mask [M, C]): the
    old log-probs of off-policy updates."""
    rows = rows_sharding(mesh, (micro_batch_size, 1), 0)
    pads = rows_sharding(mesh, (micro_batch_size,), 0)

    def logp(params, tokens, pad, mask):
        return sequence_logprobs(graphdef, params, tokens, pad, mask.shape[-1], temperature)[0]

    # Replicated out: the trainer reads them whole on every process (rows over data x fsdp span other hosts'
    # devices, which device_get refuses: every multi-process run with rl.minibatches_per_step > 1 failed at step 1)
    return jax.jit(traced_under(mesh, logp), in_shardings=(param_shardings, rows, pads, rows),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))


def traced_under(mesh: Mesh, fn):
    """fn traced with `mesh` as the context mesh, where the attention kernels find it to run per shard (each
    device its own rows and heads; kernels/tree_attention/api.py) instead of on operands gathered whole."""

    @functools.wraps(fn)
    def run(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return run


def to_global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds in full (single- or multi-process)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
