"""The package's layers: every room (a subpackage or top-level module of fastrl_jax, kernels/ included)
imports only rooms below it, and no import cycle runs between rooms.

Low to high: kernels < models < rollout < drafter < rl < cli, with config, sharding, data,
checkpoint, files, metric_sink, machine and signals shared below all of them (they may import each other, without cycles).
Imports inside functions count: a lazy import is a dependency too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RANKS = {
    "fastrl_jax": 0, "config": 0, "sharding": 0, "data": 0, "checkpoint": 0, "files": 0, "metric_sink": 0, "machine": 0, "plotting": 0,
    "signals": 0,
    "kernels": 1, "models": 2, "rollout": 3, "drafter": 4, "rl": 5, "cli": 6,
}


def package_sources(root: Path) -> dict[str, str]:
    """Dotted module name -> source of every module under fastrl_jax/ and kernels/ (fastrl_jax.kernels)."""
    out = {}
    for top, package in (("fastrl_jax", "fastrl_jax"), ("kernels", "fastrl_jax.kernels")):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root / top).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path.read_text()
    return out


def room(module: str) -> str:
    """fastrl_jax.rollout.engine -> rollout; fastrl_jax -> fastrl_jax (the package's __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(module: str, source: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted module, line) of every fastrl_jax module `module` imports, relative imports resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from fastrl_jax import sharding` imports a room by its name.
            out += [(f"{base}.{a.name}" if base == "fastrl_jax" else base, node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m == "fastrl_jax" or m.startswith("fastrl_jax.")]


def layering_errors(sources: dict[str, str], ranks: dict[str, int]) -> list[str]:
    """Upward imports, rooms without a rank, and cycles between rooms, one message each."""
    errors, edges = [], {}
    for module, source in sources.items():
        src = room(module)
        is_package = any(m.startswith(module + ".") for m in sources)
        for target, line in imported_modules(module, source, is_package):
            dst = room(target)
            for r in (src, dst):
                if r not in ranks:
                    errors.append(f"{module}: room {r!r} has no layer; give it a rank in RANKS")
            if src == dst or src not in ranks or dst not in ranks:
                continue
            edges.setdefault(src, set()).add(dst)
            if ranks[dst] > ranks[src]:
                errors.append(f"{module}:{line} imports {target}: {src} (layer {ranks[src]}) must not import "
                              f"{dst} (layer {ranks[dst]})")
    errors += [f"import cycle between rooms: {' -> '.join(c)}" for c in _cycles(edges)]
    return sorted(set(errors))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def test_rooms_import_only_downward_and_without_cycles():
    sources = package_sources(ROOT)
    assert len(sources) > 40 and {room(m) for m in sources} <= set(RANKS)
    assert layering_errors(sources, RANKS) == []


SYNTHETIC = {
    "fastrl_jax": "",
    "fastrl_jax.config": "",
    "fastrl_jax.models": "",
    "fastrl_jax.models.decoder": "from fastrl_jax.config import ModelSpec\nfrom fastrl_jax.kernels import backends\n",
    "fastrl_jax.kernels": "",
    "fastrl_jax.kernels.backends": "",
    "fastrl_jax.rollout": "",
    "fastrl_jax.rollout.engine": "from ..models.decoder import Decoder\n",
    "fastrl_jax.rl": "",
    "fastrl_jax.rl.trainer": "from fastrl_jax.rollout import engine\n",
}


def test_the_check_fails_on_an_upward_import():
    assert layering_errors(SYNTHETIC, RANKS) == []  # the clean tree passes, relative imports resolved
    upward = dict(SYNTHETIC)
    upward["fastrl_jax.models.decoder"] += "def f():\n    from fastrl_jax.rl.trainer import Trainer\n"
    errors = layering_errors(upward, RANKS)
    assert len(errors) == 2, errors  # the upward import, and the cycle it closes
    assert "fastrl_jax.models.decoder:4 imports fastrl_jax.rl.trainer: models (layer 2) must not import rl (layer 5)" in errors
    assert any(e.startswith("import cycle between rooms:") for e in errors)


@pytest.mark.parametrize("extra", ["from fastrl_jax import sharding\n", "from fastrl_jax.newroom import x\n"])
def test_the_check_fails_on_a_cycle_or_an_unranked_room(extra):
    tree = dict(SYNTHETIC, **{"fastrl_jax.sharding": "import fastrl_jax.config\n"})
    tree["fastrl_jax.config"] = extra
    errors = layering_errors(tree, RANKS)
    expected = "import cycle between rooms: config -> sharding -> config" if "sharding" in extra else "room 'newroom' has no layer"
    assert any(expected in e for e in errors), errors
