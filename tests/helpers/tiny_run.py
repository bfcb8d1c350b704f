"""Tiny GRPO runs: a tiny random Llama written as an HF checkpoint with a character tokenizer.

The trainer loads it through the same path as a real checkpoint (config.json + safetensors +
tokenizer.json), so subprocess tests (resume after SIGKILL, two processes) run the real CLI.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

VOCAB = 128
SPECIALS = ["<pad>", "<eos>", "<unk>"]
EOS_ID = 1


def _vocab() -> list[str]:
    chars = list(string.digits + string.ascii_lowercase + " +=?.,:-*")
    fill = [f"{i}{j}" for i in range(1, 10) for j in range(10)]  # multi-digit number tokens
    tokens = SPECIALS + chars + fill
    return tokens[:VOCAB]


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_vocab())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(directory)


def write_tiny_checkpoint(directory: str | Path, seed: int = 0, scale: float = 4.0) -> Path:
    """A 2-layer Llama (hidden 64, vocab 128) with random weights as an HF checkpoint directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    H, F, L, nh, nkv, D = 64, 128, 2, 4, 2, 16
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": H,
        "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": nh, "num_key_value_heads": nkv,
        "head_dim": D, "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "eos_token_id": EOS_ID, "bos_token_id": None,
    }
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (scale * 0.02 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(VOCAB, H), "model.norm.weight": np.ones(H, np.float32),
               "lm_head.weight": w(VOCAB, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(H, np.float32),
            p + "post_attention_layernorm.weight": np.ones(H, np.float32),
            p + "self_attn.q_proj.weight": w(nh * D, H), p + "self_attn.k_proj.weight": w(nkv * D, H),
            p + "self_attn.v_proj.weight": w(nkv * D, H), p + "self_attn.o_proj.weight": w(H, nh * D),
            p + "mlp.gate_proj.weight": w(F, H), p + "mlp.up_proj.weight": w(F, H), p + "mlp.down_proj.weight": w(H, F),
        }
    save_file(tensors, str(directory / "model.safetensors"))
    write_tokenizer(directory)
    return directory


def write_prompts(path: str | Path, n: int = 16, seed: int = 0) -> Path:
    """JSONL prompts 'a+b=' with single-digit answers."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 5, 2))
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def digit_reward(completion: str, answer: str) -> float:
    """Share of completion characters that are digits: varies between random samples, so a tiny random
    model gets non-zero advantages and its parameters move."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def tiny_overrides(tmp: Path, steps: int = 3) -> list[str]:
    """Config overrides for a seconds-long GRPO run on the tiny checkpoint."""
    ckpt = write_tiny_checkpoint(tmp / "tiny")
    prompts = write_prompts(tmp / "prompts.jsonl")
    return [
        f"model.path={ckpt}", f"data.source={prompts}", f"data.eval_source={prompts}", "data.instruction=",
        "data.chat_template=false", "reward.functions=[helpers.tiny_run:digit_reward]", "reward.weights=[1.0]",
        f"rl.steps={steps}", "rl.prompts_per_step=4", "rl.samples_per_prompt=4", "rl.max_new_tokens=12",
        "rl.micro_batch_size=8", "rl.temperature=1.0", f"rl.out_dir={tmp / 'run'}", "rl.tensorboard=false",
        "optim.learning_rate=0.003", "rollout.batch_buckets=[4, 16]", "rollout.length_buckets=[32, 64]",
        "rollout.prompt_buckets=[8, 16]", "rollout.steps_per_call=8", "rollout.compile_cache_dir=",
        "rollout.warm_up=false",
        # Speculation runs in these seconds-long rollouts, with a random drafter too: the tests check it is lossless.
        "sd.min_drafter_accept=0", "sd.compile_in_background=false",
        "drafter_online.tail_budget=share",  # the drafter trains in the tail whatever speculation saved
    ]
