"""The commands' last mile: files a user's editor wrote, settings that would fail only late, flags that
conflict, and Ctrl-C, each refused or reported in one line before any weights are read."""

import json
import subprocess
import sys
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


@pytest.mark.parametrize("out_dir", ["''", "'.'", "/", "..", "runs/..", "'~'", "~/"])  # --overwrite moved a home aside
def test_rl_out_dir_must_name_a_directory_of_its_own(out_dir):
    # '' ran in the working directory, where --overwrite then failed: "PosixPath('.') has an empty name"
    with pytest.raises(ConfigError, match="rl.out_dir must name the run's own directory"):
        load_config(None, [f"rl.out_dir={out_dir}"])
    assert load_config(None, ["rl.out_dir=runs/a/"]).rl.out_dir == "runs/a/"


def test_model_paths_and_buffer_sizes_read_as_given(tmp_path):
    """--model with a character outside the BMP became two lone surrogates (json.dumps escapes it as a pair YAML
    decodes apart): 'does not exist'. A drafter_online.min_buffer_tokens the buffer never holds was refused only
    when the run started, so --dry-run planned it (review)."""
    import argparse

    from fastrl_jax import cli

    path = str(tmp_path / "ckpt_\U0001F600 é")
    assert cli._config(argparse.Namespace(config=None, model=path, set=["rollout.compile_cache_dir=''"])).model.path == path
    with pytest.raises(ConfigError, match=r"min_buffer_tokens \(2048\) exceeds buffer_max_tokens \(1024\)"):
        load_config(None, ["drafter_online.min_buffer_tokens=2048", "drafter_online.buffer_max_tokens=1024"])


@pytest.mark.parametrize("key", ["rl.out_dir", "drafter_train.out_dir"])
def test_run_directories_given_as_urls_are_refused_with_the_fix(key):
    """MaxText / tunix users write gs://bucket/run: it became a local directory named gs:, and the first checkpoint
    failed in Orbax's background write, found at the next save, after two checkpoint intervals of work (review)."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + r" must be a local or mounted directory, got the URL "
                                          r"'gs://bucket/run': mount the bucket"):
        load_config(None, [f"{key}=gs://bucket/run"])


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


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`fastrl-jax generate | head -1`: no broken-pipe traceback, neither from the command nor from the flush at exit."""
    script = ("import sys; from fastrl_jax import cli; cli.cmd_generate = lambda args: print('line\\n' * 100000); "
              "sys.exit(cli.main(['generate', '--prompt', 'hi']))")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1 and err == "", err


def test_sigterm_takes_the_paths_of_ctrl_c():
    """A scheduler's SIGTERM saves what Ctrl-C saves (a collection under way, a checkpoint being written): one line
    and exit 130, not a silent death."""
    script = ("import sys, time; from fastrl_jax import cli; "
              "cli.cmd_generate = lambda args: print('ready', flush=True) or time.sleep(60); "
              "sys.exit(cli.main(['generate', '--prompt', 'hi']))")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.terminate()
    assert proc.wait(timeout=30) == 130
    assert "fastrl-jax generate: interrupted" in proc.stderr.read()


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


def test_an_unusable_compile_cache_dir_is_named(tmp_path):
    # The default ~/.cache/fastrl_jax/xla under a read-only home failed every command with "[Errno 13] Permission
    # denied: '/home/u/.cache'", exit 1, naming no setting.
    (tmp_path / "file").touch()
    run = fastrl_jax("train", "--dry-run", f"rollout.compile_cache_dir={tmp_path}/file/xla")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"rollout.compile_cache_dir {tmp_path}/file/xla cannot be created (Not a directory" in run.stderr
    assert "or to '' to compile without it" in run.stderr


def test_train_takes_overrides_on_both_sides_of_a_flag(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "cmd_train", lambda args: seen.update(vars(args)))
    assert cli.main(["train", "--config", "c.yaml", "rl.steps=2", "--resume", "rl.out_dir=x", "--set", "seed=1"]) == 0
    assert seen["overrides"] == ["rl.steps=2", "rl.out_dir=x"] and seen["set"] == ["seed=1"] and seen["resume"]
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "rl.steps=2", "--resume", "rl.out_dir=x", "--bogus"])
    assert stop.value.code == 2


def test_train_devices_only_plans_a_dry_run(tmp_path, capsys):
    # --devices N without --dry-run was ignored: the run went on with the mesh's own device count
    code = cli.main(["train", "--devices", "4", f"rl.out_dir={tmp_path}/run", f"model.path={tmp_path}/none", *NO_CACHE])
    assert code == 2 and "--devices and --platform plan a --dry-run" in capsys.readouterr().err


def test_generate_refuses_to_write_over_its_prompt_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    code = cli.main(["generate", "--model", str(tmp_path / "none"), "--prompts", "p.jsonl", "--output", str(prompts),
                     *NO_CACHE])
    assert code == 2 and "--output " + str(prompts) + " is a file the command reads (--prompts)" in capsys.readouterr().err
    assert prompts.read_text() == '{"prompt": "hi"}\n'


def test_out_dirs_are_checked_before_loading(tiny_dir, tmp_path):
    # An out_dir through a file failed after the weights loaded: "[Errno 20] Not a directory", exit 1.
    (tmp_path / "file").touch()
    for command, key in (("train-drafter", "drafter_train.out_dir"), ("train", "rl.out_dir")):
        run = fastrl_jax(command, "--set", f"model.path={tiny_dir}", f"{key}={tmp_path}/file/d", "rollout.compile_cache_dir=")
        assert run.returncode == 2 and "loaded" not in run.stderr, run.stderr
        assert f"{key} {tmp_path}/file/d: {tmp_path}/file is a file" in run.stderr


def test_a_coordinator_without_a_port_is_named(tmp_path):
    # jax.distributed.initialize raised an IndexError traceback for "--coordinator node001"
    run = fastrl_jax("train", "--coordinator", "node001", "--num-processes", "1", "--process-id", "0",
                     f"rl.out_dir={tmp_path}/run", "rollout.compile_cache_dir=")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "--coordinator must be HOST:PORT (process 0's host and a free port, e.g. node001:1234), got 'node001'" in run.stderr


def test_a_nested_answer_is_read_by_its_dotted_name_and_never_as_text(tmp_path):
    # verl's files hold the answer in reward_model.ground_truth: data.answer_field=reward_model made every answer the
    # text "{'ground_truth': '2', ...}", which no completion matches (every reward 0, silently).
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}],
                                "reward_model": {"ground_truth": "2", "style": "rule"}}) + "\n")
    assert read_records(path, messages_field="prompt", answer_field="reward_model.ground_truth") == [
        {"answer": "2", "messages": [{"role": "user", "content": "1+1?"}]}]
    with pytest.raises(ValueError, match=r"record 1: 'reward_model' holds \{'ground_truth': '2', 'style': 'rule'\}, not "
                                         r"an answer; name the field inside it, e.g. data.answer_field=reward_model.gro"):
        read_records(path, messages_field="prompt", answer_field="reward_model")


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_bench_sd_json_is_strict_and_a_cell_that_never_speculated_says_nothing(tmp_path):
    """Every request done at its prefill (--new-tokens 1): no speculative step, acceptance NaN, which json.dumps wrote
    as a bare NaN that jq / JavaScript refuse; and the cell timed plain against plain yet counted as where SD stops
    paying (found by review)."""
    from helpers.tiny import CFG, tiny_model

    from fastrl_jax import files
    from fastrl_jax.config import StrategySpec
    from fastrl_jax.drafter import bench

    rows = bench.run_bench(tiny_model(), None, {"p": [[3, 4, 5], [6, 7]]}, [1], base_cfg=CFG, batch_sizes=[1],
                           strategies=[StrategySpec("h2")], temperatures=[0.0], vocabs=None, new_tokens=1, repeats=1,
                           log=lambda line: None)
    files.write_json(tmp_path / "b.json", {"rows": rows})
    assert _strict_json((tmp_path / "b.json").read_text())["rows"][0]["acceptance_length"] is None
    assert bench.stop_paying(rows) == {}


def test_last_mile_commands_take_each_others_flag_spellings():
    """generate --output / eval and bench-sd --out, --max-new-tokens / bench-sd's --new-tokens, --samples /
    --samples-per-prompt: moving a flag between commands was 'unrecognized arguments' (found by review)."""
    parser = cli.build_parser()
    for argv in (["eval", "--output", "e.json", "--samples-per-prompt", "2"], ["bench-sd", "--output", "b.json"],
                 ["bench-sd", "--max-new-tokens", "64"], ["generate", "--prompt", "hi", "--out", "g.jsonl"]):
        args, extra = parser.parse_known_args(argv)
        assert not extra, f"{' '.join(argv)}: {extra} not understood"


def test_eval_and_bench_sd_refuse_an_out_that_is_a_file_they_read(tiny_dir, tmp_path):
    """eval --prompts F --out F replaced the held-out set by its report, bench-sd its prompt file by its JSON
    (generate refused it already; found by review)."""
    held_out = tmp_path / "heldout.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    before = held_out.read_bytes()
    for argv in (["eval", "--prompts", str(held_out), "--out", str(held_out)],
                 ["eval", "--set", f"data.eval_source={held_out}", "--output", str(held_out)],
                 ["bench-sd", "--strategies", "h2", "--prompt-sets", "--prompt-file", str(held_out), "--out", str(held_out)]):
        res = fastrl_jax(*argv[:1], "--model", str(tiny_dir), *argv[1:])
        assert res.returncode == 2 and "is a file the command reads" in res.stderr, res.stderr
    assert held_out.read_bytes() == before


def test_an_eval_file_cut_to_rl_eval_prompts_is_said(tmp_path, capsys):
    """A 500-problem held-out file scored 64 of its problems (rl.eval_prompts) without a word (found by review)."""
    from fastrl_jax.rl.evaluate import held_out_records

    held_out = tmp_path / "heldout.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(16)))
    assert len(held_out_records(load_config(None), 4, str(held_out))) == 4
    assert "evaluating its first 4 of 16 records" in capsys.readouterr().err


INTERRUPT_IN_THE_SECOND_CELL = """
import sys
from fastrl_jax import cli
from fastrl_jax.drafter import bench

format_row, logged = bench.format_row, []


def format_then_interrupt(row):
    logged.append(row)
    if len(logged) == 2:  # Ctrl-C (or a scheduler's SIGTERM) during the second cell
        raise KeyboardInterrupt
    return format_row(row)


bench.format_row = format_then_interrupt
sys.exit(cli.main(sys.argv[1:]))
"""


def test_an_interrupted_bench_sd_keeps_the_cells_it_measured(tiny_dir, tmp_path):
    """Its JSON was written once, at the end: a Ctrl-C or a time limit hours into the default grid lost every
    cell; a prompt file longer than --prompts was cut silently (both found by review)."""
    from helpers.cli import cpu_env

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 + i, 4, 5]}) + "\n" for i in range(3)))
    out = tmp_path / "b.json"
    run = subprocess.run([sys.executable, "-c", INTERRUPT_IN_THE_SECOND_CELL, "bench-sd", "--model", str(tiny_dir),
                          "--strategies", "h2", "--batch-sizes", "1", "2", "--new-tokens", "4", "--temperatures", "0",
                          "--prompts", "2", "--prompt-sets", "--prompt-file", str(prompts), "--out", str(out), "--plot", "",
                          "--set", "rollout.compile_cache_dir="], capture_output=True, text=True, env=cpu_env(1))
    assert run.returncode == 130, run.stderr
    assert "timing its first 2 of 3 prompts" in run.stderr
    saved = _strict_json(out.read_text())
    assert [r["batch"] for r in saved["rows"]] == [1] and saved["complete"] is False
