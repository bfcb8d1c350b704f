"""The rules a request must meet to run on a rollout engine, as pure functions of the request and the
engine's configs.

The engine applies them to every request (RolloutEngine.validate); a command applies them before it
loads a model, so a bad --max-new-tokens or an over-long prompt fails in a second, not after the
weights are read. Only the token-id range needs the model (its vocabulary size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from fastrl_jax.config import RolloutConfig, SpecConfig, temperature_problem

if TYPE_CHECKING:
    from fastrl_jax.rollout.engine import Request


def draft_margin(sd: SpecConfig) -> int:
    """KV-cache slots a speculative step writes past a row's last token (its largest draft tree, root excluded)."""
    return 0 if sd.mode == "off" else prompt_margin(sd)


def prompt_margin(sd: SpecConfig) -> int:
    """The draft margin a run's prompts are fitted with (trainer.fitting, eval's prompt set): sd.strategies' whether
    or not sd.mode runs them, so turning SD off or on never changes which prompts a run trains and evaluates on."""
    return max(spec.nodes() - 1 for spec in sd.strategy_list())


def sampling_problem(max_new_tokens: int, temperature: float, top_k: int, top_p: float, cfg: RolloutConfig,
                     margin: int = 0) -> str | None:
    """The reason these sampling settings cannot run on an engine of `cfg` (whatever the prompt), or None."""
    if max_new_tokens < 1:
        return f"max_new_tokens must be >= 1, got {max_new_tokens}"
    max_len = cfg.length_buckets[-1]
    if max_new_tokens + margin >= max_len:
        extra = f" + {margin} draft-tree slots" if margin else ""
        return (f"max_new_tokens ({max_new_tokens}){extra} leaves no room for a prompt in the KV cache ({max_len} slots, "
                "the largest rollout.length_buckets entry): lower it or raise rollout.length_buckets")
    if problem := temperature_problem("temperature", temperature):
        return problem
    if not 0 <= top_k < 2**31 or not 0 < top_p <= 1:  # `not <=` catches NaN too
        return f"need 0 <= top_k < 2**31, 0 < top_p <= 1; got {top_k}, {top_p}"
    return None


def prompt_limit(cfg: RolloutConfig, max_new_tokens: int, margin: int = 0) -> tuple[int, str]:
    """The longest prompt a request of max_new_tokens runs with on an engine of `cfg` whose speculative steps write
    `margin` slots past the last token, and what sets it: the largest prompt bucket, or the room max_new_tokens and
    the draft tree leave in the largest length bucket. The trainer and `eval` leave longer prompts out."""
    room = cfg.length_buckets[-1] - max_new_tokens - margin
    limit = min(cfg.prompt_buckets[-1], room)
    return limit, (f"the largest rollout.prompt_buckets ({limit} tokens)" if limit < room else
                   f"the room max_new_tokens ({max_new_tokens}) leaves in the largest rollout.length_buckets ({limit} tokens)")


def request_problem(r: Request, cfg: RolloutConfig, margin: int = 0, vocab_size: int | None = None) -> str | None:
    """The reason request `r` cannot run on an engine of `cfg` whose speculative steps write `margin`
    slots past the last token, or None; vocab_size None skips the token-id range check."""
    if problem := _type_problem(r):
        return problem
    n = len(r.prompt_ids)
    if n == 0:
        return "the prompt is empty"
    if n > cfg.prompt_buckets[-1]:
        return (f"the prompt has {n} tokens, more than the largest prompt bucket ({cfg.prompt_buckets[-1]}); "
                "raise rollout.prompt_buckets")
    problem = sampling_problem(r.max_new_tokens, r.temperature, r.top_k, r.top_p, cfg, margin)
    if problem:
        return problem
    max_len = cfg.length_buckets[-1]
    if n + r.max_new_tokens + margin > max_len:
        extra = f" + {margin} draft-tree slots" if margin else ""
        return (f"prompt ({n}) + max_new_tokens ({r.max_new_tokens}){extra} exceeds the KV cache ({max_len} "
                "slots, the largest rollout.length_buckets entry)")
    if len(r.stop_ids) > cfg.max_stop_ids:
        return f"{len(r.stop_ids)} stop ids, more than rollout.max_stop_ids={cfg.max_stop_ids}"
    if vocab_size is not None:
        return id_problem(r.prompt_ids, r.stop_ids, vocab_size)
    return None


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _type_problem(r: Request) -> str | None:
    """Fields of the wrong type, which would otherwise be truncated (2.5 tokens) or fail the whole stream."""
    for name in ("prompt_ids", "stop_ids"):
        ids = getattr(r, name)
        if not isinstance(ids, (list, tuple, np.ndarray)) or not all(_is_int(t) for t in ids):
            return f"{name} must be a list of token ids (ints), got {str(ids)[:80]!r}"
    for name in ("max_new_tokens", "top_k", "seed"):
        if not _is_int(getattr(r, name)):
            return f"{name} must be an int, got {getattr(r, name)!r}"
    for name in ("temperature", "top_p"):
        if not isinstance(getattr(r, name), (int, float, np.integer, np.floating)) or isinstance(getattr(r, name), bool):
            return f"{name} must be a number, got {getattr(r, name)!r}"
    return None


def id_problem(prompt_ids: Sequence[int], stop_ids: Sequence[int], vocab: int) -> str | None:
    """Why token ids fall outside a vocabulary of `vocab` tokens (None when they do not)."""
    if any(not 0 <= t < vocab for t in prompt_ids):
        return f"prompt token ids must be in [0, {vocab})"
    bad = [t for t in stop_ids if not 0 <= t < vocab]
    if bad:
        return f"unknown stop token ids {bad}: the vocabulary has {vocab} tokens"
    return None
