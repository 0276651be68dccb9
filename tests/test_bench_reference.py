"""bench/step_time.py's `--reference COMMIT` (the step-time guard): the reference rows are
added to the default systems, run from a temporary worktree of that commit that is removed
afterwards, and a commit that does not exist is refused before anything runs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def step_time():
    sys.path.insert(0, str(ROOT / "bench"))  # as when the script runs
    try:
        spec = importlib.util.spec_from_file_location("step_time", ROOT / "bench/step_time.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["step_time"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("step_time", None)
        sys.path.remove(str(ROOT / "bench"))


def test_reference_rows_join_the_default_systems_only_with_a_reference(step_time):
    plain = step_time.parse_args([])
    assert not set(step_time.REFERENCE_KEYS) & set(plain.systems)
    guarded = step_time.parse_args(["--reference", "HEAD"])
    assert guarded.systems == plain.systems + step_time.REFERENCE_KEYS
    chosen = step_time.parse_args(["--reference", "HEAD", "--systems", "zt1", "ref1"])
    assert chosen.systems == ["zt1", "ref1"]
    assert "--reference" in step_time.unavailable(step_time.SPECS["ref1"], plain)


def test_the_reference_worktree_is_the_commit_and_is_removed_after(step_time):
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with step_time.reference_tree("HEAD") as (tree, sha):  # a shallow clone has no other
        assert sha == head
        assert (tree / "zerotrain" / "__init__.py").is_file()
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True
        ).stdout
        assert str(tree) in listed
    assert not tree.exists()
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert str(tree) not in listed
    with pytest.raises(SystemExit, match="not a commit"):
        with step_time.reference_tree("no-such-commit-zz"):
            pass
