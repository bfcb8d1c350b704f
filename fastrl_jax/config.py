"""Frozen dataclass configs: YAML load, dotted `key=value` overrides, validation with clear messages.

A config is a tree of frozen dataclasses. `from_dict` builds it from nested dicts by
reading the field type hints, so adding a section is one dataclass plus one line in
`Config`. Each section checks its own values in `__post_init__`, so a bad value fails
at load time with a message that names the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key and what is allowed."""


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which policy checkpoint to load and in which dtype."""

    path: str = "smollm2"  # 'smollm2', a local HF checkpoint directory, or a local .gguf file
    dtype: str = "float32"  # float32 on CPU (XLA CPU runs bfloat16 ~4x slower), bfloat16 on GPU/TPU

    def __post_init__(self):
        _check_choice("model.dtype", self.dtype, ("float32", "bfloat16"))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (data, fsdp, tensor); -1 in one axis takes all remaining devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = dataclasses.asdict(self)
        for name, n in sizes.items():
            if n < 1 and n != -1:
                raise ConfigError(f"mesh.{name} must be >= 1, or -1 for all remaining devices; got {n}")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(f"at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1; got {sizes}")


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
                raise ConfigError(
                    f"rollout.{name} must be a non-empty increasing list of positive ints, got {list(value)}"
                )
        if self.prompt_buckets[-1] >= self.length_buckets[-1]:
            raise ConfigError(
                f"rollout.prompt_buckets max ({self.prompt_buckets[-1]}) must be below rollout.length_buckets max "
                f"({self.length_buckets[-1]}): completions need cache slots after the prompt"
            )
        for name in ("steps_per_call", "max_stop_ids"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: a draft tree of `steps` x `topk`, `verify_tokens` nodes verified (root included)."""

    mode: str = "off"  # off | on
    steps: int = 5
    topk: int = 4
    verify_tokens: int = 8  # SGLang's defaults: 5 / 4 / 8
    accept: str = "coupled"  # coupled (bit-identical to plain sampling) | rejection (exact in distribution)

    def __post_init__(self):
        _check_choice("sd.mode", self.mode, ("off", "on"))
        _check_choice("sd.accept", self.accept, ("coupled", "rejection"))
        if self.steps < 1 or self.topk < 1 or self.verify_tokens < 2:
            raise ConfigError(f"sd needs steps >= 1, topk >= 1, verify_tokens >= 2; got {self}")
        most = 1 + self.topk + (self.steps - 1) * self.topk**2
        if self.verify_tokens > most:
            raise ConfigError(f"sd.verify_tokens={self.verify_tokens} exceeds the {most} nodes steps x topk can draft")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run: one field per section (YAML top-level key)."""

    model: ModelSpec = ModelSpec()
    mesh: MeshConfig = MeshConfig()
    rollout: RolloutConfig = RolloutConfig()
    sd: SpecConfig = SpecConfig()
    seed: int = 0


_TYPE_NAMES = {int: "an int", float: "a float", str: "a string", bool: "a bool (true or false)"}


def from_dict(cls, data: Any, path: str = ""):
    """Builds dataclass `cls` from nested dicts; `path` is the dotted key of `data` used in messages."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'the config'} must be a mapping of keys to values, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            prefix = f"{path}." if path else ""
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown key '{dotted}' ({hint}allowed: {', '.join(fields)})")
        kwargs[key] = _convert(hints[key], value, dotted)
    for name, field in fields.items():
        no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if no_default and name not in kwargs:
            raise ConfigError(f"{path + '.' if path else ''}{name} is required")
    return cls(**kwargs)


def _convert(hint: Any, value: Any, key: str) -> Any:
    """`value` checked against (and, for tuples and floats, converted to) the field type `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"config field {key}: only Optional[X] unions are supported, got {hint}")
        return None if value is None else _convert(rest[0], value, key)
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"config field {key}: only tuple[X, ...] is supported, got {hint}")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint not in _TYPE_NAMES:
        raise TypeError(f"config field {key}: unsupported type {hint}")
    wrong = ConfigError(f"{key} must be {_TYPE_NAMES[hint]}, got {value!r}")
    # bool is a subclass of int: `true` must not pass as 1.
    if isinstance(value, bool) and hint is str:
        raise ConfigError(f"{key} must be a string, got {value!r} (YAML reads on/off/yes/no as booleans: quote it, e.g. 'on')")
    if isinstance(value, bool) and hint is not bool:
        raise wrong
    if hint is float and isinstance(value, (int, str)):
        # Strings too: PyYAML follows YAML 1.1, which reads `1e-4` (no dot) as a string.
        try:
            return float(value)
        except ValueError:
            raise wrong from None
    if not isinstance(value, hint):
        raise wrong
    return value


def _apply_override(data: dict, override: str) -> None:
    """Sets `a.b.c=value` in nested dicts; the value is parsed as YAML (ints, floats, bools, lists)."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"override {override!r} must look like section.key=value, e.g. mesh.tensor=2")
    node = data
    for depth, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent, or an empty `section:` in the YAML
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
    try:
        # An empty value means the empty string, so `key=` can clear a path setting.
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({e})") from e


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML file (or starts from the defaults when None), applies `a.b=value` overrides, validates."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {data!r}")
    for override in overrides:
        _apply_override(data, override)
    return from_dict(Config, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts, for logging and checkpoint metadata."""
    return dataclasses.asdict(cfg)
