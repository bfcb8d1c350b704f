"""Prompt token ids: the chat template applied to a text or a record, prompt files, and the built-in
prompt sets (held-out math and chat, and the drafter warm-up mix)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastrl_jax.config import Config
from fastrl_jax.data import chat_prompts, math_problems
from fastrl_jax.data.prompt_files import read_prompt_file

log = logging.getLogger(__name__)

HELD_OUT_SEED_OFFSET = 7_000_001  # held-out math problems come from another stream of the generator


def messages_prompt_ids(tokenizer, messages: Sequence[dict[str, str]], chat_template: bool = True) -> list[int]:
    """Token ids of chat messages followed by the assistant header the model continues from; without a
    chat template (or chat_template False) the messages' contents encoded as plain text."""
    if chat_template and tokenizer.chat_template:
        # Tokenized as transformers' apply_chat_template does: control tokens typed in the text (e.g.
        # "<|im_end|>") become those tokens, as in transformers.
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    if chat_template:
        _without_template(str(getattr(tokenizer, "name_or_path", "")))
    return tokenizer.encode("\n".join(m["content"] for m in messages))


@functools.cache
def _without_template(name: str) -> None:
    log.warning("the tokenizer %s has no chat template: prompts are the messages' contents as plain text, without their "
                "roles (set data.chat_template=false to say so, or give the tokenizer a template)", name or "")


def chat_prompt_ids(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of `text` as one user turn (as is for a tokenizer without a chat template, or without
    chat_template: data.chat_template)."""
    return messages_prompt_ids(tokenizer, [{"role": "user", "content": text}], chat_template)


def record_prompt_ids(record: dict[str, Any], tokenizer, instruction: str = "", chat_template: bool = True) -> list[int]:
    """Token ids of a prompt record's messages, or of its prompt + instruction as one user turn."""
    if "messages" in record:
        messages = record["messages"]
    else:
        messages = [{"role": "user", "content": record["prompt"] + (f" {instruction}" if instruction else "")}]
    return messages_prompt_ids(tokenizer, messages, chat_template)


def data_prompt_ids(cfg: Config, record: dict[str, Any], tokenizer) -> list[int]:
    """record_prompt_ids with the config's data.instruction and data.chat_template: a training or held-out record's
    prompt as the trainer and eval give it to the policy."""
    return record_prompt_ids(record, tokenizer, cfg.data.instruction, cfg.data.chat_template)


def read_jsonl_prompts(path: str | Path, tokenizer, chat_template: bool = True) -> list[list[int]]:
    """{"prompt": text} (chat template applied, unless chat_template is False) or {"prompt_ids": [ints]} per line."""
    return read_prompt_file(path, lambda text: chat_prompt_ids(tokenizer, text, chat_template))


def math_prompt_ids(tokenizer, seed: int, count: int, levels, instruction: str, held_out: bool = False,
                    chat_template: bool = True) -> list[list[int]]:
    """The first `count` built-in math problems of stream `seed` (held_out: of the held-out questions), each a user
    turn with the instruction."""
    return [chat_prompt_ids(tokenizer, f"{p.question} {instruction}".strip(), chat_template)
            for p in math_problems.problems(seed, count, tuple(levels), held_out=held_out)]


def held_out_sets(cfg: Config, tokenizer, count: int,
                  names: Sequence[str] = ("math", "chat")) -> dict[str, list[list[int]]]:
    """Held-out prompts of the sets `names`: held-out math questions (math_problems.is_held_out) of another generator
    stream, hand-written chat prompts (at most len(chat_prompts.HELD_OUT))."""
    template = cfg.data.chat_template
    make = {"math": lambda: math_prompt_ids(tokenizer, cfg.seed + HELD_OUT_SEED_OFFSET, count, cfg.data.math_levels,
                                            cfg.drafter_train.instruction, held_out=True, chat_template=template),
            "chat": lambda: [chat_prompt_ids(tokenizer, t, template) for t in chat_prompts.held_out_prompts(count)]}
    return {name: make[name]() for name in names}


def drafter_training_prompts(cfg: Config, tokenizer) -> list[list[int]]:
    """The drafter warm-up prompts: built-in math + chat (interleaved) or drafter_train.prompts' JSONL file."""
    dt, template = cfg.drafter_train, cfg.data.chat_template
    if dt.prompts != "builtin":
        return read_jsonl_prompts(dt.prompts, tokenizer, template)[: dt.num_prompts]
    n_chat = round(dt.num_prompts * dt.chat_fraction)
    math_ids = math_prompt_ids(tokenizer, cfg.seed, dt.num_prompts - n_chat, cfg.data.math_levels, dt.instruction,
                               chat_template=template)
    chat_ids = [chat_prompt_ids(tokenizer, t, template) for t in chat_prompts.train_prompts(cfg.seed, n_chat)]
    # Interleaved, so every stretch of the request stream mixes both kinds.
    out, i, j = [], 0, 0
    while i < len(math_ids) or j < len(chat_ids):
        if j >= len(chat_ids) or (i < len(math_ids) and i * len(chat_ids) <= j * len(math_ids)):
            out.append(math_ids[i])
            i += 1
        else:
            out.append(chat_ids[j])
            j += 1
    return out
