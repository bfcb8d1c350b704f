"""The rollout engine: requests in, completions out, through bucketed compiled programs.

The host loop between program calls decides what runs next: admit queued requests into free rows
(prefill), harvest finished rows, compact the live rows into the smallest batch bucket that holds
them, then decode several steps on device until a row finishes.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import sys
import time
from collections import deque
from collections.abc import Sequence

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
        self.strategy = speculative.Strategy(sd.steps, sd.topk, sd.verify_tokens)
        if sd.mode != "off" and drafter is None:
            raise ValueError("speculative decoding needs a drafter (sd.mode is on)")
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
        self.pool = ProgramPool(self._build)
        self.stats: dict[str, float] = {}
        if cfg.warm_up:
            t0 = time.perf_counter()
            self.pool.warm_up(self.warm_up_keys(), progress)
            log.info("%s, wall %.1fs", self.pool.report(), time.perf_counter() - t0)

    # ---- programs -------------------------------------------------------------------------
    def warm_up_keys(self) -> list[tuple]:
        c = self.cfg
        phase = "decode" if self.sd.mode == "off" else "sd"
        keys = [(phase, b, n) for b in c.batch_buckets for n in c.length_buckets]
        if self.sd.mode != "off":
            keys += [("draft_prefill", b, n) for b in c.batch_buckets for n in c.length_buckets]
        keys += [("prefill", b, b, t) for b in c.batch_buckets for t in c.prompt_buckets]
        keys += [("resize", b, s) for b in c.batch_buckets for s in c.batch_buckets if s < b]
        return keys

    def _empty(self, batch: int) -> programs.Slots:
        slots = programs.Slots.empty(
            self.model_cfg, batch, self.max_len, self.cfg.max_stop_ids, self.keep_hidden, self.dtype
        )
        if self.sd.mode == "off":
            return slots
        st, H = self.strategy, self.model_cfg.hidden_size
        zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)  # noqa: E731
        draft = speculative.DraftState(
            cache=nnx.merge(self.drafter_graphdef, self.drafter_state).empty_cache(
                batch, self.max_len + st.scratch_slots, self.dtype
            ),
            pending_tok=zeros(batch, st.pending),
            pending_h=zeros(batch, st.pending, H, dtype=jnp.float32),
            n_pending=zeros(batch),
            sd_steps=zeros(batch),
            sd_tokens=zeros(batch),
        )
        return slots.replace(draft=draft)

    def _build(self, key: tuple):
        phase, batch = key[0], key[1]
        slots = jax.eval_shape(lambda: self._empty(batch))
        slots = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._replicated), slots)
        if phase == "decode":
            fn = jax.jit(programs.decode, static_argnums=(0, 4), donate_argnums=(2,))
            steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
            return fn, (self.graphdef, self.state, slots, steps, key[2])
        if phase == "prefill":
            _, _, p, t = key
            adm = self._admission_shapes(p, t)
            fn = jax.jit(programs.prefill, static_argnums=(0,), donate_argnums=(2,))
            return fn, (self.graphdef, self.state, slots, adm)
        if phase == "sd":
            fn = jax.jit(speculative.sd_program, static_argnums=(0, 2, 6, 7, 8), donate_argnums=(4,))
            steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
            args = (self.graphdef, self.state, self.drafter_graphdef, self.drafter_state, slots, steps)
            return fn, (*args, self.strategy, key[2], self.sd.accept)
        if phase == "draft_prefill":
            fn = jax.jit(speculative.drafter_prefill_program, static_argnums=(0, 2, 5), donate_argnums=(4,))
            return fn, (self.graphdef, self.state, self.drafter_graphdef, self.drafter_state, slots, key[2])
        if phase == "resize":
            index = jax.ShapeDtypeStruct((key[2],), jnp.int32, sharding=self._replicated)
            return jax.jit(programs.resize), (slots, index)
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
        margin = 0 if self.sd.mode == "off" else self.strategy.verify_tokens - 1
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

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Completes every request; a request that cannot run gets finish_reason 'error', the rest still run."""
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
        counts = {"prefill_calls": 0, "decode_calls": 0, "resizes": 0, "tokens": 0, "sd_steps": 0, "sd_tokens": 0}
        t_start = time.perf_counter()
        bar = tqdm(total=len(pending), desc="rollout", unit="req", file=sys.stderr, disable=not self.progress)
        while True:
            free = [r for r in range(batch) if row_req[r] < 0]
            if pending and free:
                take = [pending.popleft() for _ in range(min(len(pending), len(free)))]
                adm, p, t = self._admission([requests[i] for i in take], free[: len(take)])
                slots = self.pool.get(("prefill", batch, p, t))(self.state, slots, adm)
                for row, i in zip(free, take):
                    row_req[row] = i
                counts["prefill_calls"] += 1
                if self.sd.mode != "off":
                    longest = int(max(len(requests[row_req[r]].prompt_ids) for r in range(batch) if row_req[r] >= 0))
                    live_len = int(jax.device_get(jnp.max(slots.length)))
                    kv = bucket_for(max(longest, live_len) + 1, c.length_buckets)
                    slots = self.pool.get(("draft_prefill", batch, kv))(
                        self.state, self.drafter_state, slots
                    )
            live, length = jax.device_get((slots.live, slots.length))
            done = [r for r in range(batch) if row_req[r] >= 0 and not live[r]]
            if done:
                for r, completion in zip(done, self._harvest(slots, done, requests, row_req)):
                    results[row_req[r]] = completion
                    counts["tokens"] += len(completion.tokens)
                    row_req[r] = -1
                if slots.draft is not None:
                    steps, toks = jax.device_get((slots.draft.sd_steps[np.asarray(done)], slots.draft.sd_tokens[np.asarray(done)]))
                    counts["sd_steps"] += int(steps.sum())
                    counts["sd_tokens"] += int(toks.sum())
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
                slots = self.pool.get(("resize", batch, target))(slots, jax.device_put(index, self._replicated))
                row_req = [row_req[r] for r in live_rows] + [-1] * (target - len(live_rows))
                length = length[live_rows]
                batch = target
                counts["resizes"] += 1
            longest = int(max(length[r] for r in range(batch) if row_req[r] >= 0))
            if self.sd.mode == "off":
                kv_len = bucket_for(longest + 1, c.length_buckets)
                steps = min(c.steps_per_call, kv_len - longest)
                slots = self.pool.get(("decode", batch, kv_len))(self.state, slots, jnp.int32(steps))
            else:
                n, depth = self.strategy.verify_tokens, self.strategy.steps
                kv_len = bucket_for(min(longest + n, self.max_len), c.length_buckets)
                steps = min(c.steps_per_call, (kv_len - longest - n) // (depth + 1) + 1)
                slots = self.pool.get(("sd", batch, kv_len))(
                    self.state, self.drafter_state, slots, jnp.int32(steps)
                )
            counts["decode_calls"] += 1
        bar.close()
        counts["seconds"] = time.perf_counter() - t_start
        if counts["sd_steps"]:
            counts["acceptance_length"] = counts["sd_tokens"] / counts["sd_steps"]
        self.stats = counts
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
