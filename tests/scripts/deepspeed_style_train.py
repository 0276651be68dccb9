"""A training script written as DeepSpeed's tutorials and examples write them, with DeepSpeed's
own imports (written for zerotrain's tests; not copied from DeepSpeed).

tests/test_deepspeed_script.py rewrites only its import lines to zerotrain and runs it with
`zerotrain run`; with DeepSpeed installed it runs as it is under `deepspeed` or torchrun.
"""

import argparse

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule  # noqa: F401 (imported as pipeline examples do)
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import RepeatingLoader, logger
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

FEATURES, CLASSES = 16, 4


def get_args():
    parser = argparse.ArgumentParser(description="a DeepSpeed-style training script")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by launchers")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--backward", choices=["engine", "torch"], default="engine")
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--save_at", type=int, default=-1)
    parser.add_argument("--load_dir", default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(FEATURES, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def synthetic_dataset(samples: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return torch.utils.data.TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    set_random_seed(1234)
    device = torch.device(get_accelerator().device_name(dist.get_local_rank()))
    ds_config = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.03, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.03, "warmup_num_steps": 4},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": args.stage,
            "offload_optimizer": {"device": "none"},
            "sub_group_size": 1e9,
            "stage3_param_persistence_threshold": 0,
        },
        "wall_clock_breakdown": False,
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=args.stage == 3):
        net = Net()
    engine, _, trainloader, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=net.parameters(),
        training_data=synthetic_dataset(256),
        config=ds_config,
    )
    start = 0
    if args.load_dir:
        _, client_state = engine.load_checkpoint(args.load_dir)
        start = client_state["step"]
    data = RepeatingLoader(trainloader)
    for step in range(start, args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, labels = next(data)
            loss = F.cross_entropy(engine(inputs.to(device)), labels.to(device))
            if args.backward == "torch":
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {mean.item():.8f} lr {engine.get_lr()[0]:.6f}", flush=True)
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, client_state={"step": step + 1})
    dist.barrier()
    if args.save_dir and dist.get_rank() == 0:
        state = get_fp32_state_dict_from_zero_checkpoint(args.save_dir)
        logger.info(f"checkpoint holds {sum(t.numel() for t in state.values())} elements")
        print(f"fp32 state dict: {sorted(state)}", flush=True)
    if dist.get_rank() == 0:
        print(f"done: stage {engine.zero_optimization_stage()}, world {dist.get_world_size()}")


if __name__ == "__main__":
    main()
