"""DeepSpeed's ALST script at each ZeRO stage: the gradient norm it steps with, against one
process's on the same sample (a tiny transformers Llama, sp 2 on 2 gloo ranks). The script is
DeepSpeed's tutorial's: register Ulysses, initialize with the mpu, the per-rank loss
aggregated over the sequence-parallel group by differentiable all-gathers.

    pip install -r requirements-bench.txt      # deepspeed==0.19.8 (uninstall before make test)
    python bench/alst_gradients.py

DeepSpeed keeps its sequence-parallel groups for the life of the process, so each stage runs in
a torchrun job of its own. zerotrain trains this script exactly at every stage
(tests/test_sequence_parallel.py::test_alst_script_equals_one_process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(stage: int) -> None:
    import deepspeed
    import torch
    import torch.distributed.nn.functional as dist_fn
    import transformers
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from zerotrain.sequence import shard_batch  # the adapter's cut, without its gathering

    def model():
        torch.manual_seed(0)
        transformers.logging.set_verbosity_error()
        config = transformers.LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    deepspeed.init_distributed(dist_backend="gloo")
    ids = torch.randint(1, 61, (1, 16), generator=torch.Generator().manual_seed(3))
    sample = {"input_ids": ids, "labels": ids.clone()}
    alone = model()
    alone(**sample).loss.backward()
    reference = torch.sqrt(sum((p.grad**2).sum() for p in alone.parameters())).item()
    m = model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=m, core_attn_implementation="sdpa", sequence_parallel_size=2,
        micro_batch_size=1, seq_length_is_variable=True,
    )  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=m, config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    batch = shard_batch(sample, mpu.get_sequence_parallel_rank(), 2)
    shift_labels = batch.pop("shift_labels")
    logits = engine(**batch).logits
    loss = engine.module.loss_function(
        logits=logits, labels=None, shift_labels=shift_labels, vocab_size=61
    )
    losses = dist_fn.all_gather(loss, group=group)
    good = (shift_labels != -100).sum()
    goods = dist_fn.all_gather(good, group=group)
    engine.backward(sum(losses[r] * goods[r] for r in range(2)) / sum(goods))
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    # stage 0 reports no norm: the gradients are whole on every rank, read them
    before = torch.sqrt(sum((g.float() ** 2).sum() for g in grads)).item() if grads else None
    engine.step()
    norm = engine.get_global_grad_norm()
    norm = before if norm is None else float(norm)
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"stage": stage, "deepspeed": norm, "one_process": reference}))


def main() -> None:
    if len(sys.argv) > 1:
        worker(int(sys.argv[1]))
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    print("| ZeRO stage | DeepSpeed's gradient norm | one process's | ratio |")
    print("|---|---|---|---|")
    for stage in range(4):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(29890 + stage), __file__, str(stage),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("{")), None)
        if line is None:
            print(f"| {stage} | failed: {done.stderr.strip().splitlines()[-1:]} | | |")
            continue
        got = json.loads(line)
        ratio = got["deepspeed"] / got["one_process"]
        print(f"| {stage} | {got['deepspeed']:.4f} | {got['one_process']:.4f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
