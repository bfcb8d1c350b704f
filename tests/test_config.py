"""Config loading: YAML, overrides, the generic dataclass builder, and the messages a user sees for mistakes."""

import dataclasses
import re
from pathlib import Path
from typing import Optional

import pytest

from fastrl_jax.config import Config, ConfigError, MeshConfig, from_dict, load_config, save_config, to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_config_loads():
    cfg = load_config(ROOT / "configs/smollm2_cpu.yaml")
    assert cfg.model.path == "smollm2" and cfg.model.dtype == "float32"
    assert cfg.mesh == MeshConfig(1, 1, 1)
    assert cfg.rollout.batch_buckets == (1, 4, 16, 64)


SHIPPED = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


def test_the_gpu_configs_are_shipped():
    assert {"smollm2_cpu.yaml", "smollm2_gpu.yaml", "qwen2.5_7b_1node.yaml", "qwen2.5_32b_multinode.yaml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_trains_and_plans(name):
    """Each config passes validation, may train (float32 master weights), and dry-runs: its engine
    programs build on the abstract model and its memory plan adds up."""
    from fastrl_jax.config import check_trainable
    from fastrl_jax.rl import dry_run

    cfg = load_config(ROOT / "configs" / name)
    check_trainable(cfg, "train")
    plan = dry_run.memory_plan(cfg)
    assert plan["total"] > plan["params"] > 0
    assert "programs:" in dry_run.plan(cfg)
    if name != "smollm2_cpu.yaml":  # the accelerator configs: bfloat16 engines over float32 master weights
        assert (cfg.model.dtype, cfg.model.engine_dtype) == ("float32", "bfloat16") and plan["rollout_params"] > 0


def test_gpu_config_uses_several_verify_groups():
    cfg = load_config(ROOT / "configs/smollm2_gpu.yaml")
    assert cfg.sd.mode == "adaptive" and len(cfg.sd.live_batch_ranges()) > 1
    assert cfg.rollout.batch_buckets[-1] >= 64 and cfg.mesh == MeshConfig(1, 1, 1)


def test_defaults_and_round_trip():
    assert load_config(None, []) == Config()
    cfg = load_config(None, ["mesh.fsdp=-1", "seed=7"])
    assert from_dict(Config, to_dict(cfg)) == cfg
    assert to_dict(cfg)["mesh"] == {"data": 1, "fsdp": -1, "tensor": 1}


def test_saved_config_loads_back(tmp_path):
    cfg = load_config(ROOT / "configs/smollm2_cpu.yaml", ["sd.strategies=[[3, 1, 4]]", "rl.out_dir='/tmp/a: b'", "sd.mode='off'"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_overrides_parse_values_and_nest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: /ckpt/qwen\nmesh:\n  tensor: 4\n")
    cfg = load_config(
        path, ["mesh.tensor=2", "rollout.length_buckets=[512, 2048]", "seed=3", "model.dtype=bfloat16",
               "rollout.warm_up=false", "rollout.compile_cache_dir="],
    )
    assert cfg.mesh.tensor == 2  # the override wins over the file
    assert cfg.model.path == "/ckpt/qwen"  # file values the overrides do not touch survive
    assert cfg.rollout.length_buckets == (512, 2048) and cfg.seed == 3 and cfg.model.dtype == "bfloat16"
    assert cfg.rollout.warm_up is False and cfg.rollout.compile_cache_dir == ""


def test_override_into_an_empty_yaml_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("mesh:\n")
    assert load_config(path, ["mesh.data=2"]).mesh.data == 2
    assert load_config(path).mesh.data == 1  # an empty section (its keys commented out) is the defaults
    assert load_config(None, ["rl.out_dir='runs/exp #3'"]).rl.out_dir == "runs/exp #3"  # quoted, '#' is text


@dataclasses.dataclass(frozen=True)
class _Inner:
    lr: float = 1.0
    sizes: tuple[int, ...] = ()
    limit: Optional[int] = 3
    name: str = "a"
    on: bool = False


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner = _Inner()
    steps: int = 1


def test_from_dict_builds_nested_typed_dataclasses():
    out = from_dict(_Outer, {"inner": {"lr": 2, "sizes": [1, 2], "limit": None, "on": True}, "steps": 5})
    assert out == _Outer(_Inner(lr=2.0, sizes=(1, 2), limit=None, on=True), steps=5)
    assert isinstance(out.inner.lr, float) and isinstance(out.inner.sizes, tuple)
    # PyYAML reads `1e-4` as a string (YAML 1.1); float fields still take it.
    assert from_dict(_Outer, {"inner": {"lr": "1e-4"}}).inner.lr == 1e-4


@pytest.mark.parametrize(
    "data, message",
    [
        ({"inner": {"lr": "fast"}}, "inner.lr must be a float, got 'fast'"),
        ({"inner": {"lr": True}}, "inner.lr must be a float, got True"),
        ({"inner": {"sizes": 3}}, "inner.sizes must be a list, got 3"),
        ({"inner": {"sizes": [1, "b"]}}, "inner.sizes[1] must be an int, got 'b'"),
        ({"inner": {"name": 5}}, "inner.name must be a string, got 5"),
        ({"inner": {"on": 1}}, "inner.on must be a bool (true or false), got 1"),
        ({"inner": 4}, "inner must be a mapping of keys to values, got 4"),
        ({"steps": 1.5}, "steps must be an int, got 1.5"),
    ],
)
def test_from_dict_names_wrong_types(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(_Outer, data)


@dataclasses.dataclass(frozen=True)
class _Required:
    path: str


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match=re.escape("inner.path is required")):
        from_dict(_Required, {}, "inner")


def test_unknown_key_suggests_the_right_one(tmp_path):
    expected = "unknown key 'mesh.tensr' (did you mean 'mesh.tensor'? allowed: data, fsdp, tensor)"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(None, ["mesh.tensr=2"])
    path = tmp_path / "typo.yaml"
    path.write_text("mseh:\n  data: 2\n")
    with pytest.raises(ConfigError, match=re.escape("unknown key 'mseh' (did you mean 'mesh'? allowed: model, mesh")):
        load_config(path)
    with pytest.raises(ConfigError, match=re.escape("unknown key 'mesh.zzz' (allowed: data, fsdp, tensor)")):
        load_config(None, ["mesh.zzz=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("mesh.data=x", "mesh.data must be an int, got 'x'"),
        ("mesh.data=true", "mesh.data must be an int, got True"),
        ("mesh.data=0", "mesh.data must be >= 1, or -1 for all remaining devices; got 0"),
        ("model.dtype=float16", "model.dtype must be one of float32, bfloat16; got 'float16'"),
        ("optim.learning_rate=.nan", "optim.learning_rate must be a finite number, got nan"),
        ("rl.temperature=.inf", "rl.temperature must be a finite number, got inf"),
        ("model.attention=flash",
         "model.attention must be one of auto, reference, pallas, pallas_interpret, triton; got 'flash'"),
        ("rollout.layer_loop=fori", "rollout.layer_loop must be one of auto, scan, unrolled; got 'fori'"),
        ("rollout.batch_buckets=[4, 1]", "rollout.batch_buckets must be a non-empty increasing list"),
        ("rollout.prompt_buckets=[2048]", "must be below rollout.length_buckets max"),
        ("seed.x=1", "seed must be an int, got {'x': 1}"),
        ("mesh", "override 'mesh' must look like section.key=value"),
        ("mesh..data=1", "must look like section.key=value"),
        ("mesh.data=[1", "override 'mesh.data=[1': the value is not valid YAML"),
        ("optim.b1=1.0", "optim needs 0 <= b1 < 1, 0 <= b2 < 1, eps > 0; got b1=1.0"),
        ("optim.eps=-1", "eps=-1.0"),
        ("seed=-1", "seed must be in [0, 2**32), got -1"),
        ("rl.out_dir=runs/exp #3", "YAML reads ' #' as the start of a comment; quote the value (out_dir='...')"),
        ("rl.clip_ratio_c=0.9", "rl.clip_ratio_c (dual-clip PPO's bound) must be > 1, or 0 for off; got 0.9"),
        ("model.rollout_dtype=float16", "model.rollout_dtype must be one of '', float32, bfloat16; got 'float16'"),
        ("drafter_train.draft_vocab_size=2", "drafter_train.eval_strategy's top-k (4) exceeds draft_vocab_size (2)"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_a_sample_buffer_must_hold_the_longest_rollout():
    from fastrl_jax.config import check_trainable

    small = load_config(None, ["rollout.length_buckets=[256, 512]", "drafter_online.buffer_max_tokens=300",
                               "drafter_train.buffer_max_tokens=300", "drafter_train.seq_len_tokens=256"])
    for command, key in (("train", "drafter_online"), ("train-drafter", "drafter_train")):
        with pytest.raises(ConfigError, match=re.escape(f"{key}.buffer_max_tokens (300) must hold the longest rollout, "
                                                        "rollout.length_buckets max (512)")):
            check_trainable(small, command)
    check_trainable(load_config(None, ["rollout.length_buckets=[256, 512]", "drafter_online.buffer_max_tokens=300",
                                       "drafter_online.enabled=false"]), "train")


def test_attention_choices_are_the_kernel_backends():
    """config sits below kernels, so it lists the backends itself; they must stay the kernels' own."""
    from fastrl_jax.kernels.backends import BACKENDS

    from fastrl_jax.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == ("auto", *BACKENDS)


@pytest.mark.parametrize("loop, unrolled_on", [("auto", {"gpu"}), ("scan", set()), ("unrolled", {"cpu", "gpu", "tpu"})])
def test_layer_loop_auto_unrolls_on_gpus_only(loop, unrolled_on):
    rollout = load_config(None, [f"rollout.layer_loop={loop}"]).rollout
    assert {p for p in ("cpu", "gpu", "tpu") if rollout.unrolled_layers(p)} == unrolled_on


def test_at_most_one_minus_one_axis():
    with pytest.raises(ConfigError, match="at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1"):
        load_config(None, ["mesh.data=-1", "mesh.tensor=-1"])


def test_override_through_a_value_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 3\n")
    with pytest.raises(ConfigError, match=re.escape("override 'seed.x=1': seed is a value, not a section")):
        load_config(path, ["seed.x=1"])


def test_a_config_path_expands_home(tmp_path, monkeypatch):
    # `--config=~/c.yaml`: the shell expands no ~ after '=', and the file was "not found"
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("seed: 3\n")
    assert load_config("~/c.yaml").seed == 3


def test_missing_and_broken_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"config file '{missing}' not found")):
        load_config(missing, [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="is not valid YAML") as error:
        load_config(bad)
    assert "\n" not in str(error.value) and "at line 1, column 17" in str(error.value)  # one line, and where
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(listed)


def test_on_off_yes_no_are_strings_only_true_false_are_booleans(tmp_path):
    # YAML 1.2 booleans: PyYAML's default (YAML 1.1) would hand `sd.mode=off` to a string field as False.
    assert load_config(None, ["sd.mode=off"]).sd.mode == "off"
    assert load_config(None, ["sd.mode=on"]).sd.mode == "on"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sd:\n  mode: on\ndrafter_online:\n  enabled: False\n")
    loaded = load_config(cfg)
    assert loaded.sd.mode == "on" and loaded.drafter_online.enabled is False
    with pytest.raises(ConfigError, match=r"drafter_online.enabled must be a bool \(true or false\), got 'yes'"):
        load_config(None, ["drafter_online.enabled=yes"])


def test_integers_are_decimal_as_in_yaml_1_2():
    # YAML 1.1 (PyYAML's default) reads `010` as octal 8 and `1:30` as base-60 90.
    cfg = load_config(None, ["rl.steps=010", "drafter_online.buffer_max_tokens=200_000", "seed=0x10",
                             "rl.out_dir=1:30"])
    assert (cfg.rl.steps, cfg.drafter_online.buffer_max_tokens, cfg.seed, cfg.rl.out_dir) == (10, 200_000, 16, "1:30")
    with pytest.raises(ConfigError, match=r"rl.steps must be an int.*got '1:30'"):
        load_config(None, ["rl.steps=1:30"])
    # Floats too: 1:30.0 was 90.0 (review)
    assert load_config(None, ["optim.learning_rate=1.5e-6", "rl.temperature=.5"]).rl.temperature == 0.5
    assert load_config(None, ["rl.out_dir=1:30.0"]).rl.out_dir == "1:30.0"
    with pytest.raises(ConfigError, match=r"optim.learning_rate must be a float.*got '1:30.0'"):
        load_config(None, ["optim.learning_rate=1:30.0"])


def test_a_string_override_read_as_yaml_structure_says_to_quote_it():
    """The shell took the quotes: `data.instruction=Think step by step: then answer` is a mapping to YAML (review)."""
    with pytest.raises(ConfigError, match=r"YAML reads ': ', '- ' and '\[' as structure; quote the value "
                                          r"\(data.instruction='...'\)"):
        load_config(None, ["data.instruction=Think step by step: then answer"])
    assert load_config(None, ["data.instruction='Think step by step: then answer'"]).data.instruction.endswith("answer")


def test_dates_are_strings_as_in_yaml_1_2(tmp_path):
    # YAML 1.1 reads 2026-11-27 as a date: a run directory named by its day was refused ("must be a string").
    assert load_config(None, ["rl.out_dir=2026-11-27"]).rl.out_dir == "2026-11-27"
    path = tmp_path / "c.yaml"
    path.write_text("rl:\n  out_dir: 2026-11-27\n")
    assert load_config(path).rl.out_dir == "2026-11-27"


def test_a_key_given_twice_is_refused(tmp_path):
    # PyYAML keeps the last: a second `rl:` section silently dropped the first's steps and out_dir.
    path = tmp_path / "c.yaml"
    path.write_text("rl:\n  steps: 100\n  out_dir: runs/a\nseed: 1\nrl:\n  prompts_per_step: 16\n")
    with pytest.raises(ConfigError, match=re.escape("is not valid YAML: 'rl' is given twice at line 5, column 1")):
        load_config(path)
    assert load_config(None, ["rl={<<: {steps: 5, top_k: 2}, steps: 7}"]).rl.steps == 7  # a merge key's keys may repeat


@pytest.mark.parametrize("value", ["08", "0o7", "1_000", "true"])
def test_a_saved_config_with_a_string_yaml_could_read_as_a_number_loads_back(tmp_path, value):
    """'08' (a W&B project, an out_dir) was saved bare, and our YAML 1.2 integers read it back as 8: eval --run and
    export-policy --run refused the run's own config.yaml (found by review)."""
    cfg = load_config(None, [f"rl.wandb_project='{value}'"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_a_double_quoted_backslash_in_an_override_is_refused_with_the_fix():
    r"""verl users write data.instruction="...\boxed{}." (Hydra keeps the backslash); YAML's double quotes made \b a
    backspace, and the policy was prompted for '\x08oxed{}' (found by review)."""
    with pytest.raises(ConfigError, match="use single quotes"):
        load_config(None, [r'data.instruction="put your final answer within \boxed{}."'])
    assert load_config(None, [r"data.instruction='within \boxed{}.'"]).data.instruction == r"within \boxed{}."
    assert load_config(None, [r'data.instruction="a\\b"']).data.instruction == "a\\b"


def test_a_wrong_case_section_gets_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'rl'"):
        load_config(None, ["RL.steps=3"])
