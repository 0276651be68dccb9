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


def hpz_engine(hierarchical: bool, parameters: str = "none"):
    import zerotrain

    torch.manual_seed(0)
    model = Blocks()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": None,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,  # every block gathered again for backward
            "stage3_prefetch_bucket_size": 0,
        },
        "comm_compression": {
            "hierarchical_partition": hierarchical,
            "parameters": {"method": parameters, "block_size": 64},
        },
    }
    return zerotrain.initialize(model=model, config=config)[0]


def hpz_runs() -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 nodes of 2 ranks: ranks 0-1 and 2-3
    rank = torch.distributed.get_rank()
    out: dict = {}
    for hierarchical in (False, True):
        for parameters in ("none", "int8"):
            engine = hpz_engine(hierarchical, parameters)
            gen = torch.Generator().manual_seed(rank)
            sent = []
            for _ in range(3):
                engine.comm.reset_stats()
                engine.backward(engine(torch.randn(4, WIDTH, generator=gen)))
                engine.step()
                sent.append({op: s.sent for op, s in engine.comm.stats.items()})
            memory = engine.memory_breakdown()
            buckets = [b.numel_padded for b in engine.optimizer.group.buckets]
            out[hierarchical, parameters] = (
                engine.consolidated_state_dict(),
                sent[-1],
                memory["compression"],
                buckets,
            )
    # one node of 4: nothing to keep inside it, a warning says so
    os.environ["LOCAL_WORLD_SIZE"] = "4"
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
