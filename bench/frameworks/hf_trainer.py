"""The HuggingFace Trainer script of bench/frameworks_vs_deepspeed.py: a GPT-2 from a config
trained with a DeepSpeed config, unchanged between DeepSpeed and zerotrain.

    python hf_trainer.py STAGE STEPS OUT_DIR

Rank 0 writes OUT_DIR/result.json (per micro-batch losses, the evaluation loss, the training
time) and the trained model (save_model) to OUT_DIR/model.
"""

import json
import sys
import time

import torch
from gpt2 import WINDOWS, gpt2, token_ids
from transformers import Trainer, TrainingArguments

stage, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
auto = "auto"
config = {
    "train_micro_batch_size_per_gpu": auto,
    "gradient_accumulation_steps": auto,
    "train_batch_size": auto,
    "gradient_clipping": auto,
    "optimizer": {
        "type": "AdamW",
        "params": {k: auto for k in ("lr", "betas", "eps", "weight_decay")},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            k: auto
            for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
        },
    },
    "zero_optimization": {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": auto,
        **(
            {
                "stage3_prefetch_bucket_size": auto,
                "stage3_param_persistence_threshold": auto,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
            if stage == 3
            else {}
        ),
    },
}
model = gpt2()
losses = []
model.register_forward_hook(
    lambda module, args, kwargs, output: (
        losses.append(output.loss.item()) if module.training else None
    ),
    with_kwargs=True,
)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return WINDOWS

    def __getitem__(self, index):
        ids = token_ids(index)
        return {"input_ids": ids, "labels": ids}


args = TrainingArguments(
    output_dir=f"{out}/trainer",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=steps,
    learning_rate=1e-3,
    warmup_steps=2,
    max_grad_norm=1.0,
    logging_steps=10**6,
    save_strategy="no",
    report_to=[],
    deepspeed=config,
    use_cpu=True,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens())
started = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - started
evaluation = trainer.evaluate()
trainer.save_model(f"{out}/model")
if trainer.args.process_index == 0:
    with open(f"{out}/result.json", "w") as f:
        result = {"losses": losses, "eval_loss": evaluation["eval_loss"], "train_s": seconds}
        json.dump({**result, "engine": type(trainer.model_wrapped).__module__}, f)
