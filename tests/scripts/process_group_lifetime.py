"""One rank of tests/test_process_group_lifetime.py (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set by the test): whoever made the default process group ends it.

``python process_group_lifetime.py zerotrain``: ``zerotrain.initialize`` makes the group.
``python process_group_lifetime.py user``: the script makes it with torch, and destroys it.
``python process_group_lifetime.py remade``: the script destroys the group zerotrain made and
makes its own, which is then the script's.
Two stage-3 engines share the group; the first is destroyed before the second trains, and a
collective runs after both are destroyed. Prints what it saw, the last line at exit.
"""

import atexit
import sys

import torch
import torch.distributed as dist

MAKER = sys.argv[1]  # "zerotrain", "user" or "remade"


def report_at_exit() -> None:
    # Registered before zerotrain is imported, so it runs after zerotrain's exit hook.
    print(f"at exit: group initialized={dist.is_initialized()}", flush=True)
    if dist.is_initialized():  # the script's own group: the script ends it
        dist.destroy_process_group()


atexit.register(report_at_exit)

import zerotrain  # noqa: E402 (after the hook above, on purpose)
from zerotrain.comm.setup import made_default_group  # noqa: E402

if MAKER == "remade":
    zerotrain.init_distributed(verbose=False)
    dist.destroy_process_group()
if MAKER in ("user", "remade"):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)  # env://, from the test's variables


def make_engine():
    model = torch.nn.Linear(7, 5)
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3},
            "steps_per_print": 10**6,
        },
    )
    return engine


first, second = make_engine(), make_engine()
print(f"zerotrain made the group: {made_default_group()}", flush=True)
first.destroy()
loss = second(torch.randn(2, 7, device=second.device)).sum()  # the second engine still trains
second.backward(loss)
second.step()
second.destroy()
total = torch.ones(1, device=second.device)
zerotrain.comm.all_reduce(total)  # the group outlives every engine's destroy()
print(f"after destroy: group initialized={dist.is_initialized()} sum={total.item():g}", flush=True)
