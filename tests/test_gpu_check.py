"""bench/gpu_check.py, the one command for a machine with one GPU, kept from rotting on the CPU:
its dry run (the same cases, tiny, on the CPU), what it reports of a case that fails or hangs,
the carried wheels it installs, and the map of zerotrain's CUDA-only code to its cases."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
_spec.loader.exec_module(gpu_check)  # stdlib only: no torch, no path changes


def _check(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[dict, str, int]:
    """The command on the CPU (--dry-run) into tmp_path; its results file, output, status."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)]
        + ["--scratch", str(tmp_path / "scratch"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = json.loads((out / "results.json").read_text())
    return results, done.stdout + done.stderr, done.returncode


def test_dry_run_trains_through_the_gpu_paths_on_the_cpu(tmp_path):
    """A training case with both NVMe offloads, a pipeline, a gradient and a parameter codec:
    each in a process of its own, a row each, the scratch files removed."""
    cases = ["stage3-param-offload-nvme", "pp1", "codec-int8", "param-codec-int8"]
    results, output, code = _check(tmp_path, "--skip-tests", "--cases", *cases)
    assert code == 0, output
    assert results["environment"]["status"] == "ok"
    assert results["setting"]["device"] == "cpu" and results["setting"]["model"] == "tiny"
    rows = {row["name"]: row for row in results["cases"]}
    assert list(rows) == cases
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row)
        assert row["step_s"] > 0 and row["peak_host_bytes"] > 0, name
    train = rows["stage3-param-offload-nvme"]
    assert len(train["losses"]) == 2 and train["losses"][-1] < train["losses"][0]
    assert 0 < rows["codec-int8"]["relative_error"] < 0.05
    assert re.search(r"^pp1\s+ok\s", output, re.M), output  # the table
    assert not any((tmp_path / "scratch").iterdir()), "NVMe working files or results left"


@pytest.mark.slow  # 15 s: a torch import per case; the dry run above keeps the harness honest
def test_a_case_that_fails_or_hangs_is_reported_and_the_others_still_run(tmp_path):
    results, output, code = _check(
        tmp_path, "--skip-tests", "--cases", "stage0", "codec-topk", "--model", "nope"
    )
    assert code == 1
    for row in results["cases"]:
        assert row["status"] == "failed", row
        assert "unknown GPT preset 'nope'" in row["error"], row
        assert "gpu_cases.py" in row["log_tail"], row  # the traceback in its own log
    results, output, code = _check(
        tmp_path, "--skip-tests", "--cases", "stage0", "stage1", "--case-timeout-s", "0.01"
    )
    assert code == 1
    assert [row["status"] for row in results["cases"]] == ["timeout", "timeout"], output
    assert "stopped after 0.01 s (its timeout)" in results["cases"][0]["error"]


@pytest.mark.slow
def test_dry_run_of_every_case_and_the_cuda_tests(tmp_path):
    """The whole command as on the GPU: tests/test_cuda.py (skipped without a GPU, so only
    collected) and every case."""
    results, output, code = _check(tmp_path, timeout=900)
    assert code == 0, output
    assert results["tests"]["status"] == "passed" and results["tests"]["skipped"] > 0
    assert [row["name"] for row in results["cases"]] == gpu_check.CASE_NAMES
    assert all(row["status"] == "ok" for row in results["cases"]), output


def test_cuda_test_outcomes_read_from_junit_xml(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase name="test_a"/><testcase name="test_b"><failure message="assert 1 == 2'
        '&#10;more">tb</failure></testcase><testcase name="test_c"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    got = gpu_check._junit(xml)
    assert got["passed"] == 1 and got["failures"] == 1 and got["skipped"] == 1
    assert got["failed_tests"] == ["test_b: assert 1 == 2"]
    assert gpu_check._junit(tmp_path / "absent.xml") == {}  # pytest stopped before writing it


def _wheel(folder: Path, module: str) -> None:
    """A wheel of one empty module: what pip needs to install it."""
    dist = f"{module}-1.0.dist-info"
    files = {
        f"{module}/__init__.py": "",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)


def test_missing_packages_come_from_the_carried_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    needed = {"gpu_check_probe": "gpu-check-probe"}
    with pytest.raises(SystemExit, match=r"gpu-check-probe not installed, and .* holds no wheels"):
        gpu_check.ensure_packages(wheels, site, needed)
    _wheel(wheels, "gpu_check_probe")
    assert gpu_check.ensure_packages(wheels, site, needed) == ["gpu_check_probe"]
    assert importlib.util.find_spec("gpu_check_probe").origin.startswith(str(site))
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(site)  # for the children too
    assert gpu_check.ensure_packages(wheels, site, needed) == []  # there now: nothing to do
    assert gpu_check.ensure_packages(tmp_path / "absent", site, {"json": "json"}) == []


# what marks code that runs only on CUDA (a comment or docstring naming CUDA does not)
CUDA_ONLY = re.compile(r'torch\.cuda\.|\.is_cuda\b|"cuda"|"nccl"|pin_memory=True')


def test_every_cuda_only_code_path_has_a_case():
    """A file of zerotrain with CUDA-only code must be in gpu_check.CUDA_CODE, with the cases
    that reach it or why none can on one GPU: new CUDA code gets a case, or a reason."""
    found = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "zerotrain").rglob("*.py")
        if CUDA_ONLY.search(path.read_text())
    }
    assert found - set(gpu_check.CUDA_CODE) == set(), "add these to gpu_check.CUDA_CODE"
    for path, reached in gpu_check.CUDA_CODE.items():
        assert (ROOT / path).is_file(), path
        assert reached, path
        if not isinstance(reached, str):
            assert set(reached) <= set(gpu_check.CASE_NAMES), path


def test_every_test_that_needs_a_gpu_is_in_the_file_gpu_check_runs():
    # gpu_check runs tests/test_cuda.py alone: a GPU test in another file would never run
    # (two did, until a GPU run of the activation-offload case found the defect they missed)
    needs_gpu = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    elsewhere = [
        path.name
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if path.name != "test_cuda.py" and needs_gpu.search(path.read_text())
    ]
    assert elsewhere == [], f"move these GPU tests into tests/test_cuda.py: {elsewhere}"


@pytest.mark.slow  # about a minute: two models probed and tried on the CPU
def test_the_gpu_planner_bench_runs_on_the_cpu_and_reports_again(tmp_path):
    """bench/plan_gpu.py's dry run (tiny GPT-2s, fp32) of a row in memory and the 2.7B's
    offload row: each predicted and measured, then --report prices them again from the saved
    probe and model facts alone, the same predictions."""
    script = ROOT / "bench" / "plan_gpu.py"
    run = [sys.executable, str(script), "--dry-run", "--out", str(tmp_path), "--rows", "0", "4"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "plan_gpu.json").read_text())
    assert [r["model"] for r in saved["rows"]] == ["gpt2-350m", "gpt2-2.7b"]
    assert all("measured" in r and "predicted" in r for r in saved["rows"]), saved["rows"]
    again = subprocess.run(
        [sys.executable, str(script), "--report", str(tmp_path / "plan_gpu.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [line for line in again.stdout.splitlines() if line.lstrip().startswith("gpt2-")]
    first = [line for line in done.stdout.splitlines() if line.lstrip().startswith("gpt2-")]
    assert rows == first[: len(rows)] and len(rows) == 2, (rows, first)
