"""comm_compression.hierarchical_partition (hpZ): 4 ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE),
stage 3 with every block gathered again for backward. The secondary partition serves those
gathers inside the node: the same model as without it, bit for bit (quantized gathers too),
the bytes moved from the world's all-gather to the node's, its memory counted."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from distributed import run_distributed
from torch import nn

from zerotrain.config import ConfigError, load_config

WIDTH = 24


class Blocks(nn.Module):
    """Three blocks (stage 3's units) between two layers of the root unit."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.last = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.last(x).square().mean()


def hpz_engine(
    hierarchical: bool, parameters: str = "none", zero_plus_plus: bool = False, freeze=None
):
    """The engine; ``zero_plus_plus``: asking for hpZ (2 ranks) and int8 parameter gathers by
    DeepSpeed's ZeRO++ keys instead of the comm_compression section; ``freeze``: the block
    whose parameters are frozen."""
    import zerotrain

    torch.manual_seed(0)
    model = Blocks()
    if freeze is not None:
        model.blocks[freeze].requires_grad_(False)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,  # every block gathered again for backward
        "stage3_prefetch_bucket_size": 0,
    }
    compression = {"hierarchical_partition": hierarchical, "parameters": {"method": parameters}}
    if parameters != "none":
        compression["parameters"]["block_size"] = 64
    if zero_plus_plus:
        zero.update(zero_hpz_partition_size=2, zero_quantized_weights=True)
        compression = {"parameters": {"block_size": 64}}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": None,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        "comm_compression": compression,
    }
    return zerotrain.initialize(model=model, config=config)[0]


def train_three_steps(engine) -> tuple[dict, dict]:
    """The model after 3 steps on this rank's data, and the bytes the last step sent."""
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(3):
        engine.comm.reset_stats()
        engine.backward(engine(torch.randn(4, WIDTH, generator=gen)))
        engine.step()
    return engine.consolidated_state_dict(), {op: s.sent for op, s in engine.comm.stats.items()}


def hpz_runs() -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 nodes of 2 ranks: ranks 0-1 and 2-3
    out: dict = {}
    for hierarchical in (False, True):
        for parameters in ("none", "int8"):
            engine = hpz_engine(hierarchical, parameters)
            state, sent = train_three_steps(engine)
            memory = engine.memory_breakdown()
            buckets = [b.numel_padded for b in engine.optimizer.group.buckets]
            out[hierarchical, parameters] = (state, sent, memory["compression"], buckets)
    # a frozen block travels exactly: qwZ quantizes the trained parameters' gathers
    engine = hpz_engine(False, "int4", freeze=1)
    out["frozen"] = train_three_steps(engine)
    # one node of 4: nothing to keep inside it, a warning says so
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    # DeepSpeed's keys ask for partitions of 2 ranks: the size comes from them, not the node
    out["ZeRO++ keys"] = train_three_steps(hpz_engine(True, zero_plus_plus=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = hpz_engine(True)
    secondary = engine.optimizer.group.residency.in_flight.secondary
    out["one node"] = ([str(w.message) for w in caught], secondary is None)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(hpz_runs, 4)


@pytest.mark.parametrize("parameters", ["none", "int8"])
def test_hpz_trains_the_same_model_bit_for_bit(runs, parameters):
    for out in runs:
        plain, hpz = out[False, parameters][0], out[True, parameters][0]
        assert plain.keys() == hpz.keys()
        assert all(torch.equal(plain[k], hpz[k]) for k in plain)


def test_frozen_parameters_are_gathered_exactly(runs):
    """Stage 3 with int4 parameter gathers and a frozen block: its values, in the exported
    state, are the ones the model was built with (qwZ's gathers quantize the trained
    parameters; before, the frozen ones were exported and checkpointed quantized)."""
    torch.manual_seed(0)
    built = Blocks().blocks[1].weight.detach()
    for out in runs:
        state, sent = out["frozen"]
        assert torch.equal(state["blocks.1.weight"], built)
        assert sent["int4_param_all_gather"] > 0


def test_deepspeed_zero_plus_plus_keys_train_as_the_comm_compression_section(runs):
    """zero_hpz_partition_size 2 and zero_quantized_weights at stage 3, on one node of 4: the
    model and the bytes of hpZ over 2 ranks with int8 gathers, configured in comm_compression
    on 2 nodes of 2."""
    for out in runs:
        state, sent = out["ZeRO++ keys"]
        want_state, want_sent, _, _ = out[True, "int8"]
        assert all(torch.equal(state[k], want_state[k]) for k in want_state)
        assert sent == want_sent and sent["hpz_all_gather"] > 0


def test_zero_plus_plus_keys_below_stage_3_and_against_the_section():
    zero = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    cfg = load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=4)
    assert cfg.comm_compression.parameters.method == "int8"
    assert cfg.comm_compression.gradients.method == "int4"
    assert not cfg.comm_compression.hierarchical_partition
    # below stage 3 DeepSpeed ignores them, and so does zerotrain, saying so
    with pytest.warns(UserWarning, match="zero_quantized_weights, zero_hpz_partition_size: ZeRO"):
        cfg = load_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {
                    "stage": 2,
                    "zero_quantized_weights": True,
                    "zero_hpz_partition_size": 8,
                },
            },
            world_size=4,
        )
    plain = load_config({"train_batch_size": 8}, world_size=4)
    assert cfg.comm_compression == plain.comm_compression
    disagreeing = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8},
        "comm_compression": {"hierarchical_partition": True, "hierarchical_partition_size": 4},
    }
    with pytest.raises(ConfigError, match="zero_hpz_partition_size: 8 asks for `comm_compres"):
        load_config(disagreeing, world_size=16)
    with pytest.raises(ConfigError, match="hierarchical_partition_size: the ranks per node of"):
        load_config(
            {"train_batch_size": 8, "comm_compression": {"hierarchical_partition_size": 2}},
            world_size=4,
        )


def test_backward_gathers_stay_inside_the_node(runs):
    for out in runs:
        _, plain, _, buckets = out[False, "none"]
        _, hpz, _, _ = out[True, "none"]
        assert "hpz_all_gather" not in plain and hpz["hpz_all_gather"] > 0
        # a re-gather of B bytes: 3/4 B over the 4 ranks, or 1/2 B over the node's 2
        moved = plain["all_gather"] - hpz["all_gather"]
        assert moved > 0 and moved * 2 == hpz["hpz_all_gather"] * 3
        # three blocks and the root's two layers; the first two blocks are gathered again for
        # backward (the last one's backward follows its forward: kept, at distance 0)
        block = WIDTH * WIDTH + WIDTH
        assert buckets.count(block) == 3
        assert hpz["hpz_all_gather"] == 2 * block * 4 // 2
        # quantized gathers: only the first gather is quantized, the node's serves the values
        _, quantized, _, _ = out[True, "int8"]
        assert quantized["hpz_all_gather"] == hpz["hpz_all_gather"]


def test_the_secondary_partition_is_counted(runs):
    for out in runs:
        _, _, plain_kept, _ = out[False, "none"]
        _, _, kept, buckets = out[True, "none"]
        assert plain_kept == 0
        assert kept == sum(n // 2 * 4 for n in buckets)  # each bucket's half, fp32


def test_one_node_warns_and_runs_without(runs):
    messages, off = runs[0]["one node"]
    assert off
    assert any(
        "hierarchical_partition: the 4 data-parallel ranks sit on one node" in m for m in messages
    )


def test_hpz_needs_stage_3():
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    config["comm_compression"] = {"hierarchical_partition": True}
    with pytest.raises(ConfigError, match="hierarchical_partition: partitions stage 3's"):
        load_config(config, world_size=1)
