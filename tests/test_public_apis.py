"""No module takes a private (underscore-prefixed) name from a third-party package.

Private names move or vanish between releases without notice: transformers 5.17 dropped the
`_SPECIAL_TOKENS` the GGUF tokenizer imported, and every command that loaded it died.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("fastrl_jax", "kernels", "scripts")
OWN_PACKAGES = {"fastrl_jax", "kernels", "scripts", "tests"}


def private_imports(source: str, filename: str = "<source>") -> list[str]:
    """`filename:line: dotted.name` for each private name `source` takes from a third-party package.

    Caught: `import a._b`, `from a._b import c`, `from a import _b`, and attribute chains read off
    an imported third-party name (`import jax` then `jax._src.core`). Dunders (`__version__`), the
    standard library and this project's own packages (or relative imports) are not third-party
    privates.
    """

    def is_private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    def third_party(module: str) -> bool:
        top = module.split(".")[0]
        return top not in OWN_PACKAGES and top not in sys.stdlib_module_names

    tree = ast.parse(source, filename)
    found = []  # (line, dotted name)
    imported_names = set()  # names bound to something from a third-party package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if third_party(alias.name):
                    imported_names.add(alias.asname or alias.name.split(".")[0])
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and third_party(node.module):
            imported_names.update(alias.asname or alias.name for alias in node.names)
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    # One hit per chain: `jax._src.tree_util` and not also its inner `jax._src`.
    inner_attributes = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner_attributes:
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported_names:
                found.append((node.lineno, ast.unparse(node)))
    private = {(line, name) for line, name in found if any(map(is_private, name.split(".")))}
    return [f"{filename}:{line}: {name}" for line, name in sorted(private)]


def test_no_module_uses_a_private_third_party_name():
    modules = sorted(path for folder in SCANNED_DIRS for path in (ROOT / folder).rglob("*.py"))
    assert len(modules) > 20, f"found only {len(modules)} modules under {SCANNED_DIRS}; is ROOT right?"
    found = [hit for path in modules for hit in private_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "private third-party names (use a public API instead):\n" + "\n".join(found)


def test_checker_flags_private_third_party_names():
    source = """
import jax._src.core
from transformers.integrations.gguf.gguf_tokenizer_mapping import _SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING
from numpy._core import multiarray

def f():
    from torch import _C
    import jax
    return jax._src.tree_util
"""
    assert private_imports(source, "m.py") == [
        "m.py:2: jax._src.core",
        "m.py:3: transformers.integrations.gguf.gguf_tokenizer_mapping._SPECIAL_TOKENS",
        "m.py:4: numpy._core.multiarray",
        "m.py:7: torch._C",
        "m.py:9: jax._src.tree_util",
    ]


def test_checker_passes_public_stdlib_and_own_names():
    source = """
from __future__ import annotations
import os, sys
import jax.numpy as jnp
from transformers import PreTrainedTokenizerFast, __version__
from fastrl_jax.models.gguf_loader import _open
from ._private import helper
from . import _sibling
import fastrl_jax.models._internal

x = jnp.zeros(3).__array__()
y = sys._getframe(0), os._exit, _open(None)._reader, self._cache.get(1)
z = PreTrainedTokenizerFast.__name__
"""
    assert private_imports(source, "m.py") == []
