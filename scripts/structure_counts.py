"""The structure counts of issue 41, for a checkout (default: this one).

    python scripts/structure_counts.py [TREE]

Prints the lines of api.py and of ``initialize``, the identifiers naming a parallel axis
(``tensor_parallel``, ``expert``, ``PipelineModule``, ``num_stages``) in api.py, the engine and
checkpoint/, the attribute chains in checkpoint/ (``a.b.c`` counted once each, by depth), and
the methods of ZeroOptimizer and of the engine. Reads source only (the standard library's
``ast`` and ``tokenize``), so it runs on any commit's tree: ``git worktree add /tmp/old COMMIT``
then ``python scripts/structure_counts.py /tmp/old``.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import sys
import tokenize

AXIS_NAMES = re.compile(r"tensor_parallel|expert|PipelineModule|num_stages", re.IGNORECASE)
ENGINE_AND_CHECKPOINT = ("api.py", "engine.py", "engine_queries.py", "backward.py", "checkpoint")


def _function_lines(path: pathlib.Path, name: str) -> int:
    node = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == name)
    return node.end_lineno - node.lineno + 1


def _methods(path: pathlib.Path, cls: str) -> int:
    node = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == cls)
    return sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)


def _axis_names(path: pathlib.Path) -> int:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return sum(t.type == tokenize.NAME and bool(AXIS_NAMES.search(t.string)) for t in tokens)


def _chains(path: pathlib.Path) -> set[str]:
    """``name.attr.attr...`` with two attributes or more."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and len(parts) >= 2:
            found.add(".".join([node.id, *reversed(parts)]))
    return found


def main() -> None:
    package = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".") / "zerotrain"
    api = package / "api.py"
    core = [
        p for p in package.rglob("*.py") if p.relative_to(package).parts[0] in ENGINE_AND_CHECKPOINT
    ]
    chains = set().union(*(_chains(p) for p in (package / "checkpoint").glob("*.py")))
    print(f"api.py: {len(api.read_text().splitlines())} lines")
    print(f"initialize: {_function_lines(api, 'initialize')} lines")
    print(
        f"parallel-axis identifiers in api.py, the engine, checkpoint/: {sum(map(_axis_names, core))}"
    )
    print(
        f"isinstance(model, PipelineModule) in api.py: {api.read_text().count('isinstance(model, PipelineModule)')}"
    )
    deep = sum(c.count(".") >= 3 for c in chains)
    print(f"attribute chains in checkpoint/: {len(chains)} of 2+ attributes, {deep} of 3+")
    print(f"ZeroOptimizer methods: {_methods(package / 'zero' / 'optimizer.py', 'ZeroOptimizer')}")
    engine = _methods(package / "engine.py", "ZeroTrainEngine")
    queries = _methods(package / "engine_queries.py", "DeepSpeedQueries")
    print(f"engine methods: {engine} + {queries} from DeepSpeedQueries")


if __name__ == "__main__":
    main()
