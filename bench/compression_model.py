"""An alpha-beta model of communication compression, fitted to bench/compression.py's runs and
extrapolated to a cluster. A model, not a measurement.

    python bench/compression_model.py [--ranks 64] [--gbits 25] [--alpha-us 20]
                                      [--params 1.5e9] [--compute 1.0]
                                      [--per-node 8] [--node-gbits 1600]

Fit: every row measured at two or more link rates (bench/results/compression_*.json) gives
step time = compute + wire bytes x 8 / (efficiency x rate): one compute time per row, one
efficiency of the link for all, from the runs without `--delay`. Alpha stays an input
(`--alpha-us`, per message hop): two ranks cannot tell hops apart from calls. A run with
`--delay` (the delay line of tests/delay_line.py) shows instead how many one-way delays each
collective adds to a step: (its step time - the same row's at `--delay 0ms`, on the same TUN
path) / (collectives per step x the delay), printed first.

Extrapolation: per rank and step, each method's collectives for `--params` trainable
parameters on `--ranks` ranks, bf16 where uncompressed (the bytes formulas below, which
tests/test_compression.py checks on the counted traffic at 4 ranks), each message hop costing
alpha and each byte 8 / (efficiency x gbits):
- ring all-reduce: 2(N-1) hops, 2(N-1)/N of the buffer; reduce-scatter and all-gather: N-1
  hops, (N-1)/N;
- top-k's all-gather of k values and indices: N-1 hops, (N-1) x 8k bytes (it grows with N);
- gTop-k: log2 N exchanges of 8k bytes, then a ring all-reduce of k values;
- quantized (int8, int4) and 1-bit reduce-scatters and all-gathers: as the ring ones, in
  their bytes per element (codes plus one fp32 scale per block of 256; 1 bit plus one scale
  per piece).
Low-rank factors are taken as 1% of the parameters (the demo GPT's PowerSGD rank 4 sends
0.9%, ACP-SGD half that). The per-step compute (`--compute` seconds) is an input too: it
depends on the accelerator, not on the network. The last line is the choice
`comm_compression.auto` would make among its default candidates on these predictions; auto
also times each codec's own compute, which this model leaves out.

Stage 3 (the second table), for a model too large to stay gathered: per step a forward
gather, a backward gather and a gradient reduce-scatter, each over the network. With hpZ
(`hierarchical_partition`) the backward gather runs inside a node of `--per-node` ranks, on
a link of `--node-gbits` (an input, like the compute), in bf16, as bench/compression.py's hpZ
rows measure it on two emulated nodes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from zerotrain.compression.auto import AutoOptions
from zerotrain.config.compression import AUTO_DEFAULT_METHOD

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from netns import seconds as tc_seconds  # noqa: E402  (tc's notation of the runs' --delay)

RESULTS = ROOT / "bench" / "results"


def _bits_per_second(rate: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)([kmg])bit", rate).groups()
    return float(number) * {"k": 1e3, "m": 1e6, "g": 1e9}[unit]


def results() -> list[dict]:
    """bench/compression.py's results, each run's file."""
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("compression_*.json"))]


def measured(runs: list[dict]) -> dict[float, dict]:
    """Of ``runs``, those without `--delay`, by link rate (bits/s)."""
    return {_bits_per_second(r["args"]["rate"]): r for r in runs if not r["args"].get("delay")}


def delays_per_collective(results: list[dict]) -> None:
    """For each of ``results`` with a delay, per row also measured at a delay of 0 on the same
    link rate: the one-way delays its collectives each added to a step (see the docstring)."""
    runs = {
        (_bits_per_second(r["args"]["rate"]), tc_seconds(r["args"]["delay"])): r
        for r in results
        if r["args"].get("delay")
    }
    for (rate, delay), data in sorted(runs.items()):
        base = runs.get((rate, 0.0))
        if delay == 0 or base is None:
            continue
        print(f"link {data['args']['rate']}, delay {data['args']['delay']} each way, against 0:")
        for name, row in data["rows"].items():
            calls = data["raw"][name].get("calls_steps")
            if not calls or name not in base["rows"]:
                continue
            per_step = sorted(calls)[len(calls) // 2]
            added = row["step_time"] - base["rows"][name]["step_time"]
            print(
                f"  {name}: {added * 1e3:+.1f} ms per step, {per_step} collectives: "
                f"{added / (per_step * delay):.2f} one-way delays each"
            )


def fit(runs: dict[float, dict]) -> tuple[float, dict[str, float]]:
    """The link efficiency and each row's compute time, by least squares (the efficiency by
    a scan: for a fixed one, each row's compute is the mean of its residuals)."""
    rows = sorted({name for rows in runs.values() for name in rows})
    points = {
        name: [
            (rows_at[name]["wire_bytes_per_step"] * 8 / rate, rows_at[name]["step_time"])
            for rate, rows_at in runs.items()
            if name in rows_at
        ]
        for name in rows
    }
    points = {name: p for name, p in points.items() if len(p) >= 2}
    if not points:
        raise SystemExit("no row was measured at two link rates: run bench/compression.py twice")
    best = None
    for step in range(5, 101):
        efficiency = step / 100
        error, compute = 0.0, {}
        for name, pts in points.items():
            residuals = [t - seconds / efficiency for seconds, t in pts]
            compute[name] = sum(residuals) / len(residuals)
            error += sum((r - compute[name]) ** 2 for r in residuals)
        if best is None or error < best[0]:
            best = (error, efficiency, compute)
    assert best is not None
    return best[1], best[2]


# bytes per element of the quantized collectives: codes plus one fp32 scale per block of 256
# (1 bit: one scale per piece); uncompressed is bf16
ELEMENT_BYTES = {"none": 2, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256, "onebit": 1 / 8}


def cluster_bytes(method: str, n: int, psi: float) -> list[tuple[int, float]]:
    """(message hops, bytes) of each collective one rank runs per step (see the docstring)."""
    ring = (n - 1) / n
    grads, _, gathered = method.partition(" + ")
    gather = (n - 1, ring * psi * ELEMENT_BYTES[gathered.split()[0] if gathered else "none"])
    if grads in ELEMENT_BYTES:
        return [(n - 1, ring * psi * ELEMENT_BYTES[grads]), gather]
    if grads in ("powersgd", "acp_sgd"):
        factors = 0.01 * psi * (1 if grads == "powersgd" else 0.5)
        messages = 2 if grads == "powersgd" else 1
        return [(2 * (n - 1) * messages, 2 * ring * factors * 4), gather]
    k = 0.01 * psi
    if grads == "topk":
        return [(n - 1, (n - 1) * 8 * k), gather]
    if grads == "gtopk":
        return [(int(math.log2(n)), math.log2(n) * 8 * k), (2 * (n - 1), 2 * ring * 4 * k), gather]
    raise ValueError(method)


def stage3_bytes(method: str, n: int, per_node: int, psi: float) -> list[tuple[int, float, bool]]:
    """(message hops, bytes, inside the node) of each stage-3 collective one rank runs per step,
    for a model too large to stay gathered: each block is gathered for its forward and again
    for its backward, and its gradients are reduce-scattered. With hpZ (", hpz") the second
    gather runs among the node's ``per_node`` ranks, from their pieces of the gathered values,
    kept in the training dtype (bf16)."""
    hpz = method.endswith(", hpz")
    reduce_scatter, gather = cluster_bytes(method.removesuffix(", hpz"), n, psi)
    again = (per_node - 1, (per_node - 1) / per_node * psi * ELEMENT_BYTES["none"], True)
    return [(*reduce_scatter, False), (*gather, False), again if hpz else (*gather, False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--gbits", type=float, default=25.0)
    parser.add_argument("--alpha-us", type=float, default=20.0, help="seconds per hop, in µs")
    parser.add_argument("--params", type=float, default=1.5e9, help="trainable parameters")
    parser.add_argument("--compute", type=float, default=1.0, help="compute seconds per step")
    parser.add_argument("--per-node", type=int, default=8, help="ranks per node (stage 3, hpZ)")
    parser.add_argument(
        "--node-gbits", type=float, default=1600.0, help="the link inside a node (hpZ)"
    )
    args = parser.parse_args()
    every = results()
    delays_per_collective(every)
    runs = {rate: data["rows"] for rate, data in measured(every).items()}
    efficiency, compute = fit(runs)
    print(f"fitted on {len(runs)} link rates: link efficiency {efficiency:.2f}")
    for name, seconds in sorted(compute.items()):
        print(f"  {name}: compute {seconds:.3f} s/step (this machine)")
    beta = 8 / (efficiency * args.gbits * 1e9)  # seconds per byte
    beta_node = 8 / (efficiency * args.node_gbits * 1e9)
    alpha = args.alpha_us * 1e-6
    print(
        f"\nmodel: {args.params:.3g} parameters, stage 1-2, {args.ranks} ranks, "
        f"{args.gbits:g} Gb/s x {efficiency:.2f}, alpha {args.alpha_us:g} µs per hop, "
        f"compute {args.compute:g} s per step\n"
    )
    print("| gradients + parameters | bytes/rank/step | comm s/step | step s | vs bf16 |")
    print("|---|---|---|---|---|")
    methods = [
        "none",
        "powersgd + int4 params",
        "acp_sgd + int4 params",
        "topk + int4 params",
        "gtopk + int4 params",
        "int8 + int8 params",
        "int4 + int4 params",
        "onebit + int4 params",
    ]

    def step_time(method: str, stage: int = 1) -> tuple[float, float, float]:
        """(bytes over the network, comm seconds, step seconds) per rank and step."""
        if stage == 3:
            messages = stage3_bytes(method, args.ranks, args.per_node, args.params)
        else:
            messages = [(*m, False) for m in cluster_bytes(method, args.ranks, args.params)]
        comm = sum(hops * alpha + b * (beta_node if node else beta) for hops, b, node in messages)
        # no overlap of communication with compute: the worst case
        return sum(b for _, b, node in messages if not node), comm, args.compute + comm

    def table(methods: list[str], stage: int = 1) -> None:
        base = step_time("none", stage)[2]
        for method in methods:
            nbytes, comm, step = step_time(method, stage)
            print(
                f"| {method} | {nbytes / 1e9:.2f} GB | {comm:.2f} | {step:.2f} "
                f"| {base / step:.2f}x |"
            )

    table(methods)
    base = step_time("none")[2]
    # comm_compression.auto's default candidates at stages 1-2 (zerotrain/api.py)
    m = AUTO_DEFAULT_METHOD
    candidates = ["none", m, f"none + {m} params", f"{m} + {m} params"]
    times = {method: step_time(method)[2] for method in candidates}
    chosen = min(times, key=times.__getitem__)
    if times[chosen] > base * (1 - AutoOptions.margin):  # the predicted gain auto switches for
        chosen = "none"
    print(
        f"\nauto (its default candidates at stages 1-2, by this model): {chosen}, "
        f"{base / times[chosen]:.2f}x; the model counts no compression compute, which auto "
        "measures and adds"
    )
    print(
        f"\nstage 3, each block gathered for its forward and again for its backward; hpZ "
        f"gathers the second time inside the node ({args.per_node} ranks, "
        f"{args.node_gbits:g} Gb/s x {efficiency:.2f}, the same alpha):\n"
    )
    print("| gradients + parameters | network bytes/rank/step | comm s/step | step s | vs bf16 |")
    print("|---|---|---|---|---|")
    table(
        [
            "none",
            "none, hpz",
            "int8 + int8 params",
            "int4 + int4 params",
            "int4 + int4 params, hpz",
        ],
        3,
    )


if __name__ == "__main__":
    main()
