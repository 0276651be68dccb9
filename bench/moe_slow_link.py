"""Expert parallelism across two "nodes" joined by a slow link: where the all-to-all bytes
and their overlap with compute decide the step time.

    sudo python bench/moe_slow_link.py [--rate 100mbit] [--model demo] [--steps 20]

Two network namespaces joined by a veth pair rate-limited with `tc` (tests/netns.py), one
`zerotrain run` of 2 ranks in each (torchrun's rendezvous over the link), train the example
GPT with MoE layers of 8 experts in every other block (top-2) for `--steps` steps; every row
reads the run's own summary (tokens/s over all ranks, the mean of the steps after the first
tenth). At ep 2 the expert-parallel groups are the two ranks of one node, so the all-to-alls
stay inside it; at ep 4 they cross the link, and `--moe-dedup` / `--moe-overlap 4` act on what
crosses. Needs root and iproute2. Writes bench/results/moe_slow_link.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from launched import output_or_kill  # noqa: E402 (after the path)
from netns import available, two_namespaces  # noqa: E402

ROWS = {
    "ep2 (all-to-all inside a node)": ["--ep", "2"],
    "ep4 (all-to-all across the link)": ["--ep", "4"],
    "ep4, token_dedup": ["--ep", "4", "--moe-dedup"],
    "ep4, overlap_chunks 4": ["--ep", "4", "--moe-overlap", "4"],
    "ep4, both": ["--ep", "4", "--moe-dedup", "--moe-overlap", "4"],
}


def run(nodes, args, extra: list[str], port: int) -> float:
    """tokens/s of one two-node run."""
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", nodes[0].address]
    train = ["examples/train_gpt.py", "--model", args.model, "--steps", str(args.steps)]
    train += ["--experts", "8", "--top-k", "2", "--print-every", str(args.steps), *extra]
    processes = [
        node.run(*rendezvous, "--master-port", str(port), "--node-rank", str(i), *train)
        for i, node in enumerate(nodes)
    ]
    outputs = [output_or_kill(p, 1800, "zerotrain run") for p in processes]
    found = re.search(r"tokens/s \(all ranks\)\s+([\d,]+)", outputs[0])
    if any(p.returncode for p in processes) or found is None:
        raise RuntimeError(f"run {extra} failed:\n{outputs[0][-2000:]}\n{outputs[1][-2000:]}")
    return float(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="the link's rate each way (tc)")
    parser.add_argument("--model", default="demo", help="GPT preset (examples/gpt/model.py)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not available():
        sys.exit("bench/moe_slow_link.py needs root, ip and tc (network namespaces)")
    results = {}
    with two_namespaces(args.rate) as nodes:
        for index, (name, extra) in enumerate(ROWS.items()):
            print(f"running {name} ...", flush=True)
            results[name] = run(nodes, args, extra, 29650 + index)
    base = results["ep4 (all-to-all across the link)"]
    print(
        f"\nGPT {args.model}, 8 experts in every other block, top-2, 2 nodes x 2 ranks, link {args.rate}\n"
    )
    print("| row | tokens/s | vs ep4 |")
    print("|---|---|---|")
    for name, tokens in results.items():
        print(f"| {name} | {tokens:,.0f} | {tokens / base:.2f} |")
    out = ROOT / "bench" / "results" / "moe_slow_link.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "tokens_per_s": results}, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
