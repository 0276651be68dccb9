"""Two "nodes" on one machine: two network namespaces joined by a veth pair, the link
rate-limited with `tc`, one `zerotrain run` (torchrun's agent) in each; or several joined
pair by pair (:func:`joined_namespaces`), each link its own rate and delay. Used by
tests/test_multinode.py, tests/test_sites.py, bench/moe_slow_link.py, bench/compression.py
and bench/sites.py; needs root and iproute2.

Each namespace has only its loopback and its end of the veth, so ranks of different nodes can
reach each other only across that link. The namespaces and the link exist only inside
:func:`two_namespaces`: leaving it deletes them, which removes the veth pair too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.213.{}.{}"  # inside our own namespaces only


def available() -> bool:
    """Whether namespaces can be made here (root, ip and tc)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


class Node:
    """One namespace: its name, the address of its end of the veth, and that interface."""

    def __init__(self, name: str, address: str, interface: str):
        self.name, self.address, self.interface = name, address, interface
        self.cgroup: Path | None = None  # a cpu cgroup its processes start in (cpu_quota)

    def advertised(self, host: bool) -> list[str]:
        """torchrun options for an elastic (c10d) rendezvous from this namespace."""
        return ["--local-addr", self.address, "--rdzv-conf", f"is_host={int(host)}"]

    def kill_everything(self) -> None:
        """SIGKILL every process in the namespace (torchrun's workers have sessions of their
        own, so a process group is not enough)."""
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def run(self, *args: str, **popen) -> subprocess.Popen:
        """``zerotrain run ARGS`` inside the namespace, in its own process group."""
        return self.python("-m", "zerotrain.cli", "run", *args, **popen)

    def python(self, *args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """``python ARGS`` inside the namespace, in its own process group (which
        tests/launched.py's ``output_or_kill`` kills), its gloo on the link, its output piped;
        ``env``: variables besides this process's."""
        env = {
            **os.environ,
            **(env or {}),
            "GLOO_SOCKET_IFNAME": self.interface,  # the link to the other node
            "PYTHONUNBUFFERED": "1",
        }
        command = ["ip", "netns", "exec", self.name, sys.executable, *args]
        if self.cgroup is not None:  # the shell joins the cgroup, then becomes the command
            join = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
            command = ["sh", "-c", join, str(self.cgroup), *command]
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            **popen,
        )


CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, as this machine has


@contextlib.contextmanager
def cpu_quota(node: Node, cores: float) -> Iterator[None]:
    """Every process ``node`` starts meanwhile shares ``cores`` of CPU time (a cpu cgroup's
    CFS quota): a weaker machine at that site."""
    if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
        raise RuntimeError(
            f"a CPU quota needs cgroup v1's cpu controller at {CPU_CGROUPS}, which this machine "
            "lacks (cgroup v2 names it cpu.max)"
        )
    group = CPU_CGROUPS / f"{node.name}-quota"
    group.mkdir()
    try:
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
        node.cgroup = group
        yield
    finally:
        node.cgroup = None
        node.kill_everything()  # a cgroup with processes in it cannot be removed
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def seconds(duration: str) -> float:
    """tc's notation for a time ("0.5ms", "100us", "1s") in seconds."""
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * scale
    raise ValueError(f"delay {duration!r}: give a number and us, ms or s (e.g. 0.5ms)")


def _delay_line(interfaces: list[str], delay: str) -> subprocess.Popen:
    """tests/delay_line.py joining two new TUN devices named ``interfaces``, each packet held
    ``delay``: this kernel's tc has no netem (sch_netem) to delay a veth."""
    script = str(Path(__file__).with_name("delay_line.py"))
    line = subprocess.Popen(
        [sys.executable, script, *interfaces, str(seconds(delay))],
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = line.stdout.readline() if line.stdout is not None else ""
    if ready.strip() != "ready":
        line.kill()
        raise RuntimeError(f"the delay line did not start (exit status {line.wait()})")
    return line


@contextlib.contextmanager
def two_namespaces(rate: str = "200mbit", delay: str | None = None) -> Iterator[list[Node]]:
    """Two namespaces joined by a link limited to ``rate`` each way (tc's notation): a veth
    pair, or with ``delay`` (e.g. "0.5ms") two TUN devices whose packets a delay line
    (tests/delay_line.py) holds that long each way."""
    tag = os.getpid() % 10_000  # concurrent runs get their own names
    names = [f"zt{tag}n{i}" for i in range(2)]
    interfaces = [f"zt{tag}{'v' if delay is None else 't'}{i}" for i in range(2)]
    subnet = tag % 250
    nodes = [
        Node(n, SUBNET.format(subnet, i + 1), v)
        for i, (n, v) in enumerate(zip(names, interfaces, strict=True))
    ]
    lines: list[subprocess.Popen] = []
    try:
        for name in names:
            _namespace(name)
        _link(interfaces, delay, lines)
        for node in nodes:
            _plug(node.name, node.interface, f"{node.address}/24", rate, delay)
        yield nodes
    finally:
        _remove(names, lines)


@contextlib.contextmanager
def joined_namespaces(links: dict[tuple[int, int], tuple[str, str | None]]) -> Iterator[list[Node]]:
    """Namespaces joined pair by pair: ``links[(i, j)]`` is the (rate, delay) of the link of
    nodes i and j, a veth pair or (with a delay) two TUN devices of a delay line, as in
    :func:`two_namespaces`. A node has one address, on each of its ends (a /32, with a route
    to each peer's over their link): what nodes i and j send each other crosses their link
    alone. Its ``interface`` (which gloo binds) is its first link's end."""
    count = 1 + max(max(pair) for pair in links)
    tag = os.getpid() % 10_000
    subnet = (tag + 7) % 250  # beside two_namespaces' subnet
    names = [f"zt{tag}m{i}" for i in range(count)]
    addresses = [SUBNET.format(subnet, 100 + i) for i in range(count)]
    ends: dict[tuple[int, int], str] = {}  # (node, peer): the node's end of their link
    lines: list[subprocess.Popen] = []
    try:
        for name in names:
            _namespace(name)
        for k, ((i, j), (rate, delay)) in enumerate(sorted(links.items())):
            pair = [f"zt{tag}p{k}{side}" for side in "ab"]
            ends[(i, j)], ends[(j, i)] = pair
            _link(pair, delay, lines)
            for me, peer in ((i, j), (j, i)):
                end, name = ends[(me, peer)], names[me]
                _plug(name, end, f"{addresses[me]}/32", rate, delay)
                route = [f"{addresses[peer]}/32", "dev", end, "src", addresses[me]]
                _ip("-n", name, "route", "add", *route)
        first_end = {me: end for (me, _), end in sorted(ends.items(), reverse=True)}
        yield [Node(names[i], addresses[i], first_end[i]) for i in range(count)]
    finally:
        _remove(names, lines)


def _namespace(name: str) -> None:
    _ip("netns", "add", name)
    _ip("-n", name, "link", "set", "lo", "up")


def _link(ends: list[str], delay: str | None, lines: list[subprocess.Popen]) -> None:
    """Two interfaces joined: a veth pair, or with ``delay`` a delay line's TUN devices
    (its process added to ``lines``)."""
    if delay is None:
        _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
    else:
        lines.append(_delay_line(ends, delay))


def _plug(namespace: str, end: str, address: str, rate: str, delay: str | None) -> None:
    """Interface ``end`` into ``namespace`` with ``address``, up, its sending limited to
    ``rate``."""
    _ip("link", "set", end, "netns", namespace)
    _ip("-n", namespace, "addr", "add", address, "dev", end)
    if delay is not None:  # 64 KB packets: few for the delay line to forward
        _ip("-n", namespace, "link", "set", end, "mtu", "64000")
    _ip("-n", namespace, "link", "set", end, "up")
    tc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", end, "root"]
    limit = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
    subprocess.run([*tc, *limit], check=True, capture_output=True)


def _remove(names: list[str], lines: list[subprocess.Popen]) -> None:
    """The namespaces, every process in them first (nothing outlives its namespace), and the
    delay lines (their TUN devices go with them)."""
    for name in names:
        Node(name, "", "").kill_everything()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for line in lines:
        line.kill()
        line.wait()


def run_job(nodes: list[Node], script: list[str], *, ranks_per_node: int, port: int, name: str):
    """``zerotrain run SCRIPT`` on every node, ``ranks_per_node`` ranks each, its rendezvous at
    the first node's ``port``; the JSON the job wrote to the file named after ``--out`` in
    ``script``'s place of ``{out}``, or a line saying why there is none (the outputs in a log
    under /tmp). For benches that run one job per row (bench/compression.py, bench/sites.py)."""
    import json

    from launched import output_or_kill

    out = Path(f"/tmp/zt-job-{os.getpid()}-{port}.json")
    out.unlink(missing_ok=True)
    per_node = str(ranks_per_node)
    rendezvous = ["--nnodes", str(len(nodes)), "--nproc-per-node", per_node]
    rendezvous += ["--master-addr", nodes[0].address]
    command = [part.replace("{out}", str(out)) for part in script]
    processes = [
        node.run(*rendezvous, "--master-port", str(port), "--node-rank", str(i), *command)
        for i, node in enumerate(nodes)
    ]
    outputs = [output_or_kill(p, 3600, name) for p in processes]
    if any(p.returncode for p in processes) or not out.exists():
        log = Path(f"/tmp/zt-job-{port}.log")
        log.write_text("\n\n".join(outputs))
        errors = [line for line in "\n".join(outputs).splitlines() if "Error" in line]
        return f"failed ({log}): {errors[-1] if errors else 'see the log'}"
    result = json.loads(out.read_text())
    out.unlink()
    return result


def run_rows(
    script: str,
    rate: str,
    delay: str | None,
    rows: list[str],
    run_row,
    port: int,
    second_node_cores: float | None = None,
    links: dict[tuple[int, int], tuple[str, str | None]] | None = None,
):
    """Each of ``rows`` as ``run_row(nodes, row, port)`` (a job: :func:`run_job`), in two
    namespaces joined by a link of ``rate`` and ``delay`` (the second node's processes held
    to ``second_node_cores`` of CPU time where given), one after the other, each row's time
    and outcome printed; the results by row; with ``links``, in the namespaces
    :func:`joined_namespaces` makes of them instead. Exits saying so where namespaces cannot
    be made here (``script`` names the caller)."""
    if not available():
        sys.exit(f"{script} needs root, ip and tc (network namespaces)")
    # one thread per rank: the ranks share this machine's cores, and torch's default of one
    # thread per core would put two ranks' threads on each (spikes of seconds, measured)
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict = {}
    with contextlib.ExitStack() as stack:
        joined = joined_namespaces(links) if links else two_namespaces(rate, delay or None)
        nodes = stack.enter_context(joined)
        if second_node_cores is not None:
            stack.enter_context(cpu_quota(nodes[1], second_node_cores))
        for index, row in enumerate(rows):
            started = time.perf_counter()
            results[row] = run_row(nodes, row, port + index)
            state = "ok" if isinstance(results[row], dict) else results[row]
            print(f"{row}: {time.perf_counter() - started:.0f} s, {state}", flush=True)
    return results
