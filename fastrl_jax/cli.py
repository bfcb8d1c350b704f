"""The `fastrl-jax` command: one sub-command per job."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fastrl_jax import files
from fastrl_jax.config import ConfigError, TrainingStopped, temperature_problem


def _config(args: argparse.Namespace, defaults: Sequence[str] = ()):
    """A sub-command's config (--config, --model, train's KEY=VALUE overrides and --set, over
    `defaults`), with the compilation cache it names (rollout.compile_cache_dir) turned on."""
    from fastrl_jax.config import load_config

    # A literal, not YAML; outside ASCII as it is (a surrogate pair for an emoji would read back as two characters)
    model = [f"model.path={json.dumps(args.model, ensure_ascii=False)}"] if getattr(args, "model", None) else []
    return _with_cache(load_config(args.config, [*defaults, *model, *getattr(args, "overrides", []), *args.set]))


def _with_cache(cfg):
    """`cfg`, with the compilation cache it names (rollout.compile_cache_dir) turned on."""
    from fastrl_jax.rollout.pool import enable_persistent_cache

    if cfg.rollout.compile_cache_dir:
        try:
            enable_persistent_cache(cfg.rollout.compile_cache_dir)
        except OSError as e:  # e.g. a read-only home directory under the default ~/.cache/fastrl_jax/xla
            raise ConfigError(f"rollout.compile_cache_dir {cfg.rollout.compile_cache_dir} cannot be created ({e.strerror}: "
                              f"{e.filename}): set it to a writable directory, or to '' to compile without it") from None
    return cfg


def _policy(cfg, tokenizer=None):
    """The policy in the engines' dtype (model.rollout_dtype, else model.dtype): every command but
    `train` uses it for inference (train-drafter reads its features, never updates it). tokenizer: one
    a command already loaded to check its prompts."""
    from fastrl_jax.models.loading import load_policy
    from fastrl_jax.sharding import make_mesh

    return load_policy(cfg.model, make_mesh(cfg.mesh), cfg.model.engine_dtype, tokenizer)


def _read_prompts(args, tokenizer, chat_template: bool) -> list[list[int]]:
    from fastrl_jax.data.prompt_files import read_prompt_file
    from fastrl_jax.data.prompts import chat_prompt_ids

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text) if args.raw else chat_prompt_ids(tokenizer, text, chat_template)

    if args.prompt is not None:
        return [encode(args.prompt)]
    return read_prompt_file(args.prompts, encode)


def check_output_file(path: str, flag: str, reads: Sequence[tuple[str, str | None]] = ()) -> Path:
    """An output file's path, checked before any work: not a directory, in an existing writable directory, and
    none of the files the command reads (reads: (its flag or key, path) pairs), which the output would replace."""
    out = Path(path).expanduser()
    for what, read in reads:
        if read and out.resolve() == Path(read).expanduser().resolve():
            raise ConfigError(f"{flag} {path} is a file the command reads ({what}): the output would replace it; "
                              f"give another {flag} path")
    if out.is_dir():
        raise ValueError(f"{flag} {out} is a directory; give the path of a file (in it, or elsewhere)")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{flag} {out}: directory {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"{flag} {out} is not writable")
    return out


def check_output_dir(path: str, key: str) -> None:
    """A directory a command creates (or adds to), checked before any work: it, or the nearest part of its
    path that exists, is a directory this user may write in."""
    out = Path(path).expanduser()
    where = next(p for p in (out, *out.parents) if p.exists())
    if not where.is_dir():
        raise ConfigError(f"{key} {out}: {where} is a file; set {key} to a directory path")
    if not os.access(where, os.W_OK):
        raise ConfigError(f"{key} {out} is not writable (by this user, in {where})")


_SPEC_FLAGS = (("spec_steps", "steps"), ("spec_topk", "topk"), ("spec_verify_tokens", "verify_tokens"),
               ("spec_accept", "accept"), ("spec_strategy", "strategies"))
_TREE_FLAGS = ("spec_steps", "spec_topk", "spec_verify_tokens")


def _generate_config(args: argparse.Namespace):
    """generate's config: --sd and --spec-* over the config's sd section, programs compiled when reached."""
    if not 0 <= args.seed < 2**32:  # the engine keys sampling by a uint32: -1 would sample as 2**32 - 1
        raise ConfigError(f"--seed must be in [0, 2**32) (request i samples with seed + i), got {args.seed}")
    spec_flags = [f"--{name.replace('_', '-')}" for name, _ in _SPEC_FLAGS if getattr(args, name) is not None]
    if args.sd == "off" and (args.drafter or spec_flags):
        used = (["--drafter"] if args.drafter else []) + spec_flags
        raise ConfigError(f"{', '.join(used)} {'applies' if len(used) == 1 else 'apply'} only to speculative decoding: "
                          "add --sd on or --sd adaptive (or drop it)")
    tree = [f"--{name.replace('_', '-')}" for name in _TREE_FLAGS if getattr(args, name) is not None]
    if args.spec_strategy and tree:
        raise ConfigError(f"--spec-strategy names the whole strategy, so {', '.join(tree)} would be ignored: give "
                          "--spec-strategy S/K/V alone, or the tree flags without it")
    spec = [f"sd.mode={args.sd!r}"] + [f"sd.{key}={getattr(args, name)!r}" for name, key in _SPEC_FLAGS
                                       if getattr(args, name) is not None and name != "spec_strategy"]
    if args.spec_strategy or tree:  # the flags name the one strategy: the config's list and its groups' ranges must not win
        spec += [f"sd.strategies=[{args.spec_strategy!r}]" if args.spec_strategy else "sd.strategies=[]",
                 "sd.group_live_batch_ranges=[]"]
    return _config(args, ["rollout.warm_up=false", *spec])


def untrained_drafter_note(sd, drafter: str | None, command: str) -> str | None:
    """What adaptive SD runs in `command` (generate, eval) without --drafter, or None when nothing sits out:
    those commands never train the random drafter, so its estimate (~1 token per step) stays below
    sd.min_drafter_accept and the EAGLE arms never compete."""
    from fastrl_jax.models.drafter_io import drafter_accept_prior

    if sd.mode != "adaptive" or not sd.uses_drafter() or drafter_accept_prior(drafter) >= sd.min_drafter_accept:
        return None
    arms = sd.strategy_list()
    eagle = [str(a) for a in arms if a.parts()[0]]
    rest = [str(a) for a in arms if not a.parts()[0]] + (["plain decoding"] if sd.plain_arm else [])
    runs = (f"{' and '.join(rest)} compete" if len(rest) > 1 else f"{rest[0]} runs where speculation would" if rest
            and rest[0] != "plain decoding" else "plain decoding runs throughout")
    return (f"--sd adaptive without --drafter: the EAGLE arms ({', '.join(eagle)}) sit out, as a randomly initialised "
            f"drafter accepts ~1 token per step, below sd.min_drafter_accept ({sd.min_drafter_accept}), and {command} "
            f"does not train it; {runs}. Give --drafter DIR (a train-drafter out_dir) to speculate with a trained drafter")


def _checked_requests(args: argparse.Namespace, cfg, path: Path):
    """(tokenizer, prompts, requests, problems): every request built and checked before the model loads;
    all invalid is an error here, some invalid a warning (they fail alone, the command exits 1)."""
    from fastrl_jax.models.loading import read_model_config
    from fastrl_jax.models.tokenizer import load_tokenizer, stop_ids
    from fastrl_jax.rollout.engine import Request
    from fastrl_jax.rollout.requests import draft_margin, request_problem

    tokenizer, model_cfg = load_tokenizer(path), read_model_config(path)
    prompts = _read_prompts(args, tokenizer, cfg.data.chat_template)
    stops = stop_ids(model_cfg, tokenizer)
    requests = [Request(p, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed + i, stops)
                for i, p in enumerate(prompts)]
    margin = draft_margin(cfg.sd)
    problems = [request_problem(r, cfg.rollout, margin, model_cfg.vocab_size) for r in requests]
    bad = [(i, why) for i, why in enumerate(problems) if why]
    listed = "; ".join(f"request {i}: {why}" for i, why in bad[:3]) + ("; ..." if len(bad) > 3 else "")
    if bad and len(bad) == len(requests):
        raise ConfigError(f"no request can run ({listed})")
    if bad:
        print(f"[fastrl-jax] {len(bad)} of {len(requests)} requests cannot run ({listed}); the other "
              f"{len(requests) - len(bad)} run, and the command exits 1", file=sys.stderr)
    return tokenizer, prompts, requests, problems


def cmd_generate(args: argparse.Namespace) -> int:
    from fastrl_jax.models.drafter_io import drafter_accept_prior, drafter_dir, make_drafter
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.rollout.engine import RolloutEngine, shared_prefix_len
    from fastrl_jax.rollout.requests import draft_margin, sampling_problem

    output = check_output_file(args.output, "--output", [("--prompts", args.prompts)]) if args.output else None
    cfg = _generate_config(args)
    problem = sampling_problem(args.max_new_tokens, args.temperature, args.top_k, args.top_p, cfg.rollout,
                               draft_margin(cfg.sd))
    if problem:
        raise ConfigError(f"bad sampling settings: {problem}")
    if args.drafter:
        drafter_dir(args.drafter)
    if note := untrained_drafter_note(cfg.sd, args.drafter, "generate"):
        print(f"[fastrl-jax] {note}", file=sys.stderr)
    tokenizer, prompts, requests, _ = _checked_requests(args, cfg, resolve_model_path(cfg.model.path))
    policy = _policy(cfg, tokenizer)
    drafter = make_drafter(cfg, policy.cfg, args.drafter, cfg.model.engine_dtype) if cfg.sd.uses_drafter() else None
    engine = RolloutEngine(policy.model, cfg.rollout, sd=cfg.sd, drafter=drafter,
                           drafter_accept=drafter_accept_prior(args.drafter),
                           shared_prefix=shared_prefix_len(cfg.rollout, [r.prompt_ids for r in requests]))
    t0 = time.perf_counter()
    done: dict[int, object] = {}
    try:
        for i, completion in engine.stream(requests):
            done[i] = completion
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (a scheduler's time limit): the finished completions are kept
        if output and done:
            files.write_text(output, "".join(json.dumps({"index": i, **_completion_row(prompts[i], done[i], tokenizer)})
                                             + "\n" for i in sorted(done)))
            print(f"[fastrl-jax] interrupted: the {len(done)} of {len(requests)} completions that finished are in "
                  f"{output} (each row's \"index\" is its request's)", file=sys.stderr)
        raise
    seconds = time.perf_counter() - t0
    results = [done[i] for i in range(len(requests))]
    rows = [_completion_row(p, r, tokenizer) for p, r in zip(prompts, results)]
    failed = [i for i, row in enumerate(rows) if "error" in row]
    for i in failed:
        print(f"[fastrl-jax] request {i}: {rows[i]['error']}", file=sys.stderr)
    if output:
        files.write_text(output, "".join(json.dumps(row) + "\n" for row in rows))
    else:
        for row in rows:
            print(row["completion"])
    tokens = sum(len(r.tokens) for r in results)
    print(f"[fastrl-jax] {len(rows) - len(failed)} completions, {tokens} tokens in {seconds:.1f}s "
          f"({tokens / seconds:.1f} tok/s, compilation included; {engine.pool.report()})", file=sys.stderr)
    _report_speculation(engine.stats)
    if failed:
        where = f"rows with an \"error\" in {output}" if output else "the errors above"
        print(f"[fastrl-jax] {len(failed)} of {len(rows)} requests failed (requests {failed[:10]}); see {where}",
              file=sys.stderr)
        return 1
    return 0


def _completion_row(prompt: list[int], r, tokenizer) -> dict:
    ids = r.tokens[:-1] if r.finish_reason == "stop" else r.tokens
    row = {"prompt_ids": prompt, "completion_ids": ids, "completion": tokenizer.decode(ids),
           "finish_reason": r.finish_reason}
    if r.error:
        row["error"] = r.error
    return row


def _report_speculation(st) -> None:
    if st.sd_steps:
        by_strategy = ", ".join(f"{k} {v:.2f}" for k, v in st.acceptance_by_strategy().items())
        print(f"[fastrl-jax] speculative: {st.sd_steps} row-steps, acceptance length "
              f"{st.acceptance_length():.2f} tokens/step ({by_strategy}); device steps with SD "
              f"{st.steps_sd}, without {st.steps_plain}", file=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    from fastrl_jax.config import check_trainable

    if (args.devices is not None or args.platform) and not args.dry_run:
        raise ConfigError("--devices and --platform plan a --dry-run; a run takes every visible device, split by "
                          "mesh.data, mesh.fsdp and mesh.tensor (one of them -1 takes the rest)")
    cfg = _config(args)
    check_trainable(cfg, "train")
    if args.dry_run:
        from fastrl_jax.rl.dry_run import mesh_shape, plan
        from fastrl_jax.rl.trainer import preflight

        sizes = mesh_shape(cfg, args.devices)
        preflight(cfg, sizes["data"] * sizes["fsdp"], files=False)  # what the run would refuse before loading
        print(plan(cfg, args.devices, args.platform))
        return
    check_output_dir(cfg.rl.out_dir, "rl.out_dir")
    if (args.num_processes is not None or args.process_id is not None) and not (args.distributed or args.coordinator):
        raise ConfigError("--num-processes / --process-id start a multi-process run: give --coordinator HOST:PORT "
                          "too, or --distributed where the cluster tells each process (SLURM, TPU pods)")
    if args.coordinator is not None and not re.fullmatch(r".+:\d+", args.coordinator):  # else an IndexError traceback
        raise ConfigError(f"--coordinator must be HOST:PORT (process 0's host and a free port, e.g. node001:1234), "
                          f"got {args.coordinator!r}")
    if args.distributed or args.coordinator:
        from fastrl_jax.rl.distributed import initialize

        initialize(args.coordinator, args.num_processes, args.process_id)
    from fastrl_jax.rl.trainer import train

    t0 = time.perf_counter()
    history = train(cfg, resume=args.resume, overwrite=args.overwrite)
    print(f"[fastrl-jax] {sum(m['step'] > 0 for m in history)} steps in {time.perf_counter() - t0:.1f}s; metrics in "
          f"{Path(cfg.rl.out_dir) / 'metrics.jsonl'}", file=sys.stderr)


def cmd_train_drafter(args: argparse.Namespace) -> None:
    from fastrl_jax.config import check_trainable
    from fastrl_jax.data.chat_prompts import HELD_OUT
    from fastrl_jax.data.prompts import drafter_training_prompts
    from fastrl_jax.drafter.warmup import check_restart, train_drafter
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.tokenizer import load_tokenizer

    cfg = _config(args, ["rollout.warm_up=false"])
    check_trainable(cfg, "train-drafter")
    if cfg.drafter_train.eval_prompts > len(HELD_OUT):  # else it fails only after the data are collected
        raise ConfigError(f"drafter_train.eval_prompts ({cfg.drafter_train.eval_prompts}) exceeds the {len(HELD_OUT)} "
                          f"held-out chat prompts: give {len(HELD_OUT)} or fewer")
    check_output_dir(cfg.drafter_train.out_dir, "drafter_train.out_dir")
    check_restart(cfg, resume=not args.restart)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.path))
    if cfg.drafter_train.prompts != "builtin":
        drafter_training_prompts(cfg, tokenizer)  # a malformed prompt file fails here, before the weights load
    policy = _policy(cfg, tokenizer)
    summary = train_drafter(cfg, policy.model, policy.tokenizer, resume=not args.restart)
    final = summary.get("final_eval", {})
    figures = ", ".join(f"{k.removeprefix('accept_')} {v:.2f}" for k, v in final.items() if k.startswith("accept_"))
    print(f"[fastrl-jax] drafter in {summary['drafter']}; held-out acceptance length: {figures or '-'}; "
          f"wall {summary['wall_seconds'] / 60:.1f} min", file=sys.stderr)


def cmd_export_drafter(args: argparse.Namespace) -> None:
    from fastrl_jax.drafter.export import eagle_architecture, export_eagle, export_eagle3
    from fastrl_jax.models.drafter_io import drafter_dir, load_drafter, save_drafter
    from fastrl_jax.models.export import check_export_dir, export_into
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.loading import read_model_config

    out = check_export_dir(args.out)
    source = drafter_dir(args.drafter)
    run_config = Path(args.drafter).expanduser() / "config.yaml"  # a train or train-drafter run: its policy
    if not args.model and not args.config and run_config.is_file():
        args.config = str(run_config)
        print(f"[fastrl-jax] the policy of {run_config}", file=sys.stderr)
    cfg = _config(args)
    model_path = resolve_model_path(cfg.model.path)
    model_cfg = read_model_config(model_path)
    drafter = load_drafter(source, model_cfg, cfg.model.dtype)
    dtype = args.dtype or _source_dtype(model_path) or str(drafter.fc[...].dtype)
    eagle, arch = ("eagle3", "LlamaForCausalLMEagle3") if drafter.kind == "eagle3" else ("eagle", eagle_architecture(model_cfg))
    with export_into(out) as partial:  # a failed export leaves nothing behind
        save_drafter(partial / "orbax", drafter)  # in model.dtype: it trains on (rl.drafter_path)
        if drafter.kind == "eagle3":  # its lm_head.weight is the policy's head rows: the one export that reads weights
            export_eagle3(drafter, model_cfg, _head_rows(args, cfg, source, drafter), partial / eagle, dtype)
        else:
            export_eagle(drafter, model_cfg, partial / eagle, dtype)
    print(f"[fastrl-jax] wrote {out / 'orbax'} (Orbax, fastrl-jax generate --drafter) and {out / eagle} "
          f"(safetensors in {dtype}, SGLang {arch})", file=sys.stderr)
    # SGLang takes a draft model's dtype from its own config.json (float32 as float16) and the target's from the
    # target's: a float16 drafter beside a bfloat16 target fails at its first matmul, unless --dtype sets both.
    flags = f"--speculative-algorithm {eagle.upper()} --speculative-draft-model-path {out / eagle} --dtype {dtype}"
    if (out / eagle / "token_map.pt").is_file():  # SGLang's EAGLE reads the draft vocabulary from this flag alone
        flags += f" --speculative-token-map {out / eagle / 'token_map.pt'}"
    print(f"[fastrl-jax] serve it beside its policy with {flags}", file=sys.stderr)


def _source_dtype(path: Path) -> str | None:
    """An HF checkpoint's dtype (config.json's torch_dtype, or transformers 5's dtype) when it is one an export
    can write; None for a GGUF file or another dtype."""
    from fastrl_jax.models.export import EXPORT_DTYPES

    config = _source_files(path)[0] or {}
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in EXPORT_DTYPES else None


def _head_rows(args: argparse.Namespace, cfg, source: Path, drafter):
    """The policy's LM head rows of the drafter's vocabulary ([K, H]), which an EAGLE-3 export writes (its
    lm_head.weight): for the drafter of a train run's checkpoint (source: RUN/checkpoints/STEP/drafter), that
    checkpoint's policy's, whose head RL moved away from the base model's and which the drafter scored with (the
    policy loads, on _export_mesh as export-policy: the run's own mesh may need more devices than this machine
    has); else the base model's, read alone."""
    import numpy as np

    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.loading import read_head_rows

    if source.parent.parent.name == "checkpoints" and (source.parent / "policy").is_dir():
        from fastrl_jax.rl.run_dir import load_run_policy

        model = [f"model.path={json.dumps(args.model, ensure_ascii=False)}"] if args.model else []  # a base model that moved
        policy = load_run_policy(source.parents[2], _export_mesh(), int(source.parent.name), [*model, *args.set])[0]
        return np.asarray(drafter.head_weight(policy.model))
    ids = None if drafter.draft_vocab is None else np.asarray(drafter.draft_vocab[...])
    return read_head_rows(resolve_model_path(cfg.model.path), ids)


def _export_mesh():
    """Every visible device along fsdp: any device count works, and no device holds the whole model."""
    from fastrl_jax.config import MeshConfig
    from fastrl_jax.sharding import make_mesh

    return make_mesh(MeshConfig(fsdp=-1))


def _source_files(path: Path) -> tuple[dict | None, dict | None]:
    """An HF source checkpoint's config.json and generation_config.json (None for a GGUF file; the second None
    without one)."""
    from fastrl_jax.models.loading import read_generation_config, read_hf_config

    return (read_hf_config(path), read_generation_config(path)) if path.is_dir() else (None, None)


def cmd_export_policy(args: argparse.Namespace) -> None:
    from fastrl_jax.models.export import check_export_dir, export_hf
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.loading import load_policy

    if args.run and (args.model or args.config):
        raise ConfigError("export-policy takes --run RUN_DIR (a trained run, with its own config) or --model PATH, not both")
    if not args.run and not args.model:
        raise ConfigError("export-policy needs --run RUN_DIR (a trained policy) or --model PATH|smollm2 (a base model)")
    if args.step is not None and not args.run:
        raise ConfigError("--step picks a checkpoint of --run RUN_DIR; a --model has none")
    if args.max_shard_mb < 1:
        raise ConfigError(f"--max-shard-mb must be >= 1, got {args.max_shard_mb}")
    out = check_export_dir(args.out)
    if args.run:
        from fastrl_jax.rl.run_dir import load_run_policy

        policy, step, cfg = load_run_policy(args.run, _export_mesh(), args.step, args.set)
        source = f"step {step} of run {args.run}"
    else:
        cfg = _config(args)
        resolve_model_path(cfg.model.path)
        policy = load_policy(cfg.model, _export_mesh())
        source = str(policy.path)
    base_config, base_generation = _source_files(policy.path)
    t0 = time.perf_counter()
    export_hf(policy.model, policy.tokenizer, out, dtype=args.dtype or cfg.model.dtype, stop_ids=policy.stop_ids,
              max_shard_bytes=args.max_shard_mb * 10**6, base_config=base_config,
              base_generation_config=base_generation,
              on_file=lambda name: print(f"[fastrl-jax] wrote {name}", file=sys.stderr))
    dtype = args.dtype or cfg.model.dtype
    print(f"[fastrl-jax] exported {source} to {out} in {time.perf_counter() - t0:.1f}s (HF safetensors, "
          f"{dtype}; transformers.AutoModelForCausalLM.from_pretrained loads it)", file=sys.stderr)
    if dtype == "float32":  # their `auto` serves float32 checkpoints in float16, which overflows in some models
        print("[fastrl-jax] SGLang and vLLM serve a float32 checkpoint in float16 under --dtype auto: pass --dtype "
              "bfloat16 to them, or export with --dtype bfloat16", file=sys.stderr)


def _eval_policy_config(args: argparse.Namespace, defaults: list[str]):
    """(config, model path) of eval's policy, checked without reading weights: a run's config.yaml and base model
    (--run), or --config / --model; `defaults`, then --set, over either."""
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.rl.run_dir import base_model_path, check_run

    if args.run and (args.model or args.config):
        raise ConfigError("eval takes --run RUN_DIR (a trained run, with its own config) or --config / --model, not both")
    if args.step is not None and not args.run:
        raise ConfigError("--step picks a checkpoint of --run RUN_DIR; a --model has none")
    if args.sd == "off" and args.drafter:
        raise ConfigError("--drafter applies only to speculative decoding: add --sd on or --sd adaptive (or drop it)")
    if args.run:
        cfg = _with_cache(check_run(args.run, args.step, [*defaults, *args.set]))
        return cfg, base_model_path(cfg, args.run)
    cfg = _config(args, defaults)
    return cfg, resolve_model_path(cfg.model.path)


def _eval_settings(args: argparse.Namespace, cfg) -> tuple[int, float, int, int]:
    """(prompts, samples, temperature, max_new_tokens): the flags, or the config's rl.eval_* settings."""
    from fastrl_jax.rl.evaluate import MAX_COMPLETIONS, MAX_SAMPLES
    from fastrl_jax.rollout.requests import draft_margin, sampling_problem

    rl = cfg.rl
    prompts = rl.eval_prompts if args.num_prompts is None else args.num_prompts
    samples = rl.eval_samples if args.samples is None else args.samples
    if prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {prompts}")
    if not 1 <= samples <= MAX_SAMPLES:
        raise ConfigError(f"--samples must be in 1 .. {MAX_SAMPLES} (completions per prompt; pass@k needs k <= samples), "
                          f"got {samples}")
    if prompts * samples > MAX_COMPLETIONS:
        raise ConfigError(f"--num-prompts {prompts} x --samples {samples} is {prompts * samples:,} completions; "
                          f"one evaluation takes at most {MAX_COMPLETIONS:,}")
    temperature = args.temperature
    if temperature is None:  # greedy for one sample; several samples need a temperature: eval's, else training's
        temperature = rl.eval_temperature if samples == 1 or rl.eval_temperature > 0 else rl.temperature
    if samples > 1 and temperature == 0:
        raise ConfigError(f"--samples {samples} at temperature 0 gives {samples} identical greedy completions: "
                          "give --temperature > 0, or --samples 1")
    max_new = rl.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    problem = sampling_problem(max_new, temperature, rl.eval_top_k, rl.eval_top_p, cfg.rollout, draft_margin(cfg.sd))
    if problem:
        raise ConfigError(f"bad sampling settings: {problem}")
    return prompts, samples, temperature, max_new


def _eval_requests(cfg, path: Path, records, samples: int, temperature: float, max_new: int):
    """(tokenizer, records, requests): the records whose prompt fits (rollout.requests.prompt_limit with
    prompt_margin: the set the trainer's in-run evaluation scores, so eval of a run repeats its eval_accuracy, with
    --sd off or on) and their requests, every prompt checked against the engine's rules."""
    from fastrl_jax.data.prompts import data_prompt_ids
    from fastrl_jax.models.loading import read_model_config
    from fastrl_jax.models.tokenizer import load_tokenizer, stop_ids
    from fastrl_jax.rl.evaluate import eval_requests
    from fastrl_jax.rollout.requests import draft_margin, prompt_limit, prompt_margin, request_problem

    tokenizer, model_cfg = load_tokenizer(path), read_model_config(path)
    rl = cfg.rl
    prompts = [data_prompt_ids(cfg, r, tokenizer) for r in records]
    margin = draft_margin(cfg.sd)
    limit, what_limits = prompt_limit(cfg.rollout, max_new, prompt_margin(cfg.sd))
    fits = [i for i, p in enumerate(prompts) if len(p) <= limit]
    if fits and len(fits) < len(records):  # none fitting is refused below, with the reason
        print(f"[fastrl-jax] {len(records) - len(fits)} of {len(records)} evaluation prompts are longer than {what_limits} and "
              "are left out, as training's evaluation leaves them out; raise it to keep them", file=sys.stderr)
        records, prompts = [records[i] for i in fits], [prompts[i] for i in fits]
    requests = eval_requests(prompts, samples, max_new, temperature, rl.eval_top_k, rl.eval_top_p, cfg.seed,
                             stop_ids(model_cfg, tokenizer))
    bad = [(g, why) for g in range(len(records))
           if (why := request_problem(requests[g * samples], cfg.rollout, margin, model_cfg.vocab_size))]
    if bad:
        listed = "; ".join(f"prompt {g}: {why}" for g, why in bad[:3])
        raise ConfigError(f"{len(bad)} of {len(records)} evaluation prompts cannot run ({listed})")
    return tokenizer, records, requests


def cmd_eval(args: argparse.Namespace) -> None:
    from fastrl_jax.data.pipeline import MATH_SOURCE
    from fastrl_jax.data.prompt_files import checked_file
    from fastrl_jax.models.drafter_io import drafter_accept_prior, drafter_dir, make_drafter
    from fastrl_jax.rl.evaluate import evaluate, format_table, held_out_records, model_workers

    defaults = ["rollout.warm_up=false", f"sd.mode={args.sd!r}"]  # programs compile when reached
    cfg, path = _eval_policy_config(args, defaults)
    source = args.prompts or cfg.data.eval_source
    read = ("--prompts" if args.prompts else "data.eval_source", source if source != MATH_SOURCE else None)
    out = check_output_file(args.out, "--out", [read]) if args.out else None
    num_prompts, samples, temperature, max_new = _eval_settings(args, cfg)
    if args.drafter:
        drafter_dir(args.drafter)
    if note := untrained_drafter_note(cfg.sd, args.drafter, "eval"):
        print(f"[fastrl-jax] {note}", file=sys.stderr)
    if source != MATH_SOURCE:
        try:
            checked_file(source, "--prompts" if args.prompts else "data.eval_source")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}; give '{MATH_SOURCE}' (the built-in held-out problems) or a .jsonl / .parquet "
                                    "file of records with an answer") from None
    records = held_out_records(cfg, num_prompts, source)
    if len(records) < num_prompts:
        print(f"[fastrl-jax] {source} holds {len(records)} records; evaluating all of them", file=sys.stderr)
    tokenizer, records, requests = _eval_requests(cfg, path, records, samples, temperature, max_new)
    if args.run:
        from fastrl_jax.rl.run_dir import load_run_policy
        from fastrl_jax.sharding import make_mesh

        policy, step, _ = load_run_policy(args.run, make_mesh(cfg.mesh), args.step, [*defaults, *args.set], tokenizer)
    else:
        policy, step = _policy(cfg, tokenizer), None
    drafter = make_drafter(cfg, policy.cfg, args.drafter) if cfg.sd.uses_drafter() else None
    workers = model_workers(cfg, policy.model, drafter, drafter_accept=drafter_accept_prior(args.drafter))
    result = evaluate(workers, tokenizer, records, requests, samples)
    print(format_table(result["results"]))
    accept = f", acceptance length {result['acceptance_length']:.2f}" if result["acceptance_length"] else ""
    print(f"[fastrl-jax] {len(requests)} completions ({len(records)} prompts x {samples}, T={temperature:g}), "
          f"{result['tokens']} tokens in {result['generate_s']:.1f}s ({result['tokens_per_s']:.1f} tok/s, "
          f"compilation included; sd {cfg.sd.mode}{accept})", file=sys.stderr)
    if out:
        settings = {"run": args.run, "step": step, "model": cfg.model.path, "prompts": source, "num_prompts": len(records),
                    "samples": samples, "temperature": temperature, "top_k": cfg.rl.eval_top_k, "top_p": cfg.rl.eval_top_p,
                    "max_new_tokens": max_new, "seed": cfg.seed, "sd": cfg.sd.mode}
        files.write_json(out, settings | result, indent=1)
        print(f"[fastrl-jax] wrote {out}", file=sys.stderr)


def _bench_sd_flags(args: argparse.Namespace) -> list:
    """bench-sd's flags checked before any file is read; returns the strategies."""
    from fastrl_jax.config import StrategySpec
    from fastrl_jax.data.chat_prompts import HELD_OUT

    names = [*args.prompt_sets, *(Path(p).stem for p in args.prompt_file)]  # a prompt file's set: its stem
    if not names:
        raise ConfigError("bench-sd needs prompts: --prompt-sets math chat, and/or --prompt-file FILE.jsonl")
    if len(set(names)) < len(names):
        raise ConfigError(f"bench-sd prompt sets need distinct names (a file's is its stem), got {names}")
    strategies = [StrategySpec.from_config(s, "--strategies") for s in args.strategies]
    if any(s.parts()[0] for s in strategies) and not args.drafter:
        raise ConfigError("bench-sd: EAGLE strategies (S/K/V) need --drafter DIR; history ones (hD) do not")
    if args.profile and not args.drafter:
        raise ConfigError("bench-sd --profile times an EAGLE step's phases: give --drafter DIR")
    if args.profile and not strategies[0].parts()[0]:
        raise ConfigError(f"bench-sd --profile times the first strategy's EAGLE tree; {args.strategies[0]} has none: "
                          "put an S/K/V strategy first")
    for t in args.temperatures:
        if problem := temperature_problem("bench-sd --temperatures", t):
            raise ConfigError(problem)
    if missing := [p for p in args.prompt_file if not Path(p).expanduser().is_file()]:
        raise FileNotFoundError(f"bench-sd --prompt-file: no file {', '.join(missing)}")
    if "chat" in args.prompt_sets and args.prompts > len(HELD_OUT):
        raise ConfigError(f"bench-sd --prompts {args.prompts}: the chat set holds {len(HELD_OUT)} held-out prompts; give "
                          f"--prompts {len(HELD_OUT)} or fewer, or leave chat out of --prompt-sets")
    return strategies


def _bench_sd_prompts(args: argparse.Namespace, cfg, tokenizer, vocab_size: int) -> dict[str, list[list[int]]]:
    """The prompt sets bench-sd times: held-out math / chat, and each --prompt-file's first --prompts."""
    from fastrl_jax.data.prompts import held_out_sets, read_jsonl_prompts
    from fastrl_jax.rollout.requests import id_problem

    prompt_sets = held_out_sets(cfg, tokenizer, args.prompts, args.prompt_sets)
    for path in args.prompt_file:
        prompts = read_jsonl_prompts(path, tokenizer, cfg.data.chat_template)
        if len(prompts) > args.prompts:
            print(f"[bench-sd] {path}: timing its first {args.prompts} of {len(prompts)} prompts (--prompts)", file=sys.stderr)
        for i, p in enumerate(prompts[: args.prompts]):
            if problem := id_problem(p, (), vocab_size):
                raise ConfigError(f"bench-sd --prompt-file {path}: prompt {i}: {problem}, the policy's vocabulary")
        prompt_sets[Path(path).stem] = prompts[: args.prompts]
    return prompt_sets


def cmd_bench_sd(args: argparse.Namespace) -> None:
    import jax

    from fastrl_jax.drafter import bench
    from fastrl_jax.machine import format_machine, machine_facts
    from fastrl_jax.models.drafter_io import drafter_dir, make_drafter
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.loading import read_model_config
    from fastrl_jax.models.tokenizer import load_tokenizer

    strategies = _bench_sd_flags(args)
    cfg = _config(args, ["rollout.warm_up=false"])
    if args.drafter:
        drafter_dir(args.drafter)
    out = check_output_file(args.out, "--out", [("--prompt-file", p) for p in args.prompt_file])
    plot = None
    if args.plot:  # matplotlib adds .png to a name without a suffix: check (and report) the file it writes
        plot = check_output_file(args.plot if Path(args.plot).suffix else f"{args.plot}.png", "--plot")
    model_path = resolve_model_path(cfg.model.path)
    tokenizer, model_cfg = load_tokenizer(model_path), read_model_config(model_path)  # checks before the weights
    prompt_sets = _bench_sd_prompts(args, cfg, tokenizer, model_cfg.vocab_size)
    drafter = make_drafter(cfg, model_cfg, args.drafter, cfg.model.engine_dtype) if args.drafter else None
    if drafter is not None and args.vocab and "reduced" in args.vocab and drafter.draft_vocab is None:
        raise ConfigError(f"bench-sd --vocab reduced: the drafter in {args.drafter} drafts over the whole vocabulary "
                          "(trained with drafter_train.draft_vocab_size 0); give --vocab full")
    policy = _policy(cfg, tokenizer)
    result = {"model": cfg.model.path, "dtype": cfg.model.engine_dtype, "drafter": args.drafter,
              "accept": cfg.sd.accept, "new_tokens": args.new_tokens, "repeats": args.repeats, "backend": jax.default_backend(),
              "machine": machine_facts()}
    print(f"[bench-sd] machine: {format_machine(result['machine'])}", file=sys.stderr)
    if args.profile:
        prof = bench.profile_step(policy.model, drafter, strategies[0], temperature=args.temperatures[-1],
                                  unrolled=cfg.rollout.unrolled_layers(jax.default_backend()))
        result["profile_ms"] = prof
        print("[bench-sd] one speculative step at batch 1, strategy " + args.strategies[0] + " (ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in prof.items()))
    rows = bench.run_bench(
        policy.model, drafter, prompt_sets, policy.stop_ids, base_cfg=cfg.rollout, batch_sizes=args.batch_sizes,
        strategies=strategies, temperatures=args.temperatures, vocabs=args.vocab, new_tokens=args.new_tokens,
        repeats=args.repeats, samples_per_prompt=args.samples_per_prompt, sd=cfg.sd,
        log=lambda line: print(f"[bench-sd] {line}", file=sys.stderr, flush=True),
        # Each cell as it is measured: an interrupt (or a later cell's failure) keeps the ones before it
        row_done=lambda rows: files.write_json(out, result | {"rows": rows, "complete": False}))
    result |= {"rows": rows, "complete": True, "stops_paying_at_batch": bench.stop_paying(rows)}
    files.write_json(out, result)  # the measurement first: the printout and the plot may fail
    print(f"[bench-sd] wrote {out}", file=sys.stderr)
    print(bench.HEADER)
    for row in rows:
        print(bench.format_row(row))
    for key, b in result["stops_paying_at_batch"].items():
        print(f"{key}: SD stops paying at batch {b if b is not None else '> ' + str(max(args.batch_sizes))}")
    if plot and bench.plot(rows, plot):
        print(f"[bench-sd] wrote {plot}", file=sys.stderr)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (configs/*.yaml); defaults apply without it")
    parser.add_argument("--model", help="HF checkpoint dir, .gguf file, or 'smollm2' (overrides model.path)")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. mesh.tensor=2 (--set may repeat)")


def _add_export_policy(sub) -> None:
    ep = sub.add_parser("export-policy", help="write a trained (or base) policy as an HF checkpoint directory")
    ep.add_argument("--run", help="GRPO run directory (rl.out_dir): exports its latest readable checkpoint")
    ep.add_argument("--step", type=int, help="with --run: the checkpoint step to export")
    _common(ep)
    ep.add_argument("--out", required=True, help="new directory: config.json, safetensors, tokenizer files")
    ep.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="weights' dtype in the export (default: the policy's, model.dtype)")
    ep.add_argument("--max-shard-mb", type=int, default=5000,
                    help="safetensors files of at most this size (MB), with model.safetensors.index.json when several")
    ep.set_defaults(func=cmd_export_policy)


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="pass@1 / pass@k and response lengths of a trained run or a model on held-out prompts")
    ev.add_argument("--run", help="GRPO run directory (rl.out_dir): its latest readable checkpoint, with its config")
    ev.add_argument("--step", type=int, help="with --run: the checkpoint step to evaluate")
    _common(ev)
    ev.add_argument("--prompts", help="'math' (held-out built-in problems, per level) or a .jsonl / .parquet file of "
                                      "records with an answer (default: data.eval_source)")
    ev.add_argument("--num-prompts", type=int, help="held-out prompts (default: rl.eval_prompts)")
    ev.add_argument("--samples", "--samples-per-prompt", dest="samples", type=int,
                    help="completions per prompt, n of pass@k (default: rl.eval_samples)")
    ev.add_argument("--temperature", type=float,
                    help="default: rl.eval_temperature (0: greedy); several samples at an rl.eval_temperature of 0 "
                         "take rl.temperature")
    ev.add_argument("--max-new-tokens", type=int, help="default: rl.max_new_tokens")
    ev.add_argument("--sd", choices=["off", "on", "adaptive"], default="off",
                    help="speculative decoding (the same completions, sooner with a trained drafter)")
    ev.add_argument("--drafter", help="drafter checkpoint directory for --sd; a random drafter when omitted")
    ev.add_argument("--out", "--output", dest="out", help="JSON file: settings, results per subset, every completion")
    ev.set_defaults(func=cmd_eval)


def _count(text: str) -> int:
    """argparse type: an int >= 1 (refused before any model loads)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def _add_bench_sd(sub) -> None:
    bs = sub.add_parser("bench-sd", help="plain vs speculative decoding tokens/s per batch size, strategy, temperature")
    _common(bs)
    bs.add_argument("--drafter", help="train-drafter out_dir, a train run's rl.out_dir, or a drafter checkpoint directory "
                    "(EAGLE strategies)")
    bs.add_argument("--batch-sizes", type=_count, nargs="+", default=[1, 2, 4, 8, 16, 32])
    bs.add_argument("--strategies", nargs="+", default=["6/4/16", "5/4/8", "4/2/6"],
                    help="steps/topk/verify_tokens (EAGLE tree), hD (history chain) or S/K/V+hD (both)")
    bs.add_argument("--samples-per-prompt", type=_count, default=1,
                    help="ask each prompt this many times in a row (other seeds), as an RL group: hD drafts from the "
                         "earlier ones")
    bs.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    bs.add_argument("--vocab", nargs="+", choices=["reduced", "full"],
                    help="the drafter's reduced draft vocabulary and/or the same weights over the full vocabulary "
                         "(default: both, or full for a drafter without a reduced one)")
    bs.add_argument("--new-tokens", "--max-new-tokens", dest="new_tokens", type=_count, default=128,
                    help="max new tokens per request (stop tokens end earlier)")
    bs.add_argument("--prompt-sets", nargs="*", choices=["math", "chat"], default=["math", "chat"],
                    help="held-out prompt sets, each timed apart: the built-in math task, general chat")
    bs.add_argument("--prompt-file", nargs="*", default=[], metavar="JSONL",
                    help='more prompt sets, named by file stem: {"prompt": text} or {"prompt_ids": [...]} per line')
    bs.add_argument("--prompts", type=_count, default=16,
                    help="prompts per set; each batch size generates all of them, batch size at a time")
    bs.add_argument("--repeats", type=_count, default=1, help="timed runs per cell after the compiling one (best is kept)")
    bs.add_argument("--profile", action="store_true", help="also time each phase of one speculative step at batch 1")
    bs.add_argument("--out", "--output", dest="out", default="bench_sd.json")
    bs.add_argument("--plot", default="bench_sd.png", help="PNG of speedup vs batch size ('' to skip)")
    bs.set_defaults(func=cmd_bench_sd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastrl-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts with the rollout engine (chat template applied)")
    _common(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt text")
    source.add_argument("--prompts", help='JSONL file: {"prompt": text} or {"prompt_ids": [...]} per line')
    gen.add_argument("--raw", action="store_true", help="encode prompt texts as is, without the chat template")
    gen.add_argument("--output", "--out", dest="output",
                     help="write JSONL results here (input order) instead of printing completions")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="per request (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 is off")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 is off")
    gen.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    gen.add_argument("--sd", choices=["off", "on", "adaptive"], default="off",
                     help="speculative decoding: off (default, whatever the config's sd.mode), on (always), "
                          "adaptive (at small live batch)")
    gen.add_argument("--drafter", help="drafter checkpoint directory; a random drafter when omitted")
    gen.add_argument("--spec-strategy", help="the strategy --sd on runs: S/K/V (EAGLE tree), hD (history chain) or S/K/V+hD")
    gen.add_argument("--spec-steps", type=int, help="draft tree depth (sd.steps)")
    gen.add_argument("--spec-topk", type=int, help="branching per step (sd.topk)")
    gen.add_argument("--spec-verify-tokens", type=int, help="tree nodes verified, root included (sd.verify_tokens)")
    gen.add_argument("--spec-accept", choices=["coupled", "rejection"], help="acceptance rule (sd.accept)")
    gen.set_defaults(func=cmd_generate)
    train = sub.add_parser("train", help="GRPO training (rollout -> rewards -> update -> weight hand-off)")
    train.add_argument("--config", help="YAML config (configs/*.yaml); defaults apply without it")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. rl.steps=10")
    train.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="more config overrides")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in rl.out_dir")
    train.add_argument("--overwrite", action="store_true",
                       help="rl.out_dir holds an earlier run: move it aside (renamed with a timestamp) and start afresh")
    train.add_argument("--dry-run", action="store_true",
                       help="build the abstract model, mesh and shardings; print memory per device and the program plan")
    train.add_argument("--devices", type=int, help="--dry-run: devices to plan for (default: the mesh sizes' product)")
    train.add_argument("--platform", choices=["cpu", "gpu", "tpu"],
                       help="--dry-run: the platform to plan for, whose attention kernels decide the update step's "
                            "activations (default: this machine's)")
    train.add_argument("--distributed", action="store_true",
                       help="call jax.distributed.initialize() first (SLURM / TPU pods are auto-detected)")
    train.add_argument("--coordinator", help="host:port of process 0 (multi-process without SLURM; implies --distributed)")
    train.add_argument("--num-processes", type=int, help="processes of a --coordinator run")
    train.add_argument("--process-id", type=int, help="this process's index in a --coordinator run")
    train.set_defaults(func=cmd_train)
    td = sub.add_parser("train-drafter", help="warm-up training of the EAGLE drafter on the policy's own generations")
    _common(td)
    td.add_argument("--restart", action="store_true",
                    help="refuse to resume: fail if drafter_train.out_dir already holds checkpoints")
    td.set_defaults(func=cmd_train_drafter)
    ex = sub.add_parser("export-drafter", help="write a trained drafter as Orbax and as an SGLang EAGLE safetensors dir")
    _common(ex)
    ex.add_argument("--drafter", required=True, help="train-drafter out_dir, a train run's rl.out_dir (its online drafter), "
                    "or a drafter checkpoint directory")
    ex.add_argument("--out", required=True,
                    help="new directory: OUT/orbax and OUT/eagle (OUT/eagle3 for an EAGLE-3 drafter) are written")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="the SGLang export's weights (default: the policy checkpoint's torch_dtype, else the drafter's)")
    ex.set_defaults(func=cmd_export_drafter)
    _add_export_policy(sub)
    _add_eval(sub)
    _add_bench_sd(sub)
    return parser


def _terminated(signum, frame) -> None:
    """SIGTERM (a scheduler's kill, `timeout`) takes Ctrl-C's paths: a collection under way is saved, a checkpoint
    being written completes. `train` stops after its current step instead (Trainer.run)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train" and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides += extra  # KEY=VALUE on both sides of a flag, as Hydra (verl) takes them
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return args.func(args) or 0  # a command returns 1 when part of its work failed (and says so)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"fastrl-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"fastrl-jax {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (`generate | head`): stop quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit fails again
        return 1
    except OSError as e:  # a full disk, a permission: the system's own words, without a traceback
        print(f"fastrl-jax {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
        print(f"\nfastrl-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pool := sys.modules.get("fastrl_jax.rollout.pool"):  # not imported yet: nothing is compiling
            pool.cancel_background_compiles()  # else exit waits for every queued program, whatever the way out


if __name__ == "__main__":
    sys.exit(main())
