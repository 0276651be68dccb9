"""Layering: the lower parts of zerotrain never import the parts built on them (any import,
also inside a function or under TYPE_CHECKING)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zerotrain"
UPPER = ("zerotrain.observability", "zerotrain.estimate", "zerotrain.cli", "zerotrain.engine")
# part -> what it may not import: comm is the lowest layer, fmt imports nothing of zerotrain
FORBIDDEN = {
    "comm": UPPER + ("zerotrain.zero",),
    "zero": UPPER,
    "observability": ("zerotrain.zero", "zerotrain.engine", "zerotrain.estimate", "zerotrain.cli"),
    "fmt.py": ("zerotrain",),
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(part: str) -> None:
    root = PACKAGE / part
    paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line} imports {name}"
        for path in paths
        for line, name in _imports(path)
        if any(name == top or name.startswith(f"{top}.") for top in FORBIDDEN[part])
    ]
    assert not offenders, offenders
