"""Config loading: YAML, overrides, and the messages a user sees for mistakes."""

from pathlib import Path

import pytest

from fastrl_jax.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_config_loads():
    cfg = load_config(ROOT / "configs/smollm2_cpu.yaml")
    assert cfg.model.path == "smollm2" and cfg.rollout.batch_buckets == (1, 4, 16, 64)


def test_overrides_parse_values_and_nest(tmp_path):
    cfg = load_config(None, ["mesh.tensor=2", "rollout.length_buckets=[512, 2048]", "seed=3", "model.dtype=bfloat16"])
    assert cfg.mesh.tensor == 2 and cfg.rollout.length_buckets == (512, 2048) and cfg.seed == 3
    assert cfg.model.dtype == "bfloat16"
    assert load_config(None, []) == Config()


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown key 'mesh.tensr' \(did you mean 'mesh.tensor'\?\); allowed: data, fsdp, tensor"):
        load_config(None, ["mesh.tensr=2"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("mesh.data=two", r"mesh.data must be int, got 'two'"),
        ("mesh.data=0", r"mesh.data must be >= 1 or -1"),
        ("model.dtype=float16", r"model.dtype must be one of float32, bfloat16"),
        ("rollout.batch_buckets=[4, 1]", r"increasing"),
        ("rollout.prompt_buckets=[2048]", r"must be below rollout.length_buckets max"),
        ("mesh", r"must look like key.path=value"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
