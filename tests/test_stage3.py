"""Stage 3: partitioned parameters on real-model patterns, bounded working set, memory."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed
from models import BlockModel, make_batches, param_groups, relative_error, run_steps

import zerotrain

STEPS, MICRO, ACCUM = 3, 2, 2
LR, WD, CLIP = 2e-2, 0.1, 0.5


def _config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": 1e-6}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
        "steps_per_print": 10**6,
    }


def reference(world: int):
    """Single process; also the eval loss after every step (no_grad, eval mode)."""
    torch.manual_seed(0)
    model = BlockModel()
    opt = torch.optim.AdamW(param_groups(model, WD), lr=LR, eps=1e-6)
    idx, tgt = make_batches(STEPS, MICRO * ACCUM * world)
    evals = []
    for step in range(STEPS):
        model(idx[step], tgt[step]).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            evals.append(model(idx[0], tgt[0]).item())
        model.train()
    return model.state_dict(), evals


def _seeded_block_model():
    torch.manual_seed(0)
    return BlockModel()


def train_block_model(stages, zero_options, build=_seeded_block_model):
    from zerotrain.comm import Communicator

    comm = Communicator()
    world, rank = comm.world_size, comm.rank
    out = {}
    for stage in stages:
        model = build()
        engine, optimizer, *_ = zerotrain.initialize(
            model=model,
            model_parameters=param_groups(model, WD),
            config=_config(stage, **zero_options),
        )
        idx, tgt = make_batches(STEPS, MICRO * ACCUM * world)
        evals = []

        def evaluate(_step, engine=engine, evals=evals, x=idx[0], y=tgt[0]):
            engine.eval()
            with torch.no_grad():
                evals.append(engine(x, y).item())
            engine.train()

        run_steps(engine, idx, tgt, MICRO, ACCUM, world, rank, after_step=evaluate)
        gatherer = getattr(optimizer.group.residency, "gatherer", None)
        out[stage] = {
            "state": engine.consolidated_state_dict(),
            "evals": evals,
            "live_after": gatherer.live_numel if gatherer else None,
            "max_live": gatherer.max_live_numel_seen if gatherer else None,
            "prefetched": gatherer.prefetched if gatherer else None,
            "unit_numels": [u.numel for u in gatherer.units] if gatherer else None,
            "live_param_elements": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }
    return out


def _check_against_reference(per_stage, world):
    want, want_evals = reference(world)
    torch.manual_seed(0)
    initial = BlockModel().state_dict()
    decay = (1 - LR * WD) ** STEPS
    for stage, got in per_stage.items():
        assert got["evals"] == pytest.approx(want_evals, rel=1e-5), stage
        for key, value in want.items():
            if key.startswith("blocks.3."):
                # Never used: torch AdamW skips it; ZeRO, like DeepSpeed, steps it with a zero
                # gradient, so only the decoupled weight decay moves it.
                factor = decay if value.dim() >= 2 else 1.0
                expected = initial[key] * factor
                assert relative_error(got["state"][key], expected) < 1e-6, (stage, key)
            else:
                err = relative_error(got["state"][key], value)
                assert err < 1e-5, f"world {world} stage {stage} {key}: {err:.2e}"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stage3_block_model_matches_single_process(world):
    results = run_distributed(train_block_model, world, [2, 3], {})
    for per_stage in results:
        _check_against_reference(per_stage, world)
        assert per_stage[3]["live_after"] == 0  # everything released between steps
        assert per_stage[3]["live_param_elements"] == 0  # parameters are placeholders now
        assert per_stage[2]["live_param_elements"] > 0


def test_stage3_prefetch_respects_live_bounds():
    # Units: 4 blocks and the root (embedding, head bias, the shared scale). Bound the working
    # set to the root plus two of the largest blocks and prefetch at most one block ahead.
    unit_numels = _unit_numels()
    root, largest = unit_numels[-1], max(unit_numels[:-1])
    bound = root + 2 * largest
    options = {"stage3_max_live_parameters": bound, "stage3_prefetch_bucket_size": largest}
    for per_stage in run_distributed(train_block_model, 2, [3], options):
        got = per_stage[3]
        assert got["prefetched"] > 0, "prefetch never issued a gather"
        assert root + largest <= got["max_live"] <= bound, (got["max_live"], bound)
        _check_against_reference(per_stage, 2)  # prefetching changes no numbers


def _unit_numels():
    return run_distributed(train_block_model, 1, [3], {})[0][3]["unit_numels"]


def test_stage3_tight_bounds_disable_prefetch_not_correctness():
    options = {"stage3_max_live_parameters": 1, "stage3_prefetch_bucket_size": 1}
    for per_stage in run_distributed(train_block_model, 2, [3], options):
        assert per_stage[3]["prefetched"] == 0
        _check_against_reference(per_stage, 2)


def count_gathers(max_reuse_distance):
    from zerotrain.comm import Communicator

    comm = Communicator()
    torch.manual_seed(0)
    model = BlockModel()
    config = _config(3, stage3_max_reuse_distance=max_reuse_distance)
    config["gradient_accumulation_steps"] = 1
    engine, optimizer, *_ = zerotrain.initialize(model=model, config=config)
    idx, tgt = make_batches(3, MICRO * comm.world_size)
    counts = []

    def count(_step):
        counts.append(optimizer.group.residency.gatherer.gathers - sum(counts))

    run_steps(engine, idx, tgt, MICRO, 1, comm.world_size, comm.rank, after_step=count)
    return counts, engine.consolidated_state_dict()


def test_stage3_reuse_distance_keeps_blocks_for_their_backward():
    # Forward uses: root, block 0, block 1 twice, block 2; backward: blocks 2, 1, 0. The
    # recording step gathers at every use (5 + 3). After it, distance 0 keeps only reuses with
    # nothing gathered in between (block 1's second call; block 2, last forward and first
    # backward): 4 + 2. A large distance keeps every block for its backward: 4 + 0.
    (short, state_a), _ = run_distributed(count_gathers, 2, 0)
    (reuse, state_b), _ = run_distributed(count_gathers, 2, 10**9)
    assert short == [8, 6, 6]
    assert reuse == [8, 4, 4]
    for key, value in state_a.items():
        assert torch.equal(value, state_b[key]), key


class _AdaptedBlock(torch.nn.Module):
    """A frozen norm and base layer with a trainable low-rank adapter, as in LoRA."""

    def __init__(self, dim: int = 16, rank: int = 2):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.base = torch.nn.Linear(dim, dim)
        self.down = torch.nn.Linear(dim, rank, bias=False)
        self.up = torch.nn.Linear(rank, dim, bias=False)
        for param in [*self.norm.parameters(), *self.base.parameters()]:
            param.requires_grad_(False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.base(h) + self.up(self.down(h))


class _AdaptedNet(torch.nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)  # trainable: the blocks' inputs need gradients
        self.blocks = torch.nn.ModuleList(_AdaptedBlock() for _ in range(3))
        self.reentrant = reentrant  # None: no activation checkpointing

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            if self.reentrant is None:
                h = block(h)
            else:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return h.pow(2).mean()


class _ReadsMemory(_AdaptedBlock):
    def forward(self, x, memory):
        return super().forward(x + memory)


class _SharedInputNet(torch.nn.Module):
    """Every block also reads one shared tensor that needs gradients, as decoder layers read
    the encoder's output: its gradient is complete only after the last block's backward."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.memory = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(_ReadsMemory() for _ in range(4))

    def forward(self, x):
        h, memory = self.embed(x), self.memory(x)
        for block in self.blocks:
            h = block(h, memory)
        return h.pow(2).mean()


def _adapted_engine(model, stage: int, **zero):
    config = _config(stage, **zero)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine, optimizer, *_ = zerotrain.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config,
    )
    return engine, optimizer


def train_adapted(runs: list[tuple[int, bool | None]], save_dir: str) -> dict:
    out = {}
    for stage, reentrant in runs:
        torch.manual_seed(0)
        model = _AdaptedNet(reentrant)
        engine, _ = _adapted_engine(model, stage)
        torch.manual_seed(1)
        losses = []
        for _ in range(STEPS * ACCUM):
            loss = engine(torch.randn(MICRO, 8))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        # a retained graph's second backward (the next micro-step) reads the frozen base again
        loss = engine(torch.randn(MICRO, 8))
        engine.backward(loss, retain_graph=True)
        engine.step()
        engine.backward(loss)
        engine.step()
        base = model.blocks[0].base.weight
        with zerotrain.zero.GatheredParameters([base], modifier_rank=0):
            # stage 3 keeps rank 0's change on every rank's shard; whole parameters (stage 0)
            # are each rank's own, as in DeepSpeed
            other = 3.0 if stage == 3 else 2.0
            base.data.mul_(2.0 if torch.distributed.get_rank() == 0 else other)
        engine.save_checkpoint(save_dir, tag=f"stage{stage}-{reentrant}")
        out[stage, reentrant] = {
            "losses": losses,
            "held": base.numel(),
            "state": engine.consolidated_state_dict(),
        }
    # a stage-3 checkpoint, frozen base included, loads into other engines built from other
    # weights: where frozen parameters are whole, partitioned in host memory, kept whole in
    # persistent units (blocks under 400 elements)
    homes = {
        "stage 0": (0, {}),
        "stage 3, cpu": (3, {"offload_param": {"device": "cpu", "pin_memory": False}}),
        "stage 3, persistent": (3, {"stage3_param_persistence_threshold": 400}),
    }
    for name, (stage, zero) in homes.items():
        torch.manual_seed(7)
        engine, _ = _adapted_engine(_AdaptedNet(None), stage, **zero)
        engine.load_checkpoint(save_dir, tag="stage3-True")
        out["loaded", name] = engine.consolidated_state_dict()
    # a shared input does not keep every block gathered until the backward ends
    torch.manual_seed(0)
    one_at_a_time = {"stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0}
    engine, optimizer = _adapted_engine(_SharedInputNet(), 3, **one_at_a_time)
    loss = engine(torch.randn(MICRO, 8))
    engine.backward(loss)
    gatherer = optimizer.group.residency.gatherer
    out["shared input"] = {
        "max_live": gatherer.max_live_numel_seen,
        "units": [u.numel for u in gatherer.units],
    }
    return out


@pytest.mark.parametrize("world", [2])
def test_stage3_partitions_frozen_parameters_and_keeps_them_for_input_gradients(world, tmp_path):
    """Frozen parameters are partitioned at stage 3 and stay gathered until backward has used
    them for the input gradient, also when activation checkpointing recomputes the block
    (reentrant: the first forward ran without grad); GatheredParameters changes them and
    checkpoints carry them."""
    runs = [(0, None), (3, None), (3, True), (3, False)]
    for got in run_distributed(train_adapted, world, runs, str(tmp_path), timeout=200):
        want = got[0, None]
        assert want["held"] == 16 * 16
        for run in runs[1:]:
            assert got[run]["held"] == 0, run  # a placeholder between uses: partitioned
            assert got[run]["losses"] == pytest.approx(want["losses"], rel=1e-6), run
            for key, value in want["state"].items():
                assert torch.allclose(got[run]["state"][key], value, atol=1e-7), (run, key)
        for name in ("stage 0", "stage 3, cpu", "stage 3, persistent"):
            loaded = got["loaded", name]
            for key, value in got[3, True]["state"].items():
                assert torch.equal(loaded[key], value), (name, key)
        shared = got["shared input"]
        root, block = shared["units"][-1], max(shared["units"][:-1])
        # the root and the block in use, and the next one gathered as this one finishes
        assert shared["max_live"] <= root + 2 * block, shared


def evaluate_around_training() -> dict:
    torch.manual_seed(0)
    model = BlockModel()
    engine, optimizer, *_ = zerotrain.initialize(
        model=model, model_parameters=param_groups(model, WD), config=_config(3)
    )
    gatherer = optimizer.group.residency.gatherer
    idx, tgt = make_batches(2, MICRO)

    def evaluate() -> None:
        engine.eval()
        with torch.no_grad():
            for _ in range(3):
                engine(idx[0], tgt[0])
        engine.train()

    evaluate()  # before the first step, which records the order
    loss = engine(idx[1], tgt[1])
    engine.backward(loss)
    engine.step()
    evaluate()  # prefetches along the recorded order
    return {"forward_order": gatherer._order["forward"], "live_after_eval": gatherer.live_numel}


def test_stage3_evaluation_leaves_nothing_gathered_nor_in_the_recorded_order():
    """Forwards without grad neither enter the order the first training step records (they
    have no backward) nor leave prefetched units gathered when they end."""
    (got,) = run_distributed(evaluate_around_training, 1)
    # the training forward's uses once: root, blocks 0, 1 (twice), 2
    assert got["forward_order"] == [4, 0, 1, 1, 2], got["forward_order"]
    assert got["live_after_eval"] == 0
