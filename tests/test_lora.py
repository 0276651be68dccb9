"""LoRA-FA (zerotrain/lora.py): the same training as LoRA with A frozen, at every ZeRO stage,
and the activation bytes it keeps for backward."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from distributed import run_distributed
from torch import nn

from zerotrain.checkpointing import count_saved_activations
from zerotrain.config import ConfigError, load_config
from zerotrain.estimate import TrainingJob, count_parameters, estimate
from zerotrain.lora import LoRAFA, apply_lora_fa

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


class FrozenALoRA(nn.Module):
    """The reference: LoRA written with autograd's own ops, A frozen (so autograd decides what
    to keep), the same parameters as a given LoRAFA."""

    def __init__(self, adapter: LoRAFA):
        super().__init__()
        self.base, self.transposed = adapter.base, adapter.transposed
        self.lora_A, self.lora_B, self.scaling = adapter.lora_A, adapter.lora_B, adapter.scaling

    def forward(self, x):
        w = self.base.weight
        out = x @ w if self.transposed else x @ w.t()
        if self.base.bias is not None:
            out = out + self.base.bias
        return out + self.scaling * ((x @ self.lora_A.t()) @ self.lora_B.t())


def _with_reference_adapters(model: nn.Module) -> nn.Module:
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRAFA):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, FrozenALoRA(module))
    return model


def test_lora_fa_matches_lora_with_a_frozen_and_gradchecks():
    torch.manual_seed(0)
    adapter = LoRAFA(nn.Linear(24, 12), r=4, alpha=8)
    with torch.no_grad():
        adapter.lora_B.normal_()  # zero at init: make the adapter path count
    x = torch.randn(3, 5, 24, requires_grad=True)
    adapter(x).square().sum().backward()
    reference = FrozenALoRA(adapter)
    x_ref = x.detach().clone().requires_grad_()
    grad_b = adapter.lora_B.grad.clone()
    adapter.lora_B.grad = None
    reference(x_ref).square().sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(grad_b, adapter.lora_B.grad, rtol=1e-6, atol=1e-6)
    assert adapter.base.weight.grad is None and adapter.lora_A.grad is None  # frozen

    double = LoRAFA(nn.Linear(6, 5).double(), r=2)

    torch.autograd.gradcheck(
        lambda x, b: _apply(double, x, b),
        (
            torch.randn(2, 6, dtype=torch.double, requires_grad=True),
            torch.randn(5, 2, dtype=torch.double, requires_grad=True),
        ),
    )


def _apply(adapter: LoRAFA, x, b):
    from zerotrain.lora import _LoRAFAFunction

    base = adapter.base
    return _LoRAFAFunction.apply(
        x, base.weight, base.bias, adapter.lora_A, b, adapter.scaling, adapter.transposed
    )


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_apply_lora_fa_adapts_gpt2_conv1d_layers_by_name():
    from models import tiny_hf_gpt2

    torch.manual_seed(0)
    model = tiny_hf_gpt2()
    merged_before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    names = apply_lora_fa(model, ["c_attn", "c_fc"], r=4)
    assert names == [
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.1.attn.c_attn",
        "transformer.h.1.mlp.c_fc",
    ]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{n}.lora_B" for n in names]
    adapter = model.transformer.h[0].attn.c_attn
    assert torch.equal(adapter.merged_weight(), merged_before)  # B starts at zero
    with pytest.raises(ValueError, match="no module of the model matches"):
        apply_lora_fa(tiny_hf_gpt2(), ["q_proj"])
    with pytest.raises(TypeError, match="adapts nn.Linear"):
        apply_lora_fa(tiny_hf_gpt2(), ["ln_f"])


def _gpt2_with_adapters(reference: bool) -> nn.Module:
    from models import tiny_hf_gpt2

    torch.manual_seed(0)
    model = tiny_hf_gpt2()
    apply_lora_fa(model, ["c_attn", "c_proj", "c_fc"], r=4)
    torch.manual_seed(1)
    for module in model.modules():  # B nonzero from the start: every step moves the loss
        if isinstance(module, LoRAFA):
            nn.init.normal_(module.lora_B, std=0.02)
    return _with_reference_adapters(model) if reference else model


def train_adapters(stages) -> dict:
    import zerotrain

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # one batch, four steps: the loss must fall as the adapters learn it
    batch = torch.randint(0, 101, (2 * world, 16), generator=torch.Generator().manual_seed(2))
    tokens = [batch] * 4
    out = {}
    for stage in stages:
        for reference in (False, True):
            model = _gpt2_with_adapters(reference)
            base_before = model.transformer.h[0].mlp.c_fc.base.weight.detach().clone()
            engine, *_ = zerotrain.initialize(
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                config={
                    "train_micro_batch_size_per_gpu": 2,
                    "gradient_clipping": 1.0,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                    # every unit partitioned, frozen base included (none kept whole)
                    "zero_optimization": {
                        "stage": stage,
                        "stage3_param_persistence_threshold": 0,
                    },
                    "steps_per_print": 10**6,
                },
            )
            losses = []
            for batch in tokens:
                ids = batch[2 * rank : 2 * rank + 2]
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            state = engine.consolidated_state_dict()
            frozen = [p for p in model.parameters() if not p.requires_grad]
            out[stage, reference] = {
                "losses": losses,
                "b": state["transformer.h.0.mlp.c_fc.lora_B"],
                "base_unchanged": torch.equal(
                    state["transformer.h.0.mlp.c_fc.base.weight"], base_before
                ),
                # between uses a rank holds 1/N of the frozen base at stage 3, all of it below
                "frozen_numel": sum(getattr(p, "ds_numel", p.numel()) for p in frozen),
                "frozen_bytes": engine.memory_breakdown()["frozen"],
                "base_held": model.transformer.h[0].mlp.c_fc.base.weight.numel(),
            }
    return out


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_lora_fa_trains_as_lora_with_a_frozen_at_every_stage():
    count = count_parameters(_gpt2_with_adapters(False), persistence_threshold=0)
    job = TrainingJob(
        trainable_params=count.trainable,
        frozen_params=count.frozen,
        persistent_frozen=count.persistent_frozen,
        dtype="fp32",
        gpus_per_node=2,
        max_live_numel=10**9,
    )
    for results in run_distributed(train_adapters, 2, [0, 1, 2, 3], timeout=300):
        for stage in (0, 1, 2, 3):
            fa, reference = results[stage, False], results[stage, True]
            assert fa["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0), stage
            assert fa["losses"][-1] < fa["losses"][0], stage  # the adapters learn
            assert torch.allclose(fa["b"], reference["b"], rtol=1e-5, atol=1e-6), stage
            assert fa["base_unchanged"] and reference["base_unchanged"], stage
            # what `zerotrain estimate` predicts (padding: under one element per bucket and rank)
            (row,) = estimate(replace(job, stages=(stage,)))
            assert row.frozen <= fa["frozen_bytes"] < row.frozen + 4 * 2 * 8, stage
            if stage == 3:
                assert row.frozen == 4 * fa["frozen_numel"] / 2
                assert fa["base_held"] == 0  # a placeholder between uses
            else:
                assert row.frozen == 4 * fa["frozen_numel"] and fa["base_held"] > 0, stage
            assert fa["losses"] == pytest.approx(results[0, False]["losses"], rel=1e-5), stage


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the non-parameter tensors autograd keeps for backward during ``model(x)``."""
    with count_saved_activations(model.parameters()) as saved:
        model(x).sum().backward()
    return saved.nbytes


def test_lora_fa_keeps_r_wide_activations_where_lora_keeps_the_input():
    """Three adapted layers of width 256, rank 4, 64 tokens: full fine-tuning and LoRA keep each
    layer's input (64 x 256 fp32) for the weight gradient, LoRA-FA keeps 64 x 4."""
    hidden, r, tokens, layers = 256, 4, 64, 3

    def stack(kind: str) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(hidden, hidden, bias=False) for _ in range(layers)))
        if kind == "full":
            return model
        apply_lora_fa(model, [str(i) for i in range(layers)], r=r)
        if kind == "lora":  # LoRA proper: A trained too
            model = _with_reference_adapters(model)
            for module in model:
                module.lora_A.requires_grad_(True)
        return model

    x = torch.randn(tokens, hidden, requires_grad=True)
    measured = {kind: activation_bytes(stack(kind), x) for kind in ("full", "lora", "lora_fa")}
    per_layer_input = tokens * hidden * 4
    assert measured["lora_fa"] == layers * tokens * r * 4
    assert measured["lora"] >= layers * per_layer_input  # x for A's gradient (and x A^T)
    assert measured["full"] >= (layers - 1) * per_layer_input  # x for W's gradient
    assert measured["lora"] // measured["lora_fa"] >= hidden // r


HAS_PEFT = HAS_TRANSFORMERS and importlib.util.find_spec("peft") is not None


def _peft_gpt2():
    from models import tiny_hf_gpt2
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True
    )
    model = get_peft_model(tiny_hf_gpt2(), lora)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # zero at init: make the first steps move the loss
            nn.init.normal_(param, std=0.02)
    return model


def _peft_engine(config: dict):
    return _peft_engine_of(_peft_gpt2(), config)


def _peft_engine_of(model: nn.Module, config: dict):
    import zerotrain

    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zerotrain.initialize(model=model, model_parameters=trainable, config=config)
    return engine


def _steps(engine, ids: torch.Tensor, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_peft(stages, root: str) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = torch.randint(0, 101, (2 * world, 16), generator=torch.Generator().manual_seed(2))
    ids = batch[2 * rank : 2 * rank + 2]
    out = {}
    for stage in stages:
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {
                "stage": stage,
                "stage3_gather_16bit_weights_on_model_save": True,
                "stage3_param_persistence_threshold": 0,
            },
            "steps_per_print": 10**6,
        }
        engine = _peft_engine(config)
        losses = _steps(engine, ids, 4)
        trained = engine.consolidated_state_dict()
        first_half = _peft_engine(config)
        _steps(first_half, ids, 2)
        first_half.save_checkpoint(f"{root}/{stage}", tag="two")
        resumed = _peft_engine(config)
        resumed.load_checkpoint(f"{root}/{stage}", tag="two")
        tail = _steps(resumed, ids, 2)
        saved = engine.save_16bit_model(f"{root}/{stage}-16bit", "model.safetensors")
        adapters = [p for n, p in engine.module.named_parameters() if "lora_" in n]
        out[stage] = {
            "losses": losses,
            "resumed_tail": tail,
            "resumed_equal": all(
                torch.equal(v, resumed.consolidated_state_dict()[k]) for k, v in trained.items()
            ),
            "optimizer_numel": engine.optimizer.num_params,
            "adapter_numel": sum(
                p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in adapters
            ),
            "saved": saved,
        }
    return out


@pytest.mark.skipif(not HAS_PEFT, reason="needs transformers and peft")
def test_peft_lora_trains_checkpoints_and_exports_at_every_stage(tmp_path):
    from safetensors.torch import load_file

    results = run_distributed(train_peft, 2, [0, 1, 2, 3], str(tmp_path), timeout=400)
    for rank in results:
        for stage, got in rank.items():
            assert got["losses"] == pytest.approx(rank[0]["losses"], rel=1e-5), stage
            assert got["losses"][-1] < got["losses"][0], stage
            assert got["resumed_tail"] == got["losses"][2:], stage
            assert got["resumed_equal"], stage
            # only the adapters are in the optimizer
            assert got["optimizer_numel"] == got["adapter_numel"] > 0, stage
            assert got["saved"], stage
    for stage in (0, 1, 2, 3):
        exported = load_file(tmp_path / f"{stage}-16bit" / "model.safetensors")
        assert any("lora_A" in k for k in exported) and any("base_layer" in k for k in exported)


def train_peft_recomputed(modes: list[str]) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = torch.randint(0, 101, (2 * world, 16), generator=torch.Generator().manual_seed(2))
    ids = batch[2 * rank : 2 * rank + 2]
    out = {}
    for mode in modes:
        stage = 0 if mode == "reference" else 3
        model = _peft_gpt2()
        if mode != "reference":
            # HF's checkpointing around each block; reentrant recomputes a forward that ran
            # without grad, so the input must ask for grad for the adapters to get theirs
            model.gradient_checkpointing_enable({"use_reentrant": mode == "reentrant"})
            model.enable_input_require_grads()
        engine = _peft_engine_of(
            model,
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                "steps_per_print": 10**6,
            },
        )
        engine.train()
        out[mode] = _steps(engine, ids, 3)
    return out


@pytest.mark.skipif(not HAS_PEFT, reason="needs transformers and peft")
def test_peft_lora_at_stage_3_with_a_partitioned_base_under_activation_checkpointing():
    """Recomputation gathers a unit inside backward; its frozen base must stay gathered until
    the gradient of the block's input is computed, with both kinds of torch checkpoint."""
    modes = ["reference", "reentrant", "non_reentrant"]
    for got in run_distributed(train_peft_recomputed, 2, modes, timeout=200):
        for mode in modes[1:]:
            assert got[mode] == pytest.approx(got["reference"], rel=1e-5), mode


def lora_fa_from_config() -> dict:
    from models import tiny_hf_gpt2

    import zerotrain

    rank = torch.distributed.get_rank()
    ids = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(2))[2 * rank :][:2]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }
    targets = ["c_attn", "c_fc"]
    out = {}
    for how in ("call", "config"):
        torch.manual_seed(0)
        model = tiny_hf_gpt2()
        if how == "call":
            apply_lora_fa(model, targets, r=4, alpha=8)
            given, cfg = None, config
        else:  # as HF's Trainer calls it: every trainable parameter, taken before
            given = [p for p in model.parameters() if p.requires_grad]
            lora_fa = {"enabled": True, "target_modules": targets, "r": 4, "alpha": 8}
            cfg = {**config, "lora_fa": lora_fa}
        engine, *_ = zerotrain.initialize(model=model, model_parameters=given, config=cfg)
        for module in model.modules():  # B nonzero: the steps move the loss
            if isinstance(module, LoRAFA):
                with zerotrain.zero.GatheredParameters([module.lora_B], modifier_rank=0):
                    torch.manual_seed(1)
                    module.lora_B.data.normal_(std=0.02)
        out[how] = {
            "losses": _steps(engine, ids, 3),
            "state": engine.consolidated_state_dict(),
            "trained": engine.optimizer.num_params,
        }
    torch.manual_seed(0)
    model = tiny_hf_gpt2()
    try:
        zerotrain.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters()),
            config={**config, "lora_fa": {"enabled": True, "target_modules": targets}},
        )
    except zerotrain.ConfigError as error:
        out["refused"] = str(error)
    return out


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_lora_fa_config_section_converts_the_model_inside_initialize():
    with pytest.raises(ConfigError, match="target_modules is empty"):
        load_config({"train_batch_size": 2, "lora_fa": {"enabled": True}}, world_size=1)
    for got in run_distributed(lora_fa_from_config, 2, timeout=200):
        call, config = got["call"], got["config"]
        assert config["losses"] == call["losses"] and config["losses"][-1] < config["losses"][0]
        # B (out x r) of c_attn (out 3 x 48) and c_fc (out 4 x 48) in 2 blocks
        assert config["trained"] == call["trained"] == 2 * (144 * 4 + 192 * 4)
        assert all(torch.equal(call["state"][k], v) for k, v in config["state"].items())
        assert got["refused"].startswith("lora_fa.enabled: initialize adapts the model's layers")
