"""The `fastrl-jax` command: one sub-command per job."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from fastrl_jax.config import ConfigError


def _load(model_arg: str, dtype: str, mesh_overrides: list[str]):
    """Model, its config and tokenizer from a path or the name 'smollm2', on the configured mesh."""
    from fastrl_jax.config import load_config
    from fastrl_jax.models.hub import resolve_model_path
    from fastrl_jax.models.loading import load_model
    from fastrl_jax.models.tokenizer import load_tokenizer
    from fastrl_jax.sharding import make_mesh

    cfg = load_config(None, [f"model.path={model_arg}", f"model.dtype={dtype}", *mesh_overrides])
    path = resolve_model_path(cfg.model.path)
    mesh = make_mesh(cfg.mesh)
    model, model_cfg = load_model(path, mesh, cfg.model.dtype)
    return model, model_cfg, load_tokenizer(path)


def cmd_generate(args: argparse.Namespace) -> None:
    from fastrl_jax.models.greedy import greedy_tokens
    from fastrl_jax.models.tokenizer import chat_prompt_ids

    t0 = time.perf_counter()
    model, model_cfg, tokenizer = _load(args.model, args.dtype, args.set)
    prompt_ids = chat_prompt_ids(tokenizer, args.prompt)
    stop_ids = set(model_cfg.eos_token_ids) | {tokenizer.eos_token_id} - {None}
    print(f"[fastrl-jax] loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    t0 = time.perf_counter()
    ids = []
    for token in greedy_tokens(model, prompt_ids, args.max_new_tokens, tuple(stop_ids)):
        if token in stop_ids:
            break
        ids.append(token)
    print(tokenizer.decode(ids, skip_special_tokens=True))
    dt = time.perf_counter() - t0
    print(f"[fastrl-jax] {len(ids)} tokens in {dt:.1f}s (compile included)", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastrl-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy completion of one prompt (chat template applied)")
    gen.add_argument("--model", default="smollm2", help="HF checkpoint dir, .gguf file, or 'smollm2'")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. mesh.tensor=2")
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
