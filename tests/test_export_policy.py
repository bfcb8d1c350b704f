"""export-policy: our Decoder written as an HF checkpoint that transformers loads with no extra arguments,
for tiny Llama / Qwen2 / Qwen3 models: the same logits and greedy ids, sharded files with an index,
the same bytes from sharded parameters, bfloat16, and refusals of output paths an export must not touch."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import transformers  # noqa: E402
from helpers.greedy import greedy_generate  # noqa: E402
from helpers.hf_tiny import FAMILIES, save_random_hf_model  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from fastrl_jax.config import MeshConfig  # noqa: E402
from fastrl_jax.models.export import check_export_dir, export_hf, export_into  # noqa: E402
from fastrl_jax.models.loading import load_model  # noqa: E402
from fastrl_jax.models.tokenizer import load_tokenizer  # noqa: E402
from fastrl_jax.sharding import make_mesh  # noqa: E402


def one_device():
    return make_mesh(MeshConfig(), jax.devices()[:1])


def export(source, out, mesh=None, **kw):
    model, _ = load_model(source, mesh or one_device())
    base = json.loads((source / "config.json").read_text())
    kw.setdefault("dtype", "float32")
    return model, export_hf(model, load_tokenizer(source), out, stop_ids=(2,), base_config=base, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def round_trip(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    save_random_hf_model(request.param, tmp / "source", tokenizer=True)
    model, out = export(tmp / "source", tmp / "export")
    return model, out


def test_transformers_loads_the_export_with_our_logits_and_greedy_ids(round_trip):
    model, out = round_trip
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.dtype == torch.float32 and hf.config.tie_word_embeddings == model.cfg.tie_word_embeddings
    prompt = tokenizer.encode("12+34=")
    assert len(prompt) == 6
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 19))
    import jax.numpy as jnp

    from fastrl_jax.models.decoder import KVCache

    ours, _, _ = model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(19), (2, 19)), KVCache.zeros(model.cfg, 2, 32),
                       jnp.zeros(2, jnp.int32))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    assert np.max(np.abs(np.asarray(ours) - theirs)) / np.max(np.abs(theirs)) < 1e-4
    stop = hf.generation_config.eos_token_id
    stop = stop if isinstance(stop, list) else [stop]
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert generated == greedy_generate(model, prompt, 12, stop)


def test_sharded_files_and_sharded_parameters_give_the_same_tensors(tmp_path):
    """Parameters split over fsdp=4 x tensor=2 and files cut at 60 kB: an index, several shards, and
    every tensor equal to the one-device, one-file export; transformers loads it."""
    save_random_hf_model("qwen2", tmp_path / "source", tokenizer=True)
    _, single = export(tmp_path / "source", tmp_path / "single")
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    model, sharded = export(tmp_path / "source", tmp_path / "sharded", mesh, max_shard_bytes=60_000)
    assert len(model.layers.wq.get_value().sharding.device_set) == 8
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == files
    want = load_file(single / "model.safetensors")
    got = {k: v for f in files for k, v in load_file(sharded / f).items()}
    assert set(got) == set(want) == set(index["weight_map"])
    assert "lm_head.weight" not in got  # tied: transformers ties it from config.json
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    transformers.AutoModelForCausalLM.from_pretrained(sharded)


def test_bfloat16_export(tmp_path):
    save_random_hf_model("llama", tmp_path / "source", tokenizer=True)
    model, out = export(tmp_path / "source", tmp_path / "bf16", dtype="bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ours = np.asarray(model.layers.w_up.get_value()[1]).T.astype(np.float32)
    theirs = hf.model.layers[1].mlp.up_proj.weight.float().detach().numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-2, atol=1e-3)


def test_export_refuses_a_file_a_full_directory_or_a_missing_parent(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is a file; give a new directory"):
        check_export_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="exists and is not empty"):
        check_export_dir(tmp_path / "full")
    with pytest.raises(FileNotFoundError, match="parent directory .*missing.* does not exist"):
        check_export_dir(tmp_path / "missing" / "out")
    (tmp_path / "empty").mkdir()
    assert check_export_dir(tmp_path / "empty") == tmp_path / "empty"
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    # An empty directory behind a link (a scratch disk linked into a project) is exported into: the whole export
    # was written, then renaming it onto the link failed and left it hidden (found by review).
    (tmp_path / "scratch").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "scratch")
    with export_into(tmp_path / "link") as partial:
        (partial / "config.json").write_text("{}\n")
    assert (tmp_path / "link" / "config.json").is_file() and (tmp_path / "link").is_symlink()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_an_existing_empty_directory_is_written_in_place_and_a_second_export_into_it_is_refused(tmp_path, monkeypatch):
    """A mount point (docker -v, a PVC) cannot be removed and renamed onto: the whole export was written
    beside it, then removing it failed and left the export hidden (review). The directory is kept and filled;
    a second export while one runs is refused (it removed the first's files as a killed export's leftovers,
    and the first then renamed an export short of its first shards into place)."""
    out = tmp_path / "mounted"
    out.mkdir()
    inode = out.stat().st_ino
    with export_into(out) as partial:
        (partial / "model.safetensors").write_bytes(b"w")
        with pytest.raises(ValueError, match="another export into it is running"), export_into(out):
            pass
        assert (partial / "model.safetensors").is_file()  # untouched by the refused one
        (partial / "config.json").write_text("{}\n")
    assert out.stat().st_ino == inode
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["mounted"]
    with pytest.raises(ValueError, match="not empty"):
        check_export_dir(out)
    # A new directory: written beside, renamed into place, with nothing left beside it
    with export_into(tmp_path / "new") as partial:
        with pytest.raises(ValueError, match="another export into it is running"), export_into(tmp_path / "new"):
            pass
        (partial / "config.json").write_text("{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mounted", "new"]
    # A place this user cannot write is refused before anything loads, not after
    monkeypatch.setattr("os.access", lambda path, mode: False)
    (tmp_path / "theirs").mkdir()
    for target in (tmp_path / "theirs", tmp_path / "theirs" / "out"):
        with pytest.raises(PermissionError, match="cannot be written by this user"):
            check_export_dir(target)


@pytest.mark.slow
def test_smollm2_export_decodes_like_generate(tmp_path):
    """The done-when check, as a user runs it: `export-policy --model smollm2`, then transformers alone
    loads the directory, its chat template gives our prompt ids, and greedy decoding gives the ids of
    `fastrl-jax generate`."""
    from helpers.cli import fastrl_jax

    out = tmp_path / "smollm2-hf"
    run = fastrl_jax("export-policy", "--model", "smollm2", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "serve a float32 checkpoint in float16 under --dtype auto: pass --dtype bfloat16" in run.stderr  # the default
    texts = ["What is 12 * 7? Answer briefly.", "Write one sentence about the sea."]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    results = tmp_path / "generated.jsonl"
    gen = fastrl_jax("generate", "--model", "smollm2", "--prompts", str(prompts), "--output", str(results),
                     "--max-new-tokens", "40", "--set", "rollout.length_buckets=[256]", "rollout.prompt_buckets=[64]")
    assert gen.returncode == 0, gen.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    eos = hf.generation_config.eos_token_id
    for text, row in zip(texts, rows):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        assert ids == row["prompt_ids"]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
        assert theirs == row["completion_ids"] + ([eos] if row["finish_reason"] == "stop" else [])
        assert len(theirs) > 5


def test_tokenizer_files_keep_extra_special_tokens_in_a_form_transformers_4_reads(tmp_path):
    """transformers 5 saves extra special tokens (Qwen2.5's <|im_start|> ...) as a list under extra_special_tokens;
    transformers 4.x, which vLLM and SGLang pin, expects a dict there and fails to load the tokenizer ('list'
    object has no attribute 'keys'). The export lists them under additional_special_tokens, which both read."""
    from helpers.tiny_run import write_tokenizer

    from fastrl_jax.models.export import save_tokenizer

    write_tokenizer(tmp_path / "source")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "source")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    save_tokenizer(tokenizer, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert isinstance(config.get("extra_special_tokens", {}), dict), config  # what transformers 4.x requires
    assert config["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert back.all_special_tokens == tokenizer.all_special_tokens
    text = "<|im_start|>12+34=<|im_end|>"
    assert back.encode(text) == tokenizer.encode(text) and len(back.encode(text)) == 8
