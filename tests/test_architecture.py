"""The architecture, checked: dependencies run one way between layers, no import cycle between
files, no file over 800 lines, only the ZeRO policy reads what a stage partitions, and only the
parallel layout and the parallelism packages name a parallel axis.

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerotrain"

# Lowest first: a module may import its own layer and the layers below it, never above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundations",
        ("fmt", "errors", "progress", "ranges", "precision", "accelerator", "config", "optim"),
    ),
    ("communication", ("comm",)),
    ("compression", ("compression",)),
    ("zero", ("zero",)),
    (
        "services",
        (
            "checkpoint",
            "observability",
            "estimate",
            "data",
            "activation_checkpointing",
            "lora",
            "tensor_parallel",
            "moe",
            "sequence",
        ),
    ),
    ("engine", ("backward", "engine_queries", "engine", "pipe")),
    # the parallel layout: the mesh and the model transforms, over the parallelism packages
    ("layout", ("parallel",)),
    # the planner's probes and cost model, which initialize's advice asks
    ("planning", ("plan",)),
    ("api", ("api", "optimizer_plan", "policies")),
    # DeepSpeed's module names over the layers below (`import zerotrain as deepspeed`), and
    # the package root, which re-exports everything
    (
        "deepspeed surface",
        ("checkpointing", "runtime", "ops", "utils", "profiling", "__init__"),
    ),
    # frameworks: the opt-in DeepSpeed alias and native integrations, over the whole package
    ("frameworks", ("compat", "integrations")),
    # the planner's trials: candidate configs trained through the API
    ("tools", ("plan_trial",)),
    ("cli", ("cli", "launcher", "__main__")),
]
MAX_LINES = 800


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int:
    """The layer of ``zerotrain.X...`` by its first component ``X``."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return index
    raise AssertionError(f"{module}: not in any layer of tests/test_architecture.py; add it")


def _files() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, modules: set[str]) -> list[tuple[str, int]]:
    """The zerotrain modules ``path`` imports (the most specific existing file for each)."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod when that file exists
            names = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            names = names or [base]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("zerotrain"):
                found.append((name, node.lineno))
    return found


def test_dependencies_run_one_way():
    files = _files()
    offenders = []
    for module, path in files.items():
        own = _layer(module)
        for imported, line in _imports(path, set(files)):
            if _layer(imported) > own:
                offenders.append(
                    f"{path.relative_to(ROOT)}:{line} ({LAYERS[own][0]}) imports {imported} "
                    f"({LAYERS[_layer(imported)][0]})"
                )
    assert not offenders, "imports against the layering:\n" + "\n".join(offenders)


def test_no_import_cycle_between_files():
    files = _files()
    graph = {m: {i for i, _ in _imports(p, set(files)) if i != m} for m, p in files.items()}
    # Tarjan's strongly connected components: any component of two or more files is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles between files: {cycles}"


def test_no_file_over_800_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these files (one idea each, at most {MAX_LINES} lines): {long}"


def test_only_the_policy_reads_what_a_stage_partitions():
    """See [Note: the stage is read once] in zerotrain/zero/policy.py. The model-state formula
    (zero/memory.py) describes a policy, and the estimator evaluates it for every stage."""
    allowed = {"zero/policy.py", "zero/memory.py", "estimate"}
    flag = re.compile(r"\b(shard_optimizer_states|shard_gradients|shard_parameters)\b")
    offenders = [
        f"{p.relative_to(PACKAGE)}:{n}"
        for p in PACKAGE.rglob("*.py")
        if not any(str(p.relative_to(PACKAGE)).startswith(a) for a in allowed)
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if flag.search(line)
    ]
    assert not offenders, f"ask the shard group's strategies instead: {offenders}"


def test_engine_and_checkpoint_name_no_parallel_axis():
    """See [Note: the parallel layout] in zerotrain/parallel/layout.py: the engine and the
    checkpoint ask the layout (``engine.layout``) and name no parallelism, so a new parallel
    axis touches the layout and its own package only. Identifiers count (names, attributes,
    imported modules), comments and strings do not."""
    checked = ["engine.py", "engine_queries.py", "backward.py", "checkpoint"]
    forbidden = re.compile(r"tensor_parallel|expert|PipelineModule|num_stages", re.IGNORECASE)
    offenders = [
        f"{p.relative_to(PACKAGE)}:{token.start[0]} {token.string}"
        for part in checked
        for p in sorted(
            (PACKAGE / part).rglob("*.py") if part == "checkpoint" else [PACKAGE / part]
        )
        for token in tokenize.generate_tokens(io.StringIO(p.read_text()).readline)
        if token.type == tokenize.NAME and forbidden.search(token.string)
    ]
    assert not offenders, f"ask the parallel layout (engine.layout) instead: {offenders}"
