"""Overlap switches change when communication happens, never the numbers."""

from __future__ import annotations

import torch

from tests.distributed import run_distributed
from tests.models import AwkwardModel, make_batches, param_groups, run_steps

STEPS, MICRO, ACCUM = 3, 2, 2


def _train(stage: int, overlap: bool):
    import zerotrain

    torch.manual_seed(0)
    model = AwkwardModel()  # tied head, frozen layer, a root-level parameter, a buffer
    engine, *_ = zerotrain.initialize(
        model=model,
        model_parameters=param_groups(model, 0.1),
        config={
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-2}},
            "gradient_clipping": 0.5,
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 40,  # several buckets, gathered in flight
                "overlap_param_gather": overlap,
            },
            "steps_per_print": 10**6,
        },
    )
    world, rank = engine.world_size, engine.global_rank
    idx, tgt = make_batches(STEPS, MICRO * ACCUM * world)
    eval_losses, in_flight = [], []

    def evaluate(step: int) -> None:  # a no-grad forward between steps reads fresh parameters
        in_flight.append(len(engine.optimizer.group.residency.in_flight))
        with torch.no_grad():
            eval_losses.append(engine(idx[0, :MICRO], tgt[0, :MICRO]).item())

    run_steps(engine, idx, tgt, MICRO, ACCUM, world, rank, after_step=evaluate)
    result = engine.consolidated_state_dict(), eval_losses, max(in_flight), model.state_dict()

    # One more step, then only the embedding runs: it waits for its own bucket alone.
    run_steps(engine, idx[:1], tgt[:1], MICRO, ACCUM, world, rank)
    pending = _in_flight(engine)
    model.embed(idx[0, :MICRO])
    own = {
        i
        for i, b in enumerate(engine.optimizer.group.buckets)
        if any(s.param is model.embed.weight for s in b.slots)
    }
    waited = pending - _in_flight(engine)
    engine.optimizer.wait_param_gathers()  # the next engine starts with nothing in flight
    return (*result, (waited == own and len(pending) > len(own)) if overlap else not pending)


def _in_flight(engine) -> set[int]:
    """Indices of the buckets whose parameter all-gather is still in flight."""
    group = engine.optimizer.group
    return {i for i, b in enumerate(group.buckets) if group.residency.in_flight.waiting(b)}


def _grid():
    return {(s, o): _train(s, o) for s in (1, 2) for o in (False, True)}


def test_overlapped_parameter_gather_is_bitwise_the_same():
    """Stages 1-2, 3 ranks: parameters all-gathered during the next forward (DeAR) give the same
    parameters, evaluation losses and model state as gathering at the end of step()."""
    for results in run_distributed(_grid, 3):
        for stage in (1, 2):
            plain, overlapped = results[stage, False], results[stage, True]
            assert overlapped[1] == plain[1], stage
            for name, value in plain[0].items():
                assert torch.equal(overlapped[0][name], value), (stage, name)
            for name, value in plain[3].items():
                assert torch.equal(overlapped[3][name], value), (stage, name)
            assert plain[2] == 0 and overlapped[2] > 0  # the switch did defer the gathers
            assert plain[4] and overlapped[4]  # a module waits for its own buckets only
