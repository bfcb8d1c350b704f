"""Online ("spot") drafter training: the devices a rollout leaves idle train the drafter.

During an RL rollout the replicas (sub-meshes along `data`) finish their shares at different
times; the long tail keeps a few busy while the rest wait. The SpotTrainer takes those idle
replicas: `lend(i)` (replica i is done) wakes a background thread that runs drafter steps on the
sample buffer (the latest RL steps' tokens and hidden states), data-parallel over the largest
aligned block of lent replicas (block sizes are powers of two dividing batch_rows, so a run
compiles at most 2R - 1 step programs). `end()` (the rollout is over, the policy update needs the
devices) stops the thread between two steps and returns within one step's time: nothing is lost,
since a step replaces the drafter and optimizer state only when it has finished, and sampling
leaves the buffer as it was. With a single replica (single-process) nothing is lent; instead `tail_step`
interleaves drafter steps into the tail of the rollout (live batch <= tail_live_batch) under a
wall-time share and, with tail_budget 'saved', only while the run's bank holds seconds: the trainer
deposits what speculation saved against plain decoding and withdraws its acceptance estimates, and
the drafter steps spend the rest, so that training on the rollout's own device never makes adaptive
SD slower than SD off.

The engines keep the drafter they were given for the whole rollout; the trainer hands them the new
weights before the next one (`drafter()`), so a rollout never mixes drafters (it would stay lossless
if it did: the policy verifies every token).

On several processes each trains its own copy on its own replicas and its own rollouts (the sample
buffer holds the hidden states its engines computed; blocks never span processes, and with one
replica a process interleaves tail steps as above), and `end()` makes the copies one before the
hand-off: parameters and optimizer moments the mean weighted by each process's drafter steps of
the phase (a process that trained none adds nothing), step counters advanced by all of them, an
all-reduce a leaf over each process's first device. Every process then drafts, estimates and saves
the same drafter; the buffers stay per process (and are saved per process). A process whose
replicas have all finished trains on all of them while it waits for the others in the rollout's
gather (sharding.host_allgather, which runs on the CPUs): the long tail of a multi-node rollout is
one node decoding while the rest wait.

Per RL step the trainer reports the drafter steps done, their seconds, the loss, the hand-back
delay, and a teacher-forced acceptance estimate (train.chain_acceptance) of the current drafter and,
every few steps, of the starting one, on the step's own rollouts before they join the buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastrl_jax.checkpoint import read_step_file, write_step_file
from fastrl_jax.config import Config, ConfigError, DrafterOnlineConfig
from fastrl_jax.drafter.buffer import PackedBatch, SampleBuffer
from fastrl_jax.drafter.train import LossSettings, chain_acceptance, drafter_optimizer, make_train_step
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.rollout.engine import Completion, Request
from fastrl_jax.sharding import (
    AXES,
    allgather_json,
    local_replicas,
    named_sharding,
    process_mesh,
    reshard,
    shardings_for,
    to_replicated,
)

log = logging.getLogger(__name__)


def aligned_blocks(num_replicas: int, rows: int) -> list[tuple[int, ...]]:
    """Replica blocks a drafter step may span, largest first: [k*s, (k+1)*s) for s a power of two
    dividing rows."""
    sizes = [s for s in (2**i for i in range(num_replicas.bit_length())) if s <= num_replicas and rows % s == 0]
    return [tuple(range(k * s, (k + 1) * s)) for s in sorted(sizes, reverse=True) for k in range(num_replicas // s)]


def check_settings(c: DrafterOnlineConfig, num_replicas: int) -> None:
    """Refuses settings under which no drafter step could ever run on `num_replicas` rollout replicas (online
    training would be on in name only)."""
    if jax.process_count() > 1 and c.min_idle_replicas > num_replicas:
        raise ConfigError(f"drafter_online.min_idle_replicas ({c.min_idle_replicas}) exceeds the {num_replicas} rollout "
                          f"replicas each of the {jax.process_count()} processes drives: the drafter would never train "
                          "(set drafter_online.enabled=false to keep it frozen)")
    if jax.process_count() == 1 and num_replicas > 1 and c.min_idle_replicas >= num_replicas:
        raise ConfigError(f"drafter_online.min_idle_replicas ({c.min_idle_replicas}) must be below the {num_replicas} "
                          "rollout replicas (mesh.data): drafter steps run on idle replicas while others still decode, "
                          "so the drafter would never train (set drafter_online.enabled=false to keep it frozen)")


def merge_reports(earlier: dict[str, float], later: dict[str, float]) -> dict[str, float]:
    """One RL step's report (SpotTrainer.end) over two of its rollout phases (rl.filter_groups draws several):
    steps and seconds add up, the loss is the mean over both phases' steps, the rest are the later phase's."""
    if not earlier:
        return dict(later)
    out = dict(later)
    for k in ("drafter_steps", "drafter_spot_s", "drafter_preempt_s"):
        out[k] = earlier[k] + later[k]
    steps = [(earlier["drafter_steps"], earlier["drafter_loss"]), (later["drafter_steps"], later["drafter_loss"])]
    out["drafter_loss"] = (sum(n * loss for n, loss in steps if n) / out["drafter_steps"] if out["drafter_steps"]
                           else float("nan"))
    return out


@functools.cache
def _process_mean() -> tuple[Mesh, Any]:
    """A mesh of each process's first device, and the weighted mean over its [processes, ...] stacks."""
    mesh = process_mesh()

    def mean(stacked, weights):
        return jnp.tensordot(weights, stacked.astype(jnp.float32), 1).astype(stacked.dtype)

    return mesh, jax.jit(mean, out_shardings=NamedSharding(mesh, P()))


def merge_processes(tree: Any, steps: Sequence[int]) -> Any:
    """Every process's host-local drafter state `tree` (the same structure everywhere) made one, on every process:
    floating leaves the mean weighted by steps[p], each process's drafter steps since their copies were last one
    (a process that trained none adds nothing; they must not all be 0), in one all-reduce a leaf over each
    process's first device; integer leaves (the optimizer's step counters) advanced by the other processes' steps.
    Each leaf keeps its sharding."""
    mesh, mean = _process_mean()
    me, others = mesh.devices[jax.process_index()], sum(steps) - steps[jax.process_index()]
    weights = jax.make_array_from_single_device_arrays(
        (len(steps),), NamedSharding(mesh, P()), [jax.device_put(np.asarray(steps, np.float32) / sum(steps), me)])

    def one(x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x + others
        row = jax.device_put(x, me)[None]
        stacked = jax.make_array_from_single_device_arrays((mesh.size, *x.shape), NamedSharding(mesh, P("process")), [row])
        return jax.device_put(mean(stacked, weights).addressable_data(0), x.sharding)

    return jax.tree.map(one, tree)


@dataclasses.dataclass
class _Placement:
    """A block of replicas as one mesh, with the shardings a drafter step uses there."""

    mesh: Mesh
    policy: dict  # pure dict of NamedSharding for the policy parameters
    drafter: nnx.State
    replicated: NamedSharding

    def rows(self, batch: dict) -> dict:
        """A host batch on the block, rows over (data, fsdp) where they divide (else replicated there)."""
        return {k: jax.device_put(v, named_sharding(self.mesh, ("batch",) + (None,) * (v.ndim - 1), v.shape))
                for k, v in batch.items()}


class SpotTrainer:
    """Owns the online drafter (parameters, optimizer state, sample buffer) of one RL run."""

    def __init__(self, cfg: Config, drafter: Drafter, policy_graphdef, policy_params: dict, mesh: Mesh, seed: int = 0):
        """policy_params: the policy's pure dict, of which drafter steps read the embedding, final norm and head
        only (workers.policy_head gives one without layers). With one replica the drafter step compiles here; with
        several, each block's program compiles on a host thread the first time the block is lent (its devices wait
        meanwhile), so handing the devices back never waits for a compilation (the persistent compilation cache
        keeps them)."""
        self.cfg, dt = cfg.drafter_online, cfg.drafter_train
        # This process's replicas (all of them, single-process); blocks and lent replicas count in positions here.
        self.replica_ids = local_replicas(mesh)
        self.mesh = Mesh(mesh.devices[self.replica_ids], AXES, axis_types=mesh.axis_types)
        self.num_replicas = len(self.replica_ids)
        check_settings(self.cfg, self.num_replicas)
        self.seed = seed
        self._apart = (jax.process_index(),) if jax.process_count() > 1 else ()  # processes draw apart
        self.buffer = SampleBuffer(self.cfg.buffer_max_tokens, drafter.feature_size, keep_steps=self.cfg.keep_steps)
        self.dgraphdef, params, self.rest = nnx.split(drafter, nnx.Param, ...)
        # Sharded over the mesh as the engines' copies are (made on the default device, all of it would sit there).
        self.params = jax.device_put(params, shardings_for(params, self.mesh))
        self.frozen = jax.tree.map(jnp.copy, self.params)  # the starting drafter, for the drift comparison
        self.tx = drafter_optimizer(self.cfg.learning_rate, self.cfg.warmup_steps, None, dt.weight_decay, dt.grad_clip_norm)
        self.opt_state = self.tx.init(self.params)
        # No donation: the engines may draft with these very buffers (a hand-off is zero-copy).
        self._step = make_train_step(self.tx, LossSettings(dt.ce_weight, dt.input_noise, dt.unroll_steps, dt.unroll_decay),
                                     donate=False)
        self._accept = jax.jit(self._chain_acceptance, static_argnums=(0, 3))
        self._estimate = None  # its compiled program (_estimate_program)
        self.estimate_compile_s = 0.0
        self.pgraphdef = policy_graphdef
        self._policy_params = policy_params
        self._abstract_policy = nnx.eval_shape(lambda: nnx.merge(policy_graphdef, policy_params))
        self._placements: dict[tuple[int, ...], _Placement] = {}
        self._placements_lock = threading.Lock()  # the compile, spot and trainer threads all place
        self.blocks = aligned_blocks(self.num_replicas, self.cfg.batch_rows)
        self.steps_done = 0  # drafter optimizer steps over the run (checkpointed)
        self.bank_s = 0.0  # one replica, tail_budget 'saved': the seconds drafter steps may still spend (checkpointed)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # from the spot or compile thread, raised by end()
        self._reset_phase()
        self._programs: dict[tuple[int, ...], Any] = {}
        self._compiling: set[tuple[int, ...]] = set()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="spot-compile")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="buffer-write")
        self._writing: tuple[int, Future] | None = None  # the step whose sample buffer is being written
        self.compile_seconds = 0.0
        if self.num_replicas == 1:
            self._compile_into((0,))
            if self._error is not None:  # compiled on this thread: its failure (or Ctrl-C) is this call's
                error, self._error = self._error, None
                raise error

    # ---- placement -----------------------------------------------------------------------------
    def _placement(self, block: tuple[int, ...]) -> _Placement:
        with self._placements_lock:
            if block not in self._placements:
                mesh = Mesh(self.mesh.devices[list(block)], AXES, axis_types=self.mesh.axis_types)
                self._placements[block] = _Placement(
                    mesh, nnx.to_pure_dict(shardings_for(nnx.state(self._abstract_policy), mesh)),
                    shardings_for(self.params, mesh), NamedSharding(mesh, P()),
                )
            return self._placements[block]

    def _seeds(self) -> tuple[int, ...]:
        """The next drafter step's randomness (batch draw, input noise)."""
        return self.seed, self.steps_done, *self._apart

    def _inputs(self, block: tuple[int, ...], batch) -> tuple:
        """The step's arguments on the block's devices, in the shardings its program was compiled for."""
        place = self._placement(block)
        key = jax.random.key(self.seed)
        for part in self._seeds()[1:]:
            key = jax.random.fold_in(key, part)
        return (jax.device_put(self.params, place.drafter), jax.device_put(self.rest, place.replicated),
                jax.device_put(self.opt_state, place.replicated), self._policy_on(place),
                place.rows(batch), jax.device_put(key, place.replicated))

    def _compile_into(self, block: tuple[int, ...]) -> None:
        try:
            t0 = time.perf_counter()
            program = self._compile(block)
            seconds = time.perf_counter() - t0
            replicas = [self.replica_ids[i] for i in block]
            print(f"[fastrl-jax] online drafter training: step program for replicas {replicas} compiled in {seconds:.1f}s",
                  file=sys.stderr)
        except BaseException as e:
            self._error = e
            program, seconds = None, 0.0
        with self._cv:
            if program is not None:
                self._programs[block] = program
            self.compile_seconds += seconds
            self._compiling.discard(block)
            self._cv.notify_all()

    def wait_compiled(self) -> None:
        """Blocks until no step program is being compiled."""
        with self._cv:
            self._cv.wait_for(lambda: not self._compiling)

    def _compile(self, block: tuple[int, ...]):
        batch = dataclasses.asdict(PackedBatch.zeros(self.cfg.batch_rows, self.cfg.seq_len_tokens, self.buffer.hidden_size))
        params, rest, opt_state, pstate, batch, key = self._inputs(block, batch)
        with jax.set_mesh(self._placement(block).mesh):  # the attention kernels run per shard (update.traced_under)
            lowered = self._step.lower(self.dgraphdef, params, rest, opt_state, self.pgraphdef, pstate, batch, key)
        return lowered.compile()

    def _policy_on(self, place: _Placement) -> dict:
        return reshard(self._policy_params, place.policy)  # zero-copy: the policy is replicated along data

    def drafter(self) -> Drafter:
        """The current drafter (for the engines' next rollout and for checkpoints)."""
        return nnx.merge(self.dgraphdef, self.params, self.rest)

    # ---- one RL step's rollout phase ---------------------------------------------------------------
    def _reset_phase(self) -> None:
        self._lent: list[tuple[int, float]] = []  # (replica, time lent)
        self._stop = False
        # tail_s: the seconds of tail steps (the rollout's own device); trace: (start, end, block)
        self._phase = {"steps": 0, "seconds": 0.0, "tail_s": 0.0, "loss": [], "trace": []}
        self._t_begin = time.perf_counter()

    def ready(self) -> bool:
        cap = self.cfg.max_steps_per_rollout
        # An empty buffer has nothing to sample, whatever min_buffer_tokens (0 is allowed) says.
        return self.buffer.num_tokens >= max(self.cfg.min_buffer_tokens, 1) and (not cap or self._phase["steps"] < cap)

    @property
    def phase_trace(self) -> tuple[list, list]:
        """The last rollout phase's drafter steps (start, end, replica block) and lent replicas (replica,
        time), perf_counter seconds; replicas as positions in replica_ids (this process's)."""
        return list(self._phase["trace"]), list(self._lent)

    def begin(self, policy_params: dict) -> None:
        """A rollout starts: drafter steps use these policy parameters (embedding, final norm, head)."""
        self._policy_params = policy_params
        self._reset_phase()
        if self.num_replicas > 1 or jax.process_count() > 1:
            self._thread = threading.Thread(target=self._loop, name="spot-trainer", daemon=True)
            self._thread.start()

    def lend(self, replica: int) -> None:
        """Replica `replica` (its index along the mesh's data axis) has finished its share of the rollout: its devices
        may train the drafter."""
        with self._cv:
            self._lent.append((self.replica_ids.index(replica), time.perf_counter()))
            self._cv.notify_all()  # wait_compiled() may wait on it too

    def tail_step(self, live_batch: int) -> None:
        """Engine hook (single replica): one drafter step while the tail is thin and the share (and with
        tail_budget 'saved', the bank) allows."""
        c, spent = self.cfg, self._phase["tail_s"]
        if (self.num_replicas > 1 or not c.tail_time_share or live_batch > c.tail_live_batch or not self.ready()
                or spent > c.tail_time_share * (time.perf_counter() - self._t_begin)
                or (c.tail_budget == "saved" and spent >= self.bank_s)):
            return
        self._phase["tail_s"] += self._train_step((0,))

    def deposit(self, seconds: float) -> None:
        """Adds to the bank (speculation's savings) or takes from it (negative: work done for the drafter)."""
        self.bank_s += seconds

    def stop(self) -> None:
        """Stops drafter training between two steps, without a report: the rollout failed. No collective (on
        several processes the others may be anywhere); the trainer raises the rollout's error."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()  # wait_compiled() may wait on it too
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def end(self) -> dict[str, float]:
        """The rollout is over: stops drafter training (between two steps) and reports the phase (on several
        processes, every process's: steps, seconds, lent replicas and buffered tokens add up, the loss is
        their mean over steps, the hand-back delay their longest; the bank is this process's)."""
        t0 = time.perf_counter()
        self.stop()
        error = self._error  # a compile failing from here on is the next end()'s (every process must agree on this)
        ph = self._phase
        self.bank_s -= ph["tail_s"]  # tail steps took the rollout's own device; idle replicas cost nothing
        report = {
            "drafter_bank_s": self.bank_s,
            "drafter_steps": ph["steps"],
            "drafter_spot_s": ph["seconds"],
            "drafter_loss": float(np.mean(ph["loss"])) if ph["loss"] else float("nan"),
            "drafter_preempt_s": time.perf_counter() - t0,
            "drafter_replicas_lent": len(self._lent),
            "drafter_buffer_tokens": self.buffer.num_tokens,
        }
        if jax.process_count() > 1:
            t1 = time.perf_counter()
            report, error = self._merge_processes(report, error)
            report["drafter_preempt_s"] += time.perf_counter() - t1
        if error is not None:
            raise RuntimeError("online drafter training failed during the rollout") from error
        if report["drafter_preempt_s"] > self.cfg.preempt_bound_s:
            log.warning("handing the devices back took %.1fs, over drafter_online.preempt_bound_s=%.1fs: lower "
                        "drafter_online.batch_rows or seq_len_tokens", report["drafter_preempt_s"], self.cfg.preempt_bound_s)
        return report

    def _merge_processes(self, report: dict[str, float],
                         error: BaseException | None) -> tuple[dict[str, float], BaseException | None]:
        """Every process's drafter made one (merge_processes) and their phase reports one (end()); with the error
        end() raises: this process's, or another's failure, which fails every process's end() alike (the
        others would wait for it in the next collective)."""
        reports = allgather_json([report, error is not None])  # NaN passes: Python's json writes it
        failed = [p for p, (_, failure) in enumerate(reports) if failure]
        if failed:
            return report, error or RuntimeError(f"online drafter training failed on process {failed[0]}")
        steps = [r["drafter_steps"] for r, _ in reports]
        if sum(steps):
            self.params, self.opt_state = merge_processes((self.params, self.opt_state), steps)
        self.steps_done += sum(steps) - self._phase["steps"]
        phases = [r for r, _ in reports]
        return functools.reduce(merge_reports, phases, {}) | {
            "drafter_bank_s": self.bank_s,
            "drafter_preempt_s": max(r["drafter_preempt_s"] for r in phases),  # side by side, not one after another
            "drafter_replicas_lent": sum(r["drafter_replicas_lent"] for r in phases),
            "drafter_buffer_tokens": sum(r["drafter_buffer_tokens"] for r in phases),
        }, None

    def _choose_block(self) -> tuple[int, ...] | None:
        """The largest compiled block of lent replicas (holding the lock); asks for the best block's
        program when it is missing."""
        lent = {r for r, _ in self._lent}
        if len(lent) < self.cfg.min_idle_replicas or (len(lent) == self.num_replicas and jax.process_count() == 1):
            # Too few idle, or all are: the rollout is over and the trainer takes the devices. On several processes
            # this one waits for the others until end() (the gather leaves its devices free).
            return None
        fits = [b for b in self.blocks if lent.issuperset(b)]
        if fits and fits[0] not in self._programs and fits[0] not in self._compiling:
            self._compiling.add(fits[0])
            self._compiler.submit(self._compile_into, fits[0])
        return next((b for b in fits if b in self._programs), None)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and self._error is None and (not self.ready() or self._choose_block() is None):
                        self._cv.wait()
                    if self._stop or self._error is not None:
                        return
                    block = self._choose_block()
                self._train_step(block)
        except BaseException as e:  # reported by end(), on the trainer's thread
            self._error = e

    def _train_step(self, block: tuple[int, ...]) -> float:
        """One drafter step on `block`; returns its seconds."""
        t0 = time.perf_counter()
        host = self.buffer.sample(np.random.default_rng(self._seeds()), self.cfg.batch_rows, self.cfg.seq_len_tokens)
        params, rest, opt_state, pstate, batch, key = self._inputs(block, dataclasses.asdict(host))
        params, opt_state, metrics = self._programs[block](params, rest, opt_state, pstate, batch, key)
        loss = float(metrics["loss"])  # waits for the step: it is whole before it counts
        self.params, self.opt_state = params, opt_state
        self.steps_done += 1
        ph = self._phase
        ph["steps"] += 1
        ph["loss"].append(loss)
        t1 = time.perf_counter()
        ph["seconds"] += t1 - t0
        ph["trace"].append((t0, t1, block))
        return t1 - t0

    def close(self) -> None:
        """Stops the compile thread (a compilation under way is dropped: the run is over) after the sample
        buffer's last write."""
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self.wait_buffer()
        self._writer.shutdown()

    # ---- drift tracking ---------------------------------------------------------------------------
    @staticmethod
    def _chain_acceptance(dgraphdef, params, rest, depth, pgraphdef, pstate, batch):
        return chain_acceptance(nnx.merge(dgraphdef, params, rest), nnx.merge(pgraphdef, pstate), batch, depth)

    def acceptance(self, requests: Sequence[Request], completions: Sequence[Completion], step: int,
                   frozen: bool = False) -> float:
        """Estimated tokens per speculative step (chain of eval_depth) of the current drafter (or the
        starting one) on these rollouts; NaN when they hold nothing to predict. On several processes every
        process calls it: each scores the rollouts it generated (the ones with hidden states), and the
        counts add up."""
        probe = SampleBuffer(self.cfg.buffer_max_tokens, self.buffer.hidden_size)
        accepted = anchors = 0
        if probe.add_rollouts(requests, completions, step)[1]:
            host = probe.sample(np.random.default_rng([self.seed, step, 1, *self._apart]), self.cfg.eval_rows,
                                self.cfg.seq_len_tokens)
            place = self._placement(self.blocks[-1])  # one replica's devices
            batch = place.rows(dataclasses.asdict(host))
            params = self.frozen if frozen else self.params
            args = (jax.device_put(params, place.drafter), jax.device_put(self.rest, place.replicated), self.pgraphdef,
                    self._policy_on(place), batch)
            with jax.set_mesh(place.mesh):
                counts = self._estimate_program(*args)(*args)
            accepted, anchors = (int(c) for c in counts)
        if jax.process_count() > 1:
            accepted, anchors = (sum(c) for c in zip(*allgather_json([accepted, anchors])))
        return 1.0 + accepted / anchors if anchors else float("nan")

    def _estimate_program(self, params, rest, pgraphdef, pstate, batch):
        """The acceptance estimate's program for these arguments (under their mesh), compiled at its first use (a
        run whose drafter never trains never needs it), its seconds counted apart in estimate_compile_s: a one-time
        cost the bank is not charged."""
        if self._estimate is None:
            t0 = time.perf_counter()
            self._estimate = self._accept.lower(self.dgraphdef, params, rest, self.cfg.eval_depth, pgraphdef, pstate,
                                                batch).compile()
            self.estimate_compile_s += time.perf_counter() - t0
        return self._estimate

    def add(self, requests: Sequence[Request], completions: Sequence[Completion], step: int) -> int:
        """Puts an RL step's rollouts into the buffer (after their acceptance was measured)."""
        return self.buffer.add_rollouts(requests, completions, step)[1]

    # ---- checkpoints ------------------------------------------------------------------------------
    def optimizer_state(self) -> dict:
        """What a checkpoint needs besides the drafter itself: optimizer state and step count."""
        state = {"optimizer": self.opt_state, "steps": jnp.asarray(self.steps_done, jnp.int32)}
        if jax.process_count() > 1:  # every process holds the same (end() merged them); Orbax saves global arrays
            return to_replicated(state, process_mesh())  # one copy a process: a whole copy on every device is waste
        return jax.device_put(state, NamedSharding(self.mesh, P()))

    def save_buffer(self, directory: Path, step: int, keep: Collection[int]) -> None:
        """Writes the sample buffer as it is now to DIR/STEP.npz on a background thread (beside the checkpoint of
        `step`, so a resume trains on what an uninterrupted run would), and removes the files of steps neither
        `step` nor in `keep` (the checkpoints on disk)."""
        self.wait_buffer()
        arrays = self.buffer.arrays()
        self._writing = step, self._writer.submit(write_step_file, self.buffer_dir(directory), step, arrays, {step, *keep})

    def wait_buffer(self) -> None:
        """Waits for the sample buffer's write; a failed one is reported, never raised (the checkpoint holds the
        drafter: only a resume from that step would start the buffer empty)."""
        if self._writing is None:
            return
        (step, future), self._writing = self._writing, None
        try:
            future.result()
        except OSError as e:
            print(f"[fastrl-jax] the online drafter's sample buffer of step {step} was not saved ({e}); a resume from "
                  "that step starts it empty", file=sys.stderr)

    def restore_buffer(self, directory: Path, step: int) -> None:
        """Takes the sample buffer saved with checkpoint `step`; without a readable one it starts empty (rollouts
        are lossless whatever the drafter: only the drafter's next steps differ from an uninterrupted run)."""
        why = read_step_file(self.buffer.load, self._saved_buffer(Path(directory), step))  # or another drafter's features
        if why is None:
            return
        self.buffer = SampleBuffer(self.buffer.max_tokens, self.buffer.hidden_size, keep_steps=self.buffer.keep_steps)
        print(f"[fastrl-jax] the online drafter's sample buffer starts empty ({why}); it refills from this step's "
              "rollouts", file=sys.stderr)

    @staticmethod
    def buffer_dir(directory: Path) -> Path:
        """Where this process's sample buffer files go (each process holds its own rollouts)."""
        return Path(directory) / (f"process_{jax.process_index()}" if jax.process_count() > 1 else "")

    def _saved_buffer(self, directory: Path, step: int) -> Path:
        """This process's buffer file of checkpoint `step`; a run resumed on another number of processes takes
        one of the n files saved (process p the p % n-th), so its rollouts are not lost to the layout alone."""
        own = self.buffer_dir(directory) / f"{step}.npz"
        saved = sorted(directory.glob(f"process_*/{step}.npz")) + sorted(directory.glob(f"{step}.npz"))
        return own if own.exists() or not saved else saved[jax.process_index() % len(saved)]

    def restore(self, drafter: Drafter, state: dict | None) -> None:
        """Continues from a checkpoint: its drafter and optimizer_state(), or with None (a checkpoint from
        before online training was on) a fresh optimizer on that drafter."""
        _, self.params, self.rest = nnx.split(drafter, nnx.Param, ...)
        if state is not None:
            self.opt_state = state["optimizer"]
            self.steps_done = int(state["steps"])
