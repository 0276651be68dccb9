"""One training run of tests/test_offload_faults.py's memory tests, alone in its process so
that its peak RSS is its own: a plain fp32 MLP of ``--layers`` x Linear(``--width``,
``--width``), stage 1, world 1, AdamW, ``--steps`` steps on one batch.

``--offload none|cpu|nvme`` (``--nvme-path DIR`` with nvme). ``--init-only``: stop after
``zerotrain.initialize``. ``--skip-preflight``: without initialize's memory preflight (to see
what the kernel does with a run that it would refuse). Prints one JSON line: the parameter count, the resident set after
initialize and after each step, the peak (VmHWM), and the memory cgroup's usage where the
process is in one with a limit. A ConfigError at initialize (a preflight) is printed as
``{"config_error": message}`` with exit status 3.
"""

import argparse
import json
import sys

import torch
from torch import nn

import zerotrain
from zerotrain.accelerator import current_rss, peak_rss

parser = argparse.ArgumentParser()
parser.add_argument("--offload", choices=["none", "cpu", "nvme"], required=True)
parser.add_argument("--nvme-path")
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--width", type=int, default=2048)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--sub-group-size", type=int, default=1 << 18)
parser.add_argument("--buffer-count", type=int, default=2)
parser.add_argument("--init-only", action="store_true")
parser.add_argument("--skip-preflight", action="store_true")
args = parser.parse_args()
if args.skip_preflight:
    zerotrain.api.check_memory = lambda *args: None


def cgroup_usage() -> int | None:
    """Bytes charged to this process's memory cgroup (v2 or v1), None outside one."""
    with open("/proc/self/cgroup", encoding="ascii") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                name = f"/sys/fs/cgroup{path}/memory.current"
            elif "memory" in controllers.split(","):
                name = f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"
            else:
                continue
            try:
                with open(name, encoding="ascii") as usage:
                    return int(usage.read())
            except (OSError, ValueError):
                continue
    return None


torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
offload = {"device": args.offload, "buffer_count": args.buffer_count}
if args.offload == "nvme":
    offload["nvme_path"] = args.nvme_path
config = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {
        "stage": 1,
        "sub_group_size": args.sub_group_size,
        "offload_optimizer": offload,
    },
    "steps_per_print": 10**6,
}
try:
    engine, *_ = zerotrain.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
except zerotrain.ConfigError as error:
    print(json.dumps({"config_error": str(error)}), flush=True)
    sys.exit(3)
record = {
    "params": sum(p.numel() for p in model.parameters()),
    "rss_after_init": current_rss(),
    "cgroup_after_init": cgroup_usage(),
    "rss_after_step": [],
}
x = torch.randn(4, args.width, generator=torch.Generator().manual_seed(1))
for _ in range(0 if args.init_only else args.steps):
    engine.backward(engine(x).square().mean())
    engine.step()
    record["rss_after_step"].append(current_rss())
record.update(peak_rss=peak_rss(), cgroup_end=cgroup_usage(), memory=engine.memory_breakdown())
print(json.dumps(record), flush=True)
