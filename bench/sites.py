"""Training across two emulated sites joined by a slow link: time to a held-out loss and bytes
across the link per token, sites (DiLoCo's outer steps every H steps) against synchronous
ZeRO with `comm_compression.auto`, in one run.

    sudo python bench/sites.py [--rate 10mbit] [--delay 20ms] [--steps 200]
                               [--micro-batch 8] [--ranks-per-site 2] [--eval-every 10]
                               [--slow-site CORES] [--sites 3 [--near-rate 100mbit]
                               [--near-delay 5ms]] [--rows ...]

Two network namespaces (tests/netns.py: TUN devices and the delay line of tests/delay_line.py
with `--delay`, rate-limited with `tc`), `--ranks-per-site` ranks in each (`zerotrain run`,
torchrun's rendezvous over the link; a site is a node), train the tiny GPT of examples/gpt on
the embedded corpus, fp32, ZeRO stage 1, AdamW (lr 1e-3 after 10 warm-up steps, clipping at
1.0), the same batches in every row, for the same steps (the same tokens). Per row:
- the wall time of the steps (evaluations outside it; the ranks meet at each evaluation,
  not at every step) and the bytes that left the first site's end of the link (`tx_bytes`,
  TCP/IP included) and the TCP payload its processes sent the other site (`ss`'s
  bytes_sent), per token trained, over the whole run (the evaluations' scalar all-reduces
  included, an exchange still travelling at the end completed);
- the loss on 16 held-out windows every `--eval-every` steps, the mean over the ranks (with
  sites, over the sites' models), and at the end;
- the time to reach the synchronous row's held-out loss at 80% of its steps.
The rows: `sync auto` (every step's gradients over the link, `comm_compression.auto` choosing
int8 where it pays), `sites H=10/50/100` (outer steps every H steps, Nesterov SGD lr 0.7,
momentum 0.9), `sites H=50/10 average` (no outer optimizer: the sites' parameters averaged),
`sites H=50 int8` and `sites H=50 average int8` (the outer exchange quantized), `sites H=50
average auto [streamed]` (none or int8 as `sites.compression.method: auto` chooses from the
link it measures at the first outer step; the results file keeps its decision), and `sites
H=50 [average] [int8] streamed` (the outer exchange in 5 fragments, each landing 2 inner steps
after it left, mixing 0.5: `sites.streaming`; `fragments` and `overlapped`: its two halves
apart, 5 fragments landing at once, and the whole model landing 2 steps later), `... split`
(the same with `sites.work_split` measured). `--sites 3`: three namespaces, the first two
joined by `--near-rate` and `--near-delay`, the third `--rate` and `--delay` from each; the
row `sites H=50 average auto flat` makes one exchange over every site (`sites.clusters`
none) against `sites H=50 average auto`, whose clusters are measured at the start; the
table's lines give each row's payload per token from each site to each other.
`--slow-site CORES` holds the second site's
processes to that much CPU time (a cgroup's quota: the weaker machine), and the table shows
each site's micro-batch at the end. The batches are the engine's dataloader's: the same
global order in every row. Needs root and iproute2.
Writes bench/results/sites_<rate>_<delay>[_slow<CORES>][_3sites].json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))

OUTER = {"type": "SGD", "params": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}
# Streaming DiLoCo: a fifth of the model every 10 steps, landing 2 steps later
STREAMING = {"fragments": 5, "overlap_steps": 2, "mixing": 0.5}
ROWS = {
    "sync auto": {"comm_compression": {"auto": True}},
    "sites H=10": {"sites": {"inner_steps": 10, "outer_optimizer": OUTER}},
    "sites H=50": {"sites": {"inner_steps": 50, "outer_optimizer": OUTER}},
    "sites H=100": {"sites": {"inner_steps": 100, "outer_optimizer": OUTER}},
    "sites H=50 average": {"sites": {"inner_steps": 50, "outer_optimizer": None}},
    "sites H=10 average": {"sites": {"inner_steps": 10, "outer_optimizer": None}},
    "sites H=50 int8": {
        "sites": {"inner_steps": 50, "outer_optimizer": OUTER, "compression": {"method": "int8"}}
    },
    "sites H=50 average int8": {
        "sites": {"inner_steps": 50, "outer_optimizer": None, "compression": {"method": "int8"}}
    },
    "sites H=50 streamed": {
        "sites": {"inner_steps": 50, "outer_optimizer": OUTER, "streaming": STREAMING}
    },
    "sites H=50 average streamed": {
        "sites": {"inner_steps": 50, "outer_optimizer": None, "streaming": STREAMING}
    },
    "sites H=50 average int8 streamed": {
        "sites": {
            "inner_steps": 50,
            "outer_optimizer": None,
            "compression": {"method": "int8"},
            "streaming": STREAMING,
        }
    },
    # streaming's two halves apart: fragments exchanged at once, and the whole overlapped
    "sites H=50 average fragments": {
        "sites": {
            "inner_steps": 50,
            "outer_optimizer": None,
            "streaming": {"fragments": 5, "overlap_steps": 0},
        }
    },
    "sites H=50 average overlapped": {
        "sites": {
            "inner_steps": 50,
            "outer_optimizer": None,
            "streaming": {"fragments": 1, "overlap_steps": 2},
        }
    },
    # the per-link codec: none or int8, chosen from the link measured at the first outer step
    "sites H=50 average auto": {
        "sites": {"inner_steps": 50, "outer_optimizer": None, "compression": {"method": "auto"}}
    },
    # three sites (--sites 3): one exchange over every site, against clusters (auto's default)
    "sites H=50 average auto flat": {
        "sites": {
            "inner_steps": 50,
            "outer_optimizer": None,
            "compression": {"method": "auto"},
            "clusters": "none",
        }
    },
    "sites H=50 average auto streamed": {
        "sites": {
            "inner_steps": 50,
            "outer_optimizer": None,
            "compression": {"method": "auto"},
            "streaming": STREAMING,
        }
    },
    "sites H=50 average int8 streamed split": {
        "sites": {
            "inner_steps": 50,
            "outer_optimizer": None,
            "compression": {"method": "int8"},
            "streaming": STREAMING,
            "work_split": "measured",
        }
    },
}
BASELINE = "sync auto"
HELD_OUT_WINDOWS = 16


# -- one rank of one row (inside a namespace) ----------------------------------------------------
def worker(spec: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    from gpt.data import train_val_datasets
    from gpt.model import GPT, gpt_config

    import zerotrain

    torch.manual_seed(0)
    config = gpt_config("tiny")
    train_set, val_set = train_val_datasets(config.block_size)
    engine, _, loader, _ = zerotrain.initialize(
        model=GPT(config), config=_config(spec), training_data=train_set
    )
    world = engine.world_size
    outer = engine.optimizer.groups[0].extensions.get("outer_step")  # sites' rows
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    micro = spec["micro_batch"]
    batches = iter(loader)  # the same global order in every row, the shares as it says
    spread = torch.linspace(0, len(val_set) - 1, HELD_OUT_WINDOWS).long().tolist()
    held_x, held_y = (torch.stack(t) for t in zip(*(val_set[i] for i in spread), strict=True))

    def mean(value: float) -> float:
        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        return tensor.item() / world

    @torch.no_grad()
    def held_out() -> float:
        engine.eval()
        loss = engine(held_x, held_y).item()
        engine.train()
        return mean(loss)

    # The clock runs from a start every rank shares to the end of each evaluation window,
    # when every rank has stepped (one exchange across the link per window, not per step: a
    # step of its own would add the link's round trips to every step of a site that needs
    # none); the evaluations are left out of it. The bytes are the whole run's, the
    # evaluations' scalar all-reduces included (a few hundred bytes): an overlapped outer
    # exchange travels on through an evaluation, and leaving out what crossed the link
    # meanwhile gave 4.4 (TCP payload) and 13.9 (the interface's counter) bytes/token for
    # exchanges that are 8.6 unoverlapped (bench/README.md).
    evaluations, elapsed = [], 0.0
    mean(0.0)  # every site is here: what initialize sent across (a broadcast) has arrived
    sent, resent = _tx_bytes(interface), _retransmitted()
    packets = _tx_bytes(interface, "packets")
    probes = -_probes_sent(
        engine, outer
    )  # the link probes' bytes, in the steps (auto's, once a job)
    links = {link: -nbytes for link, nbytes in tcp_payload_by_link().items()}
    start = time.perf_counter()
    for step in range(spec["steps"]):
        x, y = next(batches)
        engine.backward(engine(x, y))
        engine.step()
        last = step + 1 == spec["steps"]
        if (step + 1) % spec["eval_every"] == 0 or last:
            mean(0.0)  # every rank has stepped
            elapsed += time.perf_counter() - start
            evaluations.append([step, held_out(), elapsed])
            start = time.perf_counter()
    if outer is not None:  # an exchange launched at the last step, still travelling, arrives
        outer.settle()
    mean(0.0)  # every rank's has
    for link, nbytes in tcp_payload_by_link().items():
        links[link] = links.get(link, 0) + nbytes
    sent = _tx_bytes(interface) - sent
    resent = _retransmitted() - resent  # the first site's namespace
    packets = _tx_bytes(interface, "packets") - packets
    probes += _probes_sent(engine, outer)
    # each site's links, as its first rank's namespace counted them, by site
    site_of_rank = engine.global_rank // int(os.environ["LOCAL_WORLD_SIZE"])
    counted = links if int(os.environ["LOCAL_RANK"]) == 0 else None
    every = [None] * world
    dist.all_gather_object(every, (site_of_rank, counted))
    micros = torch.zeros(world, dtype=torch.long)  # each rank's last micro-batch (the split)
    micros[engine.global_rank] = engine.train_micro_batch_size_per_gpu()
    dist.all_reduce(micros)
    dist.barrier()  # then leave together: gloo aborts a process whose peer closed first
    if engine.global_rank == 0:
        tokens = spec["steps"] * world * micro * config.block_size
        result = {"seconds": elapsed, "held_out": evaluations, "tx_bytes": sent}
        result["tokens"] = tokens
        result["micro_batches"] = micros.tolist()
        result["retransmitted_segments"] = resent
        result["tx_packets"] = packets
        result["tcp_payload"] = sum(links.values())  # the first site's, to every other
        result["payload_by_sites"] = _by_sites(every)
        if outer is not None:  # this rank's exchanges and their bytes by the communicator's count
            result["exchanges"] = {"launched": outer.launched, "sent": outer.sent}
            result["probes_sent"] = probes
            result["decision"] = outer.decision  # sites.compression auto's choice, and why
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _probes_sent(engine, outer) -> int:
    """Bytes this rank's link probes sent so far (the engine's account, and the clusters'
    leaders' where ``outer``, the sites' outer step, exchanges in clusters)."""
    from zerotrain.comm.link import PROBE

    accounts = [engine.comm.stats]
    if outer is not None and outer.tiers is not None and outer.tiers.leaders is not None:
        accounts.append(outer.tiers.leaders.stats)
    return sum(account[PROBE].sent for account in accounts if PROBE in account)


def _config(spec: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
        },
        "gradient_clipping": 1.0,
        "steps_per_print": None,
        "zero_optimization": {"stage": 1},
        **ROWS[spec["row"]],
    }


def _retransmitted() -> int:
    """TCP segments this namespace has sent again (/proc/net/snmp's RetransSegs)."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()]
    names, values = (line for line in lines if line[0] == "Tcp:")
    return int(values[names.index("RetransSegs")])


def tcp_payload_sent() -> int:
    """Bytes this namespace's processes have sent to the other sites over TCP (the kernel's
    count per connection, ``ss``'s bytes_sent; the connections inside the site, from this
    namespace's address to itself, left out): the payload, without the headers and whatever
    the device's counter catches late."""
    return sum(tcp_payload_by_link().values())


def tcp_payload_by_link() -> dict[tuple[str, str], int]:
    """:func:`tcp_payload_sent` by (this namespace's address, the peer's)."""
    lines = subprocess.run(["ss", "-tinH"], capture_output=True, text=True).stdout.splitlines()
    total: dict[tuple[str, str], int] = {}
    link = None
    for line in lines:
        if not line.startswith((" ", "\t")):  # a connection: state, queues, local, peer
            fields = line.split()
            ends = tuple(field.rsplit(":", 1)[0] for field in fields[3:5])
            link = ends if len(ends) == 2 and ends[0] != ends[1] else None
        elif link is not None:
            sent = re.search(r"bytes_sent:(\d+)", line)
            total[link] = total.get(link, 0) + (int(sent.group(1)) if sent else 0)
    return total


def _by_sites(every: list) -> dict[str, int]:
    """The bytes each site sent each other site (``"0->2"``), from each rank's (site, its
    namespace's bytes by address pair, or None on a site's other ranks)."""
    counted = [(site, links) for site, links in every if links is not None]
    site_at = {here: site for site, links in counted for here, _ in links}
    out: dict[str, int] = {}
    for site, links in counted:
        for (_, peer), nbytes in links.items():
            key = f"{site}->{site_at.get(peer, peer)}"
            out[key] = out.get(key, 0) + nbytes
    return dict(sorted(out.items()))


def _tx_bytes(interface: str, what: str = "bytes") -> int:
    """What left this namespace's end of the link: bytes, or (``what="packets"``) packets."""
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_{what}").read_text())


# -- the driver (root) ---------------------------------------------------------------------------
def run_row(nodes, row: str, args, port: int) -> dict | str:
    from netns import run_job

    spec = {"row": row, "steps": args.steps, "eval_every": args.eval_every}
    spec["micro_batch"] = args.micro_batch
    script = ["bench/sites.py", "--worker", json.dumps(spec), "--out", "{out}"]
    return run_job(nodes, script, ranks_per_node=args.ranks_per_site, port=port, name=row)


def summarize(results: dict) -> list[str]:
    """A table row per run: time, held-out loss, bytes per token, and against the baseline."""
    base = results.get(BASELINE)
    target = None
    if isinstance(base, dict) and base["held_out"]:
        at = int(0.8 * len(base["held_out"])) - 1
        target = base["held_out"][max(0, at)][1]
    lines = [
        f"target held-out loss: {target:.4f} ({BASELINE} at 80% of its steps)"
        if target is not None
        else "no target: the baseline did not run",
        "| row | time s | final held-out loss | vs sync | bytes/token | payload/token | "
        "sync's bytes over | time to target s | sync's time over | micro-batch per site |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, got in results.items():
        if not isinstance(got, dict):
            lines.append(f"| {row} | {got} |")
            continue
        seconds, final = got["seconds"], got["held_out"][-1][1]
        per_token = got["tx_bytes"] / got["tokens"]
        reached = _time_to(got, target)
        cells = [row, f"{seconds:.1f}", f"{final:.4f}"]
        if isinstance(base, dict):
            base_final = base["held_out"][-1][1]
            base_reached = _time_to(base, target)
            cells.append(f"{final / base_final - 1:+.1%}")
            payload = got.get("tcp_payload", 0) / got["tokens"]
            fewer = base["tx_bytes"] / max(1, got["tx_bytes"])
            cells += [f"{per_token:.1f}", f"{payload:.1f}", f"{fewer:.0f}x"]
            cells.append("-" if reached is None else f"{reached:.1f}")
            speedup = None if reached is None or base_reached is None else base_reached / reached
            cells.append("-" if speedup is None else f"{speedup:.1f}x")
        micros = got.get("micro_batches", [])
        # the first rank of each of the two sites
        cells.append(":".join(str(m) for m in micros[:: max(1, len(micros) // 2)]))
        lines.append("| " + " | ".join(cells) + " |")
    # the bytes between each pair of sites (with three: which links carried them)
    for row, got in results.items():
        if isinstance(got, dict) and len(got.get("payload_by_sites", {})) > 2:
            pairs = got["payload_by_sites"].items()
            per_token = ", ".join(f"{pair} {n / got['tokens']:.2f}" for pair, n in pairs)
            probes = got.get("probes_sent", 0) / got["tokens"]
            lines.append(
                f"{row}: payload per token, site to site: {per_token} (of it the first site's "
                f"link probes, once a job: {probes:.2f})"
            )
    # what sites.compression auto chose, where a row's results say
    lines += [
        f"{row}: {got['decision']}"
        for row, got in results.items()
        if isinstance(got, dict) and got.get("decision")
    ]
    return lines


def _time_to(got: dict, target: float | None) -> float | None:
    """The steps' time until the first held-out loss at or below ``target``."""
    if target is None:
        return None
    return next((at for _, loss, at in got["held_out"] if loss <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="10mbit", help="the link's rate each way (tc)")
    parser.add_argument("--delay", default="20ms", help="added to each packet each way")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro-batch", type=int, default=8, help="windows per rank and step")
    parser.add_argument("--ranks-per-site", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--slow-site",
        type=float,
        metavar="CORES",
        help="hold the second site's processes to this many cores of CPU time (a cgroup)",
    )
    parser.add_argument(
        "--sites",
        type=int,
        choices=(2, 3),
        default=2,
        help="3: the first two sites joined by --near-rate and --near-delay, the third "
        "--rate and --delay away from each (run with --ranks-per-site 1 on a small machine)",
    )
    parser.add_argument("--near-rate", default="100mbit", help="--sites 3: the near link's rate")
    parser.add_argument("--near-delay", default="5ms", help="--sites 3: the near link's delay")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.out)
        return
    from netns import run_rows

    rows = list(dict.fromkeys([BASELINE, *args.rows]))  # the target's row first

    def row(nodes, name: str, port: int) -> dict | str:
        return run_row(nodes, name, args, port)

    links = None
    if args.sites == 3:
        far = (args.rate, args.delay or None)
        links = {(0, 1): (args.near_rate, args.near_delay or None), (0, 2): far, (1, 2): far}
    results = run_rows(
        "bench/sites.py", args.rate, args.delay, rows, row, 29800, args.slow_site, links
    )
    lines = summarize(results)
    print("\n" + "\n".join(lines))
    slug = re.sub(r"\W+", "", args.rate) + "_" + re.sub(r"[^\w.]+", "", args.delay or "0ms")
    if args.slow_site is not None:
        slug += f"_slow{args.slow_site:g}"
    if args.sites == 3:
        slug += "_3sites"
    out = ROOT / "bench" / "results" / f"sites_{slug}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "table": lines, "raw": results}, indent=1))
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
