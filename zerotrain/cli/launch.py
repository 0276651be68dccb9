"""``zerotrain run [launcher options] SCRIPT [SCRIPT ARGS]``: start SCRIPT once per local device
through torchrun (``python -m torch.distributed.run``). We do not write our own launcher or
rendezvous, we only pick defaults that suit ZeRO training, check what can be checked before any
rank starts (the script, the config file among its arguments, the rendezvous endpoint), and then
run torchrun in this process (zerotrain/cli/torchrun.py).

# [Note: how `zerotrain run` splits its arguments]
argparse cannot tell a torchrun option's value from the script path (in ``--nnodes 2 train.py``
it would take ``2`` as the script), so the ``run`` arguments are split by hand: every token before
the first positional that is not an option's value is a launcher option, the first positional is
the script, and everything after it belongs to the script. Which options take a value is read
from torchrun's own parser, so options that torchrun adds later pass through as well. The
launcher options we do not own are then validated by torchrun's parser and forwarded unchanged,
followed by ``--`` and the script: torchrun's parser would otherwise read a script argument that
abbreviates several of its options (``--log``) as its own, and stop.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zerotrain.cli.arguments import ParserSpec
from zerotrain.cli.torchrun import check_endpoint, run_torchrun
from zerotrain.errors import ZeroTrainError

__all__ = ["PARSER", "LaunchError", "LaunchPlan", "add_arguments", "plan_launch", "run_planned"]

# Options that belong to `zerotrain run` itself; all other launcher options go to torchrun.
_DRY_RUN = "--dry-run"
_HELP = ("-h", "--help")
_NPROC = ("--nproc-per-node", "--nproc_per_node")
_COMPAT = "--deepspeed-compat"  # ... or --deepspeed-compat=shadow
_REQUIRE_RESUME = "--require-resume"
# read by engine.load_checkpoint (zerotrain/checkpoint/load.py, REQUIRE_RESUME_ENV); not
# imported from there: `zerotrain run` starts without importing torch
REQUIRE_RESUME_ENV = "ZEROTRAIN_REQUIRE_RESUME"

# Launcher options (torchrun `dest` names) that choose how the nodes meet. With none of them and
# a single node, `--standalone` is added: torchrun then runs its own c10d store on a free local
# port, so two runs on one machine do not collide on the default master port 29500.
_RENDEZVOUS_DESTS = frozenset(
    {
        "standalone",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_conf",
        "master_addr",
        "master_port",
        "node_rank",
        "local_addr",
    }
)

# the deepspeed launcher's options, which a DeepSpeed user types first -> what to use here
_DEEPSPEED_OPTIONS = {
    "--num_gpus": "use --nproc-per-node N (processes on this node)",
    "--num_nodes": "use --nnodes N, with --rdzv-backend c10d --rdzv-endpoint HOST:PORT",
    "--num_accelerators": "use --nproc-per-node N (processes on this node)",
    "--hostfile": "start `zerotrain run --nnodes N --rdzv-endpoint HOST:PORT ...` on each node "
    "(torchrun meets the nodes at the endpoint; there is no hostfile)",
    "--include": "set CUDA_VISIBLE_DEVICES to the devices to use",
    "--exclude": "set CUDA_VISIBLE_DEVICES to the devices to use",
    "--launcher": "zerotrain run starts the ranks of one node with torchrun; under SLURM or MPI "
    "run it once per node",
}

# script arguments that name a DeepSpeed config file (DeepSpeed's, zerotrain's, HuggingFace's)
_CONFIG_ARGUMENTS = (
    "--deepspeed_config",
    "--deepspeed-config",
    "--zerotrain_config",
    "--deepspeed",
)
_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")

_RUN_USAGE = (
    "zerotrain run [--nproc-per-node N] [--deepspeed-compat[=shadow]] [--require-resume] "
    "[--dry-run] [TORCHRUN OPTIONS] SCRIPT [SCRIPT ARGS]"
)
_RUN_DESCRIPTION = """\
Launch SCRIPT once per local device with torchrun (python -m torch.distributed.run).

options:
  --nproc-per-node N  processes on this node (default: the number of CUDA devices, or 1
                      without CUDA)
  --deepspeed-compat  in every process, `import deepspeed` is zerotrain before SCRIPT starts
                      (zerotrain.compat.deepspeed.activate: for frameworks that import
                      deepspeed by name, such as the HuggingFace Trainer and Accelerate);
                      =shadow: even where a real DeepSpeed is installed
  --require-resume    engine.load_checkpoint raises instead of starting from scratch when it
                      finds no checkpoint (a mistyped path, an empty folder, only incomplete
                      saves): for jobs that must resume. Sets ZEROTRAIN_REQUIRE_RESUME=1, as
                      the config key checkpoint.require_resume does
  --dry-run           print the torchrun command line instead of running it
  -h, --help          show this help and exit

Every other option before SCRIPT is passed to torchrun unchanged, e.g. the multi-node flags
--nnodes, --node-rank, --rdzv-backend, --rdzv-endpoint, --rdzv-id, --master-addr, --master-port,
--max-restarts (see `python -m torch.distributed.run --help`).

Defaults added for you:
  --standalone        on a single node without rendezvous options: torchrun picks a free port
  OMP_NUM_THREADS     with several processes and no CUDA, set to (CPU cores // processes)
                      unless already set, so the processes share the cores without
                      oversubscribing them

Checked before any rank starts:
  SCRIPT              exists (else: did you mean ...?)
  config              a --deepspeed_config / --deepspeed FILE among the script's arguments
                      is read and checked: one error, not one per rank
  rendezvous          a --rdzv-endpoint (or --master-addr/--master-port) held by a program
                      that does not answer as a c10d store is refused within 15 s

When ranks fail, one line per distinct cause names the ranks (a zerotrain error's message,
a signal, or the exit code of a rank whose own output shows its traceback).

examples:
  zerotrain run --nproc-per-node 2 examples/train_gpt.py --steps 200
  zerotrain run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint node0:29500 --rdzv-id job42 train.py
"""


class LaunchError(ZeroTrainError, ValueError):
    """A `zerotrain run` command line that cannot be turned into a torchrun command."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """The torchrun invocation that `zerotrain run` executes."""

    argv: list[str]
    """The full command: ``[python, -m, torch.distributed.run, ...launcher options, script, ...]``."""
    env_overrides: dict[str, str] = field(default_factory=dict)
    """Environment variables set on top of the caller's environment."""
    dry_run: bool = False
    """Print the command instead of running it."""
    endpoint: tuple[str, int] | None = None
    """The rendezvous store's host and port, checked before launching (None: torchrun picks a
    free local port, ``--standalone``)."""

    @property
    def torchrun_argv(self) -> list[str]:
        """torchrun's own arguments: ``argv`` after ``python -m torch.distributed.run``."""
        return self.argv[3:]

    def shell_line(self) -> str:
        """The command as one shell line, environment overrides first."""
        env = [f"{name}={shlex.quote(value)}" for name, value in self.env_overrides.items()]
        return " ".join([*env, shlex.join(self.argv)])


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "zerotrain run"
    parser.usage = _RUN_USAGE  # its own usage lists every torchrun option: 20 lines
    return parser


def _option_arity(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Maps every option string of `parser` to whether it takes a value."""
    # argparse has no public accessor for its actions; `_actions` has been stable since 3.2.
    return {
        option: action.nargs != 0 for action in parser._actions for option in action.option_strings
    }


def _split_run_argv(
    run_argv: Sequence[str], takes_value: Mapping[str, bool]
) -> tuple[list[str], str | None, list[str]]:
    """Splits ``run`` arguments into (launcher options, script, script args).

    See [Note: how `zerotrain run` splits its arguments]. The script is None when absent.
    """
    tokens = list(run_argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            if i + 1 == len(tokens):
                return tokens[:i], None, []
            return tokens[:i], tokens[i + 1], tokens[i + 2 :]
        if not token.startswith("-") or token == "-":
            return tokens[:i], token, tokens[i + 1 :]
        name = token.split("=", 1)[0]
        if name in takes_value:
            attached = "=" in token
        elif not token.startswith("--") and token[:2] in takes_value:
            name, attached = token[:2], True  # short option with its value attached: -r3
        else:
            hint = _DEEPSPEED_OPTIONS.get("--" + name.lstrip("-").replace("-", "_"))
            raise LaunchError(
                f"zerotrain run: unknown launcher option {token!r} before the script; "
                + (
                    f"{name} is the deepspeed launcher's: {hint}"
                    if hint
                    else "see `zerotrain run --help` and `python -m torch.distributed.run --help`"
                )
            )
        if takes_value[name] and not attached:
            if i + 1 == len(tokens):
                raise LaunchError(f"zerotrain run: option {name} needs a value")
            i += 2
        else:
            i += 1
    return tokens, None, []


@dataclass
class _OwnOptions:
    nproc: str | None = None
    dry_run: bool = False
    show_help: bool = False
    compat: str | None = None  # --deepspeed-compat: "on" or "shadow"
    require_resume: bool = False


def _take_own_options(launcher_argv: list[str]) -> tuple[list[str], _OwnOptions]:
    """Removes our own options; returns (rest, what they said)."""
    rest: list[str] = []
    own = _OwnOptions()
    i = 0
    while i < len(launcher_argv):
        token = launcher_argv[i]
        name, _, attached = token.partition("=")
        if token == _DRY_RUN:
            own.dry_run = True
        elif token == _REQUIRE_RESUME:
            own.require_resume = True
        elif token in _HELP:
            own.show_help = True
        elif name == _COMPAT:
            if attached not in ("", "shadow"):
                raise LaunchError(
                    f"zerotrain run: {_COMPAT} takes no value or =shadow, got {attached!r}"
                )
            own.compat = attached or "on"
        elif name in _NPROC:
            if "=" in token:
                own.nproc = attached
            else:
                own.nproc = launcher_argv[i + 1]  # present: _split_run_argv checked it
                i += 1
        else:
            rest.append(token)
        i += 1
    return rest, own


def _parse_nproc(value: str | None, cuda_devices: int) -> int:
    if value is None:
        return max(1, cuda_devices)
    try:
        nproc = int(value)
    except ValueError:
        nproc = 0
    if nproc < 1:
        raise LaunchError(
            f"zerotrain run: --nproc-per-node must be a positive integer, got {value!r} "
            "(leave it out for one process per CUDA device, or 1 without CUDA)"
        )
    return nproc


def _is_single_node(nnodes: str) -> bool:
    # torchrun accepts "N" or an elastic range "MIN:MAX".
    return all(part.strip() == "1" for part in str(nnodes).split(":"))


def plan_launch(
    run_argv: Sequence[str],
    *,
    environ: Mapping[str, str],
    cpu_count: int,
    cuda_devices: int,
    python: str = sys.executable,
    local_rank_argument: bool = False,
) -> LaunchPlan | None:
    """Builds the torchrun command for ``zerotrain run RUN_ARGV``.

    Launches nothing, so it can be tested. `environ` is the environment the launch inherits
    (torchrun's parser reads its PET_* defaults from `os.environ` itself); `cuda_devices` is the
    number of local CUDA devices; `local_rank_argument`: each rank's script gets
    ``--local_rank=N`` before its arguments, as DeepSpeed's launcher passes it (needs
    --deepspeed-compat: the compat runner adds it). Returns None when help was requested, after
    printing it. Raises `LaunchError` on a bad command line.
    """
    torchrun = _torchrun_parser()
    takes_value = _option_arity(torchrun)
    takes_value.update(dict.fromkeys([_DRY_RUN, *_HELP, _COMPAT, _REQUIRE_RESUME], False))
    launcher_argv, script, script_args = _split_run_argv(run_argv, takes_value)
    forwarded, own = _take_own_options(launcher_argv)
    if own.show_help:
        print(f"usage: {_RUN_USAGE}\n\n{_RUN_DESCRIPTION}", end="")
        return None
    if script is None:
        raise LaunchError(f"zerotrain run: missing SCRIPT\nusage: {_RUN_USAGE}")
    if script.startswith("-"):  # python itself would read it as an option
        raise LaunchError(f"zerotrain run: SCRIPT {script!r} starts with '-'; write ./{script}")
    nproc = _parse_nproc(own.nproc, cuda_devices)

    # torchrun's parser validates the forwarded options and fills in what comes from its
    # PET_* environment variables; exits with a usage message on an invalid option value.
    parsed = torchrun.parse_args([*forwarded, script])
    if not (parsed.module or parsed.no_python):  # a path: every rank would fail to open it
        _check_script(script)
    _check_config_argument(script_args)
    given = {
        action.dest
        for action in torchrun._actions
        for token in forwarded
        if token.split("=", 1)[0] in action.option_strings
    }
    given |= {dest for dest in _RENDEZVOUS_DESTS if f"PET_{dest.upper()}" in environ}
    has_rendezvous = bool(given & _RENDEZVOUS_DESTS)
    single_node = _is_single_node(parsed.nnodes)
    if not single_node and not has_rendezvous:
        raise LaunchError(
            f"zerotrain run: --nnodes {parsed.nnodes} needs a rendezvous so that the nodes find "
            "each other: pass --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB_ID "
            "(or --master-addr, --master-port and --node-rank)"
        )

    env_overrides: dict[str, str] = {}
    if nproc > 1 and "OMP_NUM_THREADS" not in environ and cuda_devices == 0:
        # Without CUDA the processes do their math on CPU threads. torchrun would set 1 thread
        # per process (right for GPU jobs, where the CPU only feeds the device), which leaves
        # cores idle when there are fewer processes than cores; the default of every process
        # taking all cores oversubscribes them. Split the cores evenly instead.
        env_overrides["OMP_NUM_THREADS"] = str(max(1, cpu_count // nproc))
    if own.require_resume:
        env_overrides[REQUIRE_RESUME_ENV] = "1"

    argv = [python, "-m", "torch.distributed.run"]
    if single_node and not has_rendezvous:
        argv.append("--standalone")
    argv += ["--nproc-per-node", str(nproc), *forwarded]
    if own.compat and parsed.no_python:
        raise LaunchError(
            f"zerotrain run: {_COMPAT} runs SCRIPT in Python; --no-python runs a program"
        )
    if not own.compat and local_rank_argument:
        raise LaunchError(f"zerotrain run: --local_rank=N is passed only with {_COMPAT}")
    argv += ["-m"] * bool(own.compat)  # each rank runs the module zerotrain.compat
    # the end of torchrun's options: a script argument that abbreviates several of them
    # (--log: --log-dir or --logs-specs) would otherwise stop torchrun's parser
    argv.append("--")
    if own.compat:  # each rank: python -m zerotrain.compat SCRIPT (activates, then runs it)
        argv += ["zerotrain.compat", *(["--shadow-deepspeed"] * (own.compat == "shadow"))]
        argv += ["--local-rank-arg"] * local_rank_argument
        argv += ["-m"] * bool(parsed.module)  # SCRIPT is a module: the runner imports it
    argv += [script, *script_args]
    endpoint = None
    if has_rendezvous:
        endpoint = _endpoint(parsed)
    return LaunchPlan(
        argv=argv, env_overrides=env_overrides, dry_run=own.dry_run, endpoint=endpoint
    )


def _endpoint(parsed: argparse.Namespace) -> tuple[str, int] | None:
    """Where the nodes' rendezvous store listens: the c10d endpoint (torchrun's default port
    29400), or the static backend's master address and port."""
    if parsed.rdzv_backend == "c10d" and parsed.rdzv_endpoint:
        host, _, port = parsed.rdzv_endpoint.rpartition(":")
        if not host:  # "HOST" alone
            return parsed.rdzv_endpoint, 29400
        return host.strip("[]"), int(port) if port.isdigit() else 29400
    if parsed.rdzv_backend == "static" and parsed.master_port is not None:
        return parsed.master_addr, int(parsed.master_port)
    return None


def _check_script(script: str) -> None:
    path = Path(script)
    if path.is_file():
        return
    if path.is_dir():
        raise LaunchError(f"zerotrain run: SCRIPT {script} is a directory; name a Python file")
    near = difflib.get_close_matches(
        path.name, [p.name for p in path.parent.glob("*.py")] if path.parent.is_dir() else [], n=1
    )
    hint = f"; did you mean {path.parent / near[0]}?" if near else ""
    raise LaunchError(
        f"zerotrain run: SCRIPT {script} does not exist (looked in {Path.cwd()}){hint}"
    )


def _check_config_argument(script_args: Sequence[str]) -> None:
    """The config file the script is given (``--deepspeed_config FILE`` and its spellings),
    checked before any rank starts: a typo is then one message, not one per rank (the batch
    keys wait for the engine, which knows the data-parallel world size)."""
    for index, token in enumerate(script_args):
        name, equals, value = token.partition("=")
        if name not in _CONFIG_ARGUMENTS:
            continue
        if not equals:
            value = script_args[index + 1] if index + 1 < len(script_args) else ""
        if not value.lower().endswith(_CONFIG_SUFFIXES):
            continue  # DeepSpeed's --deepspeed is a flag; HuggingFace's takes the file
        from zerotrain.config import ConfigError, check_config, read_config_file

        try:
            check_config(read_config_file(Path(value)), unfilled=True)
        except ConfigError as error:
            raise LaunchError(f"zerotrain run: {name} {value}:\n{error}") from None


def _available_cpus() -> int:
    from zerotrain.accelerator import usable_cpus  # affinity and cgroup quota

    return usable_cpus()


def _cuda_device_count() -> int:
    import torch  # already imported by torchrun's parser: no cost here

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_planned(make_plan: Callable[..., LaunchPlan | None]) -> int:
    """Plan with ``make_plan(environ=, cpu_count=, cuda_devices=)`` for this machine, then run
    the plan (or print it, with --dry-run); returns the exit status. A LaunchError is one line
    on stderr and status 2."""
    try:
        plan = make_plan(
            environ=os.environ, cpu_count=_available_cpus(), cuda_devices=_cuda_device_count()
        )
    except LaunchError as error:
        print(error, file=sys.stderr)
        return 2
    if plan is None:
        return 0
    if plan.dry_run:
        print(plan.shell_line())
        return 0
    if plan.endpoint is not None:
        taken = check_endpoint(*plan.endpoint)
        if taken:
            print(taken, file=sys.stderr)
            return 2
    # see [Note: torchrun in the launcher's own process] (torchrun.py)
    return run_torchrun(plan.torchrun_argv, plan.env_overrides)


def _run_command(args: argparse.Namespace, rest: list[str]) -> int:
    return run_planned(functools.partial(plan_launch, rest))


PARSER: ParserSpec = {
    "help": "launch a training script on every local device with torchrun",
    "add_help": False,
    "usage": _RUN_USAGE,
}
"""``add_parser`` arguments of the ``run`` command."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``run``: no arguments to argparse, so ``parse_known_args`` hands back every token
    after ``run``, in order, as unrecognized; :func:`plan_launch` splits them (see the module
    note) and prints its own help."""
    parser.set_defaults(handler=_run_command, takes_raw_arguments=True)
