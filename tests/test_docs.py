"""The documentation's code, run as a reader would run it: every fenced ``python``, ``sh``,
``bash`` and ``console`` block of README.md and docs/*.md runs, or says why it does not; every
``json`` block is a config that the config checker accepts; every inline `zerotrain ...` and
`python ...` names a command, script or module that exists; the Python blocks' imports resolve.

# [Note: marking a snippet]
An HTML comment on the line just before the opening fence (invisible on the rendered page):

    <!-- not run: REASON -->        a fragment, or what needs 2 nodes, a GPU, minutes; REASON is
                                    shown as the skip reason
    <!-- run: OPTION ... -->        how to run it, options separated by spaces (shell quoting):
        slow                        only with the slow tests (`pytest -m slow`)
        file=NAME                   a python block is not run itself but written to NAME in the
                                    page's working directory, for a later command to run
        expect=TEXT                 the output contains TEXT (runs of whitespace compared as one
                                    space; `/path/to/` stands for any directory); repeatable
        timeout=S                   seconds (default 90, slow 600)
        NAME=VALUE                  an environment variable (upper-case NAME), e.g.
                                    PYTHONPATH=examples

An unmarked block runs with the defaults. Each page runs in a working directory of its own,
which links `examples/`, `bench/` and `.venv/` of the checkout (commands are written from its
root), with the interpreter's `bin/` first on PATH (`zerotrain`, `python`). A ``console``
block's `$ ` lines are the commands and its other lines the output they must print. A shell
block of `zerotrain estimate`, `zerotrain checkpoint` or `zerotrain run --dry-run` commands runs
in this process through `zerotrain.cli.main`, what the console script calls (no interpreter to
start); every other block in a process of its own. Nothing may print a Python traceback.

README.md's marks are in README_MARKS below (the lead edits README.md; they can move there).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from launched import run_in_session

from zerotrain import cli
from zerotrain.config import check_config

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
RUN_LANGUAGES = ("python", "sh", "bash", "console")
LINKED = ("examples", "bench", ".venv")  # what commands written from the repository root use
DEFAULT_TIMEOUT_S, SLOW_TIMEOUT_S = 90, 600

# README.md's blocks by their first line: its marks live here, not in the file (see the note).
README_MARKS = {
    "make demo    # sets up .venv, trains a small GPT on 2 processes with ZeRO stage 2 (no "
    "download)": "not run: make demo runs docs/quickstart.md's `zerotrain run ... --steps 200` "
    "(run there, slow); make test is this suite",
    "import zerotrain": "not run: a sketch; model, dataset, loss_fn and ds_config.json are the "
    "reader's (docs/quickstart.md has the loop that runs)",
    "zerotrain run --nproc-per-node 2 train.py --deepspeed --deepspeed_config ds_config.json": (
        "not run: train.py and ds_config.json are the reader's"
    ),
    "make test       # default suite; slow tests excluded": "not run: the suite, the linters and "
    "benchmarks of minutes",
}

_MARK = re.compile(r"^\s*<!--\s*(not run|run):\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(```+)\s*([\w-]*)\s*$")
_TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Snippet:
    """One fenced block of a page."""

    page: str
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    mark: tuple[str, str] | None  # ("run" | "not run", the rest of the comment)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def options(self) -> dict[str, list[str]]:
        """The ``run:`` options, each name with its values (``slow`` -> [""])."""
        out: dict[str, list[str]] = {}
        if self.mark and self.mark[0] == "run":
            for token in shlex.split(self.mark[1]):
                name, _, value = token.partition("=")
                out.setdefault(name, []).append(value)
        return out


def read_snippets(page: str) -> list[Snippet]:
    """The fenced blocks of ``page`` with their marks."""
    lines = (REPO / page).read_text().splitlines()
    snippets, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, language = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks)
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        ]
        mark = _MARK.match(lines[i - 1]) if i else None
        snippet = Snippet(
            page, i + 1, language, "\n".join(body) + "\n", mark.groups() if mark else None
        )
        if page == "README.md" and body and body[0] in README_MARKS:
            kind, _, rest = README_MARKS[body[0]].partition(": ")
            snippet = Snippet(page, i + 1, language, snippet.text, (kind, rest))
        snippets.append(snippet)
        i = end + 1
    return snippets


SNIPPETS = [s for page in PAGES for s in read_snippets(page)]


def timeout_s(snippet: Snippet) -> float:
    options = snippet.options()
    default = SLOW_TIMEOUT_S if "slow" in options else DEFAULT_TIMEOUT_S
    return float(options.get("timeout", [default])[0])


def _param(snippet: Snippet):
    # pytest-timeout's limit (the suite's default is 300 s) above the snippet's own, which
    # kills the snippet's processes and shows its output
    marks = [pytest.mark.timeout(timeout_s(snippet) + 60)]
    if snippet.mark and snippet.mark[0] == "not run":
        marks.append(pytest.mark.skip(reason=f"{snippet.where}: {snippet.mark[1]}"))
    elif "slow" in snippet.options():
        marks.append(pytest.mark.slow)
    return pytest.param(snippet, id=snippet.where, marks=marks)


# -- running a snippet --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """``page -> directory``: one working directory per page, made on first use, with the
    checkout's LINKED directories and the page's ``file=`` blocks in it."""
    made: dict[str, Path] = {}

    def workdir(page: str) -> Path:
        if page not in made:
            path = tmp_path_factory.mktemp(Path(page).stem)
            for name in LINKED:
                if (REPO / name).exists():
                    (path / name).symlink_to(REPO / name)
            for snippet in SNIPPETS:
                for name in snippet.options().get("file", []) if snippet.page == page else []:
                    (path / name).write_text(snippet.text)
            made[page] = path
        return made[page]

    return workdir


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def _in_process(commands: list[list[str]], text: str) -> bool:
    """Commands that `zerotrain.cli.main` runs here as the console script would: no shell
    syntax, no process started."""
    if re.search(r"[$|;&<>`]", re.sub(r"#.*", "", text)):
        return False
    return bool(commands) and all(
        words[0] == "zerotrain"
        and len(words) > 1
        and (words[1] in ("estimate", "checkpoint") or words[1:3] == ["run", "--dry-run"])
        for words in commands
    )


def run_in_process(commands: list[list[str]], workdir: Path, capsys, monkeypatch) -> str:
    monkeypatch.chdir(workdir)
    output = []
    for words in commands:
        try:
            code = cli.main(words[1:])
        except SystemExit as exit:  # argparse's own errors and --help
            code = exit.code
        out, err = capsys.readouterr()
        output.append(out + err)
        assert code == 0, f"{shlex.join(words)} exited with {code}:\n{out}{err}"
    return "".join(output)


def run_in_subprocess(argv: list[str], workdir: Path, env: dict[str, str], timeout: float) -> str:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, **env, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    env.pop("OMP_NUM_THREADS", None)  # `zerotrain run` splits the cores
    done = run_in_session(argv, cwd=workdir, env=env, timeout=timeout, what=shlex.join(argv))
    tail = "\n".join(done.stdout.splitlines()[-200:])  # torchrun's report ends it
    assert done.returncode == 0, f"exited with {done.returncode}; output ends:\n{tail}"
    return done.stdout


def expected_lines(snippet: Snippet) -> list[str]:
    """What the output must contain: ``expect=`` options, and a console block's output lines."""
    expected = list(snippet.options().get("expect", []))
    if snippet.language == "console":
        expected += [
            line for line in snippet.text.splitlines() if line and not line.startswith("$ ")
        ]
    return expected


def contains(output: str, expected: str) -> bool:
    """``expected`` in ``output``, whitespace runs as one space, `/path/to/` any directory."""
    flat = " ".join(output.split())
    pattern = r"\S*/".join(
        re.escape(part) for part in " ".join(expected.split()).split("/path/to/")
    )
    return re.search(pattern, flat) is not None


def run_snippet(snippet: Snippet, workdir: Path, capsys, monkeypatch) -> str:
    options, timeout = snippet.options(), timeout_s(snippet)
    # as written: a relative PYTHONPATH resolves against the working directory, like the root
    env = {name: values[-1] for name, values in options.items() if name.isupper()}
    if snippet.language == "python":
        script = workdir / f"_snippet_{Path(snippet.page).stem}_{snippet.line}.py"
        script.write_text(snippet.text)
        return run_in_subprocess([sys.executable, script.name], workdir, env, timeout)
    text = snippet.text
    if snippet.language == "console":
        text = "".join(line[2:] + "\n" for line in text.splitlines() if line.startswith("$ "))
    commands = shell_commands(text)
    assert commands, f"{snippet.where}: a shell block without a command; mark it not run"
    if _in_process(commands, text) and not env:
        return run_in_process(commands, workdir, capsys, monkeypatch)
    return run_in_subprocess(["bash", "-euo", "pipefail", "-c", text], workdir, env, timeout)


@pytest.mark.parametrize(
    "snippet",
    [_param(s) for s in SNIPPETS if s.language in RUN_LANGUAGES and "file" not in s.options()],
)
def test_snippet_runs(snippet, workdirs, capsys, monkeypatch):
    output = run_snippet(snippet, workdirs(snippet.page), capsys, monkeypatch)
    assert _TRACEBACK not in output, f"{snippet.where} printed a traceback:\n{output[-3000:]}"
    for expected in expected_lines(snippet):
        assert contains(output, expected), (
            f"{snippet.where}: the output lacks {expected!r}; it was:\n{output[-3000:]}"
        )


# -- what is not run is still checked -----------------------------------------------------------
def test_marks_are_known_and_every_shell_or_python_block_is_decided():
    """Marks parse (known options, a reason to every `not run`), sit on blocks that can run,
    and no command hides in an indented block the test cannot see."""
    for snippet in SNIPPETS:
        if snippet.mark is None:
            continue
        assert snippet.language in RUN_LANGUAGES, (
            f"{snippet.where}: a mark on a {snippet.language!r} block"
        )
        kind, rest = snippet.mark
        if kind == "not run":
            assert rest, f"{snippet.where}: `not run` needs a reason"
            continue
        for name in snippet.options():
            assert name in ("slow", "file", "expect", "timeout") or name.isupper(), (
                f"{snippet.where}: unknown run option {name!r} (see [Note: marking a snippet])"
            )
        if "file" in snippet.options():
            assert snippet.language == "python", f"{snippet.where}: file= is for python blocks"
    indented = re.compile(r"^(?: {4}|\t)\s*(?:\$ )?(?:zerotrain|python|\.venv/bin/\S+|make) ")
    for page in PAGES:
        fenced = {
            line
            for s in read_snippets(page)
            for line in range(s.line, s.line + s.text.count("\n") + 2)
        }
        for number, line in enumerate((REPO / page).read_text().splitlines(), 1):
            assert number in fenced or not indented.match(line), (
                f"{page}:{number}: a command in an indented block; fence it (```sh) so that "
                "this test runs it or marks it"
            )


def test_json_blocks_are_configs_the_checker_accepts():
    """Every ```json block (a whole config, or keys of one) passes `check_config`."""
    checked = 0
    for snippet in SNIPPETS:
        if snippet.language != "json":
            continue
        text = snippet.text.strip()
        text = text if text.startswith("{") else "{" + text + "}"  # keys of a config
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an accepted key that does nothing warns
            check_config(json.loads(text))
        checked += 1
    assert checked >= 10


def _imports(snippet: Snippet) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of the block's imports; a fragment that does not parse (`...` for
    the rest) gives its import lines."""
    try:
        tree = ast.parse(snippet.text)
    except SyntaxError:
        lines = [line.strip() for line in snippet.text.splitlines()]
        tree = ast.parse("\n".join(line for line in lines if line.startswith(("import ", "from "))))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_python_blocks_import_what_exists(monkeypatch):
    """Every Python block's imports resolve, those of fragments that are not run included
    (`from gpt.model import ...` where the page sets PYTHONPATH=examples)."""
    for snippet in SNIPPETS:
        if snippet.language != "python":
            continue
        for path in snippet.options().get("PYTHONPATH", []):
            monkeypatch.syspath_prepend(str(REPO / path))
        for module, names in _imports(snippet):
            try:
                imported = importlib.import_module(module)
            except ImportError as error:
                pytest.fail(f"{snippet.where}: import {module}: {error}")
            for name in names:
                if (
                    not hasattr(imported, name)
                    and importlib.util.find_spec(f"{module}.{name}") is None
                ):
                    pytest.fail(f"{snippet.where}: {module} has no {name}")


def test_inline_commands_exist():
    """Every inline `zerotrain ...` names a command (and action) that exists, every inline
    `python path.py` a script of the checkout, every `python -m module` a module."""
    fence_free = {
        page: re.sub(r"```.*?```", "", (REPO / page).read_text(), flags=re.S) for page in PAGES
    }
    checked = 0
    for page, text in fence_free.items():
        for span in re.findall(r"`((?:zerotrain|python) [^`]*)`", text):
            words = span.split()
            where = f"{page}: `{span}`"
            if words[0] == "python":
                if words[1] == "-m":
                    assert importlib.util.find_spec(words[2]) is not None, f"{where}: no module"
                else:
                    assert (REPO / words[1]).is_file(), f"{where}: no script {words[1]}"
            else:
                command = []
                for word in words[1:]:
                    if not re.fullmatch(r"[a-z][a-z-]*", word):
                        break
                    command.append(word)
                try:
                    code = cli.main([*command, "--help"])
                except SystemExit as exit:
                    code = exit.code
                assert code == 0, f"{where}: `zerotrain {' '.join(command)}` does not exist"
            checked += 1
    assert checked >= 20
