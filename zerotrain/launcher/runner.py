"""``deepspeed.launcher.runner``, the module of DeepSpeed's ``deepspeed`` command: its command
line, run by ``zerotrain run`` (torchrun). ``zerotrain deepspeed ARGS`` and ``python -m
zerotrain.launcher.runner ARGS`` take what ``deepspeed ARGS`` takes; no console script is
named ``deepspeed`` (it would shadow a real DeepSpeed's).

[Note: what the deepspeed launcher's flags become]
DeepSpeed's runner reads a hostfile (``HOST slots=N`` lines; by default ``/job/hostfile``, or
this machine's devices when there is none), filters its slots with ``--include`` /
``--exclude`` / ``--num_nodes`` / ``--num_gpus``, and then either starts the ranks of this node
itself or fans out to the other nodes over pdsh, MPI or SLURM. Here the slots left on this node
become ``--nproc-per-node`` and, where some were chosen, ``CUDA_VISIBLE_DEVICES`` (slot numbers
count the devices this process sees); ``--master_port`` a static rendezvous on 127.0.0.1 (without
it, a free port: ``--standalone``); ``--no_ssh --node_rank R`` over a hostfile of N nodes
``--nnodes N --node-rank R --master-addr --master-port``, which is what DeepSpeed's nodes do then
too. Each rank runs the script through ``python -m zerotrain.compat`` (``import deepspeed`` is
zerotrain) with ``--local_rank=N`` before its arguments unless ``--no_local_rank``, as
DeepSpeed's per-node launcher passes it. What needs a node fan-out (ssh, pdsh, MPI, SLURM),
elastic node counts, core binding, the autotuner or a pid file is refused with one line naming
the flag and what to use instead (docs/launching.md has the table).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import sys
from collections.abc import Mapping, Sequence

from zerotrain.cli.launch import LaunchError, LaunchPlan, plan_launch, run_planned

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
    "plan_deepspeed_launch",
]

DLTS_HOSTFILE = "/job/hostfile"
"""The hostfile DeepSpeed's launcher reads when ``--hostfile`` is not given (read here too)."""

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
"""The file of ``NAME=VALUE`` lines DeepSpeed's multi-node launchers export to every node
(Accelerate appends to it before a multi-node ``deepspeed`` launch). zerotrain starts no other
node, so nothing reads it here: each node's ``zerotrain run`` inherits that node's environment."""

DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
"""Where DeepSpeed looks for :data:`DEEPSPEED_ENVIRONMENT_NAME`."""

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
"""The master port of a static rendezvous when ``--master_port`` is not given."""

_PROG = "zerotrain deepspeed"
_MULTI_NODE_FIX = (
    "zerotrain starts no node over ssh, pdsh, MPI or SLURM: run `zerotrain run --nnodes N "
    "--node-rank I --rdzv-backend c10d --rdzv-endpoint FIRST_HOST:29500 --rdzv-id JOB SCRIPT` "
    "on each node, or this command with --no_ssh --node_rank I --master_addr FIRST_HOST on "
    "each node (docs/launching.md)"
)
# dest -> (the flag, what to use instead); refused whenever it differs from its default
_REFUSED = {
    "autotuning": ("--autotuning", "zerotrain's planner prices the configs instead of running "
                   "your script once per experiment: `zerotrain plan --model MODULE:FACTORY "
                   "--config ds_config.json` reads its autotuning section (docs/plan.md)"),
    "elastic_training": ("--elastic_training", "use `zerotrain run --nnodes MIN:MAX "
                         "--rdzv-backend c10d --rdzv-endpoint HOST:PORT` (torchrun's elastic "
                         "rendezvous) on each node"),
    "min_elastic_nodes": ("--min_elastic_nodes", "use `zerotrain run --nnodes MIN:MAX ...`"),
    "max_elastic_nodes": ("--max_elastic_nodes", "use `zerotrain run --nnodes MIN:MAX ...`"),
    "bind_cores_to_rank": ("--bind_cores_to_rank", "zerotrain run gives each CPU rank an equal "
                           "share of the usable cores (OMP_NUM_THREADS); to pin them, start it "
                           "under numactl or taskset"),
    "bind_core_list": ("--bind_core_list", "start zerotrain run under numactl or taskset"),
    "save_pid": ("--save_pid", "the launcher runs in this process: its pid is the one your "
                 "shell started ($!)"),
    "force_multi": ("--force_multi", _MULTI_NODE_FIX),
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    """DeepSpeed's launcher options (same names, short forms and defaults, except
    ``--master_port``: see its help), and zerotrain's ``--shadow-deepspeed`` and ``--dry-run``."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="DeepSpeed's launcher command line, run by `zerotrain run` (torchrun) on "
        "this node; every rank runs SCRIPT with `import deepspeed` resolving to zerotrain.",
    )
    add = parser.add_argument
    add("-H", "--hostfile", default=DLTS_HOSTFILE, help="MPI-style hostfile (HOST slots=N)")
    add("-i", "--include", default="", help="NODE_SPEC[@NODE_SPEC...], NODE_SPEC=HOST[:SLOT,...]")
    add("-e", "--exclude", default="", help="as --include: the slots not to use")
    add("--num_nodes", type=int, default=-1, help="the first N hosts of the hostfile")
    add("--min_elastic_nodes", type=int, default=-1, help="refused: see zerotrain run --nnodes")
    add("--max_elastic_nodes", type=int, default=-1, help="refused: see zerotrain run --nnodes")
    add("--num_gpus", "--num_accelerators", type=int, default=-1,
        help="processes on each node, devices [0, N); N CPU processes without CUDA")  # fmt: skip
    add("--master_port", type=int, default=None,
        help="port of a static rendezvous on 127.0.0.1 (DeepSpeed's default 29500 across "
        "nodes); without it, one node meets on a free port (torchrun --standalone)")  # fmt: skip
    add("--master_addr", default="", help="address of the first node (with --no_ssh)")
    add("--node_rank", type=int, default=-1, help="this node's index (with --no_ssh)")
    add("--launcher", default="pdsh", help="the multi-node fan-out: refused, see the docs")
    add("--launcher_args", default="", help="arguments of the multi-node fan-out")
    add("--module", action="store_true", help="run SCRIPT as `python -m SCRIPT`")
    add("--no_python", action="store_true", help="run SCRIPT as a program, without python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to SCRIPT")
    add("--no_ssh", action="store_true", help="this node only; run the command on each node")
    add("--no_ssh_check", action="store_true", help="multi-node fan-out only")
    add("--force_multi", action="store_true", help="refused: a multi-node fan-out")
    add("--save_pid", action="store_true", help="refused")
    add("--enable_each_rank_log", default="None", help="DIR: each rank's output in a file there")
    add("--autotuning", default="", choices=["tune", "run"], help="refused")
    add("--comment", default="", help="multi-node (SLURM) fan-out only")
    add("--account", default="", help="multi-node (SLURM) fan-out only")
    add("--elastic_training", action="store_true", help="refused: see zerotrain run --nnodes")
    add("--bind_cores_to_rank", action="store_true", help="refused")
    add("--bind_core_list", default=None, help="refused")
    add("--ssh_port", type=int, default=2222, help="multi-node fan-out only")
    add("--shadow-deepspeed", action="store_true",
        help="(zerotrain) run on zerotrain although a real DeepSpeed is installed")  # fmt: skip
    add("--dry-run", action="store_true", help="(zerotrain) print the torchrun command only")
    add("user_script", help="the script (or module, or program) each rank runs")
    add("user_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's options, as DeepSpeed's ``parse_args`` reads them."""
    return _parser().parse_args(args=None if args is None else list(args))


def fetch_hostfile(hostfile_path: str) -> collections.OrderedDict[str, int] | None:
    """``HOST slots=N`` lines -> {host: slots}, in file order; None without the file."""
    if not os.path.isfile(hostfile_path):
        return None
    with open(hostfile_path) as lines:
        return _parse_hostfile(lines.readlines(), hostfile_path)


def _parse_hostfile(lines: Sequence[str], where: str) -> collections.OrderedDict[str, int]:
    pool: collections.OrderedDict[str, int] = collections.OrderedDict()
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if match is None:
            raise LaunchError(
                f"{_PROG}: {where}:{number}: {line!r} is not `HOST slots=N`; fix the hostfile"
            )
        if match.group(1) in pool:
            raise LaunchError(f"{_PROG}: {where}:{number}: host {match.group(1)} listed twice")
        pool[match.group(1)] = int(match.group(2))
    if not pool:
        raise LaunchError(f"{_PROG}: hostfile {where} lists no host (`HOST slots=N` lines)")
    return pool


def _node_specs(text: str) -> dict[str, list[int]]:
    """``HOST[:SLOT,...]@...`` -> {host: sorted slots} ([]: the whole host)."""
    specs: dict[str, set[int]] = collections.defaultdict(set)
    for spec in text.split("@"):
        host, _, slots = spec.partition(":")
        try:
            specs[host].update(int(slot) for slot in slots.split(",") if slots)
        except ValueError:
            raise LaunchError(
                f"{_PROG}: {spec!r}: slots are device numbers, HOST:0,2 (in {text!r})"
            ) from None
    return {host: sorted(slots) for host, slots in specs.items()}


def parse_resource_filter(
    host_info: Mapping[str, list[int]], include_str: str = "", exclude_str: str = ""
) -> collections.OrderedDict[str, list[int]]:
    """The slots of ``host_info`` ({host: slot ids}) that ``--include`` keeps or ``--exclude``
    leaves, hosts in their hostfile order and hosts left without slots dropped, as DeepSpeed
    filters them."""
    if include_str and exclude_str:
        raise LaunchError(f"{_PROG}: --include and --exclude are mutually exclusive")
    if not (include_str or exclude_str):
        return collections.OrderedDict((host, list(slots)) for host, slots in host_info.items())
    kept = {} if include_str else {host: list(slots) for host, slots in host_info.items()}
    for host, slots in _node_specs(include_str or exclude_str).items():
        if host not in host_info:
            raise LaunchError(f"{_PROG}: host {host!r} is not in the hostfile ({list(host_info)})")
        for slot in slots:
            if slot not in host_info[host]:
                raise LaunchError(f"{_PROG}: host {host} has no slot {slot} ({host_info[host]})")
        if include_str:
            kept[host] = slots or list(host_info[host])
        else:
            kept[host] = [slot for slot in kept[host] if slots and slot not in slots]
    return collections.OrderedDict((host, kept[host]) for host in host_info if kept.get(host))


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str, exclusion: str
) -> collections.OrderedDict[str, list[int]]:
    """{host: slot count} -> {host: slot ids} after ``--include`` / ``--exclude``."""
    all_slots = {host: list(range(count)) for host, count in resource_pool.items()}
    return parse_resource_filter(all_slots, inclusion, exclusion)


def plan_deepspeed_launch(
    argv: Sequence[str],
    *,
    environ: Mapping[str, str],
    cpu_count: int,
    cuda_devices: int,
    python: str = sys.executable,
) -> LaunchPlan | None:
    """``deepspeed ARGV`` as the `zerotrain run` plan that runs it on this node (see [Note:
    what the deepspeed launcher's flags become]). Launches nothing. Raises LaunchError naming
    the flag where it cannot be honoured; argparse exits on a malformed command line."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    for dest, (flag, instead) in _REFUSED.items():
        if getattr(args, dest) != parser.get_default(dest):
            raise LaunchError(f"{_PROG}: {flag} is not supported: {instead}")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise LaunchError(f"{_PROG}: --num_nodes/--num_gpus cannot go with --include/--exclude")
    if args.module and args.no_python:
        raise LaunchError(f"{_PROG}: --module and --no_python cannot be used together")
    if args.no_python and not args.no_local_rank:
        raise LaunchError(
            f"{_PROG}: --no_python: zerotrain cannot add --local_rank=N to a program that is "
            "not Python; add --no_local_rank (each rank reads LOCAL_RANK from its environment)"
        )
    nnodes, node_rank, slots = _this_node(args, cuda_devices)
    run_argv: list[str] = []
    env: dict[str, str] = {}
    if slots is not None:
        run_argv += ["--nproc-per-node", str(len(slots))]
        chosen = args.include or args.exclude or args.num_gpus > 0
        if cuda_devices and chosen:  # slot numbers count the devices this process sees
            visible = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
            named = [visible[s] if len(visible) > s and visible[s] else str(s) for s in slots]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(named)
    elif args.num_gpus > 0:  # no CUDA, no hostfile: N CPU processes
        run_argv += ["--nproc-per-node", str(args.num_gpus)]
    port = args.master_port
    if nnodes > 1:
        run_argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        run_argv += ["--master-addr", args.master_addr]
        run_argv += ["--master-port", str(port or TORCH_DISTRIBUTED_DEFAULT_PORT)]
    elif port is not None:  # DeepSpeed's one node meets on 127.0.0.1
        run_argv += ["--master-addr", args.master_addr or "127.0.0.1", "--master-port", str(port)]
    if args.enable_each_rank_log != "None":
        run_argv += ["--log-dir", args.enable_each_rank_log, "--redirects", "3"]
    if args.module:
        run_argv.append("--module")
    if args.no_python:
        run_argv.append("--no-python")  # a program: no alias to activate in it
    else:
        run_argv.append(
            "--deepspeed-compat=shadow" if args.shadow_deepspeed else "--deepspeed-compat"
        )
        _check_no_real_deepspeed(args.shadow_deepspeed)
    if args.dry_run:
        run_argv.append("--dry-run")
    plan = plan_launch(
        [*run_argv, "--", args.user_script, *args.user_args],
        environ=environ,
        cpu_count=cpu_count,
        cuda_devices=cuda_devices,
        python=python,
        local_rank_argument=not (args.no_local_rank or args.no_python),
    )
    if plan is None:
        return None
    return dataclasses.replace(plan, env_overrides={**plan.env_overrides, **env})


def _this_node(args: argparse.Namespace, cuda_devices: int) -> tuple[int, int, list[int] | None]:
    """(nodes, this node's rank, its slots; None: no hostfile and no CUDA device to count)."""
    pool = fetch_hostfile(args.hostfile)
    if pool is None:
        if args.num_nodes > 1:
            raise LaunchError(
                f"{_PROG}: --num_nodes {args.num_nodes} needs a hostfile listing the nodes "
                f"({args.hostfile} does not exist); {_MULTI_NODE_FIX}"
            )
        if not cuda_devices:
            if args.include or args.exclude:
                raise LaunchError(
                    f"{_PROG}: --include/--exclude choose CUDA devices and this machine has "
                    "none; use --num_gpus N for N CPU processes"
                )
            return 1, 0, None
        pool = collections.OrderedDict(localhost=cuda_devices)
    active = parse_inclusion_exclusion(pool, args.include, args.exclude)
    if args.num_nodes > 0:
        active = collections.OrderedDict(list(active.items())[: args.num_nodes])
    if args.num_gpus > 0:
        if cuda_devices and args.num_gpus > cuda_devices:
            raise LaunchError(
                f"{_PROG}: --num_gpus {args.num_gpus}: this machine has {cuda_devices} CUDA "
                "device(s)"
            )
        active = collections.OrderedDict((host, list(range(args.num_gpus))) for host in active)
    if not active:
        raise LaunchError(f"{_PROG}: no slot is left after --include/--exclude")
    hosts = list(active)
    if len(hosts) == 1:  # DeepSpeed too runs one remaining host's ranks here, without ssh
        return 1, 0, active[hosts[0]]
    if not args.no_ssh:
        raise LaunchError(
            f"{_PROG}: {len(hosts)} nodes ({', '.join(hosts)}) would be started over "
            f"--launcher {args.launcher}; {_MULTI_NODE_FIX}"
        )
    if not 0 <= args.node_rank < len(hosts):
        raise LaunchError(
            f"{_PROG}: --no_ssh over {len(hosts)} nodes needs --node_rank in [0, {len(hosts)}): "
            "this node's line in the hostfile, from 0"
        )
    if not args.master_addr:
        raise LaunchError(
            f"{_PROG}: --no_ssh over {len(hosts)} nodes needs --master_addr, the address of "
            f"the first node ({hosts[0]}) that every node can reach"
        )
    return len(hosts), args.node_rank, active[hosts[args.node_rank]]


def _check_no_real_deepspeed(shadow: bool) -> None:
    from zerotrain.compat.deepspeed import installed_deepspeed

    real = installed_deepspeed()
    if real is not None and not shadow:
        raise LaunchError(
            f"{_PROG}: DeepSpeed is installed here ({real}): its own `deepspeed` command runs "
            "it; add --shadow-deepspeed to run the script on zerotrain instead"
        )


def main(args: Sequence[str] | None = None) -> int:
    """``deepspeed ARGS`` on zerotrain; returns the exit status."""
    argv = sys.argv[1:] if args is None else list(args)
    return run_planned(functools.partial(plan_deepspeed_launch, argv))


if __name__ == "__main__":
    sys.exit(main())
