"""The commands' last mile: files a user's editor wrote, settings that would fail only late, flags that
conflict, and Ctrl-C, each refused or reported in one line before any weights are read."""

import json
from pathlib import Path

import pytest
import yaml
from helpers.cli import fastrl_jax

from fastrl_jax import cli
from fastrl_jax.config import ConfigError, load_config
from fastrl_jax.data.prompt_files import read_prompt_file, read_records

ROOT = Path(__file__).resolve().parents[1]
NO_CACHE = ["--set", "rollout.compile_cache_dir="]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers.tiny_run import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def test_prompt_files_with_a_byte_order_mark_read_and_other_encodings_name_the_file(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "hi", "answer": "1"}\n')
    assert read_prompt_file(bom, lambda text: [len(text)]) == [[2]]
    assert read_records(bom) == [{"answer": "1", "prompt": "hi"}]
    array = tmp_path / "bom.json"
    array.write_bytes(b'\xef\xbb\xbf[{"prompt": "hi", "answer": "1"}]')
    assert read_records(array) == [{"answer": "1", "prompt": "hi"}]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    for read in (lambda p: read_prompt_file(p, len), read_records):
        with pytest.raises(ValueError, match=f"{latin1} is not UTF-8 text"):
            read(latin1)
        with pytest.raises(FileNotFoundError, match=f"{tmp_path} is a directory"):
            read(tmp_path)


def test_a_config_file_that_is_not_utf8_or_is_a_directory_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b'data:\n  instruction: "caf\xe9"\n')
    with pytest.raises(ConfigError, match="c.yaml' is not UTF-8 text"):
        load_config(path)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    path.write_bytes(b"\xef\xbb\xbfseed: 3\n")
    assert load_config(path).seed == 3


@pytest.mark.parametrize("out_dir", ["''", "'.'", "/"])
def test_rl_out_dir_must_name_a_directory_of_its_own(out_dir):
    # '' ran in the working directory, where --overwrite then failed: "PosixPath('.') has an empty name"
    with pytest.raises(ConfigError, match="rl.out_dir must name the run's own directory"):
        load_config(None, [f"rl.out_dir={out_dir}"])
    assert load_config(None, ["rl.out_dir=runs/a/"]).rl.out_dir == "runs/a/"


def generate_config(*flags):
    args = cli.build_parser().parse_args(["generate", "--prompt", "hi", "--config", str(ROOT / "configs/smollm2_cpu.yaml"),
                                          *flags, *NO_CACHE])
    return cli._generate_config(args)


def test_generate_spec_flags_replace_the_configs_strategies_and_their_ranges():
    sd = generate_config("--sd", "adaptive", "--spec-strategy", "h4").sd  # the config's ranges are for 4, 7, 8 tokens
    assert sd.strategy_list() == ["h4"] and sd.live_batch_ranges() == {5: (1, sd.threshold_live_batch)}
    sd = generate_config("--sd", "adaptive", "--spec-steps", "2", "--spec-topk", "1", "--spec-verify-tokens", "3").sd
    assert sd.strategy_list() == ["2/1/3"]
    with pytest.raises(ConfigError, match="--spec-strategy names the whole strategy, so --spec-steps would be ignored"):
        generate_config("--sd", "on", "--spec-strategy", "2/2/4", "--spec-steps", "3")


def test_configs_set_no_sd_key_their_strategies_override():
    """With sd.strategies given, sd.steps / topk / verify_tokens only seed generate's --spec-* flags; a config
    that sets them (smollm2_gpu.yaml's `steps: 6  # mode on`) says something that never happens."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        sd = yaml.safe_load(path.read_text()).get("sd", {})
        if sd.get("strategies"):
            assert not {"steps", "topk", "verify_tokens"} & set(sd), path.name


def test_held_out_sets_build_only_the_sets_asked_for(tmp_path):
    from helpers.tiny_run import write_tokenizer
    from transformers import AutoTokenizer

    from fastrl_jax.data.prompts import held_out_sets

    write_tokenizer(tmp_path)
    sets = held_out_sets(load_config(None), AutoTokenizer.from_pretrained(tmp_path), 40, ["math"])  # chat holds 32
    assert list(sets) == ["math"] and len(sets["math"]) == 40


def test_interrupt_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    try:
        code = cli.main(["generate", "--prompt", "hi"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main() as a traceback")
    assert code == 130
    err = capsys.readouterr().err
    assert "fastrl-jax generate: interrupted" in err and "Traceback" not in err


def test_eval_names_the_setting_of_a_missing_prompt_set(tmp_path):
    run = fastrl_jax("eval", "--prompts", "chat", *NO_CACHE)
    assert run.returncode == 2 and "--prompts chat not found; give 'math'" in run.stderr, run.stderr
    run = fastrl_jax("eval", "--set", f"data.eval_source={tmp_path}/none.jsonl", "rollout.compile_cache_dir=")
    assert run.returncode == 2 and f"data.eval_source {tmp_path}/none.jsonl not found" in run.stderr, run.stderr


def test_late_failures_are_refused_before_the_model_loads(tiny_dir, tmp_path):
    """A bad prompt file and held-out counts beyond the 32 chat prompts failed only after the weights were
    read (train-drafter: after its whole data collection)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    bench = ["bench-sd", "--model", str(tiny_dir), "--strategies", "h2", "--batch-sizes", "1", "--new-tokens", "2",
             "--temperatures", "0", "--out", str(tmp_path / "b.json"), *NO_CACHE]
    for extra, message in [(["--prompt-sets", "--prompt-file", str(bad)], f"{bad} is not UTF-8 text"),
                           (["--prompt-sets", "math", "chat", "--prompts", "40"], "the chat set holds 32 held-out prompts"),
                           (["--prompt-sets", "math", "--plot", str(tmp_path)], f"--plot {tmp_path}.png is a directory")]:
        if "--plot" in extra:
            Path(f"{tmp_path}.png").mkdir()
        run = fastrl_jax(*bench, *extra)
        assert run.returncode == 2 and message in run.stderr and "loaded" not in run.stderr, run.stderr
    run = fastrl_jax("train-drafter", "--model", str(tiny_dir), "--set", f"drafter_train.out_dir={tmp_path}/d",
                     "drafter_train.eval_prompts=40", "rollout.compile_cache_dir=")
    assert run.returncode == 2 and "drafter_train.eval_prompts (40) exceeds the 32" in run.stderr, run.stderr
    assert "loaded" not in run.stderr and not (tmp_path / "d").exists()
    run = fastrl_jax("train-drafter", "--model", str(tiny_dir), "--set", f"drafter_train.out_dir={tmp_path}/d",
                     f"drafter_train.prompts={bad}", "rollout.compile_cache_dir=")
    assert run.returncode == 2 and f"{bad} is not UTF-8 text" in run.stderr and "loaded" not in run.stderr, run.stderr


def test_generate_reads_a_prompt_file_with_a_byte_order_mark(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt_ids": [3, 4]}\r\n\r\n{"prompt_ids": [5]}\r\n')
    out = tmp_path / "out.jsonl"
    run = fastrl_jax("generate", "--model", str(tiny_dir), "--prompts", str(prompts), "--output", str(out),
                     "--max-new-tokens", "2", "--set", "rollout.length_buckets=[32]", "rollout.prompt_buckets=[8]",
                     "rollout.batch_buckets=[2]", "rollout.compile_cache_dir=")
    assert run.returncode == 0, run.stderr
    assert [json.loads(line)["prompt_ids"] for line in out.read_text().splitlines()] == [[3, 4], [5]]


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_generate_seed_must_be_a_uint32(seed):
    with pytest.raises(ConfigError, match=r"--seed must be in \[0, 2\*\*32\)"):
        cli._generate_config(cli.build_parser().parse_args(["generate", "--prompt", "hi", "--seed", seed]))
