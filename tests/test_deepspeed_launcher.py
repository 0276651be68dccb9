"""DeepSpeed's launcher command line (``zerotrain deepspeed``, ``deepspeed.launcher.runner``) as
the torchrun command it becomes; nothing is launched here except the compat runner's own
argument handling, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zerotrain import cli
from zerotrain.cli import LaunchError
from zerotrain.launcher import constants, runner

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RANK_RUNNER = ["-m", "--", "zerotrain.compat", "--local-rank-arg"]


@pytest.fixture(autouse=True)
def scripts_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")


def plan(argv, *, cuda_devices=4, environ=None, cpu_count=8):
    # no /job/hostfile unless a test names one: the default must not depend on this machine
    argv = argv if any(a.startswith(("-H", "--hostfile")) for a in argv) else ["-H", "none", *argv]
    return runner.plan_deepspeed_launch(
        argv, environ=environ or {}, cpu_count=cpu_count, cuda_devices=cuda_devices
    )


def hostfile(tmp_path, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_one_node_runs_every_device_through_the_compat_runner_with_local_rank():
    launch = plan(["train.py", "--steps", "3"])
    assert launch.argv == [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "4",
        *RANK_RUNNER,  # each rank activates the alias, then runs SCRIPT with --local_rank=N
        "train.py",
        "--steps",
        "3",
    ]
    assert launch.env_overrides == {}  # every device: CUDA_VISIBLE_DEVICES untouched


@pytest.mark.parametrize(
    ("flags", "environ", "nproc", "visible"),
    [
        (["--num_gpus", "2"], {}, "2", "0,1"),
        (["--num_accelerators", "3"], {}, "3", "0,1,2"),
        (["--include", "localhost:1,3"], {}, "2", "1,3"),
        (["-i", "localhost:0@localhost:2"], {}, "2", "0,2"),
        (["--exclude", "localhost:0"], {}, "3", "1,2,3"),
        # slot numbers count the devices this process sees
        (["--include", "localhost:1"], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "1", "5"),
    ],
)
def test_device_choices_become_nproc_and_cuda_visible_devices(flags, environ, nproc, visible):
    launch = plan([*flags, "train.py"], environ=environ)
    assert launch.argv[launch.argv.index("--nproc-per-node") + 1] == nproc
    assert launch.env_overrides["CUDA_VISIBLE_DEVICES"] == visible


def test_without_cuda_num_gpus_is_the_number_of_cpu_processes():
    launch = plan(["--num_gpus", "2", "train.py"], cuda_devices=0)
    assert launch.argv[launch.argv.index("--nproc-per-node") + 1] == "2"
    assert launch.env_overrides == {"OMP_NUM_THREADS": "4"}  # zerotrain run's core split


def test_master_port_is_a_static_rendezvous_on_this_node():
    launch = plan(["--master_port", "29611", "train.py"])
    assert "--standalone" not in launch.argv
    i = launch.argv.index("--master-addr")
    assert launch.argv[i : i + 4] == ["--master-addr", "127.0.0.1", "--master-port", "29611"]
    assert launch.endpoint == ("127.0.0.1", 29611)  # checked before the ranks start


def test_module_no_local_rank_and_rank_logs():
    launch = plan(["--module", "--no_local_rank", "--enable_each_rank_log", "logs", "pkg.train"])
    tail = launch.torchrun_argv[launch.torchrun_argv.index("--log-dir") :]
    expected = ["--log-dir", "logs", "--redirects", "3", "--module", *RANK_RUNNER[:3]]
    assert tail == [*expected, "-m", "pkg.train"]  # the runner imports the module
    program = plan(["--no_python", "--no_local_rank", "/bin/echo", "hi"])
    assert program.argv[-4:] == ["--no-python", "--", "/bin/echo", "hi"]  # no alias in a program


def test_a_one_host_hostfile_runs_here_with_its_slots(tmp_path):
    hosts = hostfile(tmp_path, "# the pool\nworker-0 slots=2\n\n")
    launch = plan(["--hostfile", hosts, "train.py"])
    assert launch.argv[launch.argv.index("--nproc-per-node") + 1] == "2"
    assert launch.env_overrides == {}


def test_no_ssh_runs_this_nodes_share_of_a_hostfile(tmp_path):
    hosts = hostfile(tmp_path, "node-a slots=4\nnode-b slots=2\n")
    launch = plan(
        ["-H", hosts, "--no_ssh", "--node_rank", "1", "--master_addr", "node-a", "train.py"]
    )
    args = launch.torchrun_argv
    assert args[: args.index("-m")] == [
        "--nproc-per-node",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "node-a",
        "--master-port",
        str(runner.TORCH_DISTRIBUTED_DEFAULT_PORT),
    ]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--autotuning", "tune", "train.py"],
            "--autotuning is not supported: zerotrain's planner",
        ),
        (["--elastic_training", "train.py"], "zerotrain run --nnodes MIN:MAX"),
        (["--bind_cores_to_rank", "train.py"], "numactl or taskset"),
        (["--save_pid", "train.py"], "--save_pid is not supported"),
        (["--force_multi", "train.py"], "docs/launching.md"),
        (["--num_nodes", "2", "train.py"], "--num_nodes 2 needs a hostfile"),
        (["--num_gpus", "8", "train.py"], "this machine has 4 CUDA device(s)"),
        (["--num_gpus", "2", "--include", "localhost:0", "train.py"], "cannot go with"),
        (["--include", "localhost:0", "--exclude", "localhost:1", "train.py"], "mutually"),
        (["--include", "localhost:7", "train.py"], "host localhost has no slot 7"),
        (["--include", "other", "train.py"], "host 'other' is not in the hostfile"),
        (["--exclude", "localhost", "train.py"], "no slot is left"),
        (["--no_python", "/bin/echo"], "add --no_local_rank"),
        (["--module", "--no_python", "x"], "cannot be used together"),
        (["missing.py"], "SCRIPT missing.py does not exist"),  # zerotrain run's own checks
    ],
)
def test_what_cannot_be_honoured_is_one_line_naming_the_flag(argv, says):
    with pytest.raises(LaunchError) as raised:
        plan(argv)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_multi_node_hostfile_says_to_run_zerotrain_run_on_each_node(tmp_path):
    hosts = hostfile(tmp_path, "node-a slots=8\nnode-b slots=8\n")
    with pytest.raises(LaunchError) as raised:
        plan(["--hostfile", hosts, "--launcher", "openmpi", "train.py"])
    message = str(raised.value)
    assert "2 nodes (node-a, node-b) would be started over --launcher openmpi" in message
    assert "zerotrain run --nnodes N --node-rank I" in message
    with pytest.raises(LaunchError, match="needs --master_addr"):
        plan(["--hostfile", hosts, "--no_ssh", "--node_rank", "0", "train.py"])
    with pytest.raises(LaunchError, match=r"needs --node_rank in \[0, 2\)"):
        plan(["--hostfile", hosts, "--no_ssh", "--master_addr", "node-a", "train.py"])
    bad = hostfile(tmp_path, "node-a 8\n")
    with pytest.raises(LaunchError, match="is not `HOST slots=N`"):
        plan(["--hostfile", bad, "train.py"])


def test_without_cuda_include_is_refused_and_the_command_reaches_the_cli(capsys):
    with pytest.raises(LaunchError, match="this machine has none; use --num_gpus N"):
        plan(["--include", "localhost:0", "train.py"], cuda_devices=0)
    # `zerotrain deepspeed` is the same command line; --dry-run prints what it would run
    assert cli.main(["deepspeed", "-H", "none", "--num_gpus", "2", "--dry-run", "train.py"]) == 0
    printed = capsys.readouterr().out
    assert "torch.distributed.run --standalone --nproc-per-node 2" in printed
    assert "-m -- zerotrain.compat --local-rank-arg train.py" in printed
    assert cli.main(["deepspeed", "-H", "none", "--autotuning", "run", "train.py"]) == 2
    assert "--autotuning is not supported" in capsys.readouterr().err


def test_resource_filters_as_deepspeed_reads_them():
    pool = {"a": 4, "b": 2}
    assert runner.parse_inclusion_exclusion(pool, "a:1,3@b", "") == {"a": [1, 3], "b": [0, 1]}
    assert runner.parse_inclusion_exclusion(pool, "", "a@b:0") == {"b": [1]}
    assert list(runner.parse_inclusion_exclusion(pool, "b@a:0", "")) == ["a", "b"]  # file order
    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    assert constants.PDSH_LAUNCHER == runner.parse_args(["x.py"]).launcher == "pdsh"


def test_compat_runner_passes_local_rank_and_runs_modules(tmp_path):
    (tmp_path / "show.py").write_text(
        "import sys, deepspeed; print(sys.argv[1:], deepspeed.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-m", *RANK_RUNNER[2:], "-m", "show", "--x", "1"],  # as a rank runs it
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "LOCAL_RANK": "3"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "['--local_rank=3', '--x', '1'] zerotrain"
