"""Frozen dataclass configs: YAML load, dotted `key=value` overrides, validation with clear messages.

A config is a tree of frozen dataclasses. `from_dict` builds it from nested dicts by
reading the field type hints, so adding a section is one dataclass plus one line in
`Config`. Each section checks its own values in `__post_init__`, so a bad value fails
at load time with a message that names the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fastrl_jax import files


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key and what is allowed."""


class TrainingStopped(RuntimeError):
    """A run stopped on purpose (non-finite loss, a stop signal); the message says where it stands and what to do."""


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(str(a) or repr(a) for a in allowed)}; got {value!r}")


def _check_at_least(section: str, cfg: Any, names: Sequence[str], least: int) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < least:
            raise ConfigError(f"{section}.{name} must be >= {least}, got {value}")


def _check_local_dir(key: str, path: str) -> None:
    """Run directories are written with local file operations (atomic renames, npz, JSONL): a URL would become a
    local directory named gs:, and the first checkpoint (Orbax, which reads URLs) would fail past it."""
    if "://" in path:
        raise ConfigError(f"{key} must be a local or mounted directory, got the URL {path!r}: mount the bucket (e.g. "
                          "gcsfuse, s3fs) and give its path")


MIN_TEMPERATURE = 1e-5  # vLLM's sampling epsilon too


def temperature_problem(name: str, t: float, greedy: bool = True) -> str | None:
    """Why sampling temperature `t` (the setting `name`) cannot run, or None: 0 is greedy (where `greedy`
    allows it), else MIN_TEMPERATURE <= t < inf. Below MIN_TEMPERATURE a sample is the greedy token in all
    but near-ties, and from ~1e-36 logits / t overflow float32 (NaN log-probs)."""
    if (greedy and t == 0) or MIN_TEMPERATURE <= t < math.inf:  # NaN fails both
        return None
    return f"{name} must be {'0 (greedy) or ' if greedy else ''}in [{MIN_TEMPERATURE:g}, inf), got {t}"


DTYPE_NAMES = ("float32", "bfloat16")
# "auto" and kernels.backends.BACKENDS (config sits below kernels; tests/test_config.py keeps the two equal)
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas_interpret", "triton")
LOSS_AGGREGATIONS = ("token", "sequence", "sequence_sum", "sequence_sum_norm")  # rl/grpo.py aggregate
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+")  # rl/grpo.py kl_penalty


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which policy checkpoint to load, the dtype its weights train in, and the dtype the engines run.

    Mixed precision (GPU/TPU): dtype float32 (the master weights and AdamW state of `train`, the
    drafter's in drafter training) and rollout_dtype bfloat16 (every rollout engine's copy of the
    policy and drafter, cast at each weight hand-off; also what generate / bench-sd run).
    """

    path: str = "smollm2"  # 'smollm2', a local HF checkpoint directory, or a local .gguf file
    dtype: str = "float32"  # trained weights and optimizer state; float32 (bfloat16 only for inference)
    rollout_dtype: str = ""  # '' (= dtype) | float32 | bfloat16: the engines' weights; bfloat16 on GPU/TPU, float32 on CPU
    # The layers' attention backend: auto (Triton then Pallas on GPU, Pallas on TPU, the XLA reference on CPU)
    # or one by name, e.g. reference to compare the kernels against XLA's own fusion on a GPU (docs/gpu.md).
    attention: str = "auto"

    def __post_init__(self):
        _check_choice("model.attention", self.attention, ATTENTION_BACKENDS)
        _check_choice("model.dtype", self.dtype, DTYPE_NAMES)
        _check_choice("model.rollout_dtype", self.rollout_dtype, ("", *DTYPE_NAMES))
        if self.dtype == "bfloat16" and self.rollout_dtype == "float32":
            raise ConfigError("model.rollout_dtype=float32 with model.dtype=bfloat16 is not supported: float32 copies "
                              "of bfloat16 weights hold no more precision at twice the memory; set model.rollout_dtype "
                              "to '' or bfloat16 (or model.dtype=float32)")

    @property
    def engine_dtype(self) -> str:
        """The dtype rollout engines run the policy and drafter in."""
        return self.rollout_dtype or self.dtype


def check_trainable(cfg: Config, command: str) -> None:
    """Raises ConfigError when `command` (train, train-drafter) would train weights in bfloat16: AdamW
    updates below about 1/256 of a weight round away (at learning rate 1e-6 ~98% of them,
    docs/measurements.md), so the run would silently barely train."""
    if cfg.model.dtype != "float32":
        raise ConfigError(
            f"{command} trains weights in model.dtype, which must be float32 (got {cfg.model.dtype}): bfloat16 master "
            "weights round away most AdamW updates; for bfloat16 rollouts set model.dtype=float32 and "
            "model.rollout_dtype=bfloat16 (float32 master weights and optimizer state, bfloat16 engines)")
    # A prompt + completion can fill the largest length bucket; a sample buffer smaller than that would fail
    # on the first such rollout, after hours of training (GRPO: after the policy update, before its checkpoint).
    key, section = ("drafter_online", cfg.drafter_online) if command == "train" else ("drafter_train", cfg.drafter_train)
    longest = cfg.rollout.length_buckets[-1]
    if (command != "train" or cfg.drafter_online.enabled) and section.buffer_max_tokens < longest:
        raise ConfigError(f"{key}.buffer_max_tokens ({section.buffer_max_tokens}) must hold the longest rollout, "
                          f"rollout.length_buckets max ({longest}): raise it or lower the length buckets")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (data, fsdp, tensor); -1 in one axis takes all remaining devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = dataclasses.asdict(self)
        for name, n in sizes.items():
            if n < 1 and n != -1:
                raise ConfigError(f"mesh.{name} must be >= 1, or -1 for all remaining devices; got {n}")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(f"at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1; got {sizes}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Rollout engine shapes: every (batch bucket, length bucket) is one compiled program."""

    batch_buckets: tuple[int, ...] = (1, 4, 16, 64)
    length_buckets: tuple[int, ...] = (256, 512, 1024)  # KV-cache slots attention reads (prompt + completion)
    # Prefill lengths: a prefill call runs distinct prompts (after a shared prefix) back to back, up to the
    # largest bucket's tokens, padded to the smallest bucket that holds them; the largest bounds a prompt.
    prompt_buckets: tuple[int, ...] = (64, 128, 256)
    steps_per_call: int = 32  # decode steps per program call between host visits
    refill_rows: int = 4  # while requests wait, a call runs until this many rows (<= 1/8 of the table) finish; one packed prefill refills them
    # A refill that fits one pack may take queued requests up to this many places behind the free rows' share
    # (the queue's head always goes), when that pads its pack less to the prompt bucket; 0: first come, first in.
    refill_lookahead: int = 8
    # Requests of a stream that share this many leading prompt tokens (a chat template's system turn,
    # a GRPO group's prompt) prefill them once, in multiples of it; 0 disables.
    shared_prefix_min: int = 8
    max_stop_ids: int = 4
    # Per-row attention windows in plain decoding: a call may let the n longest rows (n from this list,
    # at most a quarter of the table) read the length bucket their lengths need while every other row
    # reads a smaller one, when that reads fewer slots; each n is another decode program. () disables.
    window_rows: tuple[int, ...] = ()
    # A refill of up to an eighth of the table prefills in the same pass over the weights as a decode step
    # of the live rows (one more program per batch bucket, length bucket and prompt bucket).
    prefill_with_decode: bool = False
    compile_cache_dir: str = "~/.cache/fastrl_jax/xla"  # JAX persistent compilation cache; "" disables
    warm_up: bool = True  # compile every program at engine start
    # How the engines' programs run the policy's layers: 'scan' (lax.scan over the stacked weights), 'unrolled'
    # (each layer's weights their own buffers: one more copy of them per engine) or 'auto': unrolled on a GPU,
    # where the scan copies each layer's MLP weights at every step (H100, 2026-11-26: unrolled decodes 1.6-1.8x
    # the scan's tokens/s for a Qwen2.5-1.5B shape, 1.9-2.6x for 7B; docs/gpu.md), the scan elsewhere (CPU:
    # as fast from batch 4 and compiles ~3x faster, docs/measurements.md; TPU: not measured).
    layer_loop: str = "auto"

    def __post_init__(self):
        for name in ("batch_buckets", "length_buckets", "prompt_buckets"):
            value = getattr(self, name)
            if not value or list(value) != sorted(set(value)) or value[0] < 1:
                raise ConfigError(
                    f"rollout.{name} must be a non-empty increasing list of positive ints, got {list(value)}"
                )
        if self.prompt_buckets[-1] >= self.length_buckets[-1]:
            raise ConfigError(
                f"rollout.prompt_buckets max ({self.prompt_buckets[-1]}) must be below rollout.length_buckets max "
                f"({self.length_buckets[-1]}): completions need cache slots after the prompt"
            )
        if list(self.window_rows) != sorted(set(self.window_rows)) or any(n < 1 for n in self.window_rows):
            raise ConfigError(f"rollout.window_rows must be an increasing list of positive ints, got {list(self.window_rows)}")
        _check_at_least("rollout", self, ("steps_per_call", "max_stop_ids", "refill_rows"), 1)
        _check_at_least("rollout", self, ("shared_prefix_min", "refill_lookahead"), 0)
        _check_choice("rollout.layer_loop", self.layer_loop, ("auto", "scan", "unrolled"))

    def unrolled_layers(self, platform: str) -> bool:
        """Whether engines on `platform` (jax.default_backend(): 'cpu', 'gpu', 'tpu') unroll the layer loop."""
        return self.layer_loop == "unrolled" or (self.layer_loop == "auto" and platform == "gpu")


class StrategySpec(str):
    """A draft strategy in config notation: 'S/K/V' (an EAGLE tree: S drafter steps, top-K branching,
    V nodes verified, root included), 'hD' (a chain of up to D tokens drafted from history), or
    'S/K/V+hD' (both merged into one tree). A list [S, K, V] reads as 'S/K/V'."""

    @classmethod
    def from_config(cls, value: Any, key: str) -> StrategySpec:
        if isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            value = "/".join(map(str, value))
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a strategy like '6/4/16', 'h8' or '3/1/4+h8' (or [steps, topk, verify_tokens]), got {value!r}")
        spec = cls(value.replace(" ", ""))
        spec.parts(key)  # validates
        return spec

    def parts(self, key: str = "strategy") -> tuple[int, int, int, int]:
        """(steps, topk, verify_tokens, history_tokens); steps 0 (topk 0, verify_tokens 1) without a tree."""
        tree, _, chain = self.partition("+")
        if tree.startswith("h") and not chain:
            tree, chain = "", tree
        try:
            steps, topk, verify = (int(x) for x in tree.split("/")) if tree else (0, 0, 1)
            history = int(chain[1:]) if chain else 0
            if chain and not chain.startswith("h"):
                raise ValueError
        except ValueError:
            raise ConfigError(f"{key}: {str(self)!r} is not 'S/K/V', 'hD' or 'S/K/V+hD' (e.g. '6/4/16', 'h8', '3/1/4+h8')") from None
        if tree and (steps < 1 or topk < 1 or verify < 2):
            raise ConfigError(f"{key}: {str(self)!r} needs steps >= 1, topk >= 1, verify_tokens >= 2")
        if tree and verify > 1 + topk + (steps - 1) * topk**2:
            raise ConfigError(f"{key}: verify_tokens={verify} exceeds the {1 + topk + (steps - 1) * topk**2} nodes "
                              f"steps x topk can draft")
        if chain and history < 1:
            raise ConfigError(f"{key}: {str(self)!r} needs a history chain of at least 1 token")
        return steps, topk, verify, history

    def nodes(self) -> int:
        """Tokens one step of this strategy verifies."""
        _, _, verify, history = self.parts()
        return verify + history


@dataclasses.dataclass(frozen=True)
class HistoryConfig:
    """Drafting from history (rollout/history.py): earlier text of a row's prompt group."""

    match_tokens: int = 8  # longest suffix of a row matched against its history
    min_match: int = 2  # shorter matches draft nothing
    spec_factor: float = 2.0  # a match of m tokens drafts up to spec_factor x m (at most the strategy's hD)
    corpus_tokens: int = 4096  # per row: earlier completions of its prompt (and finished siblings') held on device
    store_prompts: int = 4096  # prompts whose completions are kept across RL steps (least recently used dropped)

    def __post_init__(self):
        _check_at_least("sd.history", self, ("match_tokens", "min_match", "corpus_tokens", "store_prompts"), 1)
        if self.spec_factor <= 0:
            raise ConfigError(f"sd.history.spec_factor must be > 0, got {self.spec_factor}")
        if self.corpus_tokens < 4 * self.match_tokens:
            raise ConfigError(f"sd.history.corpus_tokens ({self.corpus_tokens}) must be >= 4 x sd.history.match_tokens")
        if self.min_match > self.match_tokens:  # a match is at most match_tokens long: history would never draft
            raise ConfigError(f"sd.history.min_match ({self.min_match}) must be <= sd.history.match_tokens "
                              f"({self.match_tokens}), the longest match compared")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which draft strategies run, and when.

    mode 'on' always runs one strategy: strategies[0], or the EAGLE tree steps / topk / verify_tokens
    when no strategies are given. mode 'adaptive' runs plain decoding while the live batch is large and
    speculates once it has stayed <= threshold_live_batch for patience_host_steps program calls; then a
    bandit chooses among the strategies whose group covers the live batch, and plain decoding
    (plain_arm), so adaptive decoding is never slower than plain beyond exploration. Strategies are
    grouped by the tokens a step verifies (verify_tokens + history tokens); each group owns a
    live-batch range in group_live_batch_ranges (ranges may overlap: the arms of every group
    covering a live batch compete there).
    """

    mode: str = "off"  # off | on | adaptive
    steps: int = 5
    topk: int = 4
    verify_tokens: int = 8  # SGLang's defaults: 5 / 4 / 8
    accept: str = "coupled"  # coupled (bit-identical to plain sampling) | rejection (exact in distribution)
    threshold_live_batch: int = 8  # adaptive: SD only at live batch <= this
    patience_host_steps: int = 2  # adaptive: consecutive program calls at or below the threshold before SD turns on
    strategies: tuple[StrategySpec, ...] = ()  # 'S/K/V', 'hD' or 'S/K/V+hD' each; empty = the tree above
    group_live_batch_ranges: tuple[tuple[int, ...], ...] = ()  # adaptive: [nodes, min, max] per group; empty = [1, threshold] for one group
    plain_arm: bool = True  # adaptive: plain decoding is one of every group's arms
    explore_steps: int = 8  # adaptive: device steps of a bandit pull that explores (an untried or random arm)
    # adaptive: EAGLE arms compete once the drafter's estimated tokens per step (the online trainer measures
    # it on each RL step's rollouts) reaches this; a randomly initialised drafter starts out at 1.0. 0: always.
    min_drafter_accept: float = 1.3
    # adaptive: an arm whose program is not compiled yet compiles on a background thread while plain decoding
    # goes on (rollout.warm_up false reaches programs as it goes); false: the call waits for the compile.
    compile_in_background: bool = True
    bandit: str = "beg"  # adaptive: beg (bucketed epsilon-greedy) | ucb1 | fixed (each group's first strategy)
    epsilon: float = 0.1  # beg: exploration probability
    window_host_steps: int = 16  # bandit: rewards kept per strategy (sliding window)
    bandit_seed: int = 0
    history: HistoryConfig = HistoryConfig()

    def __post_init__(self):
        _check_choice("sd.mode", self.mode, ("off", "on", "adaptive"))
        _check_choice("sd.accept", self.accept, ("coupled", "rejection"))
        _check_choice("sd.bandit", self.bandit, ("beg", "ucb1", "fixed"))
        if not self.strategies:
            StrategySpec(f"{self.steps}/{self.topk}/{self.verify_tokens}").parts("sd")
        object.__setattr__(self, "strategies", tuple(  # [S, K, V] tuples of Python callers read as 'S/K/V'
            StrategySpec.from_config(spec, f"sd.strategies[{i}]") for i, spec in enumerate(self.strategies)))
        if twice := next((s for i, s in enumerate(self.strategies) if s in self.strategies[:i]), None):
            raise ConfigError(f"sd.strategies names {twice} twice: each strategy is one arm of the adaptive bandit")
        _check_at_least("sd", self, ("threshold_live_batch", "patience_host_steps", "window_host_steps", "explore_steps"), 1)
        _check_at_least("sd", self, ("min_drafter_accept",), 0)
        if not 0 <= self.epsilon <= 1:
            raise ConfigError(f"sd.epsilon must be in [0, 1], got {self.epsilon}")
        self.live_batch_ranges()  # validates the groups' ranges

    def uses_drafter(self) -> bool:
        """Whether a strategy that may run drafts with the EAGLE drafter (one must then be loaded or made)."""
        return self.mode != "off" and any(s.parts()[0] for s in self.strategy_list())

    def uses_history(self) -> bool:
        """Whether a strategy that may run drafts from history (a HistoryStore is then worth keeping)."""
        return self.mode != "off" and any(s.parts()[3] for s in self.strategy_list())

    def strategy_list(self) -> list[StrategySpec]:
        """The strategies that may run: adaptive mode's candidates; mode 'on' runs the first."""
        if self.strategies:
            return [StrategySpec(s) for s in (self.strategies if self.mode != "on" else self.strategies[:1])]
        return [StrategySpec(f"{self.steps}/{self.topk}/{self.verify_tokens}")]

    def live_batch_ranges(self) -> dict[int, tuple[int, int]]:
        """{nodes: (min_live_batch, max_live_batch)}: disjoint, covering 1 .. threshold_live_batch."""
        groups = sorted({s.nodes() for s in self.strategy_list()})
        key = "sd.group_live_batch_ranges"
        if not self.group_live_batch_ranges:
            if len(groups) > 1:
                raise ConfigError(
                    f"sd.strategies verify {len(groups)} different token counts {groups}: give {key} as "
                    "[nodes, min_live_batch, max_live_batch] per group, e.g. [[16, 1, 2], [8, 3, 8]]"
                )
            return {groups[0]: (1, self.threshold_live_batch)}
        ranges = {}
        for r in self.group_live_batch_ranges:
            if len(r) != 3 or r[1] < 1 or r[2] < r[1]:
                raise ConfigError(f"{key} entries must be [nodes, min, max] with 1 <= min <= max, got {list(r)}")
            if r[0] in ranges:
                raise ConfigError(f"{key} gives nodes={r[0]} twice")
            ranges[r[0]] = (r[1], r[2])
        if self.mode == "adaptive" and sorted(ranges) != groups:
            raise ConfigError(f"{key} must give one range per verify_tokens group of sd.strategies (the tokens a step "
                              f"verifies) {groups}, got {sorted(ranges)}")
        covered = {b for lo, hi in ranges.values() for b in range(lo, hi + 1)}
        if not covered >= set(range(1, self.threshold_live_batch + 1)):
            raise ConfigError(
                f"{key} must cover live batches 1 .. sd.threshold_live_batch ({self.threshold_live_batch}) "
                f"without gaps (ranges may overlap: their arms then compete), got {[list(r) for r in self.group_live_batch_ranges]}"
            )
        return ranges


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """RL prompts: the built-in math generator ('math') or a .jsonl / .parquet file, and a held-out set."""

    source: str = "math"  # 'math' or a path; records need prompt (or messages) and answer
    eval_source: str = "math"  # held-out prompts: 'math' (a different seed from training) or a path
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    answer_field: str = "answer"  # a dotted path reads a nested field, e.g. verl's reward_model.ground_truth
    math_levels: tuple[int, ...] = (1, 2, 3, 4, 5)  # built-in problem difficulty levels to draw from
    # Appended to every record's "prompt" text; a "messages" record is used as it is.
    instruction: str = "Put the final answer after 'The answer is'."
    chat_template: bool = True
    shuffle: bool = True

    def __post_init__(self):
        for name in ("source", "eval_source"):
            if not getattr(self, name):
                raise ConfigError(f"data.{name} must be 'math' or a .jsonl / .parquet path")
        if not self.math_levels or not set(self.math_levels) <= {1, 2, 3, 4, 5}:
            raise ConfigError(f"data.math_levels must be a non-empty subset of [1, 2, 3, 4, 5]; got {list(self.math_levels)}")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward = sum of weight x registered reward function (fastrl_jax.rl.rewards), plus DAPO's overlong
    shaping when overlong_buffer > 0 (rewards.overlong_penalty)."""

    functions: tuple[str, ...] = ("correct",)
    weights: tuple[float, ...] = (1.0,)
    # DAPO's soft overlong punishment (verl reward_model.overlong_buffer): completions longer than
    # rl.max_new_tokens - overlong_buffer lose up to overlong_penalty, linearly over the buffer's tokens; 0 off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        if not self.functions or len(self.functions) != len(self.weights):
            raise ConfigError(
                f"reward.functions ({list(self.functions)}) and reward.weights ({list(self.weights)}) "
                "must be non-empty lists of the same length"
            )
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError(f"reward.overlong_buffer and reward.overlong_penalty must be >= 0, got "
                              f"{self.overlong_buffer}, {self.overlong_penalty}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """optax AdamW with global-norm clipping and a learning-rate schedule over the optimizer updates
    (rl.steps x rl.minibatches_per_step; verl steps its schedule once an RL step, so its lr_warmup_steps is
    warmup_steps / rl.minibatches_per_step: multiply verl's by the mini-batches)."""

    learning_rate: float = 1e-6
    schedule: str = "constant"  # constant | cosine | linear (decay to 0 at the last update)
    warmup_steps: int = 0  # optimizer updates
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping

    def __post_init__(self):
        _check_choice("optim.schedule", self.schedule, ("constant", "cosine", "linear"))
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.max_grad_norm < 0 or self.weight_decay < 0:
            raise ConfigError(
                "optim needs learning_rate > 0, warmup_steps >= 0, max_grad_norm >= 0, weight_decay >= 0; "
                f"got {self}"
            )
        # b1 or b2 of 1 zeroes Adam's bias correction (1 - b^t): the first update is NaN weights.
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.eps > 0):
            raise ConfigError(f"optim needs 0 <= b1 < 1, 0 <= b2 < 1, eps > 0; got b1={self.b1}, b2={self.b2}, eps={self.eps}")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """GRPO: rollout sizes, sampling, loss, batching of the update, and the run's outputs."""

    steps: int = 3
    prompts_per_step: int = 8
    samples_per_prompt: int = 4  # the GRPO group size
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    minibatches_per_step: int = 1  # optimizer updates per rollout batch; > 1 makes later ones off-policy
    # DAPO's dynamic sampling (verl algorithm.filter_groups): prompt groups whose filter_groups_metric is the same
    # for every sample are dropped and more prompts drawn, at most max_gen_batches batches a step (0: no limit)
    filter_groups: bool = False
    # accuracy (verl's metric=acc, DAPO's recipe: the built-in correctness, whatever reward.functions add) | reward
    # (the combined reward, verl's score: where correctness means nothing for a custom reward)
    filter_groups_metric: str = "accuracy"
    max_gen_batches: int = 10
    micro_batch_size: int = 8  # sequences per forward/backward; gradients accumulate over a mini-batch
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO's clip-higher)
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0  # dual-clip PPO: a negative-advantage token loses at most clip_ratio_c x |A| (verl's); 0 = off
    # token (DAPO; verl token-mean) | sequence (GRPO; verl seq-mean-token-mean) | sequence_sum (verl seq-mean-token-sum)
    # | sequence_sum_norm (Dr. GRPO: the mean over sequences of token sum / max_new_tokens; verl's seq-mean-token-sum-norm
    # sums over its micro-batch's sequences instead, which scales its loss by ppo_micro_batch_size_per_gpu)
    loss_aggregation: str = "token"
    advantage_std_normalize: bool = True
    kl_coef: float = 0.0  # > 0 keeps a frozen reference policy
    kl_estimator: str = "k3"  # k1 (verl kl) | k2 (mse) | k3 (low_var_kl, clamped as it) | abs | k1+ | k3+ (k2 gradient)
    entropy_coeff: float = 0.0  # entropy bonus (verl actor.entropy_coeff): the loss subtracts it x the entropy
    remat: bool = False  # recompute layer activations in the backward pass
    drafter_path: str = ""  # drafter checkpoint for sd.mode != off; '' = randomly initialised (lossless, slow)
    out_dir: str = "runs/grpo"  # checkpoints, metrics.jsonl, tensorboard/
    checkpoint_every_steps: int = 1  # 0 disables checkpoints
    keep_checkpoints: int = 2
    eval_every_steps: int = 0  # held-out accuracy every N steps and at the end; 0 = never
    eval_prompts: int = 64
    eval_temperature: float = 0.0  # 0: greedy; > 0: sampled, the same seeds at every evaluation
    eval_top_p: float = 1.0  # sampled evaluation's own top-p / top-k (verl val_kwargs), not training's
    eval_top_k: int = 0
    eval_samples: int = 1  # samples per held-out prompt (eval_temperature > 0); accuracy is their mean
    tensorboard: bool = True
    wandb_project: str = ""  # Weights & Biases project of the metrics ('' off; pip install 'fastrl-jax[wandb]')

    def __post_init__(self):
        _check_choice("rl.loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS)
        _check_choice("rl.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("rl.filter_groups_metric", self.filter_groups_metric, ("accuracy", "reward"))
        _check_at_least("rl", self, ("steps", "prompts_per_step", "max_new_tokens", "minibatches_per_step",
                                     "micro_batch_size", "keep_checkpoints", "eval_prompts", "eval_samples"), 1)
        _check_at_least("rl", self, ("max_gen_batches",), 0)
        if self.samples_per_prompt < 2:
            raise ConfigError(f"rl.samples_per_prompt must be >= 2 (GRPO compares samples of a prompt), got {self.samples_per_prompt}")
        for problem in (temperature_problem("rl.temperature", self.temperature, greedy=False),
                        temperature_problem("rl.eval_temperature", self.eval_temperature)):
            if problem:
                raise ConfigError(problem)
        if not (0 < self.top_p <= 1 and 0 < self.eval_top_p <= 1) or self.top_k < 0 or self.eval_top_k < 0:
            raise ConfigError(f"rl needs 0 < top_p, eval_top_p <= 1 and top_k, eval_top_k >= 0; got {self.top_p}, "
                              f"{self.eval_top_p}, {self.top_k}, {self.eval_top_k}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0 or self.kl_coef < 0 or self.entropy_coeff < 0:
            raise ConfigError(f"rl needs 0 <= clip_low < 1, clip_high >= 0, kl_coef >= 0, entropy_coeff >= 0; got "
                              f"{self.clip_low}, {self.clip_high}, {self.kl_coef}, {self.entropy_coeff}")
        if self.clip_ratio_c != 0 and not self.clip_ratio_c > 1:
            raise ConfigError(f"rl.clip_ratio_c (dual-clip PPO's bound) must be > 1, or 0 for off; got {self.clip_ratio_c}")
        if self.checkpoint_every_steps < 0 or self.eval_every_steps < 0:
            raise ConfigError("rl.checkpoint_every_steps and rl.eval_every_steps must be >= 0")
        out = Path(self.out_dir).expanduser()
        # '.', '/', '..' and '~' are no run's own directory (--overwrite moves a run's files out of it)
        if out.name in ("", "..") or out.absolute() == Path.home().absolute():
            raise ConfigError(f"rl.out_dir must name the run's own directory (e.g. runs/grpo), got {self.out_dir!r}")
        _check_local_dir("rl.out_dir", self.out_dir)
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ConfigError(f"rl.eval_temperature must be > 0 for rl.eval_samples > 1 (greedy samples are all the "
                              f"same); got {self.eval_temperature} with {self.eval_samples} samples")
        sequences = self.prompts_per_step * self.samples_per_prompt
        if sequences % (self.minibatches_per_step * self.micro_batch_size):
            raise ConfigError(
                f"rl.prompts_per_step x rl.samples_per_prompt = {sequences} sequences must split into "
                f"rl.minibatches_per_step ({self.minibatches_per_step}) mini-batches of whole "
                f"rl.micro_batch_size ({self.micro_batch_size}) micro-batches"
            )


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    """Warm-up training of the EAGLE drafter on the policy's own generations (`fastrl-jax train-drafter`)."""

    out_dir: str = "~/.cache/fastrl_jax/drafters/smollm2"  # run dir: data, checkpoints, metrics, drafter/
    # "eagle": fc(embed, last hidden state) + SmoothL1 + CE; "eagle3": fc over three policy layers' features,
    # cross-entropy on the policy's tokens only (models/drafter.py). A loaded drafter keeps its own kind.
    # eagle accepted more on a small SmolLM2 warm-up (docs/measurements.md), so it stays the default.
    kind: str = "eagle"
    prompts: str = "builtin"  # 'builtin' (math problems + general chat) or a JSONL file of {"prompt": text}
    num_prompts: int = 512  # prompts generated from (before samples_per_prompt)
    chat_fraction: float = 0.5  # builtin: share of general chat prompts, the rest math problems
    instruction: str = "Put the final answer after 'The answer is'."  # builtin: appended to math prompts
    samples_per_prompt: int = 1
    max_new_tokens: int = 256
    temperature: float = 0.7  # generation temperature of the training data
    buffer_max_tokens: int = 1_000_000  # sample buffer bound (hidden states stored as float16)
    draft_vocab_size: int = 8192  # reduced draft vocabulary: most frequent completion tokens; 0 = full vocab
    steps: int = 2000  # optimizer steps
    batch_rows: int = 8  # packed rows per step
    seq_len_tokens: int = 512  # tokens per packed row
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.5  # 0 disables clipping
    ce_weight: float = 0.1  # loss = SmoothL1(features) + ce_weight x CE(policy's next-token distribution)
    input_noise: float = 0.1  # input features get uniform noise in [-input_noise, input_noise]
    unroll_steps: int = 2  # 1 = EAGLE; k > 1 also trains on the drafter's own predictions k - 1 deep
    unroll_decay: float = 0.8  # weight of unroll step j is unroll_decay ** j
    log_every_steps: int = 10
    eval_every_steps: int = 500  # held-out acceptance length; 0 = only at the end
    eval_prompts: int = 4  # per held-out set (math, chat)
    eval_max_new_tokens: int = 96
    eval_strategy: tuple[int, ...] = (6, 4, 16)  # [steps, topk, verify_tokens] of the eval draft tree
    checkpoint_every_steps: int = 250
    keep_checkpoints: int = 2
    tensorboard: bool = True
    wandb_project: str = ""  # Weights & Biases project of the metrics ('' off; pip install 'fastrl-jax[wandb]')

    def __post_init__(self):
        key = "drafter_train."
        if not self.out_dir:
            raise ConfigError(f"{key}out_dir must be a directory path")
        _check_local_dir(f"{key}out_dir", self.out_dir)
        if self.prompts != "builtin" and not self.prompts.endswith(".jsonl"):
            raise ConfigError(f"{key}prompts must be 'builtin' or a .jsonl file, got {self.prompts!r}")
        if self.kind not in ("eagle", "eagle3"):
            raise ConfigError(f"{key}kind must be 'eagle' or 'eagle3', got {self.kind!r}")
        _check_at_least("drafter_train", self, (
            "num_prompts", "samples_per_prompt", "max_new_tokens", "steps", "batch_rows", "log_every_steps",
            "checkpoint_every_steps", "keep_checkpoints", "eval_max_new_tokens", "unroll_steps"), 1)
        _check_at_least("drafter_train", self, (
            "warmup_steps", "eval_every_steps", "eval_prompts", "draft_vocab_size",
            "weight_decay", "grad_clip_norm", "ce_weight", "input_noise"), 0)
        if problem := temperature_problem(f"{key}temperature", self.temperature):
            raise ConfigError(problem)
        if self.learning_rate <= 0:
            raise ConfigError(f"{key}learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.chat_fraction <= 1 or not 0 < self.unroll_decay <= 1:
            raise ConfigError(f"{key}chat_fraction must be in [0, 1] and unroll_decay in (0, 1]; "
                              f"got {self.chat_fraction}, {self.unroll_decay}")
        if self.seq_len_tokens < 8:
            raise ConfigError(f"{key}seq_len_tokens must be >= 8, got {self.seq_len_tokens}")
        if self.buffer_max_tokens < self.seq_len_tokens:
            raise ConfigError(f"{key}buffer_max_tokens ({self.buffer_max_tokens}) must be >= seq_len_tokens ({self.seq_len_tokens})")
        if len(self.eval_strategy) != 3:
            raise ConfigError(f"{key}eval_strategy must be [steps, topk, verify_tokens], got {list(self.eval_strategy)}")
        try:
            SpecConfig(mode="on", steps=self.eval_strategy[0], topk=self.eval_strategy[1], verify_tokens=self.eval_strategy[2])
        except ConfigError as e:
            raise ConfigError(f"{key}eval_strategy: {e}") from None
        if 0 < self.draft_vocab_size < self.eval_strategy[1]:  # else it fails at the first evaluation, after training
            raise ConfigError(f"{key}eval_strategy's top-k ({self.eval_strategy[1]}) exceeds draft_vocab_size "
                              f"({self.draft_vocab_size}): the drafter could not propose that many tokens")


@dataclasses.dataclass(frozen=True)
class DrafterOnlineConfig:
    """Online ("spot") drafter training during RL rollouts, on devices the rollout leaves idle.

    Active when sd.mode is not off. The loss and optimizer settings not named here (ce_weight,
    input_noise, unroll, weight decay, clipping) come from drafter_train.
    """

    enabled: bool = True
    buffer_max_tokens: int = 200_000  # tokens of (prompt + completion) with hidden states held (float16)
    keep_steps: int = 4  # train on the latest this many RL steps' rollouts
    min_buffer_tokens: int = 256  # no drafter step before the buffer holds this many tokens
    batch_rows: int = 4  # packed rows per drafter step (split over the data-parallel lent replicas)
    seq_len_tokens: int = 256  # tokens per packed row; with batch_rows, this sets a step's duration
    learning_rate: float = 5.0e-5  # 3e-4 made a warm-up drafter worse on SmolLM2 (closing note of issue 8)
    warmup_steps: int = 10  # then constant
    min_idle_replicas: int = 1  # several replicas: lend devices once this many replicas are idle
    max_steps_per_rollout: int = 0  # drafter steps per RL step at most (each process's); 0 = as many as the idle time allows
    tail_time_share: float = 0.25  # one replica: drafter steps may take this share of the rollout's wall time so far, in its tail
    # One replica: 'saved' spends on drafter steps (and on acceptance estimates) only the seconds speculation
    # saved against plain decoding so far in the run, so adaptive SD never costs more than SD off; 'share'
    # gives them tail_time_share of every rollout, an investment that pays once the drafter has learned.
    tail_budget: str = "saved"
    tail_live_batch: int = 8  # one replica: drafter steps interleave while the live batch is at most this
    preempt_bound_s: float = 10.0  # handing the devices back may take this long (one drafter step); warn above
    eval_depth: int = 4  # chain depth of the per-step acceptance estimate on the step's own rollouts
    eval_rows: int = 8  # packed rows of the estimate (seq_len_tokens each)
    frozen_eval_every_steps: int = 5  # the starting drafter's acceptance too, every N RL steps; 0 = never

    def __post_init__(self):
        _check_choice("drafter_online.tail_budget", self.tail_budget, ("saved", "share"))
        _check_at_least("drafter_online", self, ("keep_steps", "batch_rows", "min_idle_replicas",
                                                 "eval_depth", "eval_rows"), 1)
        _check_at_least("drafter_online", self, ("min_buffer_tokens", "warmup_steps", "max_steps_per_rollout",
                                                 "tail_live_batch", "frozen_eval_every_steps"), 0)
        if self.seq_len_tokens < 8 or self.buffer_max_tokens < self.seq_len_tokens:
            raise ConfigError(f"drafter_online needs seq_len_tokens >= 8 and buffer_max_tokens >= seq_len_tokens; "
                              f"got {self.seq_len_tokens}, {self.buffer_max_tokens}")
        if self.learning_rate <= 0 or self.preempt_bound_s <= 0 or not 0 <= self.tail_time_share < 1:
            raise ConfigError(f"drafter_online needs learning_rate > 0, preempt_bound_s > 0, 0 <= tail_time_share < 1; "
                              f"got {self.learning_rate}, {self.preempt_bound_s}, {self.tail_time_share}")
        if self.min_buffer_tokens > self.buffer_max_tokens:  # here, not at the start: a dry run plans it otherwise
            raise ConfigError(f"drafter_online.min_buffer_tokens ({self.min_buffer_tokens}) exceeds buffer_max_tokens "
                              f"({self.buffer_max_tokens}): the buffer never holds that many, so the drafter would never train")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run: one field per section (YAML top-level key)."""

    model: ModelSpec = ModelSpec()
    mesh: MeshConfig = MeshConfig()
    rollout: RolloutConfig = RolloutConfig()
    sd: SpecConfig = SpecConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    optim: OptimConfig = OptimConfig()
    rl: RLConfig = RLConfig()
    drafter_train: DrafterTrainConfig = DrafterTrainConfig()
    drafter_online: DrafterOnlineConfig = DrafterOnlineConfig()
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.seed < 2**32:  # numpy's and the request seeds' range
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")


_TYPE_NAMES = {int: "an int", float: "a float", str: "a string", bool: "a bool (true or false)"}


def from_dict(cls, data: Any, path: str = ""):
    """Builds dataclass `cls` from nested dicts; `path` is the dotted key of `data` used in messages."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'the config'} must be a mapping of keys to values, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1) or [f for f in fields if f == str(key).lower()]
            prefix = f"{path}." if path else ""
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown key '{dotted}' ({hint}allowed: {', '.join(fields)})")
        kwargs[key] = _convert(hints[key], value, dotted)
    for name, field in fields.items():
        no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if no_default and name not in kwargs:
            raise ConfigError(f"{path + '.' if path else ''}{name} is required")
    return cls(**kwargs)


def _convert(hint: Any, value: Any, key: str) -> Any:
    """`value` checked against (and, for tuples and floats, converted to) the field type `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, {} if value is None else value, key)  # an empty `section:` (all keys commented out)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"config field {key}: only Optional[X] unions are supported, got {hint}")
        return None if value is None else _convert(rest[0], value, key)
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"config field {key}: only tuple[X, ...] is supported, got {hint}")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hasattr(hint, "from_config"):  # a type with its own notation (StrategySpec)
        return hint.from_config(value, key)
    if hint not in _TYPE_NAMES:
        raise TypeError(f"config field {key}: unsupported type {hint}")
    wrong = ConfigError(f"{key} must be {_TYPE_NAMES[hint]}, got {value!r}")
    # bool is a subclass of int: `true` must not pass as 1.
    if isinstance(value, bool) and hint is not bool:
        raise wrong
    if hint is float and isinstance(value, (int, float, str)):
        # Strings too: PyYAML follows YAML 1.1, which reads `1e-4` (no dot) as a string.
        try:
            value = float(value)
        except ValueError:
            raise wrong from None
        # No setting means NaN or infinity, and a NaN passes every `x <= 0` check below it (a NaN learning
        # rate trained to a checkpoint of NaN weights).
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return value
    if hint is str and isinstance(value, (dict, list)):  # an override's unquoted `a: b` or `- a`
        raise ConfigError(f"{key} must be a string, got {value!r}: YAML reads ': ', '- ' and '[' as structure; quote the "
                          f"value ({key}='...')")
    if not isinstance(value, hint):
        raise wrong
    return value


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans (true/false only) and integers (decimal, 0x, 0o), and no
    timestamps. Under YAML 1.1's rules, on/off/yes/no are booleans too, so `sd.mode=off` or `mode: on` would
    reach a string field as False/True; `010` is octal 8, `1:30` base-60 90, and `rl.out_dir=2026-11-27` a date.
    A key given twice in one mapping is an error, as in YAML 1.2 (PyYAML keeps the last: a second `rl:` section
    would silently drop every key of the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


_BOOL, _INT, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT, "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
# YAML 1.1's floats but base 60 (1:30.0 was 90.0)
_Loader.add_implicit_resolver(_FLOAT, re.compile(r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]"
                                                 r"[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
# Digit separators as in Python (`200_000`); ints resolve before floats, which start with the same characters.
for _first, _resolvers in _Loader.yaml_implicit_resolvers.items():
    if _first in "-+0123456789":
        _resolvers.insert(0, (_INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$")))
_Loader.add_constructor(_INT, lambda loader, node: int(loader.construct_scalar(node).replace("_", ""),
                                                       16 if "x" in node.value else 8 if "o" in node.value else 10))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _apply_override(data: dict, override: str) -> None:
    """Sets `a.b.c=value` in nested dicts; the value is parsed as YAML (ints, floats, bools, lists)."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"override {override!r} must look like section.key=value, e.g. mesh.tensor=2")
    node = data
    for depth, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent, or an empty `section:` in the YAML
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
    try:
        # An empty value means the empty string, so `key=` can clear a path setting.
        value = _load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({_yaml_error(e)})") from e
    if "#" in raw and "#" not in str(value):
        raise ConfigError(f"override {override!r}: YAML reads ' #' as the start of a comment; quote the value "
                          f"({parts[-1]}='...')")
    if isinstance(value, str) and any(ord(c) < 32 and c not in raw for c in value):
        # verl's Hydra keeps "...\boxed{}" as written; YAML's double quotes make \b a backspace
        raise ConfigError(f"override {override!r}: in double quotes YAML reads a backslash as an escape (\\b is a "
                          f"backspace); use single quotes to keep it ({parts[-1]}='...')")
    node[parts[-1]] = value


def _yaml_error(e: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong, and where."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}"


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML file (or starts from the defaults when None), applies `a.b=value` overrides, validates."""
    data: Any = {}
    if path is not None:
        path = Path(path).expanduser()  # --config=~/x.yaml: the shell expands no ~ after '='
        if not path.is_file():
            raise ConfigError(f"config file '{path}' {'is a directory' if path.is_dir() else 'not found'}")
        try:
            data = _load_yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {_yaml_error(e)}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start}: {e.reason})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {data!r}")
    for override in overrides:
        _apply_override(data, override)
    return from_dict(Config, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts, for logging and checkpoint metadata."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Writes the resolved config (file plus overrides) as YAML that `load_config` reads back; atomically (a
    temporary file, then a rename), so a kill mid-write leaves the run's previous config.yaml whole."""
    plain = json.loads(json.dumps(to_dict(cfg)))  # tuples -> lists: YAML's safe dumper has no tuples
    files.write_text(path, yaml.dump(plain, Dumper=_Dumper, sort_keys=False))


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting every string _Loader would read as something else: YAML 1.1's dumper writes
    '08' or '0o7' bare (no 1.1 number), which our YAML 1.2 integers read back as 8 and 7."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    try:
        plain = _load_yaml(text) == text
    except yaml.YAMLError:
        plain = False
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=None if plain else "'")


_Dumper.add_representer(str, _represent_str)
