"""The rollout engine: requests in, completions out, through bucketed compiled programs.

The host loop between program calls decides what runs next: admit queued requests into free rows
(prefill), harvest finished rows, compact the live rows into the smallest batch bucket that holds
them, then run several steps on device until a row finishes: plain decoding, or speculative steps
with a draft-tree strategy (sd.mode 'on' always; 'adaptive' as the controller decides from the
live batch). Speculation starting mid-generation first rebuilds the drafter's cache from the
stored policy hidden states (the draft_prefill program), never re-running the policy.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from fastrl_jax.config import RolloutConfig, SpecConfig
from fastrl_jax.models.decoder import Decoder
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout import programs, speculative
from fastrl_jax.rollout.controller import OnOff, StrategyChooser
from fastrl_jax.rollout.pool import ProgramPool, enable_persistent_cache
from fastrl_jax.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: Sequence[int]
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: Sequence[int] = ()


@dataclasses.dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop", "length" or "error"
    error: str | None = None
    # [len(prompt) + len(tokens) - 1, hidden] last-layer hidden state of every token fed to the
    # policy (all but the last completion token); only when the engine keeps hidden states.
    hidden_states: np.ndarray | None = None


def strategy_label(s: speculative.Strategy) -> str:
    """'steps/topk/verify_tokens', the notation of stats keys and timelines."""
    return f"{s.steps}/{s.topk}/{s.verify_tokens}"


def acceptance_length(stats: dict[str, float], label: str = "") -> float:
    """Tokens per speculative row-step in an engine's stats (or several rollouts' summed stats), of
    all strategies or of the one labelled `label`; NaN without speculative steps."""
    suffix = f"[{label}]" if label else ""
    steps = stats.get("sd_steps" + suffix, 0)
    return float(stats["sd_tokens" + suffix] / steps) if steps else float("nan")


def add_stats(total: dict[str, float], stats: dict[str, float]) -> None:
    """Adds one rollout's counters and seconds into `total`; the acceptance_length ratio is left out
    (acceptance_length(total) gives it from the sums)."""
    for k, v in stats.items():
        if k != "acceptance_length":
            total[k] = total.get(k, 0) + v


def acceptance_by_strategy(stats: dict[str, float]) -> dict[str, float]:
    """Acceptance length of each strategy in an engine's stats."""
    labels = [k.removeprefix("sd_steps[").removesuffix("]") for k, v in stats.items() if k.startswith("sd_steps[") and v]
    return {label: acceptance_length(stats, label) for label in labels}


def compiler_options(key: tuple) -> dict | None:
    """XLA options of a pool program. On CPU, YNNPACK fusion (XLA's default) runs the small-M weight
    dots of narrow batches and tree verification about 2x faster, but in wide programs over long
    windows its batched attention dots ran ~2.5x slower (SmolLM2 decode step, batch 64: 918 vs 362 ms
    at 640 slots, 130 vs 169 ms at 160; batch 16 at 640 slots equal; batch 4: 36 vs 76 ms). Decode and
    speculative programs of batch >= 32 over more than 512 slots compile without it."""
    phase = key[0]
    if jax.default_backend() != "cpu" or phase not in ("decode", "sd", "draft_prefill"):
        return None
    batch, kv_len = key[1], key[2]
    return {"xla_cpu_experimental_ynn_fusion_type": ""} if batch >= 32 and kv_len > 512 else None


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class RolloutEngine:
    """Generates completions for many requests at once on one model replica."""

    def __init__(
        self,
        model: Decoder,
        cfg: RolloutConfig,
        *,
        sd: SpecConfig = SpecConfig(),
        drafter: Drafter | None = None,
        keep_hidden: bool = False,
        progress: bool = True,
    ):
        self.cfg = cfg
        self.model_cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self.dtype = model.embed.get_value().dtype
        self.sd = sd
        if sd.mode != "off" and drafter is None:
            raise ValueError(f"speculative decoding needs a drafter (sd.mode is {sd.mode})")
        self.strategies = [speculative.Strategy(*s) for s in sd.strategy_list()] if sd.mode != "off" else []
        self.onoff = OnOff(sd.threshold_live_batch, sd.patience_host_steps)
        # The bandit outlives a rollout: what it learned carries over to the next RL step.
        ranges = sd.live_batch_ranges() if sd.mode == "adaptive" else {}
        self.chooser = StrategyChooser(
            self.strategies, ranges, sd.bandit, sd.epsilon, sd.window_host_steps, sd.bandit_seed
        ) if ranges else None
        self.drafter_graphdef, self.drafter_state = nnx.split(drafter) if drafter is not None else (None, None)
        # Speculation restarts the drafter from stored policy hidden states, so it keeps them.
        self.keep_hidden = keep_hidden or sd.mode != "off"
        self.progress = progress
        self.max_len = cfg.length_buckets[-1]
        weights = jax.tree.leaves(self.state)[0].sharding
        # Row tables live replicated on the model's devices.
        self._replicated = (
            NamedSharding(weights.mesh, PartitionSpec()) if isinstance(weights, NamedSharding) else weights
        )
        if cfg.compile_cache_dir:
            enable_persistent_cache(cfg.compile_cache_dir)
        self.pool = ProgramPool(self._build, compiler_options)
        self.stats: dict[str, float] = {}  # the last rollout's counters and seconds (summable across rollouts)
        # The last rollout, one entry per program call: (seconds since start at its end, live batch,
        # tokens it emitted, speculative, strategy label or "").
        self.timeline: list[tuple[float, int, int, bool, str]] = []
        if cfg.warm_up:
            t0 = time.perf_counter()
            self.pool.warm_up(self.warm_up_keys(), progress)
            report = self.pool_report()
            log.info("%s; wall %.1fs", report, time.perf_counter() - t0)
            if progress:
                print(f"[rollout] {report}", file=sys.stderr)

    # ---- programs -------------------------------------------------------------------------
    def strategy_buckets(self) -> dict[speculative.Strategy, list[int]]:
        """The batch buckets each strategy can run at: all with sd.mode 'on', its group's range when adaptive."""
        buckets = self.cfg.batch_buckets
        if self.chooser is None:
            return {s: list(buckets) for s in self.strategies}
        out = {}
        for s in self.strategies:
            lo, hi = self.chooser.ranges[s.verify_tokens]
            hi = min(hi, self.sd.threshold_live_batch, buckets[-1])  # SD never runs above the threshold
            out[s] = [b for b in buckets if bucket_for(lo, buckets) <= b <= bucket_for(hi, buckets)] if lo <= hi else []
        return out

    def warm_up_keys(self) -> list[tuple]:
        c = self.cfg
        keys = []
        if self.sd.mode != "on":
            keys += [("decode", b, n) for b in c.batch_buckets for n in c.length_buckets]
        sd_buckets = set()
        for s, buckets in self.strategy_buckets().items():
            keys += [("sd", b, n, s) for b in buckets for n in c.length_buckets]
            sd_buckets.update(buckets)
        keys += [("draft_prefill", b, n) for b in sorted(sd_buckets) for n in c.length_buckets]
        keys += [("prefill", b, b, t) for b in c.batch_buckets for t in c.prompt_buckets]
        keys += [("resize", b, s) for b in c.batch_buckets for s in c.batch_buckets if s < b]
        return keys

    def pool_report(self) -> str:
        """The compiled pool, and each strategy's share of it."""
        parts = [self.pool.report()]
        for s in self.strategies:
            parts.append(f"strategy {strategy_label(s)}: {self.pool.report(lambda k, s=s: k[0] == 'sd' and k[3] == s)}")
        return "; ".join(parts)

    def _empty(self, batch: int) -> programs.Slots:
        slots = programs.Slots.empty(
            self.model_cfg, batch, self.max_len, self.cfg.max_stop_ids, self.keep_hidden, self.dtype
        )
        if self.sd.mode == "off":
            return slots
        # One draft state serves every strategy: sized for the deepest tree and the most scratch.
        pending = max(s.pending for s in self.strategies)
        scratch = max(s.scratch_slots for s in self.strategies)
        drafter = nnx.merge(self.drafter_graphdef, self.drafter_state)
        draft = speculative.DraftState.empty(
            drafter.empty_cache(batch, self.max_len + scratch, self.dtype), pending, self.model_cfg.hidden_size
        )
        return slots.replace(draft=draft)

    def _build(self, key: tuple):
        phase, batch = key[0], key[1]
        slots = jax.eval_shape(lambda: self._empty(batch))
        slots = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._replicated), slots)
        # Outputs pinned to the row table's sharding: left free, XLA may shard e.g. hidden states like
        # the weights (fsdp), and the next program, compiled for replicated inputs, would reject them.
        out = self._replicated
        if phase == "decode":
            fn = jax.jit(programs.decode, static_argnums=(0, 4), donate_argnums=(2,), out_shardings=out)
            steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
            return fn, (self.graphdef, self.state, slots, steps, key[2])
        if phase == "prefill":
            _, _, p, t = key
            adm = self._admission_shapes(p, t)
            fn = jax.jit(programs.prefill, static_argnums=(0,), donate_argnums=(2,), out_shardings=out)
            return fn, (self.graphdef, self.state, slots, adm)
        if phase == "sd":
            fn = jax.jit(speculative.sd_program, static_argnums=(0, 2, 6, 7, 8), donate_argnums=(4,), out_shardings=out)
            steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
            args = (self.graphdef, self.state, self.drafter_graphdef, self.drafter_state, slots, steps)
            return fn, (*args, key[3], key[2], self.sd.accept)
        if phase == "draft_prefill":
            fn = jax.jit(speculative.drafter_prefill_program, static_argnums=(0, 2, 5), donate_argnums=(4,), out_shardings=out)
            return fn, (self.graphdef, self.state, self.drafter_graphdef, self.drafter_state, slots, key[2])
        if phase == "resize":
            index = jax.ShapeDtypeStruct((key[2],), jnp.int32, sharding=self._replicated)
            return jax.jit(programs.resize, out_shardings=out), (slots, index)
        raise KeyError(key)

    def _admission_shapes(self, p: int, t: int):
        i32, f32 = jnp.int32, jnp.float32

        def s(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

        return programs.Admission(
            rows=s((p,), i32), valid=s((p,), bool), tokens=s((p, t), i32), lengths=s((p,), i32),
            max_new=s((p,), i32), stop_ids=s((p, self.cfg.max_stop_ids), i32),
            params=SamplingParams(s((p,), f32), s((p,), i32), s((p,), f32), s((p,), jnp.uint32)),
        )

    def update_drafter(self, drafter: Drafter) -> None:
        """Swaps in new drafter weights; every compiled program is reused."""
        graphdef, state = nnx.split(drafter)
        if graphdef != self.drafter_graphdef:
            raise ValueError("update_drafter needs a drafter of the same structure as the engine's")
        self.drafter_state = state

    def update_weights(self, model: Decoder) -> None:
        """Swaps in new policy weights (same shapes and shardings); every compiled program is reused."""
        graphdef, state = nnx.split(model)
        if graphdef != self.graphdef:
            raise ValueError("update_weights needs a model of the same structure as the engine's")
        self.state = state

    # ---- requests -------------------------------------------------------------------------
    def validate(self, r: Request) -> str | None:
        """The reason a request cannot run, or None."""
        n, c, vocab = len(r.prompt_ids), self.cfg, self.model_cfg.vocab_size
        if n == 0:
            return "the prompt is empty"
        if n > c.prompt_buckets[-1]:
            return f"the prompt has {n} tokens, more than the largest prompt bucket ({c.prompt_buckets[-1]}); raise rollout.prompt_buckets"
        if r.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {r.max_new_tokens}"
        # A speculative step writes its whole draft tree after the last token.
        margin = max((s.verify_tokens - 1 for s in self.strategies), default=0)
        if n + r.max_new_tokens + margin > self.max_len:
            extra = f" + {margin} draft-tree slots" if margin else ""
            return (
                f"prompt ({n}) + max_new_tokens ({r.max_new_tokens}){extra} exceeds the KV cache ({self.max_len} "
                "slots, the largest rollout.length_buckets entry)"
            )
        if any(not 0 <= t < vocab for t in r.prompt_ids):
            return f"prompt token ids must be in [0, {vocab})"
        bad = [t for t in r.stop_ids if not 0 <= t < vocab]
        if bad:
            return f"unknown stop token ids {bad}: the vocabulary has {vocab} tokens"
        if len(r.stop_ids) > c.max_stop_ids:
            return f"{len(r.stop_ids)} stop ids, more than rollout.max_stop_ids={c.max_stop_ids}"
        if r.temperature < 0 or r.top_k < 0 or not 0 < r.top_p <= 1:
            return f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1; got {r.temperature}, {r.top_k}, {r.top_p}"
        return None

    def _admission(self, reqs: list[Request], rows: list[int]) -> tuple[programs.Admission, int, int]:
        c = self.cfg
        p = bucket_for(len(reqs), c.batch_buckets)
        t = bucket_for(max(len(r.prompt_ids) for r in reqs), c.prompt_buckets)
        tokens = np.zeros((p, t), np.int32)
        stop = np.full((p, c.max_stop_ids), -1, np.int32)
        for i, r in enumerate(reqs):
            tokens[i, : len(r.prompt_ids)] = r.prompt_ids
            stop[i, : len(r.stop_ids)] = r.stop_ids

        def col(values, dtype, fill=0):
            out = np.full(p, fill, dtype)
            out[: len(reqs)] = values
            return out

        adm = programs.Admission(
            rows=col(rows, np.int32),
            valid=col([True] * len(reqs), bool, False),
            tokens=tokens,
            lengths=col([len(r.prompt_ids) for r in reqs], np.int32, 1),
            max_new=col([r.max_new_tokens for r in reqs], np.int32, 1),
            stop_ids=stop,
            params=SamplingParams(
                temperature=col([r.temperature for r in reqs], np.float32),
                top_k=col([r.top_k for r in reqs], np.int32),
                top_p=col([r.top_p for r in reqs], np.float32, 1.0),
                seed=col([r.seed % 2**32 for r in reqs], np.uint32),
            ),
        )
        return jax.device_put(adm, self._replicated), p, t

    def _plan(self, live_batch: int) -> speculative.Strategy | None:
        """The strategy of this host step's speculative steps, or None for plain decoding."""
        if self.sd.mode == "on":
            return self.strategies[0]
        if self.sd.mode == "adaptive" and self.onoff.update(live_batch):
            return self.chooser.choose(live_batch)
        return None

    def generate(self, requests: Sequence[Request], between_steps: Callable[[int], None] | None = None) -> list[Completion]:
        """Completes every request; a request that cannot run gets finish_reason 'error', the rest still run.

        between_steps(live_batch), when given, runs on the host after every decode call (the online
        drafter trainer interleaves its steps into the tail there)."""
        results: list[Completion | None] = [None] * len(requests)
        pending: deque[int] = deque()
        for i, r in enumerate(requests):
            error = self.validate(r)
            if error:
                results[i] = Completion([], [], "error", error)
            else:
                pending.append(i)
        if not pending:
            return results
        c = self.cfg
        batch = bucket_for(min(len(pending), c.batch_buckets[-1]), c.batch_buckets)
        slots = jax.device_put(self._empty(batch), self._replicated)
        row_req = [-1] * batch
        stats = _Stats(self.pool)
        self.onoff.reset()
        draft_fresh = False  # whether the drafter cache holds every row's prefix
        bar = tqdm(total=len(pending), desc="rollout", unit="req", file=sys.stderr, disable=not self.progress)
        while True:
            free = [r for r in range(batch) if row_req[r] < 0]
            if pending and free:
                take = [pending.popleft() for _ in range(min(len(pending), len(free)))]
                adm, p, t = self._admission([requests[i] for i in take], free[: len(take)])
                slots, _ = stats.run("prefill", self.pool.get(("prefill", batch, p, t)), self.state, slots, adm)
                for row, i in zip(free, take):
                    row_req[row] = i
                draft_fresh = False
            live, length = jax.device_get((slots.live, slots.length))
            before = _counters(slots)
            done = [r for r in range(batch) if row_req[r] >= 0 and not live[r]]
            if done:
                for r, completion in zip(done, self._harvest(slots, done, requests, row_req)):
                    results[row_req[r]] = completion
                    stats.add("tokens", len(completion.tokens))
                    row_req[r] = -1
                bar.update(len(done))
            live_rows = [r for r in range(batch) if row_req[r] >= 0]
            if not live_rows:
                if not pending:
                    break
                continue
            target = bucket_for(len(live_rows), c.batch_buckets)
            if not pending and target < batch:
                index = np.full(target, -1, np.int32)
                index[: len(live_rows)] = live_rows
                slots, _ = stats.run("resize", self.pool.get(("resize", batch, target)), slots,
                                     jax.device_put(index, self._replicated))
                row_req = [row_req[r] for r in live_rows] + [-1] * (target - len(live_rows))
                length = length[live_rows]
                before = np.pad(before[:, live_rows], ((0, 0), (0, target - len(live_rows))))
                batch = target
            longest = int(max(length[r] for r in range(batch) if row_req[r] >= 0))
            strategy = self._plan(len(live_rows))
            if strategy is None:
                kv_len = bucket_for(longest + 1, c.length_buckets)
                steps = min(c.steps_per_call, kv_len - longest)
                key, args = ("decode", batch, kv_len), (self.state, slots, jnp.int32(steps))
                draft_fresh = False  # plain steps leave the drafter behind
            else:
                if not draft_fresh:
                    kv = bucket_for(longest + 1, c.length_buckets)
                    slots, _ = stats.run("draft_prefill", self.pool.get(("draft_prefill", batch, kv)),
                                         self.state, self.drafter_state, slots)
                    draft_fresh = True
                n, depth = strategy.verify_tokens, strategy.steps
                kv_len = bucket_for(min(longest + n, self.max_len), c.length_buckets)
                steps = min(c.steps_per_call, (kv_len - longest - n) // (depth + 1) + 1)
                key = ("sd", batch, kv_len, strategy)
                args = (self.state, self.drafter_state, slots, jnp.int32(steps))
            program = self.pool.get(key)  # compiles outside the timed call when not warmed up
            slots, seconds = stats.run(key[0], program, *args)
            diff = _counters(slots) - before  # [2, B] tokens and speculative steps per row
            tokens, row_steps = (int(x) for x in diff.sum(1))
            if strategy is None:
                stats.add("steps_plain", int(diff[0].max()))
            else:
                label = strategy_label(strategy)
                stats.add("steps_sd", int(diff[1].max()))
                for suffix in ("", f"[{label}]"):
                    stats.add("sd_tokens" + suffix, tokens)
                    stats.add("sd_steps" + suffix, row_steps)
                stats.add(f"seconds_sd[{label}]", seconds)
                if self.chooser is not None:
                    self.chooser.record(strategy, tokens / seconds)  # accepted tokens x live rows / second
            stats.timeline.append(
                (stats.elapsed(), len(live_rows), tokens, strategy is not None, strategy_label(strategy) if strategy else "")
            )
            if between_steps is not None:
                between_steps(len(live_rows))
        bar.close()
        self.stats, self.timeline = stats.finish(), stats.timeline
        return results

    def _harvest(self, slots, rows: list[int], requests, row_req) -> list[Completion]:
        idx = np.asarray(rows)
        n_out, tokens, logprobs, length = jax.device_get(
            (slots.n_out[idx], slots.out_tokens[idx], slots.out_logprobs[idx], slots.length[idx])
        )
        hidden = jax.device_get(slots.hidden[idx]) if self.keep_hidden else None
        out = []
        for j, r in enumerate(rows):
            req = requests[row_req[r]]
            n = int(n_out[j])
            toks = tokens[j, :n].tolist()
            reason = "stop" if toks and toks[-1] in req.stop_ids else "length"
            h = hidden[j, : int(length[j])] if hidden is not None else None
            out.append(Completion(toks, logprobs[j, :n].tolist(), reason, hidden_states=h))
        return out


def _counters(slots: programs.Slots) -> np.ndarray:
    """[2, B] int64: completion tokens and speculative steps so far of every row."""
    if slots.draft is None:
        n_out = jax.device_get(slots.n_out)
        return np.stack([n_out, np.zeros_like(n_out)]).astype(np.int64)
    return np.stack(jax.device_get((slots.n_out, slots.draft.sd_steps))).astype(np.int64)


class _Stats:
    """One rollout's counters, seconds per phase, and timeline."""

    def __init__(self, pool: ProgramPool):
        self.pool, self.compile_seconds = pool, pool.compile_seconds()
        self.start = time.perf_counter()
        self.values: dict[str, float] = defaultdict(float)
        self.timeline: list[tuple[float, int, int, bool, str]] = []

    def add(self, key: str, n: float = 1) -> None:
        self.values[key] += n

    def run(self, phase: str, program, *args):
        """Runs a program to completion; returns (its output, seconds), counted under `phase`."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(program(*args))
        seconds = time.perf_counter() - t0
        self.add(f"{phase}_calls")
        self.add(f"seconds_{phase}", seconds)
        return out, seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def finish(self) -> dict[str, float]:
        out = dict(self.values)
        out["seconds"] = self.elapsed()
        out["seconds_compile"] = self.pool.compile_seconds() - self.compile_seconds
        out["seconds_host"] = out["seconds"] - sum(
            v for k, v in out.items() if k.startswith("seconds_") and "[" not in k
        )
        if out.get("sd_steps"):
            out["acceptance_length"] = acceptance_length(out)
        return out
