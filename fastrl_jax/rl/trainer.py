"""The GRPO loop: prompts -> rollout (SD off / on / adaptive) -> rewards -> update -> weight hand-off.

A thin shell over pure parts: grpo.py (math), update.py (the jitted step), rollout.py (engines and
hand-off), data.py, rewards.py, metrics.py. All randomness is a function of (seed, step, index)
(request seeds) or lives in the checkpoint (data position), so a resumed run repeats the
uninterrupted one exactly.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from fastrl_jax import signals
from fastrl_jax.checkpoint import (
    RunCheckpointer,
    UnreadableCheckpoint,
    prune_step_files,
    read_step_file,
    write_step_file,
)
from fastrl_jax.config import Config, ConfigError, TrainingStopped, check_trainable, load_config, save_config, to_dict
from fastrl_jax.data import pipeline
from fastrl_jax.data.prompt_files import read_records
from fastrl_jax.data.prompts import data_prompt_ids
from fastrl_jax.drafter.online import SpotTrainer, check_settings, merge_reports
from fastrl_jax.metric_sink import check_wandb
from fastrl_jax.models.decoder import Decoder
from fastrl_jax.models.drafter_io import drafter_accept_prior, drafter_dir, make_drafter
from fastrl_jax.models.hub import resolve_model_path
from fastrl_jax.models.loading import load_policy
from fastrl_jax.models.tokenizer import load_tokenizer, stop_ids
from fastrl_jax.rl import grpo, rewards, run_dir, update
from fastrl_jax.rl.dry_run import memory_warning
from fastrl_jax.rl.evaluate import completion_text, eval_requests, evaluate, held_out_records
from fastrl_jax.rl.step_metrics import MetricsLog, rollout_summary
from fastrl_jax.rl.workers import RolloutWorkers, request_seed
from fastrl_jax.rollout.engine import Completion, Request, shared_prefix_len
from fastrl_jax.rollout.history import HistoryStore
from fastrl_jax.rollout.requests import draft_margin, prompt_limit, prompt_margin, sampling_problem
from fastrl_jax.rollout.stats import RolloutStats
from fastrl_jax.sharding import (
    allgather_json,
    local_replicas,
    make_mesh,
    process_mesh,
    shardings_for,
    to_host_local,
    to_replicated,
)

log = logging.getLogger(__name__)


class NonFiniteLoss(TrainingStopped):
    """The loss became NaN/inf; the update was not applied and the last good checkpoint kept."""


def token_digest(sequences) -> str:
    """A short hash of token id sequences: equal rollouts, equal digests (benchmarks compare runs by it)."""
    h = hashlib.blake2b(digest_size=8)
    for tokens in sequences:
        h.update(np.asarray(tokens, np.int64).tobytes() + b"|")
    return h.hexdigest()


class Trainer:
    """Owns the policy, optimizer, engines, data and checkpoints of one GRPO run."""

    def __init__(self, cfg: Config, model: Decoder, tokenizer, *, resume: bool = False, stream=sys.stdout,
                 sources: tuple[Any, list[dict]] | None = None):
        """model: the policy in model.dtype (float32): its parameters are the master weights the optimizer
        updates; the rollout engines get copies in model.rollout_dtype at every hand-off. sources: prompt_sources'
        (training source, held-out records), read here unless given."""
        check_trainable(cfg, "train")
        self.cfg, rl = cfg, cfg.rl
        run_dir.prepare_run_dir(cfg, resume=resume)  # never half-overwrite an earlier run
        self.tokenizer = tokenizer
        self.mesh = make_mesh(cfg.mesh)
        update.check_batch_fits_mesh(rl, self.mesh)
        self.graphdef, state = nnx.split(model)
        self.param_shardings = nnx.to_pure_dict(shardings_for(state, self.mesh, update.master_rules(cfg.model)))
        self.params = jax.device_put(nnx.to_pure_dict(state), self.param_shardings)
        self.total_updates = rl.steps * rl.minibatches_per_step
        self.tx = update.policy_optimizer(cfg.optim, self.total_updates)
        self.opt_shardings = update.optimizer_shardings(self.tx, self.params, self.param_shardings, self.mesh)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        self.ref_params = jax.tree.map(jnp.copy, self.params) if rl.kl_coef > 0 else None
        opts = update.StepOptions.from_config(rl)
        self._step_fn = update.jit_train_step(
            self.graphdef, self.tx, opts, self.param_shardings, self.opt_shardings, self.mesh,
            self.ref_params is not None, rl.micro_batch_size,
        )
        self._logp_fn = update.jit_logprobs(self.graphdef, rl.temperature, self.param_shardings, self.mesh,
                                            rl.micro_batch_size)

        train_src, self.eval_records = sources or prompt_sources(cfg, tokenizer)
        self.data = pipeline.PromptIterator(pipeline.prompt_batches(train_src, rl.prompts_per_step, cfg.seed,
                                                                    cfg.data.shuffle))
        self.num_records = len(train_src)  # the stream's order depends on it: a resume checks it
        self.prompts_digest = prompts_digest(train_src)  # and on the records themselves

        self.drafter = make_drafter(cfg, model.cfg, rl.drafter_path) if cfg.sd.uses_drafter() else None
        # Earlier steps' completions per prompt, drafted from when a prompt comes back (checkpointed).
        h = cfg.sd.history
        self.history = HistoryStore(h.corpus_tokens, h.store_prompts) if cfg.sd.uses_history() else None
        online = self.drafter is not None and cfg.drafter_online.enabled
        # Only the online drafter trainer reads the rollouts' hidden states: without it they stay on the device.
        self.workers = RolloutWorkers(cfg, self.graphdef, self.params, self.mesh, self.drafter, self.history,
                                      drafter_accept=drafter_accept_prior(rl.drafter_path), keep_hidden=online,
                                      shared_prefix=self._shared_prefix(train_src))
        # Drafter steps done at its latest acceptance estimate; a random drafter's prior (~1 token per step)
        # stands for one at 0 steps, a checkpoint has none.
        self._estimated_at = None if rl.drafter_path else 0
        self._drafter_accept = math.nan  # that estimate (tokens per step), NaN while the prior stands
        # It reads the policy's embedding, norm and head from the engines' copy (replicated along data, so
        # placing it on lent replicas copies nothing).
        self.spot = (SpotTrainer(cfg, self.drafter, self.graphdef, self.workers.head_params, self.mesh, cfg.seed)
                     if online else None)
        if self.spot is not None:
            self.drafter = self.spot.drafter()  # its sharded copy: the one make_drafter built sits whole on one device
        self.stop_ids = stop_ids(model.cfg, tokenizer)
        self.reward_fn = rewards.combined(cfg.reward.functions, cfg.reward.weights)

        self.out_dir = Path(rl.out_dir).expanduser()
        self.checkpointer = RunCheckpointer(self.out_dir / "checkpoints", rl.keep_checkpoints) if rl.checkpoint_every_steps else None
        self.step = 0
        self.updates = 0  # optimizer updates applied (rl.minibatches_per_step a step; the schedule's position)
        self._saving: int | None = None  # the step whose checkpoint write may still be running
        if resume:
            self._restore()
        if jax.process_index() == 0:  # what this start runs with (a refused resume leaves the run's file alone)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if resume:
                self._keep_previous_config()
            save_config(cfg, self.out_dir / "config.yaml")
        self.metrics = MetricsLog(self.out_dir, rl.tensorboard, self.step if resume else None,
                                  enabled=jax.process_index() == 0, stream=stream, wandb_project=rl.wandb_project,
                                  config=to_dict(cfg))

    # ---- set-up -------------------------------------------------------------------------------
    def _keep_previous_config(self) -> None:
        """A resume with other settings keeps the run's config.yaml, what the steps so far ran with, as
        config.to_step_STEP.yaml before it writes its own; where an earlier resume from STEP kept it already, that
        one stays (config.yaml then holds a start that saved no step: a crash, a setting set back)."""
        config_file, kept = self.out_dir / "config.yaml", self.out_dir / f"config.to_step_{self.step}.yaml"
        if kept.exists():
            return
        try:
            same = load_config(config_file) == self.cfg
        except (OSError, ConfigError):  # none, or an older version's keys
            same = not config_file.is_file()
        if not same:
            config_file.replace(kept)

    def _prompt(self, record: dict) -> list[int]:
        return data_prompt_ids(self.cfg, record, self.tokenizer)

    def _shared_prefix(self, src) -> int:
        """The prompt prefix the rollouts' streams will share (a chat template's system turn, an instruction
        ahead of the question), judged on up to 64 records spread over the source: the engines warm up the
        prefills that skip it, and skip no more (a stream of one prompt's samples shares more)."""
        picks = np.unique(np.linspace(0, len(src) - 1, min(len(src), 64)).astype(np.int64))
        return shared_prefix_len(self.cfg.rollout, [self._prompt(src[int(i)]) for i in picks])

    # ---- one step -----------------------------------------------------------------------------
    def rollout(self, records: list[dict], step: int, first: int = 0):
        """first: the step's index of the first request (a step's later batches, rl.filter_groups)."""
        rl = self.cfg.rl
        requests = [
            Request(self._prompt(r), rl.max_new_tokens, rl.temperature, rl.top_k, rl.top_p,
                    request_seed(self.cfg.seed, step, first + g * rl.samples_per_prompt + s), self.stop_ids)
            for g, r in enumerate(records) for s in range(rl.samples_per_prompt)
        ]
        spot, report = self.spot, {}
        if spot is None:
            completions, stats = self.workers.generate(requests, rl.samples_per_prompt)
        else:
            spot.begin(self.workers.head_params)
            try:
                completions, stats = self.workers.generate(requests, rl.samples_per_prompt,
                                                           replica_done=spot.lend, between_steps=spot.tail_step)
            except BaseException:
                spot.stop()  # no report: end() is a collective, and the other processes may be anywhere
                raise
            report = spot.end()  # the devices come back before anything else runs on them
            spot.deposit(self.workers.local_stats.sd_saved_s)  # this process's replicas: its tail steps spend it
        for c in completions:
            if c.finish_reason == "error":
                raise ValueError(f"rollout request failed: {c.error}")
        if self.history is not None:
            self.history.add_all((r.prompt_ids, c.tokens) for r, c in zip(requests, completions))
        return requests, completions, stats, report

    def track_drafter(self, requests: list[Request], completions: list[Completion], step: int,
                      dropped: Sequence[tuple[Request, Completion]] = ()) -> dict[str, float]:
        """Acceptance estimates on this step's rollouts (before they join the buffer) of a drafter that has
        trained since its last estimate (an unchanged one keeps it, and the metric is NaN), paid from the
        spot trainer's bank; then the buffer update and the hand-off of a changed drafter to the engines.
        dropped: rollouts the policy does not train on (rl.filter_groups' dropped groups), which are the
        policy's own samples all the same: they join the buffer too."""
        t0, compiled = time.perf_counter(), self.spot.estimate_compile_s
        on, spot = self.cfg.drafter_online, self.spot
        changed = spot.steps_done != self._estimated_at
        out = {"drafter_accept": spot.acceptance(requests, completions, step) if changed else math.nan}
        if on.frozen_eval_every_steps and (step == 1 or step % on.frozen_eval_every_steps == 0):
            # The starting drafter: the current one until it has trained.
            out["drafter_accept_frozen"] = (spot.acceptance(requests, completions, step, frozen=True)
                                            if spot.steps_done else out["drafter_accept"])
        spot.deposit(-(time.perf_counter() - t0 - (spot.estimate_compile_s - compiled)))  # its first compile: not an SD cost
        spot.add([*requests, *(r for r, _ in dropped)], [*completions, *(c for _, c in dropped)], step)
        if changed:
            self._estimated_at, self._drafter_accept = spot.steps_done, out["drafter_accept"]
            self.drafter = spot.drafter()
            self.workers.update_drafter(self.drafter, out["drafter_accept"])
        out["drafter_eval_s"] = time.perf_counter() - t0
        return out

    def _text(self, c: Completion) -> str:
        return completion_text(self.tokenizer, c)

    def build_batch(self, requests: list[Request], completions: list[Completion], advantages: np.ndarray):
        """Host arrays of one rollout batch: prompts left-padded to P slots, completions right-padded to C
        (both rounded up to multiples of update.TRAIN_LENGTH_QUANTUM, so few step programs are compiled).

        Returns (tokens [N, P + C], pad [N], mask [N, C], advantages [N], rollout log-probs [N, C]).
        """
        n = len(requests)
        P = update.train_width(max(len(r.prompt_ids) for r in requests))
        C = update.train_width(max(len(c.tokens) for c in completions))
        tokens = np.zeros((n, P + C), np.int32)
        pad = np.zeros(n, np.int32)
        mask = np.zeros((n, C), np.float32)
        logp = np.zeros((n, C), np.float32)
        for i, (r, c) in enumerate(zip(requests, completions)):
            p, k = len(r.prompt_ids), len(c.tokens)
            pad[i] = P - p
            tokens[i, P - p : P], tokens[i, P : P + k] = r.prompt_ids, c.tokens
            mask[i, :k] = 1.0
            logp[i, :k] = c.logprobs
        return tokens, pad, mask, advantages.astype(np.float32), logp

    def train(self, tokens: np.ndarray, pad: np.ndarray, mask: np.ndarray, advantages: np.ndarray) -> dict[str, float]:
        """Updates the policy on one rollout batch: rl.minibatches_per_step optimizer steps."""
        rl = self.cfg.rl
        n = len(tokens)
        m, mb = rl.minibatches_per_step, rl.micro_batch_size
        if m > 1:  # later mini-batches are off-policy: keep the sampling policy's log-probs
            place = lambda x: update.to_global(x, update.rows_sharding(self.mesh, x.shape, 0))  # noqa: E731
            old = np.concatenate([
                np.asarray(jax.device_get(self._logp_fn(
                    self.params, place(tokens[i : i + mb]), place(pad[i : i + mb]), place(mask[i : i + mb]))))
                for i in range(0, n, mb)
            ])
        else:
            old = np.zeros_like(mask)
        per = n // m
        k = per // mb
        totals: dict[str, float] = {}
        for j in range(m):
            rows = slice(j * per, (j + 1) * per)
            host = update.GRPOBatch(
                tokens=tokens[rows].reshape(k, mb, -1), pad=pad[rows].reshape(k, mb),
                mask=mask[rows].reshape(k, mb, -1), advantages=advantages[rows].reshape(k, mb),
                old_logp=old[rows].reshape(k, mb, -1),
            )
            batch = jax.tree.map(lambda x: update.to_global(x, update.rows_sharding(self.mesh, x.shape, 1)), host)
            params, opt_state, metrics = self._step_fn(self.params, self.opt_state, self.ref_params, batch)
            metrics = {key: float(v) for key, v in jax.device_get(metrics).items()}
            if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "update_norm")):
                raise NonFiniteLoss(self._nan_message(metrics, j))
            self.params, self.opt_state = params, opt_state
            self.updates += 1
            for key, v in metrics.items():
                totals[key] = totals.get(key, 0.0) + v / m
        return totals

    def _nan_message(self, metrics: dict, minibatch: int) -> str:
        last = None
        if self.checkpointer is not None:
            self._wait_checkpoint()
            last = self.checkpointer.latest_step()
        kept = f"the last good checkpoint is step {last} in {self.checkpointer.directory}" if last else "no checkpoint was written yet"
        # The failed update's optimizer state was donated to it: this trainer cannot go on, a resume can.
        applied = (f"mini-batch {minibatch + 1} of {self.cfg.rl.minibatches_per_step}: the earlier ones changed this "
                   "process's weights, no checkpoint" if minibatch else "stopped without applying the update")
        return (f"loss {metrics['loss']} / grad norm {metrics['grad_norm']} / update norm {metrics['update_norm']} at "
                f"step {self.step + 1}, {applied}; "
                f"{kept} (lower optim.learning_rate or set optim.max_grad_norm)")

    def evaluate(self) -> float:
        """Accuracy on the held-out prompts: greedy, or the mean over rl.eval_samples samples of each at
        rl.eval_temperature (with rl.eval_top_p / eval_top_k). Sampling seeds are the same at every evaluation
        (step 0 of the seed stream, which no training step uses), so evaluations differ only by the policy."""
        rl, n = self.cfg.rl, self.cfg.rl.eval_samples
        prompts = [self._prompt(r) for r in self.eval_records]
        requests = eval_requests(prompts, n, rl.max_new_tokens, rl.eval_temperature, rl.eval_top_k, rl.eval_top_p,
                                 self.cfg.seed, self.stop_ids)
        return evaluate(self.workers, self.tokenizer, self.eval_records, requests, n)["results"]["all"]["pass@1"]

    def _evaluation(self) -> dict[str, float]:
        t0 = time.perf_counter()
        accuracy = self.evaluate()
        return {"eval_accuracy": accuracy, "eval_temperature": self.cfg.rl.eval_temperature,
                "eval_s": time.perf_counter() - t0}

    def _rewards(self, records: list[dict], completions: list[Completion]) -> tuple[np.ndarray, list[float]]:
        """Each completion's reward (reward.functions, DAPO's overlong shaping) and correctness. On several
        processes each scores a share and all take the gathered scores: a reward that differs between hosts (a
        judge's timeout, a sandbox) must not train each host's rows on its own scores, nor split rl.filter_groups'
        draws (which hung the next collective)."""
        rl, shaping = self.cfg.rl, self.cfg.reward
        processes, me = jax.process_count(), jax.process_index()

        def score(i: int) -> tuple[float, float]:
            text, record = self._text(completions[i]), records[i // rl.samples_per_prompt]
            penalty = rewards.overlong_penalty(len(completions[i].tokens), rl.max_new_tokens, shaping.overlong_buffer,
                                               shaping.overlong_penalty)
            return (float(self.reward_fn(text, record["answer"], record)) + penalty,
                    rewards.correctness_reward(text, record["answer"]))

        if processes == 1:
            scored = [score(i) for i in range(len(completions))]
        else:  # a reward that raises on one process's share is every process's error, not a hang in the gather
            try:
                mine, error = [score(i) for i in range(me, len(completions), processes)], None
            except Exception as e:
                mine, error = [], f"{type(e).__name__}: {e}"
            shares = allgather_json([mine, error])
            if failed := [(p, err) for p, (_, err) in enumerate(shares) if err]:
                raise RuntimeError(f"reward.functions failed on process {failed[0][0]}: {failed[0][1]}")
            scored = [shares[i % processes][0][i // processes] for i in range(len(completions))]
        reward = np.array([r for r, _ in scored], np.float64)
        bad = ~(np.abs(reward) <= np.finfo(np.float32).max)  # NaN, inf or past float32: a NaN loss would stop the
        if bad.any():  # run with a message that blames the learning rate
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"reward.functions {list(shaping.functions)} gave {reward[i]} for sample "
                             f"{i % rl.samples_per_prompt} of the prompt whose answer is "
                             f"{records[i // rl.samples_per_prompt]['answer']!r}: rewards must be finite numbers within "
                             "float32's range")
        return reward.astype(np.float32), [c for _, c in scored]

    def _sample(self, step: int) -> _Sampled:
        """The step's rl.prompts_per_step groups, rolled out and rewarded. With rl.filter_groups (DAPO's dynamic
        sampling) a group whose rl.filter_groups_metric (accuracy, or reward) is the same for every sample is
        dropped and further batches are drawn, up to rl.max_gen_batches; short of groups then, dropped ones fill
        the step, with a warning."""
        rl, n = self.cfg.rl, self.cfg.rl.samples_per_prompt
        kept, spare, stats, report, drawn, reward_s = [], [], RolloutStats(), {}, 0, 0.0
        while len(kept) < rl.prompts_per_step and not (drawn and drawn == rl.max_gen_batches):
            records = next(self.data)
            requests, completions, batch_stats, batch_report = self.rollout(records, step, drawn * len(records) * n)
            drawn, stats = drawn + 1, stats + batch_stats
            report = merge_reports(report, batch_report)
            t0 = time.perf_counter()
            reward, correct = self._rewards(records, completions)
            reward_s += time.perf_counter() - t0
            for g in range(len(records)):
                part = slice(g * n, (g + 1) * n)
                group = (requests[part], completions[part], reward[part], correct[part])
                metric = correct[part] if rl.filter_groups_metric == "accuracy" else reward[part]
                (kept if not rl.filter_groups or np.ptp(metric) > 0 else spare).append(group)
        if len(kept) < rl.prompts_per_step:
            log.warning("step %d: %d of %d prompt groups have a %s that differs after %d batches (rl.max_gen_batches); "
                        "groups without one fill the step", step, len(kept), rl.prompts_per_step, rl.filter_groups_metric,
                        drawn)
        groups, dropped = (kept + spare)[: rl.prompts_per_step], (kept + spare)[rl.prompts_per_step:]
        return _Sampled([x for g in groups for x in g[0]], [x for g in groups for x in g[1]],
                        np.concatenate([g[2] for g in groups]), [x for g in groups for x in g[3]], stats, report, drawn,
                        reward_s, [(r, c) for g in dropped for r, c in zip(g[0], g[1])])

    def run_step(self) -> dict[str, Any]:
        rl, step = self.cfg.rl, self.step + 1
        t0 = time.perf_counter()
        requests, completions, reward, correct, stats, spot_report, drawn, reward_s, dropped = self._sample(step)
        rollout_s = time.perf_counter() - t0 - reward_s
        adv = np.asarray(grpo.group_advantages(jnp.asarray(reward), rl.samples_per_prompt, rl.advantage_std_normalize))
        tokens, pad, mask, adv, _ = self.build_batch(requests, completions, adv)

        t1 = time.perf_counter()
        lr = update.learning_rate(self.cfg.optim, self.total_updates, self.updates)
        train = self.train(tokens, pad, mask, adv)
        self.workers.update_weights(self.params)
        jax.block_until_ready(self.params)
        train_s = time.perf_counter() - t1
        self.step = step

        metrics: dict[str, Any] = {"step": step}
        metrics |= rollout_summary(reward, correct, [len(c.tokens) for c in completions],
                                   [c.finish_reason for c in completions], stats)
        metrics["rollout_digest"] = token_digest(c.tokens for c in completions)
        metrics["reward_s"] = reward_s
        if rl.filter_groups:
            metrics["gen_batches"] = drawn
        metrics |= spot_report  # the online drafter trainer's steps during the rollout
        # The engines' rate counts every token generated (rl.filter_groups draws batches it drops); "tokens" and
        # tokens_per_s count the trained completion tokens, over rollout, update and drafter estimate (verl's
        # perf/throughput also counts prompt tokens, over the whole step, per GPU).
        metrics |= {"rollout_s": rollout_s, "train_s": train_s, "generated_tokens": stats.tokens,
                    "rollout_tokens_per_s": stats.tokens / rollout_s, "lr": lr}
        metrics |= train
        if self.spot is not None:
            metrics |= self.track_drafter(requests, completions, step, dropped)
            metrics["drafter_bank_s"] = self.spot.bank_s  # after this step's deposit and estimate
        metrics["tokens_per_s"] = metrics["tokens"] / (rollout_s + train_s + metrics.get("drafter_eval_s", 0.0))
        if rl.eval_every_steps and (step % rl.eval_every_steps == 0 or step == rl.steps):
            metrics |= self._evaluation()
        self.metrics.log(metrics)  # before the checkpoint: a resume from it never runs this step again
        if self.checkpointer is not None and (step % rl.checkpoint_every_steps == 0 or step == rl.steps):
            self.save()
        return metrics

    def run(self) -> list[dict[str, Any]]:
        """Steps until rl.steps; returns this call's per-step metrics. Ctrl-C, SIGTERM or SIGUSR1 (a scheduler's
        preemption or time-limit notice, e.g. SLURM's --signal) ends the run after its current step, with that
        step's checkpoint saved (TrainingStopped); a second Ctrl-C stops at once."""
        history = []
        try:
            stops = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
            with signals.deferred(stops, "fastrl-jax", at_once=(signal.SIGINT,)) as received:
                if self.cfg.rl.eval_every_steps and self.step == 0:
                    history.append({"step": 0, **self._evaluation()})
                    self.metrics.log(history[-1])
                while self.step < self.cfg.rl.steps:
                    history.append(self.run_step())
                    if self.step < self.cfg.rl.steps and _any_process(bool(received)):
                        self._stop(received[0] if received else "another process's stop signal")
        finally:
            self.close()
        return history

    def _stop(self, why: str) -> None:
        saved = self.checkpointer is not None
        if saved and self.step % self.cfg.rl.checkpoint_every_steps:  # else run_step saved it
            self.save()
        if saved:  # the run ends here: a write that failed is this error, not "its checkpoint is saved"
            self._wait_checkpoint(final=True)
        raise TrainingStopped(f"{why}: stopped after step {self.step} of {self.cfg.rl.steps}"
                              + ("; its checkpoint is saved and --resume continues the run" if saved
                                 else " (rl.checkpoint_every_steps is 0: nothing saved)"))

    # ---- checkpoints --------------------------------------------------------------------------
    def _arrays(self) -> dict[str, Any]:
        arrays = {"policy": self.params, "optimizer": self.opt_state}
        if self.ref_params is not None:
            arrays["reference"] = self.ref_params
        if self.drafter is not None:
            drafter = nnx.to_pure_dict(nnx.state(self.drafter))  # weights and any draft vocabulary
            # Each process holds it on one local device; Orbax saves only global arrays from several processes
            arrays["drafter"] = to_replicated(drafter, process_mesh()) if jax.process_count() > 1 else drafter
        if self.spot is not None:
            arrays["drafter_optimizer"] = self.spot.optimizer_state()
        return arrays

    def save(self) -> None:
        """Starts an async checkpoint of step self.step; a failed write (disk full) keeps the previous one, and
        training goes on unless it was the final step's (close() then raises)."""
        self._wait_checkpoint()  # the previous write's failure is its own step's, and this one still starts
        meta = {"data": self.data.state(),
                "run": {"step": self.step, "updates": self.updates, "seed": self.cfg.seed, "config": to_dict(self.cfg),
                        "prompt_records": self.num_records, "prompts_digest": self.prompts_digest,
                        "rng": "request seeds derive from (seed, step, request index)"}}
        if self.history is not None:
            meta["history"] = self.history.summary()  # its tokens: RUN/history/STEP.npz, written below
        if self.spot is not None:
            # tail_budget 'saved': what speculation saved, not yet spent (each process's own, on several)
            bank = self.spot.bank_s
            meta["run"]["drafter_bank_s"] = allgather_json(bank) if jax.process_count() > 1 else bank
            # The drafter's latest acceptance estimate and its steps then: the engines' EAGLE arms gate on it
            meta["run"]["drafter_estimate"] = {"steps": self._estimated_at,
                                               "accept": None if math.isnan(self._drafter_accept) else self._drafter_accept}
        if controller := self.workers.controller_state():
            meta["controller"] = controller
        self._saving = self.step
        try:
            self.checkpointer.save(self.step, self._arrays(), meta)
        except OSError as e:
            self._checkpoint_failed(e)
        if self.spot is not None:
            self.spot.save_buffer(self.out_dir / "drafter_buffer", self.step, self.checkpointer.all_steps())
        if self.history is not None and jax.process_index() == 0:  # every process holds the same store
            try:
                write_step_file(self.out_dir / "history", self.step, self.history.arrays(),
                                {self.step, *self.checkpointer.all_steps()})
            except OSError as e:
                print(f"[fastrl-jax] the history drafter's store of step {self.step} was not saved ({e}); a resume "
                      "from that step starts it empty", file=sys.stderr)

    def _prune_step_files(self) -> None:
        """The history and sample-buffer files of steps whose checkpoint was pruned: each save kept those of the
        checkpoints on disk as it started, the step its own completion pruned (rl.keep_checkpoints) among them."""
        kept = self.checkpointer.all_steps()
        if self.spot is not None:
            self.spot.wait_buffer()
            prune_step_files(self.spot.buffer_dir(self.out_dir / "drafter_buffer"), kept)
        if self.history is not None and jax.process_index() == 0:
            prune_step_files(self.out_dir / "history", kept)

    def _wait_checkpoint(self, final: bool = False) -> None:
        """Waits for the checkpoint write under way; final: the run ends after it, so a failed one is raised."""
        try:
            self.checkpointer.wait()
        except OSError as e:
            self._checkpoint_failed(e, final)

    def _checkpoint_failed(self, e: OSError, final: bool = False) -> None:
        step, self._saving = self._saving, None
        why = "the disk is full" if e.errno == errno.ENOSPC else str(e)
        latest = max((s for s in self.checkpointer.all_steps() if s != step), default=None)
        kept = f"the previous checkpoint (step {latest}) stays valid" if latest is not None else "no earlier checkpoint exists"
        if final or step == self.cfg.rl.steps:  # no later save keeps these weights: the run must not end as if it had
            fix = "make room in" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix"
            again = "resume with --resume" if latest is not None else "run it again"
            raise OSError(e.errno, f"the final checkpoint (step {step}) failed ({why}); {kept}: {fix} "
                                   f"{self.checkpointer.directory} and {again}") from e
        print(f"[fastrl-jax] checkpoint at step {step} failed ({why}); {kept}; training continues", file=sys.stderr)

    def _restore_history(self, note: dict, step: int) -> None:
        """The history store of checkpoint `step`; without a readable file it starts empty (drafting from history is
        lossless whatever it holds: only the speed of the next steps differs from an uninterrupted run)."""
        if "entries" in note:  # checkpoints before 2026-11-27 hold it in their JSON
            self.history.restore(note)
            return
        why = read_step_file(self.history.load, self.out_dir / "history" / f"{step}.npz")
        if why is not None:
            print(f"[fastrl-jax] the history drafter's store starts empty ({why}); it refills from this step's rollouts",
                  file=sys.stderr)

    def _restore(self) -> None:
        """Continues from the latest readable checkpoint; newer unreadable steps are set aside (their step
        numbers are saved afresh when the run gets there again). With a config changed where it shapes the
        checkpoint (STATE_KEYS), no readable step is a ConfigError naming the changes."""
        ckpt = self.checkpointer
        if ckpt is None:
            raise ConfigError("--resume needs checkpoints: rl.checkpoint_every_steps is 0")
        arrays = self._arrays()
        names = ["data", "run"] + ["history"] * (self.history is not None) + ["controller"] * bool(
            self.workers.controller_state())
        latest = ckpt.latest_step()
        saved = (ckpt.read_meta(latest, "run") or {}) if latest is not None else {}
        now = to_dict(self.cfg)
        changed = _config_changes(saved.get("config", {}), now, STATE_KEYS)
        # What a run may turn on between resumes starts fresh where the checkpoint restored has none of it.
        wanted = [n for n in OPTIONAL_ITEMS if n in arrays or n in names]
        try:
            step, arrays, meta = ckpt.restore(None, arrays, meta=names, optional=OPTIONAL_ITEMS)
        except UnreadableCheckpoint as e:
            if changed:  # no step reads back: this config's layout, not damage
                raise ConfigError(f"--resume: checkpoint step {latest} does not fit this config: {', '.join(changed)} "
                                  f"changed since it was saved ({e}). Set them back (the run's "
                                  f"{self.out_dir / 'config.yaml'} has them), or start a new run") from None
            raise UnreadableCheckpoint(f"--resume: {e}. Restore {ckpt.directory} from a backup, or start the run "
                                       "again with --overwrite (the old run is moved aside)") from None
        self._check_prompt_stream(meta["run"], now)
        absent = [n for n in wanted if n not in arrays and n not in meta]
        unreadable = [s for s in ckpt.all_steps() if s > step]
        if unreadable:
            where = ckpt.set_aside(unreadable)
            print(f"[fastrl-jax] moved unreadable checkpoint steps {unreadable} to {where}"
                  + (f" ({', '.join(changed)} changed since step {latest} was saved: if that is why, set them back and "
                     "move the steps back)" if changed else ""), file=sys.stderr)
        if absent:
            print(f"[fastrl-jax] checkpoint step {step} has no {', '.join(absent)} (off when it was saved): "
                  "starting fresh", file=sys.stderr)
        self.params, self.opt_state = arrays["policy"], arrays["optimizer"]
        self.ref_params = arrays.get("reference", self.ref_params)
        if "drafter" in arrays and self.cfg.rl.drafter_path and _config_changes(meta["run"].get("config", {}), now,
                                                                                ("rl.drafter_path",)):
            # A drafter trained since (train-drafter): it drafts, trains on with a fresh optimizer, and is estimated
            # afresh. Without a path (an override forgotten) the checkpoint's drafter goes on.
            print(f"[fastrl-jax] rl.drafter_path changed since step {step} was saved: drafting with "
                  f"{self.cfg.rl.drafter_path}, not the checkpoint's drafter", file=sys.stderr)
            for name in ("drafter", "drafter_optimizer"):
                arrays.pop(name, None)
            meta["run"].pop("drafter_estimate", None)
        if "drafter" in arrays:
            drafter = to_host_local(arrays["drafter"]) if jax.process_count() > 1 else arrays["drafter"]
            nnx.update(self.drafter, _state_from(self.drafter, drafter))
        if self.spot is not None:
            state = arrays.get("drafter_optimizer")
            self.spot.restore(self.drafter, to_host_local(state) if state and jax.process_count() > 1 else state)
            self.spot.bank_s = _own_bank(meta["run"].get("drafter_bank_s", 0.0))  # checkpoints before 2026-11-26 have none
            estimate = meta["run"].get("drafter_estimate")
            if estimate is None:  # checkpoints before 2026-11-27, a new rl.drafter_path: estimated again
                estimate = {"steps": None if self.spot.steps_done else self._estimated_at, "accept": None}
            self._estimated_at = estimate["steps"]
            self._drafter_accept = math.nan if estimate["accept"] is None else float(estimate["accept"])
            self.spot.restore_buffer(self.out_dir / "drafter_buffer", step)
        if "drafter" in arrays:
            self.workers.update_drafter(self.drafter, self._drafter_accept)  # NaN: the prior until this run estimates it
        self.workers.update_weights(self.params)
        self.data.restore(meta["data"])
        if "history" in meta:
            self._restore_history(meta["history"], step)
        if "controller" in meta:
            self.workers.restore_controller(meta["controller"])
        self.step = int(meta["run"]["step"])
        # Checkpoints before 2026-11-27 have no update count: every step applied rl.minibatches_per_step then.
        self.updates = int(meta["run"].get("updates", self.step * self.cfg.rl.minibatches_per_step))
        self._say_changes(meta["run"].get("config", {}), step)
        print(f"[fastrl-jax] resumed from step {step} in {ckpt.directory}", file=sys.stderr)

    def _check_prompt_stream(self, run: dict, now: dict) -> None:
        """Refuses a resume whose prompt stream differs from the checkpoint's (its `run` meta): the saved data
        position counts batches of that stream."""
        digest = run.get("prompts_digest")  # checkpoints before 2026-11-28 have none: the file's path counts
        stream = _config_changes(run.get("config", {}), now, STREAM_KEYS if digest else STREAM_KEYS + RECORD_KEYS)
        if stream:
            raise ConfigError(f"--resume: {', '.join(stream)} changed since the run started; its saved data position "
                              "counts batches of that prompt stream, so prompts would be skipped or repeated. Set them "
                              f"back (the run's {self.out_dir / 'config.yaml'} has them), or start a new run")
        records = run.get("prompt_records", self.num_records)  # checkpoints before 2026-11-27 have none
        if records != self.num_records or digest not in (None, self.prompts_digest):
            holds = (f"{self.num_records} records that fit rollout.prompt_buckets, {records} when the run started"
                     if records != self.num_records else "as many records that fit as when the run started, but others")
            raise ConfigError(f"--resume: data.source ({self.cfg.data.source}) holds {holds}; its saved data position "
                              "counts batches of that shuffled stream, so prompts would be skipped or repeated. Put the "
                              "file back as it was (or rollout.prompt_buckets, data.instruction, data.chat_template and "
                              "the tokenizer, which decide what fits), or start a new run")

    def _say_changes(self, saved: dict, step: int) -> None:
        """What a resume changed since checkpoint `step` (its config `saved`): every setting, and the schedule's span."""
        now = to_dict(self.cfg)
        if changes := _config_changes(saved, now, tuple(now)):
            print(f"[fastrl-jax] settings changed since step {step} was saved: {'; '.join(changes)} (the run's config "
                  f"until then: {self.out_dir / f'config.to_step_{step}.yaml'})", file=sys.stderr)
        if was := _config_changes(saved, now, ("rl.steps", "rl.minibatches_per_step")):
            print(f"[fastrl-jax] {', '.join(was)}: the learning-rate schedule now spans {self.total_updates} updates; "
                  f"it goes on from update {self.updates}", file=sys.stderr)

    def close(self) -> None:
        try:
            if self.checkpointer is not None:
                self._wait_checkpoint(final=True)  # the run's last checkpoint: raised when it failed
                self._prune_step_files()
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close()
                self.checkpointer = None
            if self.spot is not None:
                self.spot.close()
            self.metrics.close()


def _own_bank(saved: float | list[float]) -> float:
    """This process's drafter bank from a checkpoint: its own entry of a multi-process run's list, else (a run
    saved on another number of processes) an equal share of the total."""
    if isinstance(saved, list) and len(saved) == jax.process_count():
        return float(saved[jax.process_index()])
    return float(sum(saved) if isinstance(saved, list) else saved) / jax.process_count()


def _state_from(module: nnx.Module, pure: dict) -> nnx.State:
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, pure)
    return state


class _Sampled(NamedTuple):
    """A step's rollout groups (Trainer._sample)."""

    requests: list[Request]
    completions: list[Completion]
    reward: np.ndarray
    correct: list[float]
    stats: RolloutStats
    spot_report: dict[str, float]  # the online drafter trainer's phase
    gen_batches: int  # prompt batches drawn
    reward_s: float  # seconds in the reward functions
    dropped: list[tuple[Request, Completion]]  # rl.filter_groups: the rollouts of groups the step does not train on


def _any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (all processes call it at the same step: they stop together)."""
    return flag if jax.process_count() == 1 else any(allgather_json(flag))


def preflight(cfg: Config, mesh_rows: int, files: bool = True) -> None:
    """What a GRPO run can be refused for before a model loads or its run directory is touched (train and
    --dry-run): weights it could not train, sampling settings no request could run with, an unknown reward,
    a missing prompt file or W&B login (files: a dry run plans a cluster's job elsewhere, without its data), a
    micro-batch that does not split over mesh_rows (data x fsdp) devices."""
    check_trainable(cfg, "train")
    rl = cfg.rl
    settings = [("rl.", rl.temperature, rl.top_k, rl.top_p)] + (
        [("rl.eval_", rl.eval_temperature, rl.eval_top_k, rl.eval_top_p)] if rl.eval_every_steps else [])
    for name, temperature, top_k, top_p in settings:
        if problem := sampling_problem(rl.max_new_tokens, temperature, top_k, top_p, cfg.rollout, draft_margin(cfg.sd)):
            raise ConfigError(f"{problem} (rl.max_new_tokens, {name}temperature, {name}top_k, {name}top_p)")
    rewards.combined(cfg.reward.functions, cfg.reward.weights)
    if cfg.reward.overlong_buffer >= rl.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer ({cfg.reward.overlong_buffer}) must be below rl.max_new_tokens "
                          f"({rl.max_new_tokens}): the penalty starts that many tokens before the limit")
    check_wandb("rl.wandb_project", rl.wandb_project, login=files)
    if rl.filter_groups and rl.filter_groups_metric == "accuracy" and "correct" not in cfg.reward.functions:
        log.warning("rl.filter_groups keeps the groups whose built-in correctness (rl.filter_groups_metric=accuracy) "
                    "differs, which reward.functions %s leave out: for answers that it cannot check, every group looks "
                    "alike and each step draws rl.max_gen_batches batches; set rl.filter_groups_metric=reward",
                    list(cfg.reward.functions))
    d = cfg.data
    for name in ("source", "eval_source")[: (1 + bool(rl.eval_every_steps)) * files]:
        path = getattr(d, name)
        if path != pipeline.MATH_SOURCE and not Path(path).expanduser().is_file():
            raise FileNotFoundError(f"data.{name}: no file {path}")
        if path != pipeline.MATH_SOURCE:  # a record without an answer (or a wrong field name): said now, not after loading
            read_records(path, prompt_field=d.prompt_field, messages_field=d.messages_field, answer_field=d.answer_field)
    update.check_batch_fits_mesh(rl, mesh_rows)
    same = d.source != pipeline.MATH_SOURCE and len({Path(f).expanduser().resolve() for f in (d.source, d.eval_source)}) == 1
    if rl.eval_every_steps and same:
        log.warning("data.eval_source is data.source (%s): the held-out accuracy scores questions the policy trains on; "
                    "give data.eval_source a file of other questions", d.source)
    elif rl.eval_every_steps and d.eval_source == pipeline.MATH_SOURCE != d.source:
        log.warning("held-out accuracy is scored on the built-in math problems (data.eval_source: math), not on "
                    "questions like data.source's; give data.eval_source a held-out file of those")


def prompt_sources(cfg: Config, tokenizer) -> tuple[Any, list[dict]]:
    """(the training prompts' source, the held-out records for rl.eval_every_steps), each without the prompts that
    cannot run (fitting)."""
    d = cfg.data
    fields = dict(prompt_field=d.prompt_field, messages_field=d.messages_field, answer_field=d.answer_field)
    train_src = pipeline.source(d.source, cfg.seed, d.math_levels, **fields)
    if isinstance(train_src, list):  # a prompt file (the built-in problems all fit)
        train_src = fitting(cfg, tokenizer, train_src, f"data.source {d.source}")
    held_out = (fitting(cfg, tokenizer, held_out_records(cfg, cfg.rl.eval_prompts), f"data.eval_source {d.eval_source}")
                if cfg.rl.eval_every_steps else [])
    return train_src, held_out


def prompts_digest(src) -> str:
    """What a training prompt source holds, for a resume to compare: 'math' for the built-in generator (its seed
    and levels are settings), else a hash of the records kept (the same file moved elsewhere is the same stream;
    a file rewritten with as many other records is not)."""
    if isinstance(src, pipeline.MathSource):
        return pipeline.MATH_SOURCE
    h = hashlib.sha256()
    for r in src:
        h.update(json.dumps(r, sort_keys=True, default=str).encode() + b"\n")
    return h.hexdigest()[:16]


def fitting(cfg: Config, tokenizer, records: list[dict], what: str) -> list[dict]:
    """The records whose prompt fits the largest prompt bucket and leaves the largest length bucket room for
    rl.max_new_tokens and the draft tree; the others are left out with a warning (verl's
    data.filter_overlong_prompts, its max_prompt_length), not found by the step that draws one. The draft tree's room
    is sd.strategies' with SD off too (prompt_margin): a run with SD off trains on the prompts it does with SD on."""
    limit, why = prompt_limit(cfg.rollout, cfg.rl.max_new_tokens, prompt_margin(cfg.sd))
    kept = [r for r in tqdm(records, desc="prompt lengths", unit="prompt", file=sys.stderr,
                            disable=len(records) < 10_000) if len(data_prompt_ids(cfg, r, tokenizer)) <= limit]
    if not kept:
        raise ConfigError(f"{what}: no prompt fits {why}; raise it")
    if len(kept) < len(records):
        log.warning("%s: %d of %d prompts are longer than %s and are left out; raise it to keep them",
                    what, len(records) - len(kept), len(records), why)
    return kept


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False, stream=sys.stdout) -> list[dict[str, Any]]:
    """Checks the run (preflight), its prompts (prompt_sources, with the tokenizer) and rl.out_dir
    (run_dir.prepare_run_dir: --resume needs a checkpoint, a fresh run never writes over an earlier one unless
    `overwrite` moves it aside), loads the policy named by cfg.model, then runs GRPO to cfg.rl.steps."""
    mesh = make_mesh(cfg.mesh)
    preflight(cfg, mesh.shape["data"] * mesh.shape["fsdp"])  # before loading a model, or touching a run
    replicas = local_replicas(mesh)  # refuses a replica spanning hosts, which the check below would count as none
    if cfg.sd.uses_drafter() and cfg.drafter_online.enabled:  # as Trainer turns it on
        check_settings(cfg.drafter_online, len(replicas))
    if warning := memory_warning(cfg, mesh.size, (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")):
        log.warning(warning)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
    sources = prompt_sources(cfg, tokenizer)  # before the weights and the run: prompts none of which can run are refused
    run_dir.prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
    if cfg.rl.drafter_path and cfg.sd.mode == "off":
        log.warning("rl.drafter_path is set but sd.mode is off: the drafter is not used (set sd.mode=adaptive)")
    elif cfg.rl.drafter_path:
        drafter_dir(cfg.rl.drafter_path)  # before the model loads
    policy = load_policy(cfg.model, mesh, tokenizer=tokenizer)
    trainer = Trainer(cfg, policy.model, policy.tokenizer, resume=resume, stream=stream, sources=sources)
    return trainer.run()


# What orders the prompt stream: a resume's saved position (a batch index) means the same prompts only under these,
# and the same records (prompts_digest; for checkpoints without one, the RECORD_KEYS that name them).
STREAM_KEYS = ("seed", "rl.prompts_per_step", "data.shuffle", "data.math_levels")
RECORD_KEYS = ("data.source", "data.prompt_field", "data.messages_field", "data.answer_field")
# Settings (sections, or single keys) that shape what a checkpoint holds: the policy, its optimizer state, the
# reference policy, the drafter and its optimizer, the history store.
STATE_KEYS = ("model", "optim", "rl.kl_coef", "rl.drafter_path", "sd.mode", "sd.strategies", "sd.history",
              "drafter_train", "drafter_online")
# Checkpoint items a resume may find missing (their setting was off when the step was saved): they start fresh.
OPTIONAL_ITEMS = ("drafter", "drafter_optimizer", "history", "controller")


def _config_changes(saved: dict, now: dict, keys: tuple[str, ...]) -> list[str]:
    """'key (was X, now Y)' for each setting under `keys` (a section or a dotted key) that differs between a
    checkpoint's config and this run's (to_dict form); a checkpoint without a saved config compares nothing."""
    def flat(d, prefix=""):
        if not isinstance(d, dict):
            return {prefix: d}
        return {k: v for key, value in d.items() for k, v in flat(value, f"{prefix}{key}.").items()} or {prefix: d}

    if not saved:
        return []
    was, is_ = flat(saved), flat(json.loads(json.dumps(now)))  # tuples as the checkpoint's JSON holds them: lists
    ours = lambda key: any(f"{key}.".startswith(f"{k}.") for k in keys)  # noqa: E731
    return [f"{key.rstrip('.')} (was {was.get(key)!r}, now {is_.get(key)!r})"
            for key in sorted(set(was) | set(is_)) if ours(key.rstrip(".")) and was.get(key) != is_.get(key)]
