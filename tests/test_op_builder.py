"""DeepSpeed's capability probes (``deepspeed.ops.__compatible_ops__``, the ``op_builder``
classes, ``deepspeed.ops.aio``) as clients use them, and that what they call compatible runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import zerotrain
from zerotrain.ops import op_builder
from zerotrain.ops.op_builder import ALL_OPS, OpNotAvailable

ROOT = Path(__file__).resolve().parents[1]

SERVED = {"fused_adam", "cpu_adam", "async_io", "fused_lamb"}

CLIENT_PROBES = """
import deepspeed
from deepspeed.ops.aio import AsyncIOBuilder  # transformers' require_deepspeed_aio
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, InferenceBuilder
from deepspeed.ops.op_builder.builder import OpBuilder
from deepspeed.ops.op_builder.all_ops import ALL_OPS
import zerotrain

assert deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME] is True
assert CPUAdamBuilder().is_compatible() and FusedAdamBuilder().is_compatible(verbose=False)
assert deepspeed.ops.__compatible_ops__[InferenceBuilder.NAME] is False
assert not OpBuilder.is_rocm_pytorch() and set(ALL_OPS) == set(deepspeed.ops.__compatible_ops__)
assert deepspeed.ops.op_builder is zerotrain.ops.op_builder
try:
    CPUAdamBuilder().load()
except RuntimeError as err:  # DeepSpeed's own failed load is a RuntimeError
    print(err)
"""


def test_client_probes_through_the_deepspeed_alias() -> None:
    # a fresh interpreter: the alias must be active before anything imports deepspeed
    code = "from zerotrain.compat import deepspeed as c; c.activate(announce=False)\n"
    done = subprocess.run(
        [sys.executable, "-c", code + textwrap.dedent(CLIENT_PROBES)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "CPUAdamBuilder().load(): zerotrain compiles no DeepSpeed extension" in done.stdout
    assert "DeepSpeedCPUAdam" in done.stdout


def test_compatible_ops_are_exactly_what_zerotrain_serves() -> None:
    compatible = zerotrain.ops.__compatible_ops__
    assert {name for name, ok in compatible.items() if ok} == SERVED
    for name, builder in ALL_OPS.items():
        assert builder.NAME == builder.name == name
        assert builder.is_compatible() is compatible[name]
    assert op_builder.GDSBuilder().is_compatible() is False  # a subclass of AsyncIOBuilder


def test_load_names_what_to_use_instead() -> None:
    with pytest.raises(OpNotAvailable, match=r"served by NVMe offload .*zerotrain\.zero\.swap"):
        op_builder.AsyncIOBuilder().load()
    with pytest.raises(RuntimeError, match=r"Adagrad.*__compatible_ops__\['cpu_adagrad'\]"):
        op_builder.CPUAdagradBuilder().jit_load()
    builder = op_builder.SparseAttnBuilder()
    assert builder.error_log is None
    assert not builder.is_compatible() and "sparse_attn" in str(builder.error_log)


def _config_for(op: str, tmp_path: Path) -> tuple[dict, type | None]:
    """The config or optimizer a client picks once the probe says ``op`` is there."""
    config: dict = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    optimizer = None
    if op == "async_io":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
        config["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": str(tmp_path),
        }
    elif op == "cpu_adam":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        optimizer = zerotrain.ops.adam.DeepSpeedCPUAdam
    elif op == "fused_adam":
        optimizer = zerotrain.ops.adam.FusedAdam
    else:
        config["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-2}}
    return config, optimizer


@pytest.mark.parametrize("op", sorted(SERVED))
def test_what_the_probes_call_compatible_trains(op: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    config, optimizer_class = _config_for(op, tmp_path)
    optimizer = optimizer_class(model.parameters(), lr=1e-2) if optimizer_class else None
    engine, *_ = zerotrain.initialize(model=model, optimizer=optimizer, config=config)
    before = [p.detach().clone() for p in model.parameters()]
    loss = engine(torch.randn(2, 8)).square().mean()
    engine.backward(loss)
    engine.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
