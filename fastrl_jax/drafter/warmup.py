"""Warm-up drafter training: generate with the policy, keep tokens and hidden states, train, evaluate.

One run lives in drafter_train.out_dir:
  data.npz          the collected sample buffer (a rerun or resume skips generation)
  data.json         the settings it was collected with (a rerun with others is refused)
  data.partial/     a collection under way, saved as it goes: a rerun after an interruption generates only the rest
  checkpoints/      RunCheckpointer steps: drafter params, optimizer state, trainer position
  metrics.jsonl     one JSON line per log step and per evaluation; tensorboard/ the same as scalars
  drafter/          the trained drafter alone (Orbax, models.drafter_io.load_drafter), written at the end
  summary.json      data, timing and final held-out acceptance lengths
  config.yaml       the resolved config of the latest start (fastrl-jax ... --config config.yaml reruns it)
Resuming (the default when checkpoints exist) continues the same run: batches and noise are
functions of (seed, step), so the steps after a restart are the steps the run would have taken;
a finished run started again with the same settings is left as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import signal
import sys
import time
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from fastrl_jax import files, signals
from fastrl_jax.checkpoint import RunCheckpointer, checkpoint_steps, read_arrays, write_arrays
from fastrl_jax.config import Config, ConfigError, SpecConfig, TrainingStopped, save_config, to_dict
from fastrl_jax.data.prompts import drafter_training_prompts, held_out_sets
from fastrl_jax.drafter.buffer import SampleBuffer
from fastrl_jax.drafter.train import LossSettings, drafter_optimizer, make_train_step
from fastrl_jax.drafter.vocab import coverage, select_draft_vocab
from fastrl_jax.metric_sink import MetricsSink, check_wandb
from fastrl_jax.models.decoder import DTYPES, Decoder, cast_floating
from fastrl_jax.models.drafter import Drafter, feature_layers
from fastrl_jax.models.drafter_io import save_drafter
from fastrl_jax.models.tokenizer import stop_ids
from fastrl_jax.rollout.engine import Request, RolloutEngine
from fastrl_jax.rollout.requests import sampling_problem

# Seconds of generation an interrupted collection may lose: what it collected is saved this often.
PARTIAL_SAVE_SECONDS = 60.0


def partial_dir(data_file: Path) -> Path:
    """Where an interrupted collection of data_file keeps its files (PartialData): DATA.partial beside it."""
    return data_file.with_name(data_file.stem + ".partial")


class PartialData:
    """A collection under way, saved as it goes to DIR/FIRST.npz files, each the buffer's sequences of the
    requests FIRST, FIRST + 1, ... (with how many it covers), so a rerun after an interruption adds them
    to its buffer and generates only the requests after them."""

    def __init__(self, directory: Path, buffer: SampleBuffer):
        self.directory, self.buffer = directory, buffer
        self.first = 0  # the first request no file covers
        self._requests = self._sequences = 0  # requests since the last save, and the sequences they added
        self._added = buffer.added  # the buffer's count of added sequences at the last save
        self._saved_at = time.perf_counter()

    def load(self) -> int:
        """Adds the saved sequences to the buffer, in order; returns how many requests they cover. Files after a
        gap or an unreadable one are removed (their requests are generated again)."""
        saved = sorted((f for f in self.directory.glob("*.npz") if f.stem.isdigit()), key=lambda f: int(f.stem))
        for i, f in enumerate(saved):
            try:
                if int(f.stem) != self.first:
                    raise ValueError("not the next requests")
                arrays = read_arrays(f)
                covers = int(arrays["requests"])
                SampleBuffer(self.buffer.max_tokens, self.buffer.hidden_size).load(f)  # whole, before the buffer takes it
                if len(arrays["lengths"]) < int(arrays.get("sequences", 0)):  # some were evicted before the save,
                    self.buffer.clear()  # so was everything older: what the file holds is all the buffer held
                self.buffer.load(f)
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
                print(f"[train-drafter] {f} is left out ({e}): the requests from {self.first} on are generated again",
                      file=sys.stderr)
                for later in saved[i:]:
                    later.unlink(missing_ok=True)
                break
            self.first += covers
        self._added = self.buffer.added
        return self.first

    def added(self, sequences: int) -> None:
        """One more request went into the buffer, adding `sequences` (0 or 1); saves every PARTIAL_SAVE_SECONDS."""
        self._requests, self._sequences = self._requests + 1, self._sequences + sequences
        if time.perf_counter() - self._saved_at >= PARTIAL_SAVE_SECONDS:
            self.save()

    def save(self) -> None:
        """Writes the requests since the last save (those of their sequences the buffer still holds, with how many
        they added: where the buffer evicted some of them, it evicted every older one too, and a rerun's buffer
        holds only these; not one added after the last call of `added`, which an interruption may leave behind)."""
        if self._requests:
            self.directory.mkdir(parents=True, exist_ok=True)
            sequences = self.buffer.arrays(range(self._added, self._added + self._sequences))
            write_arrays(self.directory / f"{self.first}.npz",
                         {**sequences, "requests": np.array(self._requests), "sequences": np.array(self._sequences)})
            self.first, self._added = self.first + self._requests, self._added + self._sequences
            self._requests = self._sequences = 0
        self._saved_at = time.perf_counter()

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def collect(engine: RolloutEngine, requests: list[Request], buffer: SampleBuffer, step: int = 0,
            progress: bool = True, partial: PartialData | None = None) -> dict[str, float]:
    """Generates `requests` as one stream and adds (prompt + completion, hidden states, completion mask)
    to the buffer in request order (so the buffer does not depend on which rows finished first);
    a completion leaves memory once it and every earlier one are in the buffer. `partial`, when given,
    saves what is in the buffer as it goes, and when the collection is interrupted."""
    t0, tokens, generated, added, waiting, next_i = time.perf_counter(), 0, 0, 0, {}, 0
    failed: list[str] = []  # the engine's reasons, in the order the requests failed
    bar = tqdm(total=len(requests), desc="collect", unit="seq", file=sys.stderr, disable=not progress)
    try:
        for i, completion in engine.stream(requests):
            if completion.finish_reason == "error":
                failed.append(completion.error or "?")
            waiting[i], generated = completion, generated + len(completion.tokens)
            while next_i in waiting:
                seqs, new_tokens = buffer.add_rollouts([requests[next_i]], [waiting.pop(next_i)], step)
                added, tokens, next_i = added + seqs, tokens + new_tokens, next_i + 1
                if partial is not None:
                    partial.added(seqs)
            bar.update(1)
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - t0):.0f}")  # the buffer adds in request order
    except BaseException:  # Ctrl-C, a failed program: a rerun starts after what the buffer holds
        if partial is not None:
            partial.save()
        raise
    bar.close()
    if failed:
        print(f"[train-drafter] {len(failed)} of {len(requests)} requests failed and add nothing to the data (the "
              f"first: {failed[0]})", file=sys.stderr)
    seconds = time.perf_counter() - t0
    return {"generated_tokens": tokens, "generate_seconds": seconds, "skipped": len(requests) - added,
            "failed": len(failed), "first_failure": failed[0] if failed else None,
            "generate_tok_s": tokens / seconds, "idle_row_steps": engine.stats.idle_row_steps,
            "prefill_share": engine.stats.seconds["prefill"] / seconds}


def acceptance(engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int, temperature: float,
               stop: tuple[int, ...], seed: int = 0) -> float:
    """Mean accepted tokens per speculative step over the prompts (engine with sd on)."""
    reqs = [Request(p, max_new_tokens, temperature, seed=seed + i, stop_ids=stop) for i, p in enumerate(prompts)]
    failed = [c.error for c in engine.generate(reqs) if c.finish_reason == "error"]
    if failed:  # the figure is over the rest (NaN over none): say so
        print(f"[train-drafter] {len(failed)} of {len(reqs)} held-out prompts cannot run ({failed[0]}); the acceptance "
              "length is over the rest", file=sys.stderr)
    return engine.stats.acceptance_length()


def check_restart(cfg: Config, resume: bool) -> None:
    """Refuses (before anything is loaded or generated) a missing drafter_train.prompts file, collected data (or an
    interrupted collection) in drafter_train.out_dir from other settings (check_data), to start the out_dir afresh when it
    already holds checkpoints and `resume` is off, and to resume from past drafter_train.steps; and completion lengths
    the engine cannot hold (collected, or the held-out evaluation's with its draft tree: its figures came out NaN after
    the whole run)."""
    dt = cfg.drafter_train
    lengths = [("max_new_tokens", dt.max_new_tokens, dt.temperature, 0)]
    if dt.eval_prompts:
        lengths.append(("eval_max_new_tokens", dt.eval_max_new_tokens, 0.0, dt.eval_strategy[2] - 1))
    for name, max_new, temperature, margin in lengths:
        if problem := sampling_problem(max_new, temperature, 0, 1.0, cfg.rollout, margin):
            raise ConfigError(f"drafter_train.{name}: {problem}")
    prompts = cfg.drafter_train.prompts
    if prompts != "builtin" and not Path(prompts).expanduser().is_file():
        raise FileNotFoundError(f"drafter_train.prompts: no file {prompts} ('builtin' or a JSONL file of prompts)")
    check_wandb("drafter_train.wandb_project", cfg.drafter_train.wandb_project)
    data_file = Path(cfg.drafter_train.out_dir).expanduser() / "data.npz"
    partial = partial_dir(data_file)
    if data_file.is_file() or any(partial.glob("*.npz")):  # a collection under other settings would be deleted
        check_data(cfg, data_file if data_file.is_file() else partial)
    steps = checkpoint_steps(cfg.drafter_train.out_dir)
    if steps and not resume:
        raise ValueError(f"{Path(cfg.drafter_train.out_dir).expanduser() / 'checkpoints'} already holds checkpoints "
                         f"(up to step {steps[-1]}): resume (drop --restart), or choose another drafter_train.out_dir")
    if steps and steps[-1] > cfg.drafter_train.steps:  # resuming would train nothing and call it a shorter run
        raise ValueError(f"{Path(cfg.drafter_train.out_dir).expanduser() / 'checkpoints'} holds checkpoints up to step "
                         f"{steps[-1]}, past drafter_train.steps={cfg.drafter_train.steps}: raise it to at least "
                         f"{steps[-1]}, or choose another drafter_train.out_dir")


def train_drafter(cfg: Config, policy: Decoder, tokenizer, *, resume: bool = True, progress: bool = True) -> dict:
    """Runs the whole warm-up (collect, choose the draft vocabulary, train, evaluate, save); returns the summary.

    policy: in the engines' dtype (model.rollout_dtype); it generates the data and its features train
    the drafter, whose own weights train in model.dtype (float32) and are cast for the evaluations."""
    dt = cfg.drafter_train
    check_restart(cfg, resume)
    t_start = time.perf_counter()
    out_dir = Path(dt.out_dir).expanduser().resolve()
    done = out_dir / "summary.json"  # written last
    summary: dict = {"config": dataclasses.asdict(dt), "seed": cfg.seed}
    if done.is_file() and (out_dir / "drafter").is_dir() and checkpoint_steps(out_dir)[-1:] == [dt.steps]:
        finished = json.loads(done.read_text())
        # The same settings again would evaluate again (a second final row in metrics.jsonl) and write a summary
        # without the data collection's figures.
        if {k: finished.get(k) for k in summary} == json.loads(json.dumps(summary)):
            print(f"[train-drafter] {out_dir} holds this run, finished at step {dt.steps}: nothing to do (delete "
                  f"{done} to evaluate it again, or raise drafter_train.steps to train on)", file=sys.stderr)
            return finished
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir / "config.yaml")
    stop = stop_ids(policy.cfg, tokenizer)
    buffer = collect_data(cfg, policy, tokenizer, out_dir / "data.npz", stop, summary, progress)
    counts = buffer.token_counts(policy.cfg.vocab_size)
    # A size covering the policy's whole vocabulary drafts over all of it, as an untrained drafter does (fresh_draft_vocab)
    vocab = select_draft_vocab(counts, dt.draft_vocab_size, stop) if 0 < dt.draft_vocab_size < policy.cfg.vocab_size else None
    if dt.draft_vocab_size >= policy.cfg.vocab_size:
        print(f"[train-drafter] drafter_train.draft_vocab_size {dt.draft_vocab_size} covers the policy's vocabulary of "
              f"{policy.cfg.vocab_size}: the drafter drafts over all of it", file=sys.stderr)
    if vocab is not None:
        summary["data"]["draft_vocab_coverage"] = coverage(counts, vocab)
        print(f"[train-drafter] draft vocabulary: {len(vocab)} tokens cover "
              f"{summary['data']['draft_vocab_coverage']:.2%} of completion tokens", file=sys.stderr)
    ckpt = RunCheckpointer(out_dir / "checkpoints", keep=dt.keep_checkpoints)
    # A resumed run drops the later lines
    sink = MetricsSink(out_dir, dt.tensorboard, ckpt.latest_step(), dt.wandb_project, to_dict(cfg))
    evaluate = HeldOutEvaluator(cfg, policy, tokenizer, stop, sink)
    drafter = Drafter(policy.cfg, nnx.Rngs(cfg.seed), DTYPES[cfg.model.dtype], draft_vocab=vocab, kind=dt.kind)
    t_train = time.perf_counter()
    try:
        drafter = train(cfg, policy, drafter, buffer, ckpt, sink, evaluate, progress)
    finally:  # on Ctrl-C too: the checkpoint being written completes, and a rerun resumes from it
        ckpt.close()
    summary["train_seconds"] = time.perf_counter() - t_train
    summary["steps"] = dt.steps
    final_dir = out_dir / "drafter"
    if final_dir.exists():
        shutil.rmtree(final_dir)
    save_drafter(final_dir, drafter)
    summary["final_eval"] = evaluate(drafter, dt.steps, temperatures=(0.0, 0.7))
    sink.close()
    summary["wall_seconds"] = time.perf_counter() - t_start
    summary["drafter"] = str(final_dir)
    files.write_text(done, json.dumps(summary, indent=2) + "\n")
    return summary


DATA_SETTINGS = ("kind", "prompts", "num_prompts", "chat_fraction", "instruction", "samples_per_prompt", "max_new_tokens",
                 "temperature", "buffer_max_tokens")


def data_settings(cfg: Config) -> dict:
    """The settings that shape the warm-up data (in JSON form): other values collect other data."""
    dt = cfg.drafter_train
    settings = {"model.path": cfg.model.path, "model.rollout_dtype": cfg.model.engine_dtype, "seed": cfg.seed,
                "data.math_levels": cfg.data.math_levels, **{f"drafter_train.{k}": getattr(dt, k) for k in DATA_SETTINGS}}
    if not cfg.data.chat_template:  # recorded only when off, so data collected before it was read still matches
        settings["data.chat_template"] = False
    if dt.prompts != "builtin":
        settings["drafter_train.prompts (sha256)"] = hashlib.sha256(Path(dt.prompts).expanduser().read_bytes()).hexdigest()
    return json.loads(json.dumps(settings))


def check_data(cfg: Config, data_file: Path) -> None:
    """Refuses to reuse data_file (data.npz, or an interrupted collection's data.partial) when the settings it was
    collected with (data.json beside it) differ from cfg's; data collected before the settings were recorded passes
    unchecked."""
    record = data_file.with_suffix(".json")
    if not record.is_file():
        return
    was, now = json.loads(record.read_text()), data_settings(cfg)
    changed = [f"{k} (was {was.get(k)!r}, now {now.get(k)!r})" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    if changed:
        # Checkpoints of another policy or drafter kind cannot go on (they would be found unreadable after the collection)
        other_drafter = any(was.get(k) != now.get(k) for k in ("model.path", "drafter_train.kind"))
        keep = ("and its checkpoints (drafter_train.out_dir's checkpoint steps: they are another policy's or kind's)"
                if other_drafter else "(its checkpoints then continue on the new data)")
        raise ValueError(f"{data_file} was collected with other settings: {'; '.join(changed)}. Delete it {keep} to "
                         "collect again, restore the settings, or give a new drafter_train.out_dir")


def collect_data(cfg: Config, policy: Decoder, tokenizer, data_file: Path, stop, summary: dict, progress: bool) -> SampleBuffer:
    """The training data: the policy's answers to the warm-up prompts with their hidden states, generated
    once and saved to data_file with its settings beside it (a rerun or resume with the same settings reads
    it back)."""
    dt = cfg.drafter_train
    layers = feature_layers(dt.kind, policy.cfg.num_layers)
    buffer = SampleBuffer(dt.buffer_max_tokens, policy.cfg.hidden_size * max(len(layers), 1))
    if data_file.is_file():
        try:
            buffer.load(data_file)
        except ValueError as e:
            raise ValueError(f"{e}: drafter_train.kind {dt.kind} reads layers {list(layers)} of this policy; delete "
                             f"{data_file} to collect again, or give a new drafter_train.out_dir") from None
        except (KeyError, EOFError, zipfile.BadZipFile) as e:  # damaged inside (a zip's directory read)
            raise ValueError(f"{data_file} is damaged ({e}): delete it to collect again") from None
        unchecked = "" if data_file.with_suffix(".json").is_file() else " (no record of its settings: not checked)"
        print(f"[train-drafter] reusing {len(buffer)} sequences ({buffer.num_tokens} tokens) from {data_file}{unchecked}",
              file=sys.stderr)
    else:
        requests = [Request(p, dt.max_new_tokens, dt.temperature, seed=cfg.seed * 1_000_003 + i * dt.samples_per_prompt + k,
                            stop_ids=stop)
                    for i, p in enumerate(drafter_training_prompts(cfg, tokenizer)) for k in range(dt.samples_per_prompt)]
        # The record comes first: it tells a rerun whether an interrupted collection's files are of its settings
        record, settings, start = data_file.with_suffix(".json"), data_settings(cfg), 0
        partial = PartialData(partial_dir(data_file), buffer)
        if record.is_file() and json.loads(record.read_text()) == settings:
            start = partial.load()
            if start:
                print(f"[train-drafter] continuing an interrupted collection: {start} of {len(requests)} requests were "
                      f"saved in {partial.directory}", file=sys.stderr)
        else:
            partial.remove()
            files.write_text(record, json.dumps(settings, indent=2) + "\n")
        engine = RolloutEngine(policy, dataclasses.replace(cfg.rollout, warm_up=False), keep_hidden=True, progress=progress,
                               feature_layers=layers)
        summary["collect"] = {**collect(engine, requests[start:], buffer, progress=progress, partial=partial),
                              "resumed_requests": start}
        del engine
        if not len(buffer):  # kept, the empty data (and the partial files covering those requests) would be reused
            partial.remove()
            data_file.with_suffix(".json").unlink(missing_ok=True)
            why = summary["collect"]["first_failure"] or "no completion had a token to learn"
            raise ValueError(f"the collection added no sequence to train on ({why}); fix that (e.g. rollout.prompt_buckets "
                             "and rollout.length_buckets must hold the prompts and drafter_train.max_new_tokens) and run "
                             "again")
        buffer.save(data_file)
        partial.remove()
    summary["data"] = {"sequences": len(buffer), "tokens": buffer.num_tokens}
    return buffer


def train(cfg: Config, policy: Decoder, drafter: Drafter, buffer: SampleBuffer, ckpt: RunCheckpointer,
          sink: MetricsSink, evaluate: HeldOutEvaluator, progress: bool) -> Drafter:
    """drafter_train.steps optimizer steps from ckpt's latest checkpoint (or the start), logging to the
    sink, checkpointing and evaluating on the way; returns the trained drafter."""
    dt = cfg.drafter_train
    dgraphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    pgraphdef, pstate = nnx.split(policy)
    optimizer = drafter_optimizer(dt.learning_rate, dt.warmup_steps, dt.steps, dt.weight_decay, dt.grad_clip_norm)
    opt_state = optimizer.init(params)
    train_step = make_train_step(optimizer, LossSettings(dt.ce_weight, dt.input_noise, dt.unroll_steps, dt.unroll_decay))
    start, evaluated = 0, True  # evaluated: the held-out evaluation of the step training starts from is written
    if ckpt.latest_step() is not None:
        start, arrays, meta = ckpt.restore(None, {"params": nnx.to_pure_dict(params), "opt_state": opt_state}, ["trainer"])
        evaluated = meta["trainer"].get("evaluated", True)
        nnx.replace_by_pure_dict(params, arrays["params"])
        opt_state = arrays["opt_state"]
        unreadable = [s for s in ckpt.all_steps() if s > start]
        if unreadable:  # saved afresh when training gets there again; keep-k would otherwise prune the good step
            where = ckpt.set_aside(unreadable)
            sink.drop_after(start)
            print(f"[train-drafter] moved unreadable checkpoint steps {unreadable} to {where}", file=sys.stderr)
        print(f"[train-drafter] resuming at step {start} from {ckpt.directory}", file=sys.stderr)
    log = _StepLog(sink)
    base_key = jax.random.key(cfg.seed)
    bar = tqdm(total=dt.steps, initial=start, desc="train-drafter", unit="step", file=sys.stderr, disable=not progress)

    def save(done, params, opt_state):
        meta = {"trainer": {"step": done, "evaluated": evaluated == done}}
        ckpt.save(done, {"params": nnx.to_pure_dict(params), "opt_state": opt_state}, meta)

    def due(step: int) -> bool:  # the held-out evaluation at this step
        return bool(dt.eval_every_steps) and step % dt.eval_every_steps == 0 and step != dt.steps

    last = (start, params, opt_state)  # the latest finished step, assigned at once: an interrupt sees one whole
    saved = start
    if due(start) and not evaluated:  # stopped inside it, with the step saved
        log.last_eval = evaluate(nnx.merge(dgraphdef, params, rest), start)
    evaluated = start
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    try:
        # A stop signal ends the run after the step under way, with that step saved; Ctrl-C again, at once
        with signals.deferred(stops, "train-drafter", at_once=(signal.SIGINT,)) as received:
            for step in range(start, dt.steps):
                batch = buffer.sample(np.random.default_rng([cfg.seed, step]), dt.batch_rows, dt.seq_len_tokens)
                batch = {k: jnp.asarray(v) for k, v in dataclasses.asdict(batch).items()}
                *state, m = train_step(dgraphdef, params, rest, opt_state, pgraphdef, pstate, batch,
                                       jax.random.fold_in(base_key, step))
                last = (step + 1, *state)
                done, params, opt_state = last
                log.pending.append(m)
                bar.update(1)
                if done % dt.log_every_steps == 0 or done == dt.steps or received:
                    bar.set_postfix(log.flush(done))
                if due(done):  # before the checkpoint, which says it ran
                    log.last_eval = evaluate(nnx.merge(dgraphdef, params, rest), done)
                evaluated = done
                if done % dt.checkpoint_every_steps == 0 or done == dt.steps or received:
                    saved = done
                    save(*last)
                if received and done < dt.steps:
                    raise TrainingStopped(f"{received[0]}: stopped after step {done} of {dt.steps}; its checkpoint "
                                          "is saved, and the same command again continues the run")
    except KeyboardInterrupt:  # Ctrl-C twice, or inside the first compile: the steps since the last checkpoint are kept
        if last[0] > saved and any(x.is_deleted() for x in jax.tree.leaves(last[1:])):
            # It came as the next step returned, before its result was taken: that step consumed (donated) these
            print(f"[train-drafter] interrupted inside step {last[0] + 1}, which had taken step {last[0]}'s state; "
                  f"a resume continues from step {saved}", file=sys.stderr)
        elif last[0] > saved:
            save(*last)
        raise
    bar.close()
    return nnx.merge(dgraphdef, params, rest)


class _StepLog:
    """Averages the train step metrics between log steps and writes them, with the latest evaluation."""

    def __init__(self, sink: MetricsSink):
        self.sink, self.pending, self.last_eval, self.t0 = sink, [], {}, time.perf_counter()

    def flush(self, step: int) -> dict[str, str]:
        """Writes the mean of the pending steps' metrics; returns the progress bar's postfix."""
        host = jax.device_get(self.pending)
        logged = {k: float(np.mean([float(x[k]) for x in host])) for k in host[0] if k != "entries"}
        logged["train_entries_per_s"] = sum(float(x["entries"]) for x in host) / (time.perf_counter() - self.t0)
        self.pending, self.t0 = [], time.perf_counter()
        self.sink.write({"step": step, **logged})
        return {"loss": f"{logged['loss']:.3f}", "acc0": f"{logged['acc_0']:.2f}",
                **{k.replace("accept_", "al_"): f"{v:.2f}" for k, v in self.last_eval.items() if k.startswith("accept")}}


class HeldOutEvaluator:
    """Acceptance lengths of a drafter on the held-out math and chat prompts (drafter_train.eval_*),
    through an engine with speculative decoding always on (built at the first call, then reused)."""

    def __init__(self, cfg: Config, policy: Decoder, tokenizer, stop, sink: MetricsSink):
        self.cfg, self.policy, self.stop, self.sink = cfg, policy, stop, sink
        dt = cfg.drafter_train
        self.sets = held_out_sets(cfg, tokenizer, dt.eval_prompts) if dt.eval_prompts else {}
        self.engine: RolloutEngine | None = None

    def __call__(self, drafter: Drafter, step: int, temperatures=(0.0,)) -> dict[str, float]:
        if not self.sets:
            return {}
        dt = self.cfg.drafter_train
        drafter = cast_floating(drafter, self.policy.embed[...].dtype)  # the engine runs the policy's dtype
        if self.engine is None:
            steps, topk, verify = dt.eval_strategy
            sd = SpecConfig(mode="on", steps=steps, topk=topk, verify_tokens=verify)
            rollout = dataclasses.replace(self.cfg.rollout, warm_up=False)
            self.engine = RolloutEngine(self.policy, rollout, sd=sd, drafter=drafter, progress=False)
        else:
            self.engine.update_drafter(drafter)
        t0 = time.perf_counter()
        res = {f"accept_{name}_t{t:g}": acceptance(self.engine, prompts, dt.eval_max_new_tokens, t, self.stop, self.cfg.seed)
               for t in temperatures for name, prompts in self.sets.items()}
        res["eval_seconds"] = time.perf_counter() - t0
        self.sink.write({"step": step, **{k: float(v) for k, v in res.items()}})
        return res
