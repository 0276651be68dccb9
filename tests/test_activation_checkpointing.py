"""Activation checkpointing (zerotrain/activation_checkpointing.py, DeepSpeed's
zerotrain.checkpointing): the same gradients as without it, on one
process and under the engine at every stage; dropout replayed; memory as derived."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_distributed
from models import VOCAB, BlockModel, make_batches, param_groups, run_steps

import zerotrain
from zerotrain import activation_checkpointing as checkpointing
from zerotrain.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt.model import GPT, Block, gpt_config  # noqa: E402


@pytest.fixture(autouse=True)
def default_policy():
    checkpointing.configure()
    checkpointing.reset_stats()
    yield
    checkpointing.configure()


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", **overrides))


def gpt_batch(batch: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (batch, seq), generator=gen) for _ in range(2))


def gradients(model: torch.nn.Module, *batch: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks in every run
    model(*batch).backward()
    return [p.grad for p in model.parameters()]


def assert_bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


# -- one process -------------------------------------------------------------------------------
def test_gradients_identical_and_dropout_replayed():
    model = tiny_gpt(dropout=0.1)
    x, y = gpt_batch(3, 40)
    reference = gradients(model, x, y)
    torch.manual_seed(7)
    assert model(x, y).item() != model(x, y).item()  # dropout draws differ: they must be replayed

    checkpointing.wrap(model)
    assert_bitwise_equal(gradients(model, x, y), reference)
    stats = checkpointing.recompute_stats()
    assert (stats.checkpointed_forwards, stats.recomputations) == (4, 4)
    assert stats.forward_seconds == stats.recompute_seconds == 0.0  # timed only with profile

    with torch.no_grad():  # nothing to keep: checkpoint just calls the block
        model(x, y)
    assert checkpointing.recompute_stats().checkpointed_forwards == 4


def test_cpu_checkpointing_and_profile_keep_the_numbers():
    model = tiny_gpt()
    x, y = gpt_batch(2, 64)
    reference = gradients(model, x, y)
    checkpointing.wrap(model)
    checkpointing.configure(
        deepspeed_config={
            "activation_checkpointing": {
                "cpu_checkpointing": True,
                "synchronize_checkpoint_boundary": True,
                "profile": True,
            }
        }
    )
    assert_bitwise_equal(gradients(model, x, y), reference)
    stats = checkpointing.recompute_stats()
    assert stats.recomputations == 4 and stats.forward_seconds > 0 and stats.recompute_seconds > 0
    assert "4 recomputations" in str(stats) and "s recomputing" in str(stats)


def scaled_tanh(x, *, weight, scale=1.0, bias=None):
    hidden = torch.tanh(x @ weight) * scale  # two (rows x 33) intermediates, not kept
    return (hidden @ weight.T + bias).sum(dim=1)


def test_keyword_arguments_are_inputs():
    torch.manual_seed(0)
    x = torch.randn(5, 7, requires_grad=True)
    weight = torch.randn(7, 33, requires_grad=True)
    bias = torch.randn(7, requires_grad=True)
    inputs = (x, weight, bias)
    scaled_tanh(x, weight=weight, scale=0.5, bias=bias).sum().backward()
    reference = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = checkpointing.checkpoint(scaled_tanh, x, weight=weight, scale=0.5, bias=bias)
    out.sum().backward()
    assert_bitwise_equal([t.grad for t in inputs], reference)
    # Only the inputs, keyword ones included, are kept (and so offloaded by cpu_checkpointing).
    # (Some torch versions also save an empty dummy.)
    assert [t.data_ptr() for t in saved if t.numel()] == [t.data_ptr() for t in inputs]


def block_calls(model: GPT) -> list[int]:
    """Per block, how often its first layer ran: 2 for a recomputed block."""
    calls = [0] * len(model.blocks)
    for index, block in enumerate(model.blocks):

        def count(module, args, index=index):
            calls[index] += 1

        block.ln_attn.register_forward_pre_hook(count)
    return calls


@pytest.mark.parametrize(
    ("every", "expected"), [(1, [2] * 5), (2, [2, 1, 2, 1, 2]), (3, [2, 1, 1, 2, 1])]
)
def test_wrap_checkpoints_every_kth_block(every, expected):
    model = tiny_gpt(n_layer=5)
    calls = block_calls(model)
    assert checkpointing.wrap(model, block_type=Block, every=every) is model
    gradients(model, *gpt_batch(2, 16))
    assert calls == expected
    assert checkpointing.recompute_stats().recomputations == expected.count(2)
    assert list(model.state_dict()) == list(tiny_gpt(n_layer=5).state_dict())


def test_wrap_errors():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="every must be a positive integer, got 0"):
        checkpointing.wrap(model, every=0)
    with pytest.raises(ValueError, match="GPT has no instances of .*Conv1d.*pass the class"):
        checkpointing.wrap(model, block_type=torch.nn.Conv1d)
    checkpointing.wrap(model)  # the default: the children of the ModuleList, the GPT blocks
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpointing.wrap(model, block_type=Block)


def estimated_activation_bytes(batch: int, every: int | None) -> int:
    """Saved-activation bytes of the demo GPT (fp32, dropout 0), derived op by op.

    B batch, T sequence, d width, h heads, V vocabulary; counts are elements of 4 bytes.
    One block keeps, for its backward:
      ln_attn: its input x (BTd) and per-row mean and rstd (2BT);
      qkv: its input, the normalised x (BTd);
      attention (torch's CPU flash kernel): q, k, v, views of the qkv output (3BTd), its output
        (BTd) and the per-row logsumexp (BhT). The kernel lays the output out as (B, T, h, d/h),
        so the transpose and reshape into proj's input are views: no storage of their own;
      ln_mlp: its input x + attn (BTd), mean and rstd (2BT);
      fc: its input (BTd); GELU: its input, fc's output (4BTd); proj: GELU's output (4BTd);
      the residual adds and the p=0 dropouts keep nothing;
    in all 16BTd + BhT + 4BT. Outside the blocks: the token ids (BT int64) and positions (T
    int64) for the embeddings' backward; ln_final's input (BTd) and mean and rstd (2BT);
    lm_head's input (BTd); cross entropy's log-softmax output (BTV), the targets (BT int64) and
    a scalar total weight.
    A checkpointed block keeps only its input, BTd (torch saves the inputs of the region and
    recomputes the rest), so with every block checkpointed the blocks keep L*BTd instead of
    L*(16BTd + BhT + 4BT): 1/16 of it, plus the small per-row terms. The peak of the backward
    adds back one block's full set while that block is recomputed.
    """
    cfg = gpt_config("demo")
    B, T, d, h, V, L = batch, cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer
    full_block = 4 * (16 * B * T * d + B * h * T + 4 * B * T)
    checkpointed_block = 4 * B * T * d
    outside = 8 * B * T + 8 * T + 4 * (2 * B * T * d + 2 * B * T + B * T * V) + 8 * B * T + 4
    blocks = [
        checkpointed_block if every and index % every == 0 else full_block for index in range(L)
    ]
    return outside + sum(blocks)


def test_saved_activation_memory_falls_as_derived():
    torch.manual_seed(0)
    batch = gpt_batch(2, gpt_config("demo").block_size)
    measured = {}
    for every in (None, 2, 1):
        torch.manual_seed(0)
        model = GPT(gpt_config("demo"))
        if every:
            checkpointing.wrap(model, every=every)
        with checkpointing.count_saved_activations(model.parameters()) as saved:
            loss = model(*batch)
        loss.backward()
        measured[every] = saved.nbytes
        assert measured[every] == estimated_activation_bytes(2, every), every
    print(
        "saved activations, demo GPT, batch 2 x 128: "
        + ", ".join(f"every {k}: {v / 2**20:.2f} MiB" for k, v in measured.items())
    )
    assert measured[None] / measured[1] > 10  # 26.0 MB -> 2.4 MB


# -- config ------------------------------------------------------------------------------------
def test_config_section_and_configure(tmp_path):
    config = {
        "train_batch_size": 4,
        "activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 6},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    checkpointing.configure(None, str(path), profile=True)
    policy = checkpointing._policy
    assert policy.cpu_checkpointing and policy.profile and policy.number_checkpoints == 6
    assert checkpointing.is_configured()
    checkpointing.configure(checkpoint_in_cpu=False)  # keys not given fall back to defaults
    assert checkpointing._policy == zerotrain.config.ActivationCheckpointingConfig()
    assert checkpointing._policy.model_dump() == {  # DeepSpeed's defaults
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }

    section = {"contiguous_memory_optimization": True, "partition_activation": True}
    with pytest.raises(ConfigError, match=r"partition_activation: unknown key; did you mean"):
        checkpointing.configure(deepspeed_config={"activation_checkpointing": section})
    with pytest.raises(ConfigError, match=r"^activation_checkpointing: contiguous_memory_opt"):
        checkpointing.configure(contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="requires partition_activations and number_checkpoints"):
        checkpointing.configure(contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match=r"requires number_checkpoints \("):
        checkpointing.configure(contiguous_checkpointing=True, partition_activations=True)
    with pytest.raises(ConfigError, match="model parallelism is not supported"):
        checkpointing.configure(object())

    checkpointing._warned = False
    with pytest.warns(UserWarning, match="partition_activations has no effect"):
        checkpointing.configure(partition_activations=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        checkpointing.configure(partition_activations=True)


def test_configure_with_a_null_section_takes_the_defaults():
    """A DeepSpeed dict whose section is null reads as a config without one (found by the type
    checker: the null section used to reach configure as None, an AttributeError)."""
    checkpointing.configure(deepspeed_config={"activation_checkpointing": {"profile": True}})
    checkpointing.configure(
        deepspeed_config={"train_batch_size": 4, "activation_checkpointing": None}
    )
    assert checkpointing._policy == zerotrain.config.ActivationCheckpointingConfig()
    checkpointing.configure()


# -- under the engine, 2 ranks -----------------------------------------------------------------
class ManualCheckpointModel(BlockModel):
    """BlockModel whose forward calls ``checkpoint`` on block modules itself, DeepSpeed style:
    block 0 and the first call of block 1 as one region, the second call of block 1 and block 2
    alone. The recomputation runs the blocks' stage-3 hooks again, inside the backward."""

    def forward(self, idx, targets):
        h = self.embed(idx) * self.mix
        h = checkpointing.checkpoint(lambda t: self.blocks[1](self.blocks[0](t)), h)
        h = checkpointing.checkpoint(self.blocks[1], h)
        h = checkpointing.checkpoint(self.blocks[2], h)
        logits = F.linear(h, self.embed.weight, self.head_bias)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def train_two_steps(stage: int, kind: str, checkpointed: bool) -> dict:
    from zerotrain.comm import Communicator

    comm = Communicator()
    torch.manual_seed(0)
    if kind == "gpt":  # dropout inside every block
        model = GPT(gpt_config("tiny", dropout=0.1, n_layer=3))
        if checkpointed:
            checkpointing.wrap(model, every=1)
        idx, tgt = (torch.randint(0, 256, (2, 8, 24)) for _ in range(2))
    else:
        model = ManualCheckpointModel() if checkpointed else BlockModel()
        idx, tgt = make_batches(2, 8)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "seed": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        # stage 3: every block released after its forward, so gathered again for its backward
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        },
        "steps_per_print": 10**6,
    }
    if checkpointed:
        config["activation_checkpointing"] = {"cpu_checkpointing": True, "profile": True}
    checkpointing.reset_stats()
    engine, optimizer, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, 0.1), config=config
    )
    run_steps(engine, idx, tgt, 2, 2, comm.world_size, comm.rank)
    gatherer = getattr(engine.optimizer.group.residency, "gatherer", None)
    return {
        "state": engine.consolidated_state_dict(),
        "traffic": (gatherer.gathers, gatherer.prefetched) if gatherer else None,
        "stats": checkpointing.recompute_stats(),
    }


def train_grid() -> dict:
    return {
        (stage, kind, checkpointed): train_two_steps(stage, kind, checkpointed)
        for stage in (0, 1, 2, 3)
        for kind in ("gpt", "manual")
        for checkpointed in (False, True)
    }


def test_engine_stages_0_to_3_same_parameters_with_checkpointing():
    results = run_distributed(train_grid, 2)
    for rank_results in results:
        for (stage, kind, checkpointed), run in rank_results.items():
            if not checkpointed:
                continue
            reference = rank_results[(stage, kind, False)]
            assert run["state"].keys() == reference["state"].keys()
            for name, value in reference["state"].items():
                assert torch.equal(run["state"][name], value), (stage, kind, name)
            # Stage 3: the recomputation found its blocks gathered, without extra gathers and
            # without disturbing the recorded order that prefetching follows.
            assert run["traffic"] == reference["traffic"], (stage, kind)
            # initialize applied the section: profile timed the recomputations.
            stats = run["stats"]
            assert stats.recomputations == 3 * 2 * 2  # 3 regions, 2 steps of 2 micro-steps
            assert stats.recompute_seconds > 0, (stage, kind)


def test_host_offload_fetches_one_region_ahead_and_changes_nothing():
    """[Note: activation offload], its copies forced on a CPU: in backward, while a region
    recomputes, only the next region's input is back ahead of use; the gradients are those
    without offload, bit for bit."""
    from zerotrain.activation_checkpointing import HostOffload

    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(5)]
    x = torch.randn(4, 8, requires_grad=True)

    def loss_of(offload):
        h = x
        for block in blocks:
            with offload.region() if offload else contextlib.nullcontext():
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return h.square().sum()

    loss_of(None).backward()
    reference = [t.grad.clone() for t in [x, *(p for b in blocks for p in b.parameters())]]
    for t in [x, *(p for b in blocks for p in b.parameters())]:
        t.grad = None
    offload = HostOffload(torch.device("cpu"))
    loss = loss_of(offload)
    ahead = []
    for block in blocks:  # runs again only in the recomputation
        block.register_forward_pre_hook(lambda module, args: ahead.append(offload.resident()))
    loss.backward()
    assert ahead == [1, 1, 1, 1, 0]  # last block first; the next region's one input is back
    got = [t.grad for t in [x, *(p for b in blocks for p in b.parameters())]]
    assert_bitwise_equal(got, reference)


def test_transformers_gradient_checkpointing_follows_the_policy():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    assert checkpointing.use_for_transformers(model) == 3  # the base model and its 2 layers
    before = checkpointing.recompute_stats().recomputations
    ids = torch.randint(0, 32, (1, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    assert checkpointing.recompute_stats().recomputations - before == 2
