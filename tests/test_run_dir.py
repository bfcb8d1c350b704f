"""A trained GRPO run as its user meets it afterwards: train refuses to write over it (or moves it aside
with --overwrite), resume survives a damaged checkpoint, export-policy --run writes its policy."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.checkpoints import damage
from helpers.cli import cpu_env
from helpers.tiny_run import tiny_overrides
from safetensors.numpy import load_file

from fastrl_jax.config import load_config
from fastrl_jax.metric_sink import read_metrics
from fastrl_jax.models.loading import load_model
from fastrl_jax.models.tokenizer import load_tokenizer
from fastrl_jax.rl.trainer import Trainer
from fastrl_jax.sharding import make_mesh

TESTS = Path(__file__).parent


def cli(*args):
    """The command in a fresh one-device process that can import the tests' reward function."""
    return subprocess.run([sys.executable, "-m", "fastrl_jax.cli", *args], capture_output=True, text=True, env=cpu_env(),
                          cwd=TESTS.parent, timeout=600)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two GRPO steps of the tiny model, a checkpoint after each; returns (run dir, final parameters)."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = load_config(None, [*tiny_overrides(tmp, steps=2), "rl.keep_checkpoints=2", "mesh.fsdp=-1"])
    model, _ = load_model(cfg.model.path, make_mesh(cfg.mesh))
    trainer = Trainer(cfg, model, load_tokenizer(Path(cfg.model.path)), stream=open(os.devnull, "w"))
    trainer.run()
    return tmp / "run", {k: np.asarray(v) for k, v in trainer.params["layers"].items()} | {
        "embed": np.asarray(trainer.params["embed"])}


def copy_of(run_dir: Path, where: Path) -> Path:
    shutil.copytree(run_dir, where)
    return where


def test_train_refuses_a_run_directory_without_resume_before_loading_anything(run, tmp_path):
    run_dir, _ = run
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    res = cli("train", "--config", str(run_dir / "config.yaml"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"rl.out_dir {run_dir} already holds a run (config.yaml, metrics.jsonl, checkpoints; checkpoints up to " \
           "step 2): add --resume to continue it, --overwrite" in res.stderr
    assert "loaded" not in res.stderr  # refused before the model was read
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    empty = cli("train", "--config", str(run_dir / "config.yaml"), f"rl.out_dir={tmp_path / 'new'}", "--resume")
    assert empty.returncode == 2 and "--resume: no checkpoint in" in empty.stderr and "loaded" not in empty.stderr
    both = cli("train", "--config", str(run_dir / "config.yaml"), "--resume", "--overwrite")
    assert both.returncode == 2 and "give one of them" in both.stderr


def test_resume_falls_back_past_a_damaged_step_and_saves_it_again(run, tmp_path):
    work = copy_of(run[0], tmp_path / "run")
    damage(work / "checkpoints" / "2")
    # A learning rate lowered as the NaN stop advises shapes no checkpoint item: the fall back holds (it did not)
    res = cli("train", "--config", str(work / "config.yaml"), f"rl.out_dir={work}", "--resume", "optim.learning_rate=1e-4")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "checkpoint step 2 in" in res.stderr and "is unreadable" in res.stderr and "using step 1" in res.stderr
    assert "optim.learning_rate (was" in res.stderr and "changed since step 2 was saved" in res.stderr
    assert "resumed from step 1" in res.stderr
    assert [m["step"] for m in read_metrics(work / "metrics.jsonl")] == [1, 2]
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["1", "2"]  # step 2 written afresh
    assert (work / "checkpoints.unreadable" / "2").is_dir()


def test_no_readable_checkpoint_says_what_to_do_and_overwrite_moves_the_run_aside(run, tmp_path):
    work = copy_of(run[0], tmp_path / "run")
    shutil.rmtree(work / "checkpoints" / "1")  # as keep_checkpoints: 1 leaves it
    damage(work / "checkpoints" / "2")
    res = cli("train", "--config", str(work / "config.yaml"), f"rl.out_dir={work}", "--resume")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    error = [line for line in res.stderr.splitlines() if line.startswith("fastrl-jax train: error:")]
    assert len(error) == 1 and "step 2: ValueError: OUT_OF_RANGE" in error[0]
    assert "no earlier step is left to fall back to" in error[0] and "--overwrite" in error[0]
    again = cli("train", "--config", str(work / "config.yaml"), f"rl.out_dir={work}", "rl.steps=1", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert f"moved the previous run in {work} to {aside}" in again.stderr
    assert [m["step"] for m in read_metrics(aside / "metrics.jsonl")] == [1, 2]  # the old run, kept whole
    assert [m["step"] for m in read_metrics(work / "metrics.jsonl")] == [1]


def test_export_policy_from_a_run(run, tmp_path):
    run_dir, params = run
    out = tmp_path / "hf"
    res = cli("export-policy", "--run", str(run_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"exported step 2 of run {run_dir}" in res.stderr
    tensors = load_file(out / "model.safetensors")
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], params["embed"])
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.up_proj.weight"], params["w_up"][1].T)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--step", "7"], "--step 7: no such checkpoint in"),
    (["--model", "smollm2"], "not both"),
    (["--out", "{file}"], "is a file; give a new directory"),
    (["--out", "{missing}/x"], "does not exist; create it first"),
])
def test_export_policy_refuses_before_loading(run, tmp_path, args, message):
    (tmp_path / "file").write_text("x")
    args = [a.format(file=tmp_path / "file", missing=tmp_path / "missing") for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "hf")]
    res = cli("export-policy", "--run", str(run[0]), *out, *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert "loaded" not in res.stderr and not (tmp_path / "hf").exists()


def test_eval_of_a_run_is_the_same_with_adaptive_speculative_decoding(run, tmp_path):
    """Position-keyed sampling makes SD lossless, so `eval --sd adaptive` must give the very same completions
    and results as plain decoding (here with a random drafter, so it is only slower)."""
    common = ["eval", "--run", str(run[0]), "--num-prompts", "4", "--samples", "3", "--temperature", "1.0"]
    plain = cli(*common, "--out", str(tmp_path / "plain.json"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    sd = cli(*common, "--out", str(tmp_path / "sd.json"), "--sd", "adaptive", "--set", "sd.threshold_live_batch=16",
             "sd.patience_host_steps=1", "sd.steps=2", "sd.topk=2", "sd.verify_tokens=4")
    assert sd.returncode == 0, sd.stderr[-3000:]
    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "sd"))
    assert a["step"] == b["step"] == 2 and a["samples"] == 3 and a["sd"] == "off" and b["sd"] == "adaptive"
    assert a["acceptance_length"] is None and b["acceptance_length"] >= 1.0  # speculation ran
    assert a["results"] == b["results"] and a["per_prompt"] == b["per_prompt"]
    completions = [c for p in a["per_prompt"] for c in p["completions"]]
    assert len(completions) == 12 and len(set(completions)) > 1
    assert plain.stdout.splitlines()[0].split()[:6] == ["subset", "prompts", "samples", "pass@1", "pass@2", "pass@3"]


@pytest.mark.parametrize("args, message", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--samples", "-1"], "--samples must be in 1 .. 1024"),
    (["--samples", "5000"], "--samples must be in 1 .. 1024"),
    (["--samples", "2", "--temperature", "0"], "gives 2 identical greedy completions"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--temperature", "-1"], "temperature must be 0 (greedy) or in [1e-05, inf), got -1.0"),
    (["--out", "{tmp}/missing/eval.json"], "directory {tmp}/missing does not exist; create it first"),
    (["--out", "{tmp}"], "is a directory"),
    (["--step", "7"], "--step 7: no such checkpoint"),
    (["--model", "smollm2"], "not both"),
    (["--drafter", "{tmp}"], "--drafter applies only to speculative decoding"),
    (["--sd", "on", "--drafter", "{tmp}/none"], "drafter checkpoint {tmp}/none not found"),
    (["--prompts", "{tmp}/none.jsonl"], "none.jsonl not found"),
    (["--set", "rollout.prompt_buckets=[2]"], "4 of 4 evaluation prompts cannot run (prompt 0: the prompt has 4 tokens"),
])
def test_eval_refuses_bad_input_before_loading(run, tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    res = cli("eval", "--run", str(run[0]), "--num-prompts", "4", *args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message.format(tmp=tmp_path) in res.stderr and "Traceback" not in res.stderr
    assert "loaded" not in res.stderr


def test_eval_and_export_need_a_run_or_a_model(tmp_path):
    for command in ("eval", "export-policy"):
        res = cli(command, "--run", str(tmp_path), "--out", str(tmp_path / "o"))
        assert res.returncode == 2 and f"--run {tmp_path} has no config.yaml" in res.stderr
    res = cli("eval", "--step", "3", "--model", "smollm2")
    assert res.returncode == 2 and "--step picks a checkpoint of --run" in res.stderr


def test_train_refuses_an_out_dir_that_is_a_file_and_eval_a_run_that_is_not_grpo(run, tmp_path):
    (tmp_path / "taken").write_text("mine")
    res = cli("train", "--config", str(run[0] / "config.yaml"), f"rl.out_dir={tmp_path / 'taken'}")
    assert res.returncode == 2 and "is a file; set rl.out_dir to a directory" in res.stderr and "loaded" not in res.stderr
    drafter_run = tmp_path / "warmup"
    (drafter_run / "checkpoints" / "100" / "params").mkdir(parents=True)  # what train-drafter writes
    shutil.copy(run[0] / "config.yaml", drafter_run / "config.yaml")
    res = cli("eval", "--run", str(drafter_run))
    assert res.returncode == 2 and "is not a GRPO run: its checkpoints hold no policy" in res.stderr
    res = cli("eval", "--run", str(run[0]), "--num-prompts", "100000", "--samples", "11")
    assert res.returncode == 2 and "1,100,000 completions; one evaluation takes at most 1,000,000" in res.stderr


def test_overwrite_of_a_symlinked_out_dir_keeps_the_run_on_the_links_disk(tmp_path):
    """runs/grpo -> /scratch/grpo: --overwrite moved the link aside, and the new run made a plain directory where it
    was, on the small disk the link was made to avoid (found by review)."""
    from fastrl_jax.rl.run_dir import prepare_run_dir

    scratch = tmp_path / "scratch" / "grpo"
    scratch.mkdir(parents=True)
    (scratch / "metrics.jsonl").write_text('{"step": 1}\n')
    link = tmp_path / "runs" / "grpo"
    link.parent.mkdir()
    link.symlink_to(scratch)
    prepare_run_dir(load_config(None, [f"rl.out_dir={link}"]), resume=False, overwrite=True)
    link.mkdir(parents=True, exist_ok=True)  # what the trainer does next
    assert link.is_symlink() and link.resolve() == scratch and not any(scratch.iterdir())
    (aside,) = [p for p in scratch.parent.iterdir() if p.name.startswith("grpo.old-")]
    assert (aside / "metrics.jsonl").is_file()


def test_overwrite_moves_the_runs_files_aside_and_nothing_else(tmp_path):
    """--overwrite renamed the whole of rl.out_dir: the user's own files in an experiment folder went with the old
    run, and an rl.out_dir of a home directory moved the home aside (review)."""
    from fastrl_jax.rl.run_dir import prepare_run_dir

    out = tmp_path / "exp1"
    (out / "checkpoints" / "3").mkdir(parents=True)
    (out / "checkpoints.unreadable").mkdir()
    for name in ("config.yaml", "config.to_step_3.yaml", "metrics.jsonl", "wandb_id", "notes.md", "reward.png"):
        (out / name).write_text(name)
    prepare_run_dir(load_config(None, [f"rl.out_dir={out}"]), resume=False, overwrite=True)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("exp1.old-")]
    assert sorted(p.name for p in out.iterdir()) == ["notes.md", "reward.png"]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "checkpoints.unreadable", "config.to_step_3.yaml",
                                                       "config.yaml", "metrics.jsonl", "wandb_id"]
    assert (aside / "checkpoints" / "3").is_dir()
