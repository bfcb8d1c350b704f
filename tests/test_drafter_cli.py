"""`fastrl-jax export-drafter` end to end on a tiny policy config, and clear errors."""

import json

import numpy as np
from flax import nnx
from helpers.cli import fastrl_jax
from helpers.tiny import TINY

from fastrl_jax.drafter.export import load_eagle
from fastrl_jax.models.drafter import Drafter
from fastrl_jax.models.drafter_io import load_drafter, save_drafter


def tiny_model_dir(tmp_path):
    d = tmp_path / "policy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": TINY.vocab_size, "hidden_size": TINY.hidden_size,
        "intermediate_size": TINY.intermediate_size, "num_hidden_layers": TINY.num_layers,
        "num_attention_heads": TINY.num_heads, "num_key_value_heads": TINY.num_kv_heads,
        "rms_norm_eps": TINY.rms_norm_eps, "max_position_embeddings": TINY.max_position_embeddings,
    }))
    return d


def test_export_drafter_writes_orbax_and_eagle(tmp_path):
    run = tmp_path / "run"
    drafter = Drafter(TINY, nnx.Rngs(0), draft_vocab=np.arange(0, 128, 2))
    save_drafter(run / "drafter", drafter)  # a train-drafter out_dir holds drafter/
    out = tmp_path / "export"
    res = fastrl_jax("export-drafter", "--model", str(tiny_model_dir(tmp_path)), "--drafter", str(run), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert (out / "eagle" / "config.json").is_file() and (out / "eagle" / "model.safetensors").is_file()
    for back in (load_drafter(out / "orbax", TINY), load_eagle(out / "eagle", TINY)):
        np.testing.assert_array_equal(back.fc[...], drafter.fc[...])
        np.testing.assert_array_equal(back.draft_vocab[...], drafter.draft_vocab[...])
    again = fastrl_jax("export-drafter", "--model", str(tmp_path / "policy"), "--drafter", str(run), "--out", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr and "Traceback" not in again.stderr
    # Without --model, a run directory's own config names the policy (not the default smollm2).
    from fastrl_jax.config import load_config, save_config

    save_config(load_config(None, [f"model.path={tmp_path / 'policy'}"]), run / "config.yaml")
    res = fastrl_jax("export-drafter", "--drafter", str(run), "--out", str(tmp_path / "export2"))
    assert res.returncode == 0 and (tmp_path / "export2" / "eagle" / "config.json").is_file(), res.stderr


def test_export_drafter_writes_the_policys_dtype_and_the_serve_flags_name_it(tmp_path):
    """SGLang gives a draft model the dtype of its own config.json (float32 as float16) and the target its own: a
    float32 export beside a bfloat16 policy (Qwen2.5's, Llama-3's) fails at the draft's first matmul (found by
    review). The export takes the policy checkpoint's torch_dtype, and the printed serve flags set --dtype."""
    from safetensors.numpy import load_file

    policy = tiny_model_dir(tmp_path)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    drafter = Drafter(TINY, nnx.Rngs(0), draft_vocab=np.arange(0, 128, 2))
    save_drafter(tmp_path / "d", drafter)
    for flag, dtype in (((), "bfloat16"), (("--dtype", "float16"), "float16")):
        out = tmp_path / f"export_{dtype}"
        res = fastrl_jax("export-drafter", "--model", str(policy), "--drafter", str(tmp_path / "d"), "--out", str(out), *flag)
        assert res.returncode == 0, res.stderr
        assert json.loads((out / "eagle" / "config.json").read_text())["torch_dtype"] == dtype
        assert str(load_file(str(out / "eagle" / "model.safetensors"))["fc.weight"].dtype) == dtype
        assert f"--speculative-algorithm EAGLE --speculative-draft-model-path {out / 'eagle'} --dtype {dtype}" in res.stderr
        np.testing.assert_allclose(load_eagle(out / "eagle", TINY).fc[...].astype(np.float32), drafter.fc[...],
                                   rtol=1e-2, atol=1e-3)
        assert load_drafter(out / "orbax", TINY).fc[...].dtype == np.float32  # it trains on: model.dtype


def test_missing_unfinished_or_foreign_drafters_are_one_clear_line(tmp_path):
    policy = str(tiny_model_dir(tmp_path))
    unfinished = tmp_path / "warmup"
    (unfinished / "checkpoints" / "500").mkdir(parents=True)  # what a train-drafter run leaves before its end
    (unfinished / "config.yaml").write_text("seed: 0\n")
    (unfinished / "data.npz").write_bytes(b"")
    plain_run = tmp_path / "grpo"  # a train run with sd.mode off: no drafter in its checkpoints
    (plain_run / "checkpoints" / "3" / "policy").mkdir(parents=True)
    foreign = tmp_path / "notes"
    foreign.mkdir()
    cases = {tmp_path / "none": "not found", unfinished: "a train-drafter run that has not finished (it has no drafter/ yet)",
             plain_run: "is a train run whose checkpoints hold no drafter",
             foreign: "is not a drafter checkpoint (no Orbax metadata)"}
    for drafter, message in cases.items():
        res = fastrl_jax("export-drafter", "--model", policy, "--drafter", str(drafter), "--out", str(tmp_path / "o"))
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert not (tmp_path / "o").exists()


def test_export_drafter_onto_a_file_is_one_clear_line(tmp_path):
    save_drafter(tmp_path / "run" / "drafter", Drafter(TINY, nnx.Rngs(0)))
    (tmp_path / "taken").write_text("mine")
    res = fastrl_jax("export-drafter", "--model", str(tiny_model_dir(tmp_path)), "--drafter", str(tmp_path / "run"),
                     "--out", str(tmp_path / "taken"))
    assert res.returncode == 2 and "is a file; give a new directory" in res.stderr and "Traceback" not in res.stderr
    assert (tmp_path / "taken").read_text() == "mine"


def test_bench_sd_without_prompts_or_with_clashing_sets_is_one_clear_line(tmp_path):
    res = fastrl_jax("bench-sd", "--model", str(tiny_model_dir(tmp_path)), "--drafter", str(tmp_path), "--prompt-sets")
    assert res.returncode == 2 and "--prompt-file" in res.stderr and "Traceback" not in res.stderr
    clash = fastrl_jax("bench-sd", "--model", str(tmp_path / "policy"), "--drafter", str(tmp_path),
                       "--prompt-file", str(tmp_path / "a" / "math.jsonl"))
    assert clash.returncode == 2 and "distinct names" in clash.stderr and "Traceback" not in clash.stderr
    for flag, value in (("--prompts", "0"), ("--repeats", "0"), ("--batch-sizes", "-1"), ("--new-tokens", "x")):
        res = fastrl_jax("bench-sd", "--model", str(tmp_path / "policy"), flag, value)
        assert res.returncode == 2 and f"argument {flag}" in res.stderr and f": must be an int >= 1, got '{value}'" in res.stderr, res.stderr


def test_export_drafter_for_a_policy_it_cannot_export_leaves_nothing(tmp_path):
    """EAGLE export writes Llama or Qwen2 layers: a Qwen3 policy (q/k norm) is refused, and the refusal leaves no
    half-written export behind that would make a rerun (e.g. with the right --model) refuse its --out."""
    from fastrl_jax.models.loading import read_model_config

    policy = tiny_model_dir(tmp_path)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    save_drafter(tmp_path / "run" / "drafter", Drafter(read_model_config(policy), nnx.Rngs(0)))
    out = tmp_path / "export"
    res = fastrl_jax("export-drafter", "--model", str(policy), "--drafter", str(tmp_path / "run"), "--out", str(out))
    assert res.returncode == 2 and "family qwen3 has q/k norm, which neither has" in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "run"]  # no export, no .export.partial


def test_train_drafter_restart_over_checkpoints_is_refused_before_loading(tmp_path):
    (tmp_path / "warmup" / "checkpoints" / "100").mkdir(parents=True)
    res = fastrl_jax("train-drafter", "--model", str(tiny_model_dir(tmp_path)), "--restart",
                     "--set", f"drafter_train.out_dir={tmp_path / 'warmup'}")
    assert res.returncode == 2 and "already holds checkpoints (up to step 100): resume (drop --restart)" in res.stderr
    assert "loaded" not in res.stderr and "Traceback" not in res.stderr


def test_bench_sd_output_paths_are_checked_before_the_benchmark(tmp_path):
    save_drafter(tmp_path / "run" / "drafter", Drafter(TINY, nnx.Rngs(0)))
    res = fastrl_jax("bench-sd", "--model", str(tiny_model_dir(tmp_path)), "--drafter", str(tmp_path / "run"),
                     "--out", str(tmp_path / "missing" / "bench.json"))
    assert res.returncode == 2 and f"directory {tmp_path / 'missing'} does not exist" in res.stderr
    assert "loaded" not in res.stderr and "Traceback" not in res.stderr


def test_export_drafter_writes_eagle3_for_an_eagle3_drafter(tmp_path):
    from helpers.tiny_run import write_tiny_checkpoint
    from safetensors.numpy import load_file

    from fastrl_jax.config import MeshConfig
    from fastrl_jax.models.loading import load_model
    from fastrl_jax.sharding import make_mesh

    policy_dir = write_tiny_checkpoint(tmp_path / "policy")
    drafter = Drafter(TINY, nnx.Rngs(0), draft_vocab=np.arange(0, 128, 2), kind="eagle3")
    save_drafter(tmp_path / "d", drafter)
    out = tmp_path / "export"
    res = fastrl_jax("export-drafter", "--model", str(policy_dir), "--drafter", str(tmp_path / "d"), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "LlamaForCausalLMEagle3" in res.stderr and not (out / "eagle").exists()
    assert "loaded" not in res.stderr  # the head rows alone are read: the whole policy loaded before (review)
    assert f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {out / 'eagle3'} --dtype float32" in res.stderr
    assert json.loads((out / "eagle3" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    policy, _ = load_model(policy_dir, make_mesh(MeshConfig(fsdp=-1)))
    head = load_file(str(out / "eagle3" / "model.safetensors"))["lm_head.weight"]
    np.testing.assert_array_equal(head, np.asarray(policy.head_weight())[0:128:2])
    for back in (load_drafter(out / "orbax", TINY), load_eagle(out / "eagle3", TINY)):
        assert back.kind == "eagle3"
        np.testing.assert_array_equal(back.fc[...], drafter.fc[...])


def test_bench_sd_refuses_what_it_can_before_loading_the_policy(tmp_path):
    """Prompt ids past the vocabulary, --profile of a history strategy, --vocab reduced of a full-vocabulary drafter
    were refused only after the policy loaded and the machine was measured (minutes at 7B; found by review)."""
    from helpers.tiny_run import write_tiny_checkpoint

    policy = str(write_tiny_checkpoint(tmp_path / "policy"))
    save_drafter(tmp_path / "d", Drafter(TINY, nnx.Rngs(0)))  # drafts over the whole vocabulary
    (tmp_path / "oov.jsonl").write_text('{"prompt_ids": [3, 4, 500]}\n')  # the tiny vocabulary has 128 tokens
    (tmp_path / "ok.jsonl").write_text('{"prompt_ids": [3, 4, 5]}\n')
    cases = [
        (["--prompt-file", str(tmp_path / "oov.jsonl"), "--strategies", "h2"], "token ids must be in [0, 128)"),
        (["--prompt-file", str(tmp_path / "ok.jsonl"), "--drafter", str(tmp_path / "d"), "--strategies", "h2", "3/2/4",
          "--profile"], "h2 has none"),
        (["--prompt-file", str(tmp_path / "ok.jsonl"), "--drafter", str(tmp_path / "d"), "--strategies", "3/2/4",
          "--vocab", "reduced"], "drafts over the whole vocabulary"),
    ]
    for extra, message in cases:
        res = fastrl_jax("bench-sd", "--model", policy, "--prompt-sets", *extra, "--out", str(tmp_path / "b.json"))
        assert res.returncode == 2 and message in res.stderr and "loaded" not in res.stderr, res.stderr
