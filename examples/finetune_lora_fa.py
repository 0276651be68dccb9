"""Fine-tune a GPT with LoRA-FA adapters at ZeRO stage 3, the frozen base partitioned too.

    zerotrain run --nproc-per-node 2 examples/train_gpt.py --checkpoint-dir ckpt    # a base
    zerotrain run --nproc-per-node 2 examples/finetune_lora_fa.py --base ckpt --data DIR

DIR: text to fine-tune on, e.g. the standard library's `email` package. The base weights come
from train_gpt.py's checkpoints (any stage and world size), loaded into a plain model by
`zerotrain.checkpoint.load_consolidated`; without --base the base is random. The config's
`lora_fa` section makes `initialize` replace the attention and MLP projections by LoRA-FA
adapters (A frozen, B trained; Zhang et al., arXiv:2308.03303) and freeze everything else. Stage
3 then partitions the frozen base like the adapters: each rank keeps 1/N of it between uses. The
script prints the validation loss on the fine-tuning data before and after, and what a rank
holds of the base and of the adapters.
"""

from __future__ import annotations

import argparse
import time

import torch
from gpt.data import train_val_datasets
from gpt.model import GPT, PRESETS, gpt_config
from train_gpt import forever, print_summary, validation_loss

import zerotrain
from zerotrain.checkpoint import load_consolidated
from zerotrain.fmt import MiB


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="train_gpt.py's --checkpoint-dir")
    parser.add_argument("--model", choices=sorted(PRESETS), default="demo", help="GPT preset")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--r", type=int, default=8, help="adapter rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--micro-batch", type=int, default=8, help="windows per rank per step")
    parser.add_argument("--data", default=None, help="text file or directory to fine-tune on")
    parser.add_argument("--print-every", type=int, default=10, help="steps between lines")
    parser.add_argument("--val-batches", type=int, default=8, help="held-out batches")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("steps", "r", "micro_batch", "print_every", "val_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    zerotrain.init_distributed()
    torch.manual_seed(args.seed)  # the same adapters (A) on every rank
    config = gpt_config(args.model)
    model = GPT(config)
    if args.base:
        load_consolidated(model, args.base)
    train_set, val_set = train_val_datasets(config.block_size, args.data)
    engine, _, train_loader, _ = zerotrain.initialize(
        model=model,
        training_data=train_set,
        config={
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
            "gradient_clipping": 1.0,
            "lora_fa": {
                "enabled": True,
                "target_modules": ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"],
                "r": args.r,
                "alpha": 2 * args.r,
            },
            # every block partitioned, even a small model's (default: blocks under 100k
            # parameters stay whole)
            "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": args.print_every,
        },
    )
    is_rank0 = engine.global_rank == 0
    val_before, _ = validation_loss(engine, val_set, args.val_batches, args.micro_batch)
    batches = forever(train_loader)
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = (t.to(engine.device) for t in next(batches))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    seconds = time.perf_counter() - start
    val_after, used = validation_loss(engine, val_set, args.val_batches, args.micro_batch)
    memory = engine.memory_breakdown()
    if is_rank0:
        trained = engine.optimizer.num_params
        frozen = sum(numel(p) for p in model.parameters() if not p.requires_grad)
        rows = [
            ("base", args.base or "random (no --base)"),
            ("ZeRO stage, world size", f"{engine.zero_optimization_stage()}, {engine.world_size}"),
            ("trained (B of the adapters)", f"{trained:,} of {trained + frozen:,} parameters"),
            ("validation loss before", f"{val_before:.4f} ({used} batches)"),
            ("validation loss after", f"{val_after:.4f}"),
            ("training time", f"{seconds:.1f} s ({seconds / args.steps:.3f} s/step)"),
            (
                "frozen parameters, this rank",
                f"{memory['frozen'] / MiB:.2f} MiB (all of them: {4 * frozen / MiB:.2f} MiB, fp32)",
            ),
            (
                "adapter states, this rank",
                f"{memory['total'] / MiB:.2f} MiB (ZeRO formula: "
                f"{memory['formula_total'] / MiB:.2f} MiB)",
            ),
        ]
        print_summary(rows)


def numel(param: torch.nn.Parameter) -> int:
    """A parameter's elements, also where stage 3 left a placeholder (DeepSpeed's ds_numel)."""
    return getattr(param, "ds_numel", param.numel())


if __name__ == "__main__":
    main()
