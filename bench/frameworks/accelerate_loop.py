"""The Accelerate script of bench/frameworks_vs_deepspeed.py: the GPT-2 and data of
hf_trainer.py in a plain Accelerate loop with a DeepSpeed plugin, unchanged between DeepSpeed and
zerotrain (the launcher sets ACCELERATE_USE_DEEPSPEED=true, as `accelerate launch
--use_deepspeed` does).

    python accelerate_loop.py STAGE STEPS OUT_DIR

Rank 0 writes OUT_DIR/result.json (per micro-batch losses, the evaluation loss, the training
time) and the trained model (``get_state_dict``) to OUT_DIR/model/model.safetensors.
"""

import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from gpt2 import WINDOWS, gpt2, token_ids
from safetensors.torch import save_file

stage, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
MICRO, ACCUM = 4, 2
config = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": 1.0,
    "zero_allow_untested_optimizer": True,  # DeepSpeed: a torch AdamW under ZeRO
    "zero_optimization": {
        "stage": stage,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,  # for get_state_dict
    },
    "steps_per_print": 10**6,
}
accelerator = Accelerator(
    deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
    # CPU: Accelerate picks a process-group backend only for accelerators
    kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
)
model = gpt2()
samples = [token_ids(i) for i in range(WINDOWS)]
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(samples, batch_size=MICRO)
engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)

losses = []
started = time.perf_counter()
for ids in loader:
    loss = engine(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)  # the engine's backward and step: it counts the accumulation
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
    if len(losses) == steps * ACCUM:
        break
seconds = time.perf_counter() - started
engine.eval()
with torch.no_grad():
    evals = [engine(input_ids=ids, labels=ids).loss for ids in list(loader)[:4]]
eval_loss = accelerator.reduce(torch.stack(evals).mean(), "mean").item()
state = accelerator.get_state_dict(engine)
if accelerator.is_main_process:
    os.makedirs(f"{out}/model", exist_ok=True)
    weights = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}  # tied
    save_file(weights, f"{out}/model/model.safetensors")
    with open(f"{out}/result.json", "w") as f:
        result = {"losses": losses, "eval_loss": eval_loss, "train_s": seconds}
        json.dump({**result, "engine": type(engine).__module__}, f)
accelerator.wait_for_everyone()
