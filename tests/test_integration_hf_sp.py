"""The HF Trainer with Accelerate's ParallelismConfig (sp_backend "deepspeed", sp_size 2) runs
DeepSpeed's ALST path on zerotrain through the compat alias: Accelerate registers Ulysses and
wraps the dataloader in the adapter, the Trainer aggregates the loss over the sequence-parallel
group (deepspeed.utils.groups), and the run trains as zerotrain called directly on the shards
each rank was fed, with the config the Trainer filled in."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from distributed import run_distributed

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")),
    reason="needs transformers and accelerate",
)

VOCAB, SEQ, STEPS = 61, 15, 4  # 15 tokens: padded to 16 for sp 2


def _model():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(1, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        labels = ids.clone()
        labels[: index % 5] = -100  # a prompt of a few tokens, not trained on
        return {"input_ids": ids, "labels": labels}


class _Recorder:
    """The shares the Trainer fed this rank, and the losses the model returned."""

    def __init__(self, model):
        self.batches: list[dict] = []
        model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output) -> None:
        if module.training:
            keys = ("input_ids", "position_ids", "shift_labels")
            self.batches.append({k: kwargs[k].detach().clone() for k in keys})


DS_CONFIG = {
    "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 10**6,
}


def train_with_hf_trainer(out: str) -> dict:
    from zerotrain.compat.deepspeed import activate

    activate()
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    import zerotrain

    model = _model()
    recorder = _Recorder(model)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,  # the Trainer's loss scaling meets the engine's
        max_steps=STEPS,
        max_grad_norm=0.0,
        learning_rate=0.5,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        deepspeed=DS_CONFIG,
        parallelism_config=ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=2,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
        ),
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    history = trainer.train()
    engine = trainer.model_wrapped
    assert isinstance(engine, zerotrain.ZeroTrainEngine), type(engine)
    config = trainer.args.hf_deepspeed_config.config
    trained = engine.consolidated_state_dict()
    zerotrain.sequence.hf.unregister_attention()
    direct = _direct(config, recorder.batches)
    return {
        "trained": trained,
        "direct": direct,
        "batches": recorder.batches,
        "train_batch_size": config["train_batch_size"],
        "loss": history.training_loss,
    }


def _direct(config: dict, batches: list[dict]) -> dict:
    """The shares through zerotrain called directly with sequence_parallel_size 2 and the
    model's own loss (the sample's token mean over both shares)."""
    import zerotrain

    engine, *_ = zerotrain.initialize(
        model=_model(), config={**config, "sequence_parallel_size": 2}
    )
    for batch in batches:
        engine.backward(engine(**batch).loss)
        engine.step()
    state = engine.consolidated_state_dict()
    zerotrain.sequence.hf.unregister_attention()
    return state


def test_hf_trainer_with_ulysses_trains_as_zerotrain_called_directly(tmp_path):
    results = run_distributed(
        train_with_hf_trainer, 2, str(tmp_path), timeout=400, fresh_interpreter=True
    )
    first, second = results
    assert first["train_batch_size"] == 2  # one data-parallel rank (sp 2 shares each sample) x 2
    for rank in results:
        for key, value in rank["trained"].items():
            assert torch.allclose(value, rank["direct"][key], rtol=1e-5, atol=1e-6), key
    # the two ranks were fed the two halves of the same samples, positions continuing
    for a, b in zip(first["batches"], second["batches"], strict=True):
        assert a["position_ids"][0, -1] + 1 == b["position_ids"][0, 0]
        assert a["input_ids"].shape == b["input_ids"].shape == (1, (SEQ + 1) // 2)
    assert len(first["batches"]) == STEPS * 2
    assert torch.isfinite(torch.tensor(first["loss"]))
