"""The torchrun command that `zerotrain run` builds; nothing is launched here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import zerotrain
from zerotrain import cli
from zerotrain.cli import LaunchError, launch, plan_launch

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(autouse=True)
def scripts_here(tmp_path, monkeypatch):
    """The scripts the command lines name exist (zerotrain run checks them before launching)."""
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "script.py", "./-odd.py"):
        (tmp_path / name).write_text("")


def plan(argv, *, environ=None, cpu_count=8, cuda_devices=0):
    return plan_launch(argv, environ=environ or {}, cpu_count=cpu_count, cuda_devices=cuda_devices)


def test_single_node_defaults_to_standalone_and_one_process_without_cuda():
    launch = plan(["train.py", "--steps", "3"])
    assert launch.argv == [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "1",
        "--",  # the end of torchrun's options: what follows is the script's
        "train.py",
        "--steps",
        "3",
    ]
    assert launch.env_overrides == {}  # one process keeps torch's default of all cores
    assert not launch.dry_run


def test_nproc_defaults_to_the_cuda_device_count():
    launch = plan(["train.py"], cuda_devices=4)
    assert launch.argv[launch.argv.index("--nproc-per-node") + 1] == "4"
    assert launch.env_overrides == {}  # GPU jobs keep torchrun's own OMP_NUM_THREADS choice


@pytest.mark.parametrize(
    ("nproc", "cpu_count", "environ", "expected"),
    [
        ("2", 8, {}, {"OMP_NUM_THREADS": "4"}),
        ("3", 8, {}, {"OMP_NUM_THREADS": "2"}),
        ("4", 2, {}, {"OMP_NUM_THREADS": "1"}),  # more processes than cores: at least 1
        ("2", 8, {"OMP_NUM_THREADS": "7"}, {}),  # the user's choice wins
        ("1", 8, {}, {}),
    ],
)
def test_omp_num_threads_splits_the_cores_between_cpu_processes(
    nproc, cpu_count, environ, expected
):
    launch = plan(["--nproc-per-node", nproc, "train.py"], environ=environ, cpu_count=cpu_count)
    assert launch.env_overrides == expected


def test_omp_num_threads_is_left_to_torchrun_with_cuda():
    assert plan(["--nproc-per-node", "2", "train.py"], cuda_devices=2).env_overrides == {}


def test_multi_node_options_pass_through_in_order_without_standalone():
    launcher = [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29500",
        "--rdzv_id=job42",
        "--max-restarts",
        "3",
        "-r3",
    ]
    script = ["train.py", "--lr", "-1", "--nnodes", "5"]
    launch = plan(["--nproc-per-node", "8", *launcher, *script], cuda_devices=8)
    assert launch.argv == [*TORCHRUN, "--nproc-per-node", "8", *launcher, "--", *script]


@pytest.mark.parametrize(
    "launcher",
    [
        ["--master-addr", "10.0.0.1", "--master-port", "29600"],
        ["--master_port=29600"],
        ["--standalone"],  # given by the user: not added twice
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"],
    ],
)
def test_rendezvous_options_replace_standalone(launcher):
    launch = plan([*launcher, "train.py"])
    assert launch.argv.count("--standalone") == launcher.count("--standalone")
    assert launch.argv[len(TORCHRUN) + 2 :] == [*launcher, "--", "train.py"]


def test_torchrun_environment_variables_count_as_options():
    environ = {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "node0:29500", "PET_RDZV_BACKEND": "c10d"}
    launch = plan(["train.py"], environ=environ)
    assert "--standalone" not in launch.argv


def test_nproc_spellings():
    for launcher in (["--nproc_per_node", "3"], ["--nproc-per-node=3"], ["--nproc_per_node=3"]):
        launch = plan([*launcher, "train.py"])
        assert launch.argv == [*TORCHRUN, "--standalone", "--nproc-per-node", "3", "--", "train.py"]


def test_a_script_argument_abbreviating_torchrun_options_stays_the_scripts():
    """Issue 42: `--log` abbreviates torchrun's --log-dir and --logs-specs, and torchrun's
    parser stopped on it; the script's arguments now follow a `--`."""
    from torch.distributed.run import parse_args

    launch = plan(["train.py", "--log", "run.txt"])
    parsed = parse_args(launch.torchrun_argv)
    assert (parsed.training_script, parsed.training_script_args) == (
        "train.py",
        ["--log", "run.txt"],
    )


def test_arguments_after_the_script_belong_to_the_script():
    launch = plan(["train.py", "--dry-run", "--help", "--nproc-per-node", "9"])
    assert not launch.dry_run
    assert launch.argv[-5:] == ["train.py", "--dry-run", "--help", "--nproc-per-node", "9"]
    assert launch.argv[launch.argv.index("--nproc-per-node") + 1] == "1"


def test_double_dash_ends_the_launcher_options():
    launch = plan(["--nproc-per-node", "2", "--", "train.py", "--x"])
    assert launch.argv[len(TORCHRUN) :] == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--",
        "train.py",
        "--x",
    ]


def test_module_mode_passes_through():
    launch = plan(["-m", "my_package.train", "--epochs", "1"])
    assert launch.argv[len(TORCHRUN) :] == [
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "--",
        "my_package.train",
        "--epochs",
        "1",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus", "train.py"], "unknown launcher option '--bogus'"),
        (["--nproc-per-node", "2"], "missing SCRIPT"),
        (["--", "-weird.py"], "starts with '-'; write ./-weird.py"),
        (["--nproc-per-node", "0", "train.py"], "positive integer, got '0'"),
        (["--nproc-per-node", "auto", "train.py"], "positive integer, got 'auto'"),
        (["--nproc-per-node"], "--nproc-per-node needs a value"),
        (["--nnodes", "2", "train.py"], "--nnodes 2 needs a rendezvous"),
        (["--nnodes", "1:4", "train.py"], "--nnodes 1:4 needs a rendezvous"),
    ],
)
def test_bad_command_lines_name_the_problem(argv, message):
    with pytest.raises(LaunchError, match=message):
        plan(argv)


def test_an_invalid_torchrun_option_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan(["--max-restarts", "many", "train.py"])
    assert exit_info.value.code == 2
    assert "--max-restarts" in capsys.readouterr().err


def test_dry_run_prints_the_command_with_its_environment(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launch, "_available_cpus", lambda: 4)
    monkeypatch.setattr(launch, "_cuda_device_count", lambda: 0)
    status = cli.main(["run", "--dry-run", "--nproc-per-node", "2", "train.py", "--name", "a b"])
    assert status == 0
    assert capsys.readouterr().out == (
        f"OMP_NUM_THREADS=2 {sys.executable} -m torch.distributed.run --standalone "
        "--nproc-per-node 2 -- train.py --name 'a b'\n"
    )


def test_deepspeed_compat_starts_each_rank_through_the_alias():
    launch = plan(["--deepspeed-compat", "--nproc-per-node", "2", "train.py", "--lr", "1"])
    assert launch.argv[len(TORCHRUN) + 3 :] == [
        "-m",
        "--",
        "zerotrain.compat",
        "train.py",
        "--lr",
        "1",
    ]
    shadow = plan(["--deepspeed-compat=shadow", "train.py"])
    assert shadow.argv[len(TORCHRUN) + 3 :] == [
        "-m",
        "--",
        "zerotrain.compat",
        "--shadow-deepspeed",
        "train.py",
    ]
    assert "zerotrain.compat" not in plan(["train.py"]).argv
    with pytest.raises(LaunchError, match="takes no value or =shadow, got 'yes'"):
        plan(["--deepspeed-compat=yes", "train.py"])


def test_require_resume_reaches_the_engine_through_its_environment_variable():
    from zerotrain.checkpoint.load import REQUIRE_RESUME_ENV  # what the engine reads

    required = plan(["--require-resume", "--nproc-per-node", "1", "train.py", "--resume"])
    assert required.env_overrides == {REQUIRE_RESUME_ENV: "1"}
    assert required.argv[-4:] == ["1", "--", "train.py", "--resume"]  # not passed to torchrun
    assert REQUIRE_RESUME_ENV not in plan(["train.py"]).env_overrides


def test_main_reports_launch_errors_with_status_2(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_cuda_device_count", lambda: 0)
    assert cli.main(["run", "--dry-run", "--bogus", "train.py"]) == 2
    assert "unknown launcher option '--bogus'" in capsys.readouterr().err


def test_run_help(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_cuda_device_count", lambda: 0)
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: zerotrain run")
    assert "--nproc-per-node N" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"zerotrain {zerotrain.__version__}\n"


@pytest.mark.parametrize("option", ["--version", "--help"])
def test_version_and_help_import_no_torch(option):
    # see [Note: `zerotrain --version` imports nothing heavy] in zerotrain/cli/__init__.py
    code = (
        "import sys\n"
        "from zerotrain.cli import main\n"
        "try:\n"
        f"    main([{option!r}])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic')))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo))
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2


def test_run_launches_the_script_on_every_rank_and_passes_failure_on(tmp_path):
    """The one test here that launches: torchrun, 2 processes of a script that only reports."""
    script = tmp_path / "report.py"
    script.write_text(
        "import os, sys, pathlib\n"
        # one file per rank: two ranks printing to one pipe interleave their lines
        "pathlib.Path(__file__).with_name('rank' + os.environ['RANK']).write_text("
        "f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} threads "
        "{os.environ['OMP_NUM_THREADS']} args {sys.argv[1:]}\")\n"
        "if '--config-error' in sys.argv:\n"
        "    import time, zerotrain\n"
        # both ranks raise together: one that is still importing when the other has
        # failed is stopped by torchrun, and the report then names only the first
        "    here = pathlib.Path(__file__).with_name('imported' + os.environ['RANK'])\n"
        "    here.touch()\n"
        "    other = here.with_name('imported' + str(1 - int(os.environ['RANK'])))\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not other.exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.001)\n"
        "    raise zerotrain.ConfigError('zero_optimization.stage: must be between 0 and 3')\n"
        "sys.exit(3 if '--fail' in sys.argv and os.environ['RANK'] == '1' else 0)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="5")

    def run(*script_args, torchrun=()):
        command = [sys.executable, "-m", "zerotrain.cli", "run", "--nproc-per-node", "2"]
        return subprocess.run(
            [*command, *torchrun, str(script), *script_args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = run("--x", "1")
    assert ok.returncode == 0, ok.stderr
    for rank in (0, 1):
        report = (tmp_path / f"rank{rank}").read_text()
        assert report == f"rank {rank} of 2 threads 5 args ['--x', '1']"
    failed = run("--fail")
    assert failed.returncode == 3
    # the cause first, then the rank torchrun stopped; no torchrun traceback or table
    head = f"zerotrain run: {script} failed\n  rank 1: exit code 3 (the rank's own output above "
    assert failed.stderr.endswith(
        f"{head}says why)\n"
        "  rank 0: killed by SIGTERM (torchrun stops the other ranks once one has failed)\n"
    ) or failed.stderr.endswith(f"{head}says why)\n"), failed.stderr  # rank 0 may end first
    assert "ChildFailedError" not in failed.stderr
    # zerotrain's own error: said once for both ranks, without a traceback
    # torchrun looks at its ranks every 2 s, not 0.1: the second rank to raise has written its
    # error before the first one's end makes torchrun stop it
    config = run("--config-error", torchrun=("--monitor-interval", "2"))
    assert config.returncode == 1
    assert config.stderr.endswith(
        f"zerotrain run: {script} failed\n"
        "  ranks 0-1: ConfigError: zero_optimization.stage: must be between 0 and 3\n"
    ), config.stderr
    assert "Traceback" not in config.stderr and config.stderr.count("ConfigError") == 1


def test_a_missing_script_or_a_bad_config_is_refused_before_launching(tmp_path):
    with pytest.raises(LaunchError, match=r"SCRIPT trian.py does not exist \(looked in .*\); "):
        plan(["--nproc-per-node", "2", "trian.py"])
    with pytest.raises(LaunchError, match="did you mean train.py"):
        plan(["trian.py"])
    with pytest.raises(LaunchError, match="is a directory"):
        plan([str(tmp_path)])
    plan(["-m", "not_a_file.train"])  # a module: python finds it, not us
    (tmp_path / "ds.json").write_text('{"train_batch_size": 8, "zero_optimisation": {}}')
    for args in (["--deepspeed_config", "ds.json"], ["--deepspeed_config=ds.json"]):
        with pytest.raises(LaunchError) as error:
            plan(["train.py", *args])
        assert str(error.value) == (
            "zerotrain run: --deepspeed_config ds.json:\n"
            "zero_optimisation: unknown key; did you mean 'zero_optimization'?"
        )
    (tmp_path / "ok.yaml").write_text("train_batch_size: auto\nzero_optimization: {stage: 3}\n")
    plan(["train.py", "--deepspeed", "--deepspeed_config", "ok.yaml"])  # HF's autos are fine
    with pytest.raises(LaunchError, match="config file does not exist"):
        plan(["train.py", "--deepspeed", "missing.json"])  # HuggingFace's --deepspeed FILE


@pytest.mark.parametrize(
    ("option", "hint"),
    [
        ("--num_gpus", "use --nproc-per-node N"),
        ("--num-gpus", "use --nproc-per-node N"),
        ("--num_nodes", "use --nnodes N"),
        ("--hostfile", "start `zerotrain run --nnodes N"),
    ],
)
def test_deepspeed_launcher_options_name_torchruns(option, hint):
    with pytest.raises(LaunchError, match=f"{option} is the deepspeed launcher's: {hint}"):
        plan([option, "2", "train.py"])


def test_the_rendezvous_endpoint_is_planned_for_the_check():
    c10d = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint"]
    assert plan([*c10d, "node0:29511", "train.py"]).endpoint == ("node0", 29511)
    assert plan([*c10d, "node0", "train.py"]).endpoint == ("node0", 29400)
    static = ["--master-addr", "10.0.0.1", "--master-port", "29600", "train.py"]
    assert plan(static).endpoint == ("10.0.0.1", 29600)
    assert plan(["train.py"]).endpoint is None  # standalone: torchrun picks a free port


def test_an_endpoint_held_by_another_program_is_refused_in_bounded_time(monkeypatch):
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from zerotrain.cli import torchrun

    monkeypatch.setattr(torchrun, "PROBE_TIMEOUT_S", 3.0)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert torchrun.check_endpoint("127.0.0.1", port) is None  # nothing there: ours to take
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    assert torchrun.check_endpoint("127.0.0.1", store.port) is None  # a store answers
    with socket.socket() as silent:  # accepts connections, never answers (an HTTP server)
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        message = torchrun.check_endpoint("127.0.0.1", silent.getsockname()[1])
    assert message is not None and "does not answer as a c10d store (no answer in 3 s)" in message


def test_a_stopped_launch_stops_its_ranks_and_says_so(tmp_path):
    import signal
    import time

    script = tmp_path / "sleepy.py"
    script.write_text(
        "import os, pathlib, time\n"
        "pathlib.Path(__file__).with_name(f\"pid{os.environ['RANK']}\").write_text(str(os.getpid()))\n"
        "time.sleep(300)\n"
    )
    repo = Path(__file__).resolve().parents[1]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "zerotrain.cli", "run", "--nproc-per-node", "2", str(script)],
        env=dict(os.environ, PYTHONPATH=str(repo)),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = [tmp_path / "pid0", tmp_path / "pid1"]
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text() for p in pids):
            assert time.monotonic() < deadline and launcher.poll() is None, "ranks never started"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)  # a scheduler's stop: SLURM's scancel
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert err.endswith("zerotrain run: stopped by SIGTERM; the ranks were stopped\n"), err
    assert "Traceback" not in err
    for pid in pids:
        assert not Path(f"/proc/{pid.read_text()}").exists()  # no rank outlived the launcher


def test_config_check_reports_every_problem_or_what_the_config_asks_for(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8, "zero_optimisation": {}, "gradient_clip": 1}')
    assert cli.main(["config", "check", str(bad)]) == 1
    assert capsys.readouterr().err == (
        f"{bad}: 2 problem(s)\n"
        "zero_optimisation: unknown key; did you mean 'zero_optimization'?\n"
        "gradient_clip: unknown key; did you mean 'gradient_clipping'?\n"
    )
    good = tmp_path / "ds.yaml"
    good.write_text(
        "train_batch_size: 16\ntrain_micro_batch_size_per_gpu: 4\nbf16: {enabled: true}\n"
        "zero_optimization: {stage: 3, offload_optimizer: {device: cpu}}\n"
    )
    assert cli.main(["config", "check", str(good), "--world-size", "2"]) == 0
    assert capsys.readouterr().out == (
        f"{good}: valid\n"
        "  ZeRO stage 3, bf16, optimizer none (the script's), offload: optimizer cpu, "
        "parameters none\n"
        "  batch: train_batch_size 16 = micro-batch 4 x accumulation 2 x 2 data-parallel "
        "rank(s)\n"
    )
    assert cli.main(["config", "check", str(good), "--world-size", "3"]) == 1
    assert "is not divisible by" in capsys.readouterr().err
    hf = tmp_path / "hf.json"  # HuggingFace's template: its Trainer fills the autos
    hf.write_text('{"train_batch_size": "auto", "zero_optimization": {"stage": 2}}')
    assert cli.main(["config", "check", str(hf), "--world-size", "2"]) == 0
    assert '"auto" values are left for HuggingFace' in capsys.readouterr().out
    # python -m zerotrain.config FILE is the same check
    run = subprocess.run(
        [sys.executable, "-m", "zerotrain.config", str(bad)], capture_output=True, text=True
    )
    assert run.returncode == 1 and "did you mean 'zero_optimization'" in run.stderr
