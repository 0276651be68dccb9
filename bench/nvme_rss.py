"""What NVMe optimizer offload saves in host memory: peak RSS in memory vs ``device: nvme``.

    python bench/nvme_rss.py [--rounds 3] [--steps 3] [--sub-group-size 262144]
                             [--buffer-count 2] [--nvme-path DIR] [--glibc-env]
                             [--optimizer AdamW|Muon]

Trains a 58.8M-parameter MLP (7 Linear layers, 1024 -> 8192 -> 1024 ..., fp32 on the CPU) at
ZeRO stage 2 on one rank with AdamW (or Muon: its weights' momentum, AdamW's moments for the
biases; [Note: Muon on NVMe] in zerotrain/zero/nvme.py), ``--steps`` steps, once with the optimizer in memory and
once with ``offload_optimizer: {device: nvme}``, each in a fresh process (so that its peak RSS,
VmHWM via ``zerotrain.accelerator.peak_rss``, is its own), ``--rounds`` times alternating.
Prints per round the two peaks and the share of the optimizer state's bytes (Adam's exp_avg and
exp_avg_sq, or Muon's, from the in-memory run's ``memory_breakdown()``) that NVMe keeps out of memory:

    saved = (in-memory peak - nvme peak) / optimizer-state bytes

1.0 would be all of it; the staging sets and the ring (``--buffer-count`` sub-groups of
``--sub-group-size`` elements) are what NVMe itself holds. The processes run with glibc's
allocator as a user has it (no ``MALLOC_*`` variable); ``--glibc-env`` adds rows with
``MALLOC_MMAP_THRESHOLD_=65536``, the setting tests/test_offload_faults.py once needed, for
comparison. Writes bench/results/nvme_rss.json (nvme_rss_muon.json with Muon).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS = 7
WIDTHS = (1024, 8192)
MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sub-group-size", type=int, default=1 << 18)
    parser.add_argument("--buffer-count", type=int, default=2)
    parser.add_argument("--nvme-path", default=None, help="default: a fresh directory in /tmp")
    parser.add_argument("--glibc-env", action="store_true", help="also MALLOC_MMAP_THRESHOLD_")
    parser.add_argument("--optimizer", choices=["AdamW", "Muon"], default="AdamW")
    parser.add_argument("--out", default=None, help="default: bench/results/nvme_rss[_muon].json")
    parser.add_argument("--child", choices=["none", "nvme"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.out is None:
        suffix = "_muon" if args.optimizer == "Muon" else ""
        args.out = str(ROOT / "bench" / "results" / f"nvme_rss{suffix}.json")
    return args


def child(args: argparse.Namespace) -> None:
    """One run in this process: print its JSON line."""
    import torch
    from torch import nn

    import zerotrain
    from zerotrain.accelerator import peak_rss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for index in range(LAYERS):
        width_in, width_out = WIDTHS if index % 2 == 0 else WIDTHS[::-1]
        layers.append(nn.Linear(width_in, width_out))
    model = nn.Sequential(*layers)
    offload: dict = {"device": args.child, "buffer_count": args.buffer_count}
    if args.child == "nvme":
        offload["nvme_path"] = args.nvme_path
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": args.optimizer, "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 2,
            "sub_group_size": args.sub_group_size,
            "offload_optimizer": offload,
        },
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(1))
    for _ in range(args.steps):
        engine.backward(engine(x).square().mean())
        engine.step()
    record = {
        "params": sum(p.numel() for p in model.parameters()),
        "peak_rss": peak_rss(),
        "memory": engine.memory_breakdown(),
    }
    print(json.dumps(record), flush=True)


def run_child(args: argparse.Namespace, offload: str, env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--child", offload, "--steps", str(args.steps)]
    command += ["--sub-group-size", str(args.sub_group_size)]
    command += ["--buffer-count", str(args.buffer_count), "--nvme-path", args.nvme_path]
    command += ["--optimizer", args.optimizer]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{offload} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="zerotrain-nvme-rss-", dir=args.nvme_path) as tmp:
        args.nvme_path = tmp
        envs = {"glibc default": {}}
        if args.glibc_env:
            envs["MALLOC_MMAP_THRESHOLD_=65536"] = {"MALLOC_MMAP_THRESHOLD_": "65536"}
        rows = []
        for round_index in range(args.rounds):
            for env_name, env in envs.items():
                in_memory = run_child(args, "none", env)
                on_nvme = run_child(args, "nvme", env)
                state = in_memory["memory"]["optimizer_states"]
                saved = (in_memory["peak_rss"] - on_nvme["peak_rss"]) / state
                rows.append(
                    {
                        "round": round_index,
                        "allocator": env_name,
                        "params": in_memory["params"],
                        "optimizer_state_bytes": state,
                        "in_memory_peak_rss": in_memory["peak_rss"],
                        "nvme_peak_rss": on_nvme["peak_rss"],
                        "nvme_staging_bytes": on_nvme["memory"]["staging"],
                        "saved": saved,
                    }
                )
                print_row(rows[-1])
    print()
    for env_name in envs:
        saved = [row["saved"] for row in rows if row["allocator"] == env_name]
        print(f"{env_name}: saved {statistics.median(saved):.2f} (median of {len(saved)})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def print_row(row: dict) -> None:
    if row["round"] == 0 and row["allocator"] == "glibc default":
        print(
            f"{row['params'] / 1e6:.1f}M parameters, optimizer state "
            f"{row['optimizer_state_bytes'] / MiB:.0f} MiB; saved = (in-memory peak - nvme "
            "peak) / optimizer state"
        )
        print(f"{'round':>5}  {'allocator':<30} {'in memory':>10} {'nvme':>10} {'saved':>6}")
    print(
        f"{row['round']:>5}  {row['allocator']:<30} {row['in_memory_peak_rss'] / MiB:>6.0f} MiB"
        f" {row['nvme_peak_rss'] / MiB:>6.0f} MiB {row['saved']:>6.2f}"
    )


if __name__ == "__main__":
    main()
