"""The `fastrl-jax` command: one sub-command per job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from fastrl_jax.config import ConfigError


def _load(args: argparse.Namespace, defaults: list[str] = ()):
    """Config, model, model config and tokenizer for a sub-command's --config/--model/--set."""
    from fastrl_jax.config import load_config
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.loading import load_model
    from fastrl_jax.models.tokenizer import load_tokenizer
    from fastrl_jax.sharding import make_mesh

    overrides = [*defaults, *([f"model.path={args.model}"] if args.model else []), *args.set]
    cfg = load_config(args.config, overrides)
    t0 = time.perf_counter()
    path = resolve_model_path(cfg.model.path)
    model, model_cfg = load_model(path, make_mesh(cfg.mesh), cfg.model.dtype)
    tokenizer = load_tokenizer(path)
    print(f"[fastrl-jax] loaded {cfg.model.path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return cfg, model, model_cfg, tokenizer


def _read_prompts(args, tokenizer) -> list[list[int]]:
    from fastrl_jax.models.tokenizer import chat_prompt_ids

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text) if args.raw else chat_prompt_ids(tokenizer, text)

    if args.prompt is not None:
        return [encode(args.prompt)]
    path = Path(args.prompts)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts file {path} not found")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON ({e})") from e
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(encode(row["prompt"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt_ids"), list):
            prompts.append([int(t) for t in row["prompt_ids"]])
        else:
            raise ValueError(f'{path}:{n} needs {{"prompt": text}} or {{"prompt_ids": [ints]}}, got {line[:80]!r}')
    return prompts


def cmd_generate(args: argparse.Namespace) -> None:
    from fastrl_jax.rollout.engine import Request, RolloutEngine

    # A one-off generation compiles only the programs it reaches.
    spec = [f"sd.{key}={value!r}" for key, value in (
        ("mode", args.sd), ("steps", args.spec_steps), ("topk", args.spec_topk),
        ("verify_tokens", args.spec_verify_tokens), ("accept", args.spec_accept)) if value is not None]
    cfg, model, model_cfg, tokenizer = _load(args, ["rollout.warm_up=false", *spec])
    prompts = _read_prompts(args, tokenizer)
    stop_ids = tuple(sorted(set(model_cfg.eos_token_ids) | ({tokenizer.eos_token_id} - {None})))
    requests = [
        Request(p, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed + i, stop_ids)
        for i, p in enumerate(prompts)
    ]
    drafter = None
    if cfg.sd.mode != "off":
        from flax import nnx

        from fastrl_jax.checkpoint import load_drafter
        from fastrl_jax.models.decoder import DTYPES
        from fastrl_jax.models.drafter import Drafter

        if args.drafter:
            drafter = load_drafter(args.drafter, model_cfg, DTYPES[cfg.model.dtype])
        else:
            print("[fastrl-jax] no --drafter: using a randomly initialised drafter (lossless, but slow)", file=sys.stderr)
            drafter = Drafter(model_cfg, nnx.Rngs(cfg.seed), DTYPES[cfg.model.dtype])
    engine = RolloutEngine(model, cfg.rollout, sd=cfg.sd, drafter=drafter)
    t0 = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - t0
    rows = []
    for p, r in zip(prompts, results):
        ids = r.tokens[:-1] if r.finish_reason == "stop" else r.tokens
        row = {"prompt_ids": p, "completion_ids": ids, "completion": tokenizer.decode(ids), "finish_reason": r.finish_reason}
        if r.error:
            row["error"] = r.error
            print(f"[fastrl-jax] request {len(rows)}: {r.error}", file=sys.stderr)
        rows.append(row)
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        for row in rows:
            print(row["completion"])
    tokens = sum(len(r.tokens) for r in results)
    print(f"[fastrl-jax] {len(rows)} completions, {tokens} tokens in {seconds:.1f}s "
          f"({tokens / seconds:.1f} tok/s, compilation included; {engine.pool.report()})", file=sys.stderr)
    if "acceptance_length" in engine.stats:
        print(f"[fastrl-jax] speculative: {engine.stats['sd_steps']} row-steps, acceptance length "
              f"{engine.stats['acceptance_length']:.2f} tokens/step", file=sys.stderr)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (configs/*.yaml); defaults apply without it")
    parser.add_argument("--model", help="HF checkpoint dir, .gguf file, or 'smollm2' (overrides model.path)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. mesh.tensor=2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastrl-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts with the rollout engine (chat template applied)")
    _common(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt text")
    source.add_argument("--prompts", help='JSONL file: {"prompt": text} or {"prompt_ids": [...]} per line')
    gen.add_argument("--raw", action="store_true", help="encode prompt texts as is, without the chat template")
    gen.add_argument("--output", help="write JSONL results here (input order) instead of printing completions")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 is off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    gen.add_argument("--sd", choices=["off", "on"], help="speculative decoding (overrides sd.mode)")
    gen.add_argument("--drafter", help="drafter checkpoint directory; a random drafter when omitted")
    gen.add_argument("--spec-steps", type=int, help="draft tree depth (sd.steps)")
    gen.add_argument("--spec-topk", type=int, help="branching per step (sd.topk)")
    gen.add_argument("--spec-verify-tokens", type=int, help="tree nodes verified, root included (sd.verify_tokens)")
    gen.add_argument("--spec-accept", choices=["coupled", "rejection"], help="acceptance rule (sd.accept)")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"fastrl-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
