"""ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules and its neighbours): a leaf's
parameters are gathered together for its forward and backward, so a Mixture-of-Experts block
whose ranks route to different experts trains as one process does."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from models import DIM, VOCAB, make_batches, micro_batch, relative_error
from torch import nn

import zerotrain

STEPS, MICRO, LR = 3, 2, 2e-2


class Expert(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(h)))


class SparseMoeBlock(nn.Module):
    """Each sequence goes to one expert, chosen by its first token's parity; the experts (of
    different sizes) are the model's outermost list."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([Expert(5), Expert(6)])

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if chosen.any():
                out[chosen] = expert(h[chosen])
        return h + out


class MoeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = SparseMoeBlock()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.moe(self.embed(idx), idx[:, 0] % 2)
        return F.cross_entropy(self.head(h).view(-1, VOCAB), targets.view(-1))


def _batches(world: int):
    """Rank 0's sequences all start with an even token (expert 0), rank 1's with an odd one."""
    idx, tgt = make_batches(STEPS, MICRO * world)
    idx[:, :, 0] = 2 * (idx[:, :, 0] // 2)  # even
    idx[:, MICRO:, 0] = torch.where(idx[:, MICRO:, 0] + 1 < VOCAB, idx[:, MICRO:, 0] + 1, 1)
    return idx, tgt


def _model() -> MoeModel:
    torch.manual_seed(0)
    return MoeModel()


def reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.0)
    idx, tgt = _batches(2)
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train_with_leaf(leaf_module: dict | None):
    """With ``leaf_module`` None the block is marked by hand, else by the config's section."""
    from zerotrain.comm import Communicator
    from zerotrain.utils import set_z3_leaf_modules

    comm = Communicator()
    model = _model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if leaf_module is None:
        set_z3_leaf_modules(model, [SparseMoeBlock])  # as Accelerate's transformer_moe_cls_names
    else:
        zero["leaf_module"] = leaf_module
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": 1e-6, "weight_decay": 0}},
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    idx, tgt = _batches(comm.world_size)
    experts_used = set()
    for step in range(STEPS):
        x = micro_batch(idx[step], 0, comm.rank, comm.world_size, MICRO)
        y = micro_batch(tgt[step], 0, comm.rank, comm.world_size, MICRO)
        experts_used.update((x[:, 0] % 2).tolist())
        engine.backward(engine(x, y))
        engine.step()
    units = [u.module for u in engine.optimizer.group.residency.gatherer.units if not u.is_root]
    return {
        "state": engine.consolidated_state_dict(),
        "experts_used": sorted(experts_used),
        "units_are_the_block": units == [engine.module.moe],
    }


@pytest.mark.parametrize(
    "leaf_module",
    [None, {"classes": "SparseMoeBlock"}, {"name_suffixes": ["moe"]}],
    ids=["set_z3_leaf_modules", "config-classes", "config-suffixes"],
)
def test_moe_block_marked_leaf_trains_as_one_process_when_ranks_use_different_experts(
    leaf_module,
):
    want = reference()
    results = run_distributed(train_with_leaf, 2, leaf_module, collective_timeout_s=20)
    assert [r["experts_used"] for r in results] == [[0], [1]]  # the premise: disjoint experts
    for got in results:
        assert got["units_are_the_block"]
        for key, value in want.items():
            err = relative_error(got["state"][key], value)
            assert err < 1e-5, f"{key}: {err:.2e}"


def test_leaf_mark_chooses_the_gather_unit_and_the_api_reads_it():
    from zerotrain.utils import (
        get_z3_leaf_modules,
        set_z3_leaf_modules,
        set_z3_leaf_modules_by_name,
        unset_z3_leaf_modules,
        z3_leaf_module,
        z3_leaf_parameter,
    )
    from zerotrain.zero.units import find_unit_modules

    model = _model()
    experts = list(model.moe.experts)
    # unmarked, each expert is a unit of its own: ranks routing differently gather differently
    assert find_unit_modules(model) == experts
    assert set_z3_leaf_modules(model, ["SparseMoeBlock"]) == [model.moe]
    assert z3_leaf_module(model.moe) and not z3_leaf_module(model)
    assert get_z3_leaf_modules(model) == [model.moe]
    assert z3_leaf_parameter(model.moe.experts[1].up.weight)
    assert not z3_leaf_parameter(model.embed.weight)
    assert find_unit_modules(model) == [model.moe]
    assert unset_z3_leaf_modules(model, [SparseMoeBlock]) == [model.moe]
    assert get_z3_leaf_modules(model) == [] and find_unit_modules(model) == experts
    assert not z3_leaf_parameter(model.moe.experts[1].up.weight)
    assert set_z3_leaf_modules_by_name(model, ["moe.experts.0"]) == ([experts[0]], [])
    assert find_unit_modules(model) == experts  # a leaf that is a unit already
    with pytest.raises(ValueError, match="Expert2"):
        set_z3_leaf_modules(model, ["Expert2"])
    assert set_z3_leaf_modules(model, ["Expert2"], raise_if_not_found=False) == []


def test_leaf_module_config_marks_its_classes_names_and_suffixes_and_warns_on_no_match():
    from zerotrain.config import LeafModuleConfig
    from zerotrain.runtime.zero.leaf_module_config import (
        DEFAULT_LEAF_MODULE_CLASSES,
        DeepSpeedZeroLeafModuleConfig,
    )
    from zerotrain.utils.z3_leaf_module import apply_zero_leaf_module_config

    assert DeepSpeedZeroLeafModuleConfig is LeafModuleConfig
    assert LeafModuleConfig().classes == DEFAULT_LEAF_MODULE_CLASSES  # DeepSpeed's MoE blocks
    assert any(c.endswith(".Qwen3MoeSparseMoeBlock") for c in DEFAULT_LEAF_MODULE_CLASSES)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults matching nothing is no news
        assert apply_zero_leaf_module_config(model, LeafModuleConfig()) == []
    by_name = LeafModuleConfig(names="moe.experts.0", name_suffixes=["experts.1"])
    assert apply_zero_leaf_module_config(model, by_name) == list(model.moe.experts)
    qualified = f"{SparseMoeBlock.__module__}.SparseMoeBlock"
    with pytest.warns(UserWarning, match=r"\['Nope', 'no.such', 'xyz'\] match no module"):
        found = apply_zero_leaf_module_config(
            _model(),
            LeafModuleConfig(classes=[qualified, "Nope"], names=["no.such"], name_suffixes=["xyz"]),
        )
    assert [type(m) for m in found] == [SparseMoeBlock]


def test_leaf_module_config_is_read_at_stage_3_only():
    from zerotrain.config import load_config
    from zerotrain.utils import get_z3_leaf_modules

    section = {"leaf_module": {"classes": ["SparseMoeBlock"]}}
    base = {"train_micro_batch_size_per_gpu": 1}
    loaded = load_config({**base, "zero_optimization": section}, world_size=1)
    assert loaded.zero_optimization.leaf_module.classes == ["SparseMoeBlock"]
    misspelled = {"leaf_module": {"clases": ["SparseMoeBlock"]}}
    with pytest.raises(zerotrain.ConfigError, match="leaf_module.clases"):
        load_config({**base, "zero_optimization": misspelled}, world_size=1)
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, **section}}
    zerotrain.initialize(model=model, config=config)
    assert get_z3_leaf_modules(model) == []  # DeepSpeed marks them at stage 3 only
