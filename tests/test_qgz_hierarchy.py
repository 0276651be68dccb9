"""comm_compression.gradients.hierarchical (ZeRO++'s qgZ hierarchy) on 4 ranks as 2 nodes of 2:
the quantized reduce-scatter exchanges inside each node first, then across the nodes. The
codec against the same two exchanges written out with the quantization operators, the bytes
each exchange sends, the fallback where the node holds one rank or all, and the engine's
wiring from the config."""

from __future__ import annotations

import warnings

import pytest
import torch
from distributed import run_distributed
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.compression import BucketShape, GradientCompression, make_codec
from zerotrain.compression.quantize import dequantize, quantize
from zerotrain.config import ConfigError, load_config

PIECE, BLOCK = 40, 8  # each rank's piece of the bucket; elements per quantization block


def int8(values: torch.Tensor) -> torch.Tensor:
    """``values`` as the codec's int8 blocks stand for them."""
    return dequantize(quantize(values, 8, BLOCK), BLOCK)


def codec_runs() -> dict:
    world = Communicator()
    gen = torch.Generator().manual_seed(world.rank)
    grads = torch.randn(4 * PIECE, generator=gen)
    bucket = [BucketShape(4 * PIECE, [(0, (4 * PIECE,))])]
    out: dict = {"inputs": world.all_gather_object(grads)}
    for name, ranks_per_node in (("hierarchical", 2), ("flat", 0)):
        options = GradientCompression(
            method="int8", block_size=BLOCK, ranks_per_node=ranks_per_node
        )
        codec = make_codec(options, world, bucket)
        world.reset_stats()
        shard = torch.empty(PIECE)
        codec.reduce_scatter(0, shard, grads.clone()).wait()
        out[name] = (shard, {op: s.sent for op, s in world.stats.items()})
    with warnings.catch_warnings(record=True) as caught:  # one node of 4 ranks
        warnings.simplefilter("always")
        options = GradientCompression(method="int8", block_size=BLOCK, ranks_per_node=4)
        out["one node"] = (
            make_codec(options, world, bucket).by_node,
            [str(w.message) for w in caught],
        )
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(codec_runs, 4)


def test_node_sums_then_sums_across_nodes_as_written_out(runs):
    """Rank r = place r % 2 on node r // 2. Inside a node, place l receives from each of its
    node's ranks their pieces l and 2 + l (one quantized vector) and sums them; across the
    nodes, rank r receives from each node its sum of piece r (quantized again) and sums
    those: bit for bit, and within int8's error of the exact sum."""
    inputs = runs[0]["inputs"]
    node_sums = {}  # (node, place) -> that node's sum of the place's pieces on both nodes
    for node in range(2):
        for place in range(2):
            total = torch.zeros(2 * PIECE)
            for rank in (2 * node, 2 * node + 1):
                total += int8(inputs[rank].view(2, 2, PIECE)[:, place].reshape(-1))
            node_sums[node, place] = total
    exact = torch.stack(inputs).sum(0).view(4, PIECE)
    for rank, run in enumerate(runs):
        node, place = divmod(rank, 2)
        want = torch.zeros(PIECE)
        for other in range(2):
            want += int8(node_sums[other, place].view(2, PIECE)[node])
        got = run["hierarchical"][0]
        assert torch.equal(got, want), rank
        assert ((got - exact[rank]).norm() / exact[rank].norm()).item() < 0.03


def test_the_bytes_between_nodes_halve(runs):
    """Per rank: inside the node one peer gets 2 pieces (80 codes, 10 scales), across the
    nodes one rank gets 1 piece (40 codes, 5 scales); in one exchange 3 ranks get a piece,
    2 of them on the other node."""
    for run in runs:
        assert run["hierarchical"][1] == {
            "int8_reduce_scatter_in_node": 80 + 10 * 4,
            "int8_reduce_scatter_across_nodes": 40 + 5 * 4,
        }
        assert run["flat"][1] == {"int8_reduce_scatter": 3 * (40 + 5 * 4)}


def test_one_node_warns_and_exchanges_once(runs):
    for run in runs:
        by_node, caught = run["one node"]
        assert by_node is None
        assert any("sit on one node (4 ranks per node)" in m for m in caught)


# -- through the engine --------------------------------------------------------------------------
def engine_runs() -> dict:
    import zerotrain

    out = {}
    for name, hierarchical in (("hierarchical", True), ("flat", False)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        gradients = {"method": "int8", "block_size": 64, "hierarchical": hierarchical}
        compression: dict = {"gradients": gradients}
        if hierarchical:
            compression["hierarchical_partition_size"] = 2
        engine = zerotrain.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": 4,
                "steps_per_print": None,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "comm_compression": compression,
            },
        )[0]
        engine.optimizer.comm.reset_stats()
        gen = torch.Generator().manual_seed(Communicator().rank)
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 32, generator=gen)).square().mean())
            engine.step()
        out[name] = (engine.consolidated_state_dict(), sorted(engine.optimizer.comm.stats))
    return out


def test_the_engine_reduces_by_node_from_the_config():
    """Stage 3, int8 gradients over 2 nodes of 2: the hierarchical run sends its gradients
    inside the nodes and across them, and trains the flat run's model within int8's error."""
    per_rank = run_distributed(engine_runs, 4)
    for run in per_rank:
        (hierarchical, ops), (flat, flat_ops) = run["hierarchical"], run["flat"]
        assert {"int8_reduce_scatter_in_node", "int8_reduce_scatter_across_nodes"} <= set(ops)
        assert "int8_reduce_scatter" in flat_ops and "int8_reduce_scatter" not in ops
        for key, value in flat.items():
            error = (hierarchical[key] - value).norm() / value.norm()
            assert 0 < error.item() < 0.02, key  # another quantization, the same training


def test_config_of_the_hierarchy():
    base = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
    powersgd = {"gradients": {"method": "powersgd", "hierarchical": True}}
    stage2 = {**base, "zero_optimization": {"stage": 2}, "comm_compression": powersgd}
    with pytest.raises(ConfigError, match="gradients.hierarchical: acts on int8, int4"):
        load_config(stage2, world_size=4)
    size_alone = {"hierarchical_partition_size": 2, "gradients": {"method": "int4"}}
    with pytest.raises(ConfigError, match="hierarchical_partition and gradients.hierarchical"):
        load_config({**base, "comm_compression": size_alone}, world_size=4)
    size_alone["gradients"]["hierarchical"] = True
    load_config({**base, "comm_compression": size_alone}, world_size=4)
    with pytest.raises(ConfigError, match="hierarchical: not with auto yet"):
        load_config({**base, "comm_compression": {**size_alone, "auto": True}}, world_size=4)
