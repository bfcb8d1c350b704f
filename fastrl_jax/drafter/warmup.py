"""Warm-up drafter training: generate with the policy, keep tokens and hidden states, train, evaluate.

One run lives in drafter_train.out_dir:
  data.npz          the collected sample buffer (a rerun or resume skips generation)
  checkpoints/      RunCheckpointer steps: drafter params, optimizer state, trainer position
  metrics.jsonl     one JSON line per log step and per evaluation; tensorboard/ the same as scalars
  drafter/          the trained drafter alone (Orbax, checkpoint.load_drafter), written at the end
  summary.json      data, timing and final held-out acceptance lengths
  config.yaml       the resolved config of the latest start (fastrl-jax ... --config config.yaml reruns it)
Resuming (the default when checkpoints exist) continues the same run: batches and noise are
functions of (seed, step), so the steps after a restart are the steps the run would have taken.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from fastrl_jax.checkpoint import RunCheckpointer, save_drafter
from fastrl_jax.config import Config, SpecConfig, save_config
from fastrl_jax.data.prompt_files import read_prompt_file
from fastrl_jax.metrics import MetricsSink
from fastrl_jax.data import chat_prompts, math_problems
from fastrl_jax.drafter.buffer import SampleBuffer
from fastrl_jax.drafter.train import LossSettings, make_optimizer, make_train_step
from fastrl_jax.drafter.vocab import coverage, select_draft_vocab
from fastrl_jax.models.decoder import DTYPES, Decoder
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.models.tokenizer import chat_prompt_ids, stop_ids
from fastrl_jax.rollout.engine import Request, RolloutEngine

HELD_OUT_SEED_OFFSET = 7_000_001  # held-out math problems come from another stream of the generator


def math_prompt_ids(tokenizer, seed: int, count: int, levels, instruction: str) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, f"{p.question} {instruction}".strip())
            for p in math_problems.problems(seed, count, tuple(levels))]


def training_prompt_ids(cfg: Config, tokenizer) -> list[list[int]]:
    """The warm-up prompts: built-in math + chat (interleaved) or a JSONL file."""
    dt = cfg.drafter_train
    if dt.prompts != "builtin":
        return read_jsonl_prompts(dt.prompts, tokenizer)[: dt.num_prompts]
    n_chat = round(dt.num_prompts * dt.chat_fraction)
    math_ids = math_prompt_ids(tokenizer, cfg.seed, dt.num_prompts - n_chat, cfg.data.math_levels, dt.instruction)
    chat_ids = [chat_prompt_ids(tokenizer, t) for t in chat_prompts.train_prompts(cfg.seed, n_chat)]
    # Interleaved, so every generation chunk mixes both kinds.
    out, i, j = [], 0, 0
    while i < len(math_ids) or j < len(chat_ids):
        if j >= len(chat_ids) or (i < len(math_ids) and i * len(chat_ids) <= j * len(math_ids)):
            out.append(math_ids[i])
            i += 1
        else:
            out.append(chat_ids[j])
            j += 1
    return out


def held_out_sets(cfg: Config, tokenizer, count: int) -> dict[str, list[list[int]]]:
    """Held-out prompts: math problems of another generator stream, and hand-written chat prompts."""
    dt = cfg.drafter_train
    return {
        "math": math_prompt_ids(tokenizer, cfg.seed + HELD_OUT_SEED_OFFSET, count, cfg.data.math_levels, dt.instruction),
        "chat": [chat_prompt_ids(tokenizer, t) for t in chat_prompts.held_out_prompts(count)],
    }


def read_jsonl_prompts(path: str | Path, tokenizer) -> list[list[int]]:
    """{"prompt": text} (chat template applied) or {"prompt_ids": [ints]} per line."""
    return read_prompt_file(path, lambda text: chat_prompt_ids(tokenizer, text))


def collect(engine: RolloutEngine, requests: list[Request], buffer: SampleBuffer, step: int = 0,
            chunk: int = 512, progress: bool = True) -> dict[str, float]:
    """Generates `requests` and adds (prompt + completion, hidden states, completion mask) to buffer.

    Requests go to the engine `chunk` at a time: the engine refills finished rows from its queue, so
    a large chunk keeps the batch full; the chunk bounds the completions' hidden states held at once."""
    t0, tokens, skipped = time.perf_counter(), 0, 0
    bar = tqdm(total=len(requests), desc="collect", unit="seq", file=sys.stderr, disable=not progress)
    for lo in range(0, len(requests), chunk):
        part = requests[lo : lo + chunk]
        added, new_tokens = buffer.add_rollouts(part, engine.generate(part), step)
        skipped += len(part) - added
        tokens += new_tokens
        bar.update(len(part))
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    seconds = time.perf_counter() - t0
    return {"generated_tokens": tokens, "generate_seconds": seconds, "skipped": skipped,
            "generate_tok_s": tokens / seconds}


def acceptance(engine: RolloutEngine, prompts: list[list[int]], max_new_tokens: int, temperature: float,
               stop: tuple[int, ...], seed: int = 0) -> float:
    """Mean accepted tokens per speculative step over the prompts (engine with sd on)."""
    reqs = [Request(p, max_new_tokens, temperature, seed=seed + i, stop_ids=stop) for i, p in enumerate(prompts)]
    engine.generate(reqs)
    return float(engine.stats.get("acceptance_length", float("nan")))


def train_drafter(cfg: Config, policy: Decoder, tokenizer, *, resume: bool = True, progress: bool = True) -> dict:
    """Runs the whole warm-up (collect, choose the draft vocabulary, train, evaluate, save); returns the summary."""
    dt = cfg.drafter_train
    t_start = time.perf_counter()
    out_dir = Path(dt.out_dir).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir / "config.yaml")
    model_cfg = policy.cfg
    stop = stop_ids(model_cfg, tokenizer)
    rollout_cfg = dataclasses.replace(cfg.rollout, warm_up=False)
    summary: dict = {"config": dataclasses.asdict(dt), "seed": cfg.seed}

    # ---- data ------------------------------------------------------------------------------
    buffer = SampleBuffer(dt.buffer_max_tokens, model_cfg.hidden_size)
    data_file = out_dir / "data.npz"
    if data_file.is_file():
        buffer.load(data_file)
        print(f"[train-drafter] reusing {len(buffer)} sequences ({buffer.num_tokens} tokens) from {data_file}", file=sys.stderr)
    else:
        prompts = training_prompt_ids(cfg, tokenizer)
        requests = [Request(p, dt.max_new_tokens, dt.temperature, seed=cfg.seed * 1_000_003 + i * dt.samples_per_prompt + k,
                            stop_ids=stop) for i, p in enumerate(prompts) for k in range(dt.samples_per_prompt)]
        engine = RolloutEngine(policy, rollout_cfg, keep_hidden=True, progress=progress)
        summary["collect"] = collect(engine, requests, buffer, progress=progress)
        del engine
        buffer.save(data_file)
    summary["data"] = {"sequences": len(buffer), "tokens": buffer.num_tokens}

    counts = buffer.token_counts(model_cfg.vocab_size)
    vocab = select_draft_vocab(counts, dt.draft_vocab_size, stop) if dt.draft_vocab_size else None
    if vocab is not None:
        summary["data"]["draft_vocab_coverage"] = coverage(counts, vocab)
        print(f"[train-drafter] draft vocabulary: {len(vocab)} tokens cover "
              f"{summary['data']['draft_vocab_coverage']:.2%} of completion tokens", file=sys.stderr)

    # ---- model, optimizer, resume ----------------------------------------------------------
    dtype = DTYPES[cfg.model.dtype]
    drafter = Drafter(model_cfg, nnx.Rngs(cfg.seed), dtype, draft_vocab=vocab)
    dgraphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    pgraphdef, pstate = nnx.split(policy)
    optimizer = make_optimizer(dt.learning_rate, dt.warmup_steps, dt.steps, dt.weight_decay, dt.grad_clip_norm)
    opt_state = optimizer.init(params)
    settings = LossSettings(dt.ce_weight, dt.input_noise, dt.unroll_steps, dt.unroll_decay)
    train_step = make_train_step(optimizer, settings)

    ckpt = RunCheckpointer(out_dir / "checkpoints", keep=dt.keep_checkpoints)
    start = 0
    if resume and ckpt.latest_step() is not None:
        start, arrays, _ = ckpt.restore(None, {"params": nnx.to_pure_dict(params), "opt_state": opt_state})
        nnx.replace_by_pure_dict(params, arrays["params"])
        opt_state = arrays["opt_state"]
        print(f"[train-drafter] resuming at step {start} from {ckpt.directory}", file=sys.stderr)
    elif ckpt.latest_step() is not None:
        raise ValueError(f"{ckpt.directory} already holds checkpoints: resume, or choose another drafter_train.out_dir")
    metrics_out = MetricsSink(out_dir, dt.tensorboard, start if start else None)

    eval_engine = None
    eval_sets = held_out_sets(cfg, tokenizer, dt.eval_prompts) if dt.eval_prompts else {}

    def evaluate(step: int, temperatures=(0.0,)) -> dict[str, float]:
        nonlocal eval_engine
        if not eval_sets:
            return {}
        d = nnx.merge(dgraphdef, params, rest)
        if eval_engine is None:
            steps_, topk, verify = dt.eval_strategy
            sd = SpecConfig(mode="on", steps=steps_, topk=topk, verify_tokens=verify)
            eval_engine = RolloutEngine(policy, rollout_cfg, sd=sd, drafter=d, progress=False)
        else:
            eval_engine.update_drafter(d)
        t0 = time.perf_counter()
        res = {f"accept_{name}_t{t:g}": acceptance(eval_engine, prompts, dt.eval_max_new_tokens, t, stop, cfg.seed)
               for t in temperatures for name, prompts in eval_sets.items()}
        res["eval_seconds"] = time.perf_counter() - t0
        metrics_out.write({"step": step, **{k: float(v) for k, v in res.items()}})
        return res

    # ---- training ---------------------------------------------------------------------------
    base_key = jax.random.key(cfg.seed)
    pending: list[dict] = []
    last_eval: dict[str, float] = {}
    t_train = time.perf_counter()
    t_log = time.perf_counter()
    bar = tqdm(total=dt.steps, initial=start, desc="train-drafter", unit="step", file=sys.stderr, disable=not progress)
    for step in range(start, dt.steps):
        batch = buffer.sample(np.random.default_rng([cfg.seed, step]), dt.batch_rows, dt.seq_len_tokens)
        batch = {k: jnp.asarray(v) for k, v in dataclasses.asdict(batch).items()}
        params, opt_state, m = train_step(dgraphdef, params, rest, opt_state, pgraphdef, pstate, batch,
                                          jax.random.fold_in(base_key, step))
        pending.append(m)
        bar.update(1)
        done = step + 1
        if done % dt.log_every_steps == 0 or done == dt.steps:
            host = jax.device_get(pending)
            logged = {k: float(np.mean([float(x[k]) for x in host])) for k in host[0] if k != "entries"}
            entries = sum(float(x["entries"]) for x in host)
            logged["train_entries_per_s"] = entries / (time.perf_counter() - t_log)
            pending, t_log = [], time.perf_counter()
            metrics_out.write({"step": done, **logged})
            bar.set_postfix(loss=f"{logged['loss']:.3f}", acc0=f"{logged['acc_0']:.2f}",
                            **{k.replace("accept_", "al_"): f"{v:.2f}" for k, v in last_eval.items() if k.startswith("accept")})
        if done % dt.checkpoint_every_steps == 0 or done == dt.steps:
            ckpt.save(done, {"params": nnx.to_pure_dict(params), "opt_state": opt_state}, {"trainer": {"step": done}})
        if dt.eval_every_steps and done % dt.eval_every_steps == 0 and done != dt.steps:
            last_eval = evaluate(done)
    bar.close()
    ckpt.close()
    summary["train_seconds"] = time.perf_counter() - t_train
    summary["steps"] = dt.steps

    drafter = nnx.merge(dgraphdef, params, rest)
    final_dir = out_dir / "drafter"
    if final_dir.exists():
        shutil.rmtree(final_dir)
    save_drafter(final_dir, drafter)
    summary["final_eval"] = evaluate(dt.steps, temperatures=(0.0, 0.7))
    metrics_out.close()
    summary["wall_seconds"] = time.perf_counter() - t_start
    summary["drafter"] = str(final_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
