"""Frozen dataclass configs: YAML load, dotted `key=value` overrides, validation with clear messages."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key and what is allowed."""


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    path: str = "smollm2"  # 'smollm2', an HF checkpoint directory, or a .gguf file
    dtype: str = "float32"  # float32 on CPU (XLA CPU runs bfloat16 ~4x slower), bfloat16 on GPU/TPU

    def __post_init__(self):
        _check_choice("model.dtype", self.dtype, ("float32", "bfloat16"))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh (data, fsdp, tensor); -1 in one axis takes all remaining devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, n in sizes.items():
            if n < 1 and n != -1:
                raise ConfigError(f"mesh.{name} must be >= 1 or -1 (all remaining devices), got {n}")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Rollout engine shapes: every (batch bucket, length bucket) is one compiled program."""

    batch_buckets: tuple[int, ...] = (1, 4, 16, 64)
    length_buckets: tuple[int, ...] = (256, 512, 1024)  # KV-cache slots attention reads (prompt + completion)
    prompt_buckets: tuple[int, ...] = (64, 128, 256)  # padded prompt lengths for prefill
    steps_per_call: int = 32  # decode steps per program call between host visits
    max_stop_ids: int = 4
    compile_cache_dir: str = "~/.cache/fastrl_jax/xla"  # JAX persistent compilation cache; "" disables
    warm_up: bool = True  # compile every program at engine start

    def __post_init__(self):
        for name in ("batch_buckets", "length_buckets", "prompt_buckets"):
            value = getattr(self, name)
            if not value or list(value) != sorted(set(value)) or value[0] < 1:
                raise ConfigError(f"rollout.{name} must be a non-empty increasing list of positive ints, got {list(value)}")
        if self.prompt_buckets[-1] >= self.length_buckets[-1]:
            raise ConfigError(
                f"rollout.prompt_buckets max ({self.prompt_buckets[-1]}) must be below rollout.length_buckets max "
                f"({self.length_buckets[-1]}): completions need cache slots after the prompt"
            )
        if self.steps_per_call < 1 or self.max_stop_ids < 1:
            raise ConfigError("rollout.steps_per_call and rollout.max_stop_ids must be >= 1")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelSpec = ModelSpec()
    mesh: MeshConfig = MeshConfig()
    rollout: RolloutConfig = RolloutConfig()
    seed: int = 0


def from_dict(cls, data: dict[str, Any], prefix: str = ""):
    """Builds dataclass `cls` from nested dicts, naming any unknown key or wrongly typed value."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}; allowed: {', '.join(fields)}")
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _convert(hint, value, key: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _convert(next(a for a in args if a is not type(None)), value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")
    return value


def apply_override(data: dict, override: str) -> None:
    """Sets `a.b.c=value` in nested dicts; the value is parsed as YAML (ints, floats, bools, lists)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.path=value")
    key, raw = override.split("=", 1)
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not a section")
    node[leaf] = yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Reads a YAML file (or the defaults when None), applies overrides, validates."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from e
    for override in overrides:
        apply_override(data, override)
    return from_dict(Config, data)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
