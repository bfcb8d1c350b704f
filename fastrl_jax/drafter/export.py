"""Drafter export: a safetensors directory in EAGLE layout that SGLang's LlamaForCausalLMEagle loads (its
Qwen2ForCausalLMEagle for a Qwen2 policy: the same layout with the layer's q/k/v biases), or for an EAGLE-3
drafter the layout of its LlamaForCausalLMEagle3.

Layout (as SafeAILab EAGLE checkpoints; no embedding, no head: SGLang takes both from the target):
  config.json        LlamaConfig of the one-layer drafter, architectures ["LlamaForCausalLMEagle"] (Qwen2Config,
                     ["Qwen2ForCausalLMEagle"], for a Qwen2 policy)
  model.safetensors  fc.weight [H, 2H] (input = concat(embed, feature)), fc.bias [H] (zeros),
                     layers.0.self_attn.{q,k,v,o}_proj.weight (Qwen2: and layers.0.self_attn.{q,k,v}_proj.bias),
                     layers.0.mlp.{gate,up,down}_proj.weight,
                     layers.0.post_attention_layernorm.weight (layer 0 has no input_layernorm),
                     and with a reduced draft vocabulary EAGLE-3's d2t [K] int64 (target id - draft
                     index) and t2d [vocab] bool (Llama only: SGLang's Qwen2 loader fails on them), which
                     SGLang's EAGLE model does not read: it drafts over the hot tokens of
                     --speculative-token-map, so the draft ids are written as
  token_map.pt       (torch.save of the K ids; token_map.json where torch is not installed) too.
Weights are in torch nn.Linear layout [out, in]; q/k use HF's half-split RoPE layout, as ours do.
Features are the target's last hidden state after its final norm, as SGLang captures them.
An export goes to a new or empty directory, written whole or not at all (models.export.export_into), and
only for the policy the drafter was made for (same widths, an EAGLE layer's family, and layers for its EAGLE-3
features).

EAGLE-3 (export_eagle3; SGLang python/sglang/srt/models/llama_eagle3.py, for Qwen policies too: the drafter's
layer is Llama's whatever the policy's family):
  config.json        architectures ["LlamaForCausalLMEagle3"], draft_vocab_size K, target_hidden_size,
                     tie_word_embeddings false (a tied draft head would be the full embedding), bias false,
                     eagle_config.eagle_aux_hidden_state_layer_ids (SGLang captures the input of layer id + 1:
                     our feature_layers - 1)
  model.safetensors  fc.weight [H, 3H], midlayer.self_attn.{q,k,v}_proj.weight [heads x D, 2H] (input
                     concat(norm(embed), norm(hidden))), midlayer.self_attn.o_proj.weight,
                     midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
                     midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight [K, H] (the
                     policy's head rows of the draft vocabulary), d2t [K] int64 and t2d [vocab] bool.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from flax import nnx

from fastrl_jax.models.config import ModelConfig
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.models.export import export_dtype, export_into, readable_as_umask_allows
from fastrl_jax.models.loading import HFTensor, hf_layer_tensors

_FILE = "model.safetensors"
log = logging.getLogger(__name__)


def eagle_architecture(cfg: ModelConfig) -> str:
    """SGLang's EAGLE model class for a drafter of this policy's layers: Llama's, or Qwen2's (q/k/v biases)."""
    if cfg.qk_norm:
        raise ValueError(f"EAGLE export writes Llama or Qwen2 layers (SGLang's LlamaForCausalLMEagle / Qwen2ForCausalLMEagle); "
                         f"family {cfg.family} has q/k norm, which neither has")
    return "Qwen2ForCausalLMEagle" if cfg.qkv_bias else "LlamaForCausalLMEagle"


def _eagle_layer_names(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Our layer parameter -> its EAGLE tensor (the policy's HF name for layer 0 without the "model."
    prefix) and conversions; no input_layernorm (the drafter's layer has none)."""
    eagle_architecture(cfg)
    return {ours: hf._replace(template=hf.template.format(0).removeprefix("model."))
            for ours, hf in hf_layer_tensors(cfg).items() if ours != "attn_norm"}


def _check_policy(drafter: Drafter, cfg: ModelConfig) -> None:
    """Refuses a drafter of another policy than `cfg`: config.json would describe `cfg`, the tensors the drafter."""
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
    if drafter.kind == "eagle":  # its layer is its policy's family's (an EAGLE-3 layer is Llama's for every policy):
        # SGLang's Llama loader skips q/k/v biases, Qwen2's keeps uninitialised ones for missing biases
        fields += ("qkv_bias", "qk_norm")
    wrong = [f"{f} {getattr(drafter.cfg, f)} (policy: {getattr(cfg, f)})" for f in fields
             if getattr(drafter.cfg, f) != getattr(cfg, f)]
    if drafter.feature_layers and max(drafter.feature_layers) >= cfg.num_layers:
        wrong.append(f"feature layers {list(drafter.feature_layers)} (policy: {cfg.num_layers} layers)")
    if wrong:
        raise ValueError(f"the drafter is of another policy: its {', '.join(wrong)}; export it with the policy it "
                         "was trained for")


def _layer_tensors(drafter: Drafter) -> dict[str, np.ndarray]:
    """The drafter's layer in torch nn.Linear layout [out, in], under its EAGLE names."""
    p = {k: np.asarray(v)[0] for k, v in nnx.to_pure_dict(nnx.state(drafter.layers, nnx.Param)).items()}
    return {hf.template: hf.to_hf(p[ours]) for ours, hf in _eagle_layer_names(drafter.cfg).items()}


def eagle_config(cfg: ModelConfig, draft_vocab_size: int | None, dtype: str) -> dict:
    rope = cfg.rope_params
    architecture = eagle_architecture(cfg)
    out = {
        "architectures": [architecture],
        "model_type": "qwen2" if architecture == "Qwen2ForCausalLMEagle" else "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": rope.get("rope_theta", 10000.0),
        # Untied whatever the policy: SGLang replaces the drafter's embedding and head by the target's
        # (set_embed_and_head), and with a tied config its head is the embedding module, deleted twice there.
        "tie_word_embeddings": False,
        "bias": False,
        "torch_dtype": dtype,
    }
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        out["rope_scaling"] = scaling
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        out["eos_token_id"] = list(cfg.eos_token_ids)
    if draft_vocab_size is not None:
        out["draft_vocab_size"] = draft_vocab_size
    return out


def _vocab_tensors(drafter: Drafter, vocab_size: int) -> dict[str, np.ndarray]:
    """EAGLE-3's d2t (target id - draft index) [K] int64 and t2d [vocab] bool; none without a draft vocabulary."""
    if drafter.draft_vocab is None:
        return {}
    ids = np.asarray(drafter.draft_vocab[...]).astype(np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(len(ids)), "t2d": t2d}


def _write(out_dir: str | Path, tensors: dict[str, np.ndarray], config: dict, token_ids: np.ndarray | None = None
           ) -> Path:
    """Writes the export to out_dir, a new or empty directory (its parents are created), whole or not at all:
    over an earlier export it would mix the two (e.g. keep that one's token_map.pt)."""
    from safetensors.numpy import save_file

    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    with export_into(out, flag="out_dir") as partial:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(partial / _FILE), metadata={"format": "pt"})
        readable_as_umask_allows(partial / _FILE)  # SGLang may run as another user
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if token_ids is not None:
            write_token_map(token_ids, partial)
    return out


def _in_dtype(tensors: dict[str, np.ndarray], dtype: str | None) -> tuple[dict[str, np.ndarray], str]:
    """The weights cast to `dtype` (an EXPORT_DTYPES key; None: as they are) and that dtype's name."""
    if dtype is None:
        return tensors, str(next(iter(tensors.values())).dtype)
    np_dtype = export_dtype(dtype)
    return {k: v.astype(np_dtype) for k, v in tensors.items()}, dtype


def export_eagle(drafter: Drafter, policy_cfg: ModelConfig, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Writes config.json and model.safetensors (and token_map.pt with a draft vocabulary) to out_dir, a new or
    empty directory; dtype: the weights' (an EXPORT_DTYPES key), the drafter's by default."""
    if drafter.kind != "eagle":
        raise ValueError(f"export_eagle writes EAGLE drafters; this one is {drafter.kind} (use export_eagle3)")
    _check_policy(drafter, policy_cfg)
    fc = np.asarray(drafter.fc[...])  # [2H, H]
    tensors, dtype = _in_dtype({"fc.weight": fc.T, "fc.bias": np.zeros(fc.shape[1], fc.dtype), **_layer_tensors(drafter)},
                               dtype)
    if eagle_architecture(policy_cfg) == "LlamaForCausalLMEagle":  # Qwen2's loader fails on a tensor it has no place for
        tensors |= _vocab_tensors(drafter, policy_cfg.vocab_size)
    vocab = None if drafter.draft_vocab is None else drafter.draft_vocab_size
    token_ids = None if drafter.draft_vocab is None else np.asarray(drafter.draft_vocab[...])
    return _write(out_dir, tensors, eagle_config(policy_cfg, vocab, dtype), token_ids)


def write_token_map(ids: np.ndarray, out_dir: Path) -> Path:
    """The draft vocabulary as SGLang's --speculative-token-map reads it (torch.load of the hot token ids):
    out_dir/token_map.pt, or, without torch here, out_dir/token_map.json and a note on converting it (naming
    no directory: out_dir is a partial export, renamed when complete)."""
    ids = [int(i) for i in ids]
    try:
        import torch
    except ImportError:
        path = out_dir / "token_map.json"
        path.write_text(json.dumps(ids) + "\n")
        log.warning("torch is not installed: wrote the draft vocabulary as token_map.json beside the drafter's "
                    "model.safetensors; SGLang's --speculative-token-map needs it as .pt: in that directory, run python -c "
                    "\"import json, torch; torch.save(json.load(open('token_map.json')), 'token_map.pt')\"")
        return path
    path = out_dir / "token_map.pt"
    torch.save(ids, path)
    return path


def read_token_map(out_dir: Path) -> np.ndarray | None:
    """The draft vocabulary write_token_map wrote to out_dir (token_map.pt, else token_map.json), or None."""
    if (out_dir / "token_map.pt").is_file():
        import torch

        return np.asarray(torch.load(out_dir / "token_map.pt", weights_only=True), np.int64)
    if (out_dir / "token_map.json").is_file():
        return np.asarray(json.loads((out_dir / "token_map.json").read_text()), np.int64)
    return None


def _eagle3_layer_names(cfg: ModelConfig) -> dict[str, tuple]:
    """Our EAGLE-3 layer parameter -> (its SGLang tensor name, to ours, to torch's [out, in] layout); cfg: the drafter's
    (a Llama layer for every policy)."""
    D = cfg.head_dim
    names = {ours: (hf.template.format(0).replace("model.layers.0.", "midlayer."), hf.to_ours, hf.to_hf)
             for ours, hf in hf_layer_tensors(cfg).items() if ours not in ("wq", "wk", "wv")}
    for ours, heads in (("wq", cfg.num_heads), ("wk", cfg.num_kv_heads), ("wv", cfg.num_kv_heads)):
        names[ours] = (f"midlayer.self_attn.{ours[1]}_proj.weight",  # [heads x D, 2H] <-> [2H, heads, D]
                       lambda w, heads=heads: w.T.reshape(w.shape[1], heads, D), lambda w: w.reshape(w.shape[0], -1).T)
    same = lambda w: w  # noqa: E731
    names["hidden_norm"] = ("midlayer.hidden_norm.weight", same, same)
    return names


def export_eagle3(drafter: Drafter, cfg: ModelConfig, head_rows: np.ndarray, out_dir: str | Path,
                  dtype: str | None = None) -> Path:
    """Writes an EAGLE-3 drafter as SGLang's LlamaForCausalLMEagle3 checkpoint (config.json and
    model.safetensors) to out_dir, a new or empty directory. cfg: the policy's; head_rows: its LM head rows
    of the draft vocabulary ([K, H], Drafter.head_weight; loading.read_head_rows reads them alone), written
    as lm_head.weight. dtype: the weights' (an EXPORT_DTYPES key), the drafter's by default."""
    if drafter.kind != "eagle3":
        raise ValueError(f"export_eagle3 writes EAGLE-3 drafters; this one is {drafter.kind} (use export_eagle)")
    _check_policy(drafter, cfg)
    if head_rows.shape != (drafter.draft_vocab_size, cfg.hidden_size):
        raise ValueError(f"head_rows is {head_rows.shape}; the drafter scores {(drafter.draft_vocab_size, cfg.hidden_size)}")
    layers = list(drafter.feature_layers)
    if layers != sorted(set(layers)) or layers[0] < 1:
        # SGLang captures each layer once, in ascending order, and layer 0's input not at all in some versions
        log.warning("EAGLE-3 feature layers %s (a %d-layer policy) are not distinct, ascending and >= 1: SGLang will "
                    "feed this drafter other features than it was trained on", layers, cfg.num_layers)
    p = {k: np.asarray(v)[0] for k, v in nnx.to_pure_dict(nnx.state(drafter.layers, nnx.Param)).items()}
    fc = np.asarray(drafter.fc[...])  # [3H, H]
    tensors, dtype = _in_dtype({
        "fc.weight": fc.T, "norm.weight": np.asarray(drafter.norm[...]),
        "lm_head.weight": np.asarray(head_rows).astype(fc.dtype),
        **{name: to_hf(p[ours]) for ours, (name, _, to_hf) in _eagle3_layer_names(drafter.cfg).items()}}, dtype)
    tensors |= _vocab_tensors(drafter, cfg.vocab_size)
    config = eagle_config(drafter.cfg, drafter.draft_vocab_size, dtype) | {
        "architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": cfg.hidden_size,
        "bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.feature_layers]},
    }
    return _write(out_dir, tensors, config)


def _load_eagle3(path: Path, t: dict, config: dict, policy_cfg: ModelConfig) -> Drafter:
    """An export_eagle3 directory's drafter. Its lm_head.weight is not read: the drafter scores with
    the policy's head rows of its draft vocabulary, which is what export_eagle3 wrote there."""
    H = policy_cfg.hidden_size
    if t["fc.weight"].shape != (H, 3 * H):
        raise ValueError(f"{path}: fc.weight is {t['fc.weight'].shape}, this policy needs {(H, 3 * H)}")
    ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    layers = None if ids is None else tuple(i + 1 for i in ids)
    vocab = t["d2t"] + np.arange(len(t["d2t"])) if "d2t" in t else None
    drafter = Drafter(policy_cfg, nnx.Rngs(0), t["fc.weight"].dtype, draft_vocab=vocab, kind="eagle3", layers=layers)
    _check_policy(drafter, policy_cfg)
    names = _eagle3_layer_names(drafter.cfg)
    _set_layer(drafter, path, {ours: (name, to_ours(t[name])) for ours, (name, to_ours, _) in names.items()})
    drafter.fc.set_value(np.ascontiguousarray(t["fc.weight"].T))
    drafter.norm.set_value(t["norm.weight"])
    return drafter


def _set_layer(drafter: Drafter, path: Path, values: dict[str, tuple[str, np.ndarray]]) -> None:
    """Our layer parameter -> (its file's tensor name, value in our layout) into the drafter's one layer."""
    state = nnx.state(drafter.layers, nnx.Param)
    pure = nnx.to_pure_dict(state)
    for ours, (name, value) in values.items():
        if pure[ours].shape[1:] != value.shape:
            raise ValueError(f"{path}: {name} is {value.shape} in our layout, this policy needs {pure[ours].shape[1:]}")
        pure[ours] = value[None]
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(drafter.layers, state)


def load_eagle(path: str | Path, policy_cfg: ModelConfig) -> Drafter:
    """Reads a directory written by export_eagle (or export_eagle3: by its config's architecture) back
    into a Drafter for a policy of config policy_cfg."""
    from safetensors.numpy import load_file

    path = Path(path).expanduser()
    if not (path / _FILE).is_file():
        raise FileNotFoundError(f"{path / _FILE} not found (expected a directory written by export-drafter)")
    t = load_file(str(path / _FILE))
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    if "LlamaForCausalLMEagle3" in config.get("architectures", ()):
        return _load_eagle3(path, t, config, policy_cfg)
    written, needed = config.get("architectures", []), eagle_architecture(policy_cfg)
    if written and written != [needed]:
        raise ValueError(f"{path} holds a {', '.join(written)} drafter; a {policy_cfg.family} policy drafts with {needed}")
    H = policy_cfg.hidden_size
    if t["fc.weight"].shape != (H, 2 * H):
        raise ValueError(f"{path}: fc.weight is {t['fc.weight'].shape}, this policy needs {(H, 2 * H)}")
    if np.any(t.get("fc.bias", 0) != 0):
        raise ValueError(f"{path}: fc.bias is non-zero; this drafter has no fc bias")
    vocab = t["d2t"] + np.arange(len(t["d2t"])) if "d2t" in t else read_token_map(path)
    drafter = Drafter(policy_cfg, nnx.Rngs(0), t["fc.weight"].dtype, draft_vocab=vocab)
    names = _eagle_layer_names(drafter.cfg)
    _set_layer(drafter, path, {ours: (hf.template, hf.to_ours(t[hf.template])) for ours, hf in names.items()})
    drafter.fc.set_value(np.ascontiguousarray(t["fc.weight"].T))
    return drafter
