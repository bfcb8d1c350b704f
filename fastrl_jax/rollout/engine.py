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
import functools
import logging
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from fastrl_jax.config import RolloutConfig, SpecConfig
from fastrl_jax.models.decoder import Decoder, KVCache, unstack_layers
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout import history as history_lib
from fastrl_jax.rollout import programs, speculative
from fastrl_jax.rollout.controller import OnOff, StrategyChooser
from fastrl_jax.rollout.history import HistoryStore
from fastrl_jax.rollout.pool import ProgramPool, compile_error
from fastrl_jax.rollout.requests import draft_margin, request_problem
from fastrl_jax.rollout.sampling import SamplingParams
from fastrl_jax.rollout.stats import Call, Recorder, RolloutStats
from fastrl_jax.sharding import shardings_for

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
    # [len(prompt) + len(tokens) - 1, F] policy features (last-layer hidden state, or EAGLE-3's three
    # layers) of every token fed to the policy (all but the last completion token); only when the
    # engine keeps hidden states.
    hidden_states: np.ndarray | None = None


@functools.cache
def _past_context(max_len: int, context: int) -> None:
    log.warning("rollout.length_buckets reach %d positions, past the %d the model is made for (its config.json's "
                "max_position_embeddings, or a RoPE scaling's reach): tokens there are out of its training "
                "distribution; lower rollout.length_buckets / rl.max_new_tokens, or add RoPE scaling", max_len, context)


def compiler_options(key: tuple) -> dict | None:
    """XLA options of a pool program. On CPU, YNNPACK fusion (XLA's default) speeds up the small-M
    weight dots of narrow batches and tree verification, but slows the batched attention dots of wide
    programs over long windows (docs/measurements.md): decode and speculative programs of batch >= 32
    over more than 512 slots compile without it."""
    phase = key[0]
    if jax.default_backend() != "cpu" or phase not in ("decode", "decode_admit", "sd", "draft_prefill"):
        return None
    batch, kv_len = key[1], key[2]
    return {"xla_cpu_experimental_ynn_fusion_type": ""} if batch >= 32 and kv_len > 512 else None


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (buckets sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def pack_prompts(prompts: Sequence[Sequence[int]], capacity: int) -> list[list[int]]:
    """Indices of `prompts` in packs whose distinct prompts hold at most `capacity` tokens together (each
    prompt holds at most that many), first fit, longest first; a repeated prompt joins its first copy's pack."""
    packs: list[list[int]] = []
    room: list[int] = []
    where: dict[tuple[int, ...], int] = {}
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        key = tuple(prompts[i])
        j = where.get(key)
        if j is None:
            j = next((j for j, left in enumerate(room) if left >= len(key)), len(packs))
            if j == len(packs):
                packs.append([])
                room.append(capacity)
            room[j] -= len(key)
            where[key] = j
        packs[j].append(i)
    return packs


def pick_refill(prompts: Sequence[Sequence[int]], rows: int, buckets: Sequence[int]) -> list[int]:
    """Which `rows` of the queued `prompts` (the queue's first ones, its head first) a refill takes: the
    first `rows`, with later ones swapped in, best swap first, while that pads the refill's one pack less
    to its prompt bucket. The head always goes, so no request waits longer than its place in the queue.
    A refill whose prompts need more than one pack stays first come, first in."""
    keys = [tuple(p) for p in prompts]
    take, spare = list(range(rows)), list(range(rows, len(prompts)))
    copies = Counter(keys[i] for i in take)
    tokens = sum(map(len, copies))  # a repeated prompt is prefilled once

    def padding(n: int) -> float:
        return bucket_for(n, buckets) - n if n <= buckets[-1] else math.inf

    def swapped(a: int, b: int) -> int:  # the pack's tokens with take[a] swapped for spare[b]
        out, into = keys[take[a]], keys[spare[b]]
        return tokens - len(out) * (copies[out] == 1) + len(into) * (copies[into] == 0) if out != into else tokens

    best = padding(tokens)
    while 0 < best < math.inf:
        least = min(((padding(swapped(a, b)), a, b) for a in range(1, rows) for b in range(len(spare))), default=(best,))
        if least[0] >= best:
            break
        best, a, b = least
        tokens = swapped(a, b)
        copies[keys[take[a]]] -= 1
        copies[keys[spare[b]]] += 1
        take[a], spare[b] = spare[b], take[a]
    return sorted(take)


def shared_prefix_len(cfg: RolloutConfig, prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens a stream of `prompts` prefills once for all: their common prefix in multiples of
    rollout.shared_prefix_min, leaving every prompt a token of its own (0 for fewer than two prompts or a shorter
    prefix)."""
    block = cfg.shared_prefix_min
    if not block or len(prompts) < 2:
        return 0
    first, shortest = prompts[0], min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    n = min(n, cfg.length_buckets[-1] - cfg.prompt_buckets[-1])  # prefix + prompt bucket fit a row
    return n // block * block


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
        history: HistoryStore | None = None,
        feature_layers: tuple[int, ...] | None = None,
        drafter_accept: float = math.inf,
        shared_prefix: int | None = None,
    ):
        """keep_hidden: completions carry the policy's hidden states (features) on the host, the drafter's
        training data.
        history: earlier completions per prompt that history strategies draft from (the caller adds
        to it, e.g. the trainer after each RL step); within a call, finished siblings count anyway.
        feature_layers: the policy features kept as hidden states (Decoder capture indices; () the
        last-layer hidden state); None: the drafter's (Drafter.feature_layers), () without one.
        drafter_accept: the drafter's estimated tokens per step (set_drafter_accept); inf, trusted, by
        default; 1.0 for a randomly initialised one.
        shared_prefix: the leading prompt tokens the caller's streams share (shared_prefix_len of its prompts,
        e.g. a chat template's system turn): rollout.warm_up compiles the prefills that skip them, which every
        stream of such prompts runs, and not those of no prefix; and no stream skips more (one prompt's samples
        share all but its last tokens: skipping them would compile prefix and prefill programs in the rollout,
        and a repeated prompt is prefilled once anyway). None: each stream skips what its prompts share."""
        self.cfg = cfg
        self.model_cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self._policy_dtypes = _dtypes(self.state)
        self.unrolled = cfg.unrolled_layers(jax.default_backend())
        if self.unrolled:
            self.state = unstack_layers(self.state)
        self.dtype = model.embed.get_value().dtype
        self._set_up_speculation(sd, drafter, history, feature_layers, drafter_accept)
        # Speculation restarts the drafter from stored policy hidden states, so the table keeps them; completions
        # carry them to the host only when asked (the drafter's training data: up to ~84 MB a completion at 32B).
        self.keep_hidden = keep_hidden or self.uses_drafter
        self.return_hidden = keep_hidden
        self.progress = progress
        self.max_len = cfg.length_buckets[-1]
        if self.max_len > model.cfg.context_length:
            _past_context(self.max_len, model.cfg.context_length)
        self._place_on_devices()
        self.pool = ProgramPool(self._build, compiler_options, mesh=self.mesh)
        # Background compiles that failed in this rollout: their arms decode plainly there until the next one (a failure
        # may pass: a drop near the memory-map limit, a device out of memory), said once a program
        self._failed_compiles: set[tuple] = set()
        self._said_failed: set[tuple] = set()
        self._ran: set[tuple] = set()  # programs run at least once: a call that grows it was some program's first run
        self._plain_step_s: dict[tuple[int, int], float] = {}  # (batch, kv_len): the latest plain call's seconds per step
        self.stats = RolloutStats()  # the last rollout's
        self.timeline: list[Call] = []  # the last rollout's program calls
        self._shared_prefix = shared_prefix
        if cfg.warm_up:
            self._warm_up(progress, shared_prefix or 0)

    def _set_up_speculation(self, sd: SpecConfig, drafter: Drafter | None, history: HistoryStore | None,
                            feature_layers: tuple[int, ...] | None, drafter_accept: float) -> None:
        """The strategies, the adaptive controller and the drafter (checked against the strategies), and the policy
        features the table keeps."""
        self.sd = sd
        self.strategies = [speculative.Strategy(*spec.parts()) for spec in sd.strategy_list()] if sd.mode != "off" else []
        self.uses_drafter = any(s.uses_drafter for s in self.strategies)
        self.uses_history = any(s.history_tokens for s in self.strategies)
        if self.uses_drafter and drafter is None:
            raise ValueError(f"speculative decoding with an EAGLE tree needs a drafter (sd.mode is {sd.mode}, "
                             f"strategies {[s.label for s in self.strategies]})")
        h = sd.history
        self.match = history_lib.MatchSettings(h.match_tokens, h.min_match, h.spec_factor)
        self.history = history
        self.onoff = OnOff(sd.threshold_live_batch, sd.patience_host_steps)
        # The bandit outlives a rollout: what it learned carries over to the next RL step.
        ranges = sd.live_batch_ranges() if sd.mode == "adaptive" else {}
        self.chooser = StrategyChooser(
            self.strategies, ranges, sd.bandit, sd.epsilon, sd.window_host_steps, sd.bandit_seed, sd.plain_arm,
            sd.min_drafter_accept,
        ) if ranges else None
        self.set_drafter_accept(drafter_accept)
        self.drafter_graphdef, self.drafter_state = (
            nnx.split(drafter) if drafter is not None and self.uses_drafter else (None, None))
        if feature_layers is None:
            feature_layers = drafter.feature_layers if drafter is not None else ()
        if self.uses_drafter and tuple(feature_layers) != drafter.feature_layers:
            raise ValueError(f"feature_layers {feature_layers} differ from the drafter's {drafter.feature_layers}")
        wide = [s.label for s in self.strategies if s.uses_drafter and s.topk > drafter.draft_vocab_size]
        if wide:  # else lax.top_k fails inside the first speculative program's compile
            raise ValueError(f"strategies {wide} branch wider than the drafter's {drafter.draft_vocab_size}-token draft "
                             "vocabulary: lower their top-k (S/K/V) or train a drafter with a larger draft_vocab_size")
        self.feature_layers = tuple(feature_layers)

    def _place_on_devices(self) -> None:
        """The mesh the model's weights live on, the drafter on it, and the shapes programs are built against."""
        weights = jax.tree.leaves(self.state)[0].sharding
        # Row tables live on the model's devices (_placed); programs trace under its mesh (kernels run per shard).
        self.mesh = weights.mesh if isinstance(weights, NamedSharding) else None
        self._replicated = NamedSharding(self.mesh, PartitionSpec()) if self.mesh is not None else weights
        self.drafter_state = self._on_mesh(self.drafter_state)
        # What programs are built against: shapes and shardings, which weight updates keep (update_weights holds no
        # state while it cuts the per-layer copies, and a background compile reading it then failed)
        self._state_spec, self._drafter_spec = (
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
            for tree in (self.state, self.drafter_state))

    def _warm_up(self, progress: bool, prefix_len: int) -> None:
        """Compiles every program the engine may run (rollout.warm_up), with a report of what it took."""
        t0 = time.perf_counter()
        self.pool.warm_up(self.warm_up_keys(prefix_len), progress)
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
            lo, hi = self.chooser.ranges[s.num_nodes]
            hi = min(hi, self.sd.threshold_live_batch, buckets[-1])  # SD never runs above the threshold
            out[s] = [b for b in buckets if bucket_for(lo, buckets) <= b <= bucket_for(hi, buckets)] if lo <= hi else []
        return out

    def warm_up_keys(self, prefix_len: int = 0) -> list[tuple]:
        """Every program a stream can reach; prefix_len: the shared prompt prefix its prefills skip."""
        c = self.cfg
        keys = []
        if self.sd.mode != "on":
            keys += [("decode", b, n) for b in c.batch_buckets for n in c.length_buckets]
            keys += [("decode", b, kv, n, narrow) for b in c.batch_buckets for n in c.window_rows if 4 * n <= b
                     for kv in c.length_buckets for narrow in c.length_buckets if narrow < kv]
        sd_buckets = set()
        for s, buckets in self.strategy_buckets().items():
            keys += [("sd", b, n, s) for b in buckets for n in c.length_buckets]
            sd_buckets.update(buckets if s.uses_drafter else ())
        keys += [("draft_prefill", b, n) for b in sorted(sd_buckets) for n in c.length_buckets]
        # A pack of any prompt bucket's tokens may hold any number of requests the table has rows for.
        keys += [("prefill", b, p, n, prefix_len) for b in c.batch_buckets for p in c.batch_buckets if p <= b
                 for n in c.prompt_buckets]
        if c.prefill_with_decode:  # refills of up to an eighth of a table ride on a decode step
            keys += [("decode_admit", b, kv, n, prefix_len) for b in c.batch_buckets for kv in c.length_buckets
                     for n in c.prompt_buckets]
        keys += [("prefix", 1, prefix_len)] if prefix_len else []
        keys += [("resize", b, s) for b in c.batch_buckets for s in c.batch_buckets if s < b]
        keys += [("empty", b) for b in c.batch_buckets]
        return keys

    def pool_report(self) -> str:
        """The compiled pool, and each strategy's share of it."""
        parts = [self.pool.report()]
        for s in self.strategies:
            parts.append(f"strategy {s.label}: {self.pool.report(lambda k, s=s: k[0] == 'sd' and k[3] == s)}")
        return "; ".join(parts)

    def _empty(self, batch: int) -> programs.Slots:
        slots = programs.Slots.empty(
            self.model_cfg, batch, self.max_len, self.cfg.max_stop_ids, self.keep_hidden, self.dtype,
            self.sd.history.corpus_tokens if self.uses_history else 0, self.feature_layers,
        )
        if not self.uses_drafter:
            return slots
        # One draft state serves every strategy: sized for the most tokens a step emits and the most scratch.
        eagle = [s for s in self.strategies if s.uses_drafter]
        pending = max(s.pending for s in eagle)
        scratch = max(s.scratch_slots for s in eagle)
        drafter = nnx.merge(self.drafter_graphdef, self.drafter_state)
        draft = speculative.DraftState.empty(
            drafter.empty_cache(batch, self.max_len + scratch, self.dtype), pending, drafter.feature_size, self.dtype,
        )
        return slots.replace(draft=draft)

    def _on_mesh(self, drafter_state):
        """The drafter's weights on the policy's devices, split as its logical axes say: load_drafter / make_drafter
        give them on one device, and a program refuses arguments on other devices than its weights'."""
        if drafter_state is None or self.mesh is None:
            return drafter_state
        return jax.device_put(drafter_state, shardings_for(drafter_state, self.mesh))

    def _placed(self, tree):
        """The shardings of a row table or prefix (arrays or shapes): its KV caches and kept hidden states split as
        programs.cache_spec and hidden_spec say (each device holds its own rows of its own KV heads; with rows whole,
        every device along fsdp held the whole table), every other field replicated."""
        if self.mesh is None:
            return jax.tree.map(lambda x: KVCache(k=self._replicated, v=self._replicated) if isinstance(x, KVCache)
                                else self._replicated, tree, is_leaf=lambda x: isinstance(x, KVCache))

        def one(x):
            if not isinstance(x, KVCache):
                return self._replicated
            split = NamedSharding(self.mesh, programs.cache_spec(self.mesh, x.k.shape[1], x.k.shape[2]))
            return KVCache(k=split, v=split)

        out = jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))
        hidden = getattr(tree, "hidden", None)
        if hidden is not None:
            spec = programs.hidden_spec(self.mesh, hidden.shape[0], hidden.shape[-1])
            out = dataclasses.replace(out, hidden=NamedSharding(self.mesh, spec))
        return out

    def _shapes(self, make: Callable):
        """The shapes of make()'s arrays, each with its _placed sharding."""
        tree = jax.eval_shape(make)
        return jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), tree, self._placed(tree))

    def _build(self, key: tuple):
        phase, batch = key[0], key[1]
        slots = self._shapes(lambda: self._empty(batch))
        # Outputs pinned to the row table's sharding: left free, XLA may shard e.g. hidden states like
        # the weights (fsdp), and the next program, compiled for the table's shardings, would reject them.
        out = self._placed(slots)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)  # max_steps, min_finished
        if phase == "decode":  # ("decode", batch, kv_len[, wide rows, narrow window])
            fn = jax.jit(programs.decode, static_argnums=(0, 5, 7), donate_argnums=(2,), out_shardings=out)
            args = (self.graphdef, self._state_spec, slots, scalar, scalar, key[2])
            if len(key) == 3:
                return fn, args
            return fn, (*args, jax.ShapeDtypeStruct((key[3],), jnp.int32, sharding=self._replicated), key[4])
        if phase == "prefill":  # ("prefill", batch, requests, packed tokens, shared prefix)
            _, _, p, n, prefix_len = key
            fn = jax.jit(programs.prefill, static_argnums=(0,), donate_argnums=(2,), out_shardings=out)
            return fn, (self.graphdef, self._state_spec, slots, self._admission_shapes(p, n), self._prefix_shapes(prefix_len))
        if phase == "decode_admit":  # ("decode_admit", batch, kv_len, packed tokens, shared prefix)
            _, batch, kv_len, n, prefix_len = key
            adm = self._admission_shapes(self._refill_limit(batch), n)
            fn = jax.jit(programs.decode_and_admit, static_argnums=(0, 5), donate_argnums=(2,), out_shardings=out)
            return fn, (self.graphdef, self._state_spec, slots, adm, self._prefix_shapes(prefix_len), kv_len)
        if phase == "prefix":
            tokens = jax.ShapeDtypeStruct((key[2],), jnp.int32, sharding=self._replicated)
            out = self._placed(jax.eval_shape(lambda: self._no_prefix(key[2])))
            fn = jax.jit(programs.prefix_program, static_argnums=(0, 3, 4, 5), out_shardings=out)
            return fn, (self.graphdef, self._state_spec, tokens, self.dtype, self.keep_hidden, self.feature_layers)
        if phase == "sd":
            fn = jax.jit(speculative.sd_program, static_argnums=(0, 2, 7, 8, 9, 10), donate_argnums=(4,), out_shardings=out)
            args = (self.graphdef, self._state_spec, self.drafter_graphdef, self._drafter_spec, slots, scalar, scalar)
            return fn, (*args, key[3], key[2], self.sd.accept, self.match)
        if phase == "draft_prefill":
            fn = jax.jit(speculative.drafter_prefill_program, static_argnums=(0, 2, 5), donate_argnums=(4,), out_shardings=out)
            return fn, (self.graphdef, self._state_spec, self.drafter_graphdef, self._drafter_spec, slots, key[2])
        if phase == "resize":
            index = jax.ShapeDtypeStruct((key[2],), jnp.int32, sharding=self._replicated)
            out = self._placed(jax.eval_shape(lambda: self._empty(key[2])))
            return jax.jit(programs.resize, out_shardings=out), (slots, index)
        if phase == "empty":
            return jax.jit(lambda: self._empty(batch), out_shardings=out), ()
        raise KeyError(key)

    def _prefix_shapes(self, length: int) -> programs.Prefix:
        return self._shapes(lambda: self._no_prefix(length))

    def _admission_shapes(self, p: int, n: int):
        i32, f32 = jnp.int32, jnp.float32

        def s(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

        return programs.Admission(
            rows=s((p,), i32), valid=s((p,), bool), offset=s((p,), i32), lengths=s((p,), i32),
            max_new=s((p,), i32), stop_ids=s((p, self.cfg.max_stop_ids), i32),
            params=SamplingParams(s((p,), f32), s((p,), i32), s((p,), f32), s((p,), jnp.uint32)), group=s((p,), i32),
            tokens=s((n,), i32), positions=s((n,), i32), segment=s((n,), i32),
        )

    def shared_prefix_len(self, requests: Sequence[Request]) -> int:
        """How many leading prompt tokens a stream of `requests` prefills once for all (shared_prefix_len), at most
        the engine's shared_prefix."""
        n = shared_prefix_len(self.cfg, [r.prompt_ids for r in requests])
        return n if self._shared_prefix is None else min(n, self._shared_prefix)

    def _no_prefix(self, length: int = 0) -> programs.Prefix:
        width = self.model_cfg.hidden_size * max(len(self.feature_layers), 1)
        hidden = jnp.zeros((1, length, width), self.dtype) if self.keep_hidden else None
        return programs.Prefix(jnp.zeros(length, jnp.int32), KVCache.zeros(self.model_cfg, 1, length, self.dtype), hidden)

    def _prefix(self, tokens: list[int], rec: Recorder) -> programs.Prefix:
        if not tokens:
            empty = self._no_prefix()
            return jax.device_put(empty, self._placed(empty))
        ids = jax.device_put(np.asarray(tokens, np.int32), self._replicated)
        prefix, _ = self._run(rec, ("prefix", 1, len(tokens)), self.state, ids)
        return prefix

    def reset_controller(self) -> None:
        """Forgets what the adaptive controller learned (benchmarks time cold rollouts with it)."""
        self.onoff.reset()
        if self.chooser is not None:
            self.chooser.forget(self.sd.bandit_seed)

    def update_drafter(self, drafter: Drafter, accept: float = math.nan) -> None:
        """Swaps in new drafter weights (every compiled program is reused), with their estimated
        tokens per step when known (set_drafter_accept); the bandit forgets what the old drafter's arms earned."""
        graphdef, state = nnx.split(drafter)
        if graphdef != self.drafter_graphdef:
            raise ValueError("update_drafter needs a drafter of the same structure as the engine's")
        _check_dtypes("update_drafter", _dtypes(state), _dtypes(self.drafter_state))
        self.drafter_state = self._on_mesh(state)
        if self.chooser is not None:
            self.chooser.forget_drafter_arms()
        self.set_drafter_accept(accept)

    def set_drafter_accept(self, accept: float) -> None:
        """The drafter's estimated tokens per step (NaN: no estimate, nothing changes). The adaptive
        controller's EAGLE arms compete only from sd.min_drafter_accept on."""
        c = self.chooser
        if c is None or math.isnan(accept) or not self.uses_drafter:
            return
        was = c.drafter_accept >= c.min_drafter_accept
        c.drafter_accept = accept
        if was != (accept >= c.min_drafter_accept):
            log.info("EAGLE arms %s: the drafter's estimated tokens per step %.2f %s sd.min_drafter_accept=%.2f",
                     "compete" if not was else "sit out", accept, "<" if was else ">=", c.min_drafter_accept)

    def update_weights(self, model: Decoder) -> None:
        """Swaps in new policy weights (same shapes and shardings); every compiled program is reused."""
        graphdef, state = nnx.split(model)
        if graphdef != self.graphdef:
            raise ValueError("update_weights needs a model of the same structure as the engine's")
        _check_dtypes("update_weights", _dtypes(state), self._policy_dtypes)
        if self.unrolled:
            # The old per-layer copies go before the new ones are cut: the stacked weights, the old and the new
            # copies would hold the layers three times over at once. Should cutting fail (out of memory, Ctrl-C), the
            # engine holds no weights until the next update_weights: a rollout then says so (_stream).
            self.state = None
            state = unstack_layers(state)
        self.state = state

    # ---- requests -------------------------------------------------------------------------
    def validate(self, r: Request) -> str | None:
        """The reason a request cannot run, or None (rollout.requests' rules, with this model's vocabulary)."""
        return request_problem(r, self.cfg, draft_margin(self.sd), self.model_cfg.vocab_size)

    def _admission(self, reqs: list[Request], rows: list[int], groups: list[int], skip: int,
                   p: int | None = None) -> tuple[programs.Admission, int, int]:
        """The device admission of reqs into rows, their prompts (after the shared prefix's `skip`
        tokens) packed back to back, one copy per distinct prompt; with its shape (p requests, padded to
        a batch bucket unless given; n packed tokens)."""
        c = self.cfg
        p = p or bucket_for(len(reqs), c.batch_buckets)
        offsets: dict[tuple[int, ...], int] = {}
        used = 0
        for r in reqs:
            prompt = tuple(r.prompt_ids[skip:])
            if prompt not in offsets:
                offsets[prompt], used = used, used + len(prompt)
        n = bucket_for(used, c.prompt_buckets)
        tokens, positions, segment = np.zeros(n, np.int32), np.zeros(n, np.int32), np.full(n, -1, np.int32)
        for i, (prompt, at) in enumerate(offsets.items()):
            tokens[at : at + len(prompt)] = prompt
            positions[at : at + len(prompt)] = np.arange(skip, skip + len(prompt))
            segment[at : at + len(prompt)] = i
        stop = np.full((p, c.max_stop_ids), -1, np.int32)
        for i, r in enumerate(reqs):
            stop[i, : len(r.stop_ids)] = r.stop_ids

        def col(values, dtype, fill=0):
            out = np.full(p, fill, dtype)
            out[: len(reqs)] = values
            return out

        adm = programs.Admission(
            rows=col(rows, np.int32),
            valid=col([True] * len(reqs), bool, False),
            offset=col([offsets[tuple(r.prompt_ids[skip:])] for r in reqs], np.int32),
            lengths=col([len(r.prompt_ids) for r in reqs], np.int32, skip + 1),
            max_new=col([r.max_new_tokens for r in reqs], np.int32, 1),
            stop_ids=stop,
            params=SamplingParams(
                temperature=col([r.temperature for r in reqs], np.float32),
                top_k=col([r.top_k for r in reqs], np.int32),
                top_p=col([r.top_p for r in reqs], np.float32, 1.0),
                seed=col([r.seed % 2**32 for r in reqs], np.uint32),
            ),
            group=col(groups, np.int32),
            tokens=tokens, positions=positions, segment=segment,
        )
        return jax.device_put(adm, self._replicated), p, n

    def _plan(self, live_batch: int, queued: bool) -> tuple[speculative.Strategy, bool]:
        """The strategy of this host step (speculative.PLAIN for plain decoding), and whether the bandit
        chose it (its reward then goes back to the bandit). Adaptive speculation waits for the queue to
        empty: until then finished rows are refilled and the batch stays full."""
        if self.sd.mode == "on":
            return self.strategies[0], False
        if self.sd.mode == "adaptive" and not queued and self.onoff.update(live_batch):
            choice = self.chooser.choose(live_batch)
            if choice is not None:
                return choice, True
        return speculative.PLAIN, False

    def generate(self, requests: Sequence[Request], between_steps: Callable[[int], None] | None = None) -> list[Completion]:
        """Completes every request (stream's completions in request order); a request that cannot run
        gets finish_reason 'error', the rest still run."""
        results: list[Completion | None] = [None] * len(requests)
        for i, completion in self.stream(requests, between_steps):
            results[i] = completion
        return results

    def stream(self, requests: Sequence[Request],
               between_steps: Callable[[int], None] | None = None) -> Iterator[tuple[int, Completion]]:
        """Yields (request index, completion) as requests finish: one stream through one row table.

        A finished row is refilled from the queue at the next host visit; while the queue holds
        requests, a device call runs until rollout.refill_rows rows have finished (or steps_per_call),
        so refills come in one packed prefill instead of one per row. Once the queue is empty, live rows move
        to smaller batch buckets as they finish, and adaptive speculation may start. Errors (requests
        that cannot run) come first. between_steps(live_batch), when given, runs on the host after
        every decode call (the online drafter trainer interleaves its steps into the tail there).
        engine.stats and engine.timeline describe the stream once it is exhausted (or closed early: what ran)."""
        rec = Recorder(self.pool.compile_seconds())
        try:
            yield from self._stream(requests, between_steps, rec)
        finally:
            self.stats, self.timeline = rec.finish(self.pool.compile_seconds()), rec.timeline

    def _stream(self, requests: Sequence[Request], between_steps, rec: Recorder) -> Iterator[tuple[int, Completion]]:
        if self.state is None:
            raise RuntimeError("this engine holds no policy weights: its last update_weights failed after dropping the "
                               "old ones (out of memory?); call update_weights again")
        self._failed_compiles.clear()
        queue: deque[int] = deque()
        for i, r in enumerate(requests):
            error = self.validate(r)
            if error:
                yield i, Completion([], [], "error", error)
            else:
                queue.append(i)
        if not queue:
            return
        c, valid = self.cfg, set(queue)
        table = _Table(self._placed_empty(bucket_for(min(len(queue), c.batch_buckets[-1]), c.batch_buckets)))
        table.text = history_lib.GroupCorpus([r.prompt_ids if i in valid else () for i, r in enumerate(requests)],
                                             self.history, self.sd.history.corpus_tokens, self.sd.history.match_tokens)
        shared = self.shared_prefix_len([requests[i] for i in queue])
        table.prefix = self._prefix(list(requests[queue[0]].prompt_ids[:shared]), rec)
        self.onoff.reset()
        with tqdm(total=len(queue), desc="rollout", unit="req", file=sys.stderr, disable=not self.progress) as bar:
            while queue or table.busy():
                done = self._collect_finished(table, requests, rec)
                bar.update(len(done))
                yield from done
                self._admit(table, queue, requests, rec)  # into the rows just freed
                # Rows still decoding: an admitted row may have finished at its prefill (max_new_tokens 1, or a
                # stop id first); it is collected at the next visit, and a table of such rows needs no decode call.
                live = int(np.sum(jax.device_get(table.slots.live)))
                if not live or live < table.busy():
                    # Collected (and refilled) before the next call: kept, a done row would also hold the table in a
                    # larger batch bucket than its live rows need for a whole call.
                    continue
                if not queue:
                    self._compact(table, rec)
                self._advance(table, *self._plan(live, bool(queue)), rec, refill=len(queue), live=live)
                if between_steps is not None:
                    between_steps(live)

    # ---- the steps of one host visit ------------------------------------------------------------
    def _placed_empty(self, batch: int) -> programs.Slots:
        """An empty row table, made in place on the replica's devices by a compiled program: made op by op, it would
        pass whole through the default device (a KV cache of GBs, on another replica's device) and compile each op
        for every new size during the rollout."""
        return self.pool.get(("empty", batch))()

    def _run(self, rec: Recorder, key: tuple, *args):
        """Runs program `key` to completion (compiling it first, outside the timing, if it is not
        warm); returns (its output, seconds), counted under its phase."""
        program = self.pool.get(key)
        t0 = time.perf_counter()
        out = jax.block_until_ready(program(*args))
        seconds = time.perf_counter() - t0
        rec.timed(key[0], seconds)
        self._ran.add(key)  # a program's first run pays one-time costs (loading it; 43 against 0.5 ms, CPU)
        return out, seconds

    def _admit(self, table: _Table, queue: deque[int], requests: Sequence[Request], rec: Recorder) -> None:
        """Prefills queued requests into the free rows (pick_refill chooses them among the queue's first,
        rollout.refill_lookahead places deep): their distinct prompts packed into sequences of at most the
        largest prompt bucket (first fit, longest first), one prefill call per pack, each padded to the
        smallest prompt bucket that holds it. With rollout.prefill_with_decode, a pack of at most an eighth
        of the table's rows rides on a decode step of the live rows instead (decode_and_admit)."""
        free, skip = table.free_rows(), table.prefix.tokens.shape[0]
        if not free or not queue:
            return
        window = [queue.popleft() for _ in range(min(len(queue), len(free) + self.cfg.refill_lookahead))]
        prompts = [requests[i].prompt_ids[skip:] for i in window]
        picked = pick_refill(prompts, min(len(window), len(free)), self.cfg.prompt_buckets)
        take = [window[j] for j in picked]
        queue.extendleft(reversed([i for i in window if i not in take]))  # the others keep their places
        ride = self.cfg.prefill_with_decode and table.busy() > 0  # one pack per visit rides on a decode step
        riders = self._refill_limit(table.batch)
        for pack in pack_prompts([prompts[j] for j in picked], self.cfg.prompt_buckets[-1]):
            ids = [take[j] for j in pack]
            reqs, rows, groups = [requests[i] for i in ids], [free[j] for j in pack], [table.text.group_of[i] for i in ids]
            if ride and len(pack) <= riders:
                lengths, live = jax.device_get((table.slots.length, table.slots.live))  # rows the step decodes
                adm, _, n = self._admission(reqs, rows, groups, skip, riders)
                key = ("decode_admit", table.batch, self._plain_kv_len(int(lengths[live].max())), n, skip)
                ride = False
            else:
                adm, p, n = self._admission(reqs, rows, groups, skip)
                key = ("prefill", table.batch, p, n, skip)
            rec.stats.prompt_tokens += int(np.sum(adm.segment >= 0))
            rec.stats.prompt_slots += n
            table.slots, _ = self._run(rec, key, self.state, table.slots, adm, table.prefix)
        for row, i in zip(free, take):
            table.row_req[row] = i
        table.draft_fresh = False
        table.text.dirty = True

    @staticmethod
    def _refill_limit(batch: int) -> int:
        """An eighth of a `batch`-row table (at least 1 row): the most rows a call waits to see finish
        before their refill, and the requests a refill riding on a decode step admits (decode_and_admit
        programs take that many, padded, so each length bucket and prompt bucket is one program)."""
        return max(1, batch // 8)

    def _collect_finished(self, table: _Table, requests, rec: Recorder) -> list[tuple[int, Completion]]:
        """The finished rows' (request index, completion); frees their rows."""
        live = jax.device_get(table.slots.live)
        rows = [r for r in range(table.batch) if table.row_req[r] >= 0 and not live[r]]
        if not rows:
            return []
        done = []
        for r, completion in zip(rows, self._harvest(table.slots, rows, [requests[table.row_req[r]] for r in rows])):
            done.append((table.row_req[r], completion))
            rec.stats.tokens += len(completion.tokens)
            table.text.finished(table.row_req[r], completion.tokens)
            table.row_req[r] = -1
        return done

    def _compact(self, table: _Table, rec: Recorder) -> None:
        """Moves the live rows into the smallest batch bucket that holds them (the queue is empty)."""
        live_rows = [r for r in range(table.batch) if table.row_req[r] >= 0]
        target = bucket_for(len(live_rows), self.cfg.batch_buckets)
        if target >= table.batch:
            return
        index = np.full(target, -1, np.int32)
        index[: len(live_rows)] = live_rows
        table.slots, _ = self._run(rec, ("resize", table.batch, target), table.slots,
                                   jax.device_put(index, self._replicated))
        table.row_req = [table.row_req[r] for r in live_rows] + [-1] * (target - len(live_rows))

    def _advance(self, table: _Table, strategy: speculative.Strategy, pulled: bool, rec: Recorder, refill: int,
                 live: int) -> None:
        """One device call: plain decoding, or speculative steps of `strategy`, until rows finish: one
        row, or rollout.refill_rows (at most an eighth of the table, and at most `refill`: the requests
        queued for the rows). pulled: the bandit chose the strategy; it gets the call's tokens per second back.
        live: the rows decoding (> 0)."""
        c, batch = self.cfg, table.batch
        before = _counters(table.slots)  # [6, B]: tokens, speculative steps, EAGLE / history drafts, idle, length
        longest = int(max(before[5, r] for r in range(batch) if table.row_req[r] >= 0))
        prefill_s = 0.0
        wide = None
        ran = len(self._ran)
        background = pulled and not strategy.is_plain and self.sd.compile_in_background
        if background and not self._sd_programs_ready(table, strategy, longest):
            if any(k in self._failed_compiles for k in self._sd_keys(table, strategy, longest)):
                self.chooser.record(strategy, live, 0.0)  # it cannot run here: it earns nothing, and the bandit moves on
            strategy, pulled = speculative.PLAIN, False  # plain decoding while the arm's programs compile
        if strategy.is_plain:
            kv_len = self._plain_kv_len(longest)
            steps = min(c.steps_per_call, kv_len - longest)
            key, args = ("decode", batch, kv_len), (self.state, table.slots)
            window = self._windows(table, before[5], kv_len)
            if window is not None:
                wide, narrow, narrow_longest = window
                key, steps = (*key, len(wide), narrow), min(steps, narrow - narrow_longest)
            table.draft_fresh = False  # plain steps leave the drafter behind
        else:
            prefill_s = self._prepare_drafting(table, strategy, longest, rec)
            n, depth = strategy.num_nodes, max(strategy.steps, strategy.history_tokens)
            kv_len = self._sd_kv_len(strategy, longest)
            steps = min(c.steps_per_call, (kv_len - longest - n) // (depth + 1) + 1)
            key, args = ("sd", batch, kv_len, strategy), (self.state, self.drafter_state, table.slots)
        if steps < 1:  # the windows and buckets above always leave a step; without one the stream would spin
            raise RuntimeError(f"no step fits program {key[:3]} (longest row {longest}): an engine bug, please report it")
        exploring = pulled and self.chooser.exploring
        if exploring:  # a short call: an arm that loses costs little to try
            steps = min(steps, self.sd.explore_steps)
        # Waiting rows idle: at most an eighth of the table waits for a refill.
        min_finished = min(c.refill_rows, self._refill_limit(batch), refill) if refill else 1
        args = (*args, jnp.int32(steps), jnp.int32(min_finished))
        if wide is not None:
            args = (*args, jax.device_put(np.asarray(wide, np.int32), self._replicated))
        table.slots, seconds = self._run(rec, key, *args)
        diff = _counters(table.slots)[:5] - before[:5]  # [5, B] per row
        tokens, row_steps, eagle, hist, idle = (int(x) for x in diff.sum(1))
        rec.stats.idle_row_steps += idle
        # A call that was some program's first run (one-time loading) measures neither a strategy nor plain decoding:
        # the bandit's arm stays untried or keeps its rewards, and the bank's savings skip it.
        measured = len(self._ran) == ran
        if strategy.is_plain:
            rec.decode_call(live, tokens, int(diff[0].max()), seconds, kv_len, batch)
            if measured:
                self._plain_step_s[batch, kv_len] = seconds / max(int(diff[0].max()), 1)
        else:
            rec.sd_call(strategy.label, live, tokens, row_steps, int(diff[1].max()), seconds, eagle, hist, kv_len, batch)
            plain_step = self._plain_step_s.get((batch, self._plain_kv_len(longest)))
            if plain_step is not None and measured:  # plain decoding emits a token per live row and step
                rec.stats.sd_saved_s += tokens / live * plain_step - seconds - prefill_s
        if pulled and measured:
            self.chooser.record(strategy, live, arm_reward(tokens, live, seconds, prefill_s,
                                                           steps / c.steps_per_call if exploring else 1.0))

    def _plain_kv_len(self, longest: int) -> int:
        """The length bucket a plain step reads when the longest row holds `longest` tokens (its new token's slot included)."""
        return bucket_for(longest + 1, self.cfg.length_buckets)

    def _sd_kv_len(self, strategy: speculative.Strategy, longest: int) -> int:
        return bucket_for(min(longest + strategy.num_nodes, self.max_len), self.cfg.length_buckets)

    def _sd_programs_ready(self, table: _Table, strategy: speculative.Strategy, longest: int) -> bool:
        """Whether the programs a call of `strategy` runs now are compiled; those that are not start
        compiling in the background (sd.compile_in_background)."""
        ready = True
        for key in self._sd_keys(table, strategy, longest):  # each: every missing one starts compiling
            if key in self._failed_compiles:
                return False
            try:
                ready &= self.pool.ready(key)
            except Exception as e:  # noqa: BLE001 - its compile failed: plain decoding goes on, as while compiling
                self._failed_compiles.add(key)
                if key not in self._said_failed:
                    self._said_failed.add(key)
                    log.warning("program %s failed to compile in the background (%s); strategy %s decodes plainly "
                                "there for the rest of this rollout, and compiles again in the next", key[:3],
                                compile_error(e), strategy.label)
                return False
        return ready

    def _sd_keys(self, table: _Table, strategy: speculative.Strategy, longest: int) -> list[tuple]:
        """The programs a call of `strategy` runs now."""
        keys = [("sd", table.batch, self._sd_kv_len(strategy, longest), strategy)]
        if strategy.uses_drafter and not table.draft_fresh:
            keys.append(self._draft_prefill_key(table, longest))
        return keys

    def _draft_prefill_key(self, table: _Table, longest: int) -> tuple:
        return ("draft_prefill", table.batch, self._plain_kv_len(longest))

    def _windows(self, table: _Table, lengths: np.ndarray, kv_len: int) -> tuple[list[int], int, int] | None:
        """Per-row windows for a plain call, when they read fewer cache slots than one kv_len window for
        every row: (the n longest busy rows, which read kv_len; the narrow window every other row reads,
        a length bucket with room for a whole call; the longest of those rows), or None."""
        busy = sorted((r for r in range(table.batch) if table.row_req[r] >= 0), key=lambda r: -lengths[r])
        best, slots_read = None, table.batch * kv_len
        for n in self.cfg.window_rows:
            if n >= len(busy) or 4 * n > table.batch:
                break
            rest = int(lengths[busy[n]])  # the longest row left in the narrow window
            narrow = bucket_for(min(rest + self.cfg.steps_per_call, self.max_len), self.cfg.length_buckets)
            cost = table.batch * narrow + n * kv_len
            if narrow < kv_len and cost < slots_read:
                best, slots_read = (busy[:n], narrow, rest), cost
        return best

    def _prepare_drafting(self, table: _Table, strategy: speculative.Strategy, longest: int, rec: Recorder) -> float:
        """Brings what `strategy` drafts from up to date: each row's history corpus, and the EAGLE
        drafter's cache (rebuilt from the stored hidden states after steps that did not run it).
        Returns the seconds of that drafter prefill (0 when none ran)."""
        if strategy.history_tokens and table.text.dirty:
            corpus = jax.device_put(table.text.rows(table.row_req), self._replicated)
            table.slots = table.slots.replace(corpus=corpus)
            table.text.dirty = False
        if not strategy.uses_drafter:
            table.draft_fresh = False  # history steps leave the drafter behind
            return 0.0
        if table.draft_fresh:
            return 0.0
        table.slots, seconds = self._run(rec, self._draft_prefill_key(table, longest), self.state, self.drafter_state,
                                         table.slots)
        table.draft_fresh = True
        return seconds

    def _harvest(self, slots, rows: list[int], requests: list[Request]) -> list[Completion]:
        # The per-row outputs whole (a few hundred KB): indexed on the device, each number of rows would compile a gather
        idx = np.asarray(rows)
        n_out, tokens, logprobs, length = (x[idx] for x in jax.device_get(
            (slots.n_out, slots.out_tokens, slots.out_logprobs, slots.length)))
        hidden = None
        if self.return_hidden:  # GBs whole: gathered on the device, rows padded to a power of two (few programs)
            padded = np.pad(idx, (0, (1 << (len(idx) - 1).bit_length()) - len(idx)), mode="edge")
            # float32 on the host whatever the engine's dtype: what the sample buffer and callers expect
            hidden = np.asarray(jax.device_get(_take_rows(slots.hidden, padded)), np.float32)[: len(idx)]
        out = []
        for j, req in enumerate(requests):
            n = int(n_out[j])
            toks = tokens[j, :n].tolist()
            reason = "stop" if toks and toks[-1] in req.stop_ids else "length"
            h = hidden[j, : int(length[j])] if hidden is not None else None
            out.append(Completion(toks, logprobs[j, :n].tolist(), reason, hidden_states=h))
        return out


@jax.jit
def _take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    return x[rows]


@dataclasses.dataclass
class _Table:
    """The row table of one generate call on device, and which request each row serves."""

    slots: programs.Slots
    row_req: list[int] = dataclasses.field(default_factory=list)  # request index per row, -1 when free
    draft_fresh: bool = False  # whether the drafter cache holds every row's prefix
    text: history_lib.GroupCorpus | None = None  # what the rows' prompt groups wrote (history drafting)
    prefix: programs.Prefix | None = None  # the prompt prefix every request shares, prefilled once

    def __post_init__(self):
        self.row_req = self.row_req or [-1] * self.slots.batch

    @property
    def batch(self) -> int:
        return len(self.row_req)

    def free_rows(self) -> list[int]:
        return [r for r in range(self.batch) if self.row_req[r] < 0]

    def busy(self) -> int:
        """Rows serving a request (live, or finished and not yet collected)."""
        return sum(r >= 0 for r in self.row_req)


def arm_reward(tokens: int, live: int, seconds: float, prefill_s: float, prefill_share: float) -> float:
    """A bandit arm's reward for a call: tokens per second and live row, the drafter prefill a switch to it needed
    counted as part of its cost. An exploring call, cut short (sd.explore_steps), carries the share of it a whole call
    would (prefill_share): charged whole to those few steps, an EAGLE arm tried right after plain calls (as BEG
    explores it) never showed its rate once its drafter is warm, and plain decoding kept the bucket (review)."""
    return tokens / (seconds + prefill_s * min(prefill_share, 1.0)) / live


def _dtypes(state) -> list[str]:
    """One per weight, stacked [L, ...] or split per layer (unstack_layers) alike."""
    return [str(jax.tree.leaves(v)[0].dtype) for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def _check_dtypes(what: str, have: list[str], want: list[str]) -> None:
    """The compiled programs take weights of the dtypes they were built for; cast before handing over."""
    if have != want:
        raise ValueError(f"{what} got weights in {sorted(set(have))}, the engine runs {sorted(set(want))}: cast them "
                         "first (models.decoder.cast_floating)")


def _counters(slots: programs.Slots) -> np.ndarray:
    """[6, B] int64 of every row so far: completion tokens, speculative steps, emitted drafts EAGLE
    proposed, emitted drafts the history proposed, steps waited finished, and its cached length."""
    n_out, counts, idle, length = jax.device_get((slots.n_out, slots.spec_counts, slots.idle, slots.length))
    return np.concatenate([n_out[None], counts.T, idle[None], length[None]]).astype(np.int64)
