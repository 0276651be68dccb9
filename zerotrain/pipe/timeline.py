"""What a pipeline step's order of work costs: the forwards and backwards each rank ran
(``PipelineEngine.pipeline_actions``), replayed with given costs.

[Note: the bubble replayed]
A stage's forward of a micro-batch needs the previous stage's forward of it, its backward the
next stage's backward of it; each rank runs its own actions in the order it ran them. Starting
every action as soon as its rank is free and its input exists, with a forward costing
``forward`` and a backward ``backward`` (time units, one stage's share of the model; sends
free), gives the step's length and each rank's idle share. With equal costs this is the bubble
of the schedule's textbook analysis: (p - 1) / (m + p - 1) for 1F1B and GPipe with p ranks and
m micro-batches, (p - 1) / (v m + p - 1) for interleaved 1F1B with v stages per rank, each v
times cheaper. Wall-clock shares measure the same thing plus whatever else is slow (on a
shared CPU, mostly the sharing: see bench/parallel3d.py); the replay measures the order alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing it imports torch.distributed.pipelining (see pipe/engine.py)
    from zerotrain.comm.pipeline import PipelineAction


def idle_shares(
    ranks: Sequence[Sequence[PipelineAction]],
    forward: float = 1.0,
    backward: float = 1.0,
    weight: float = 1.0,
) -> list[float]:
    """Each rank's idle share of the step ``ranks`` ran (one list of actions per pipeline rank),
    replayed with those costs (``backward``: of a whole backward, or under ZBV of the input
    gradient, ``weight`` then of the weight gradients; see [Note: the bubble replayed])."""
    stages = 1 + max(a.stage for actions in ranks for a in actions)
    cost = {"F": forward, "B": backward, "W": weight}
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> its end
    free = [0.0] * len(ranks)
    busy = [0.0] * len(ranks)
    next_of = [0] * len(ranks)
    remaining = sum(len(actions) for actions in ranks)
    while remaining:
        progressed = False
        for rank, actions in enumerate(ranks):
            while next_of[rank] < len(actions):
                action = actions[next_of[rank]]
                needs = _input_of(action, stages)
                if needs is not None and needs not in done:
                    break
                start = max(free[rank], done[needs] if needs is not None else 0.0)
                free[rank] = start + cost[action.kind]
                busy[rank] += cost[action.kind]
                done[action.kind, action.stage, action.micro_batch] = free[rank]
                next_of[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [
                actions[i] for actions, i in zip(ranks, next_of, strict=True) if i < len(actions)
            ]
            raise ValueError(f"these actions wait for each other: {waiting}")
    length = max(free)
    return [1.0 - b / length for b in busy]


def _input_of(action: PipelineAction, stages: int) -> tuple[str, int, int] | None:
    """The action this one waits for (None: none but its rank's previous one)."""
    if action.kind == "W":  # after its own stage's input gradient, on the same rank
        return None
    if action.kind == "F":
        return None if action.stage == 0 else ("F", action.stage - 1, action.micro_batch)
    if action.stage == stages - 1:
        return ("F", action.stage, action.micro_batch)
    return ("B", action.stage + 1, action.micro_batch)


def in_flight(actions: Sequence[PipelineAction]) -> int:
    """The most micro-batches whose forward ran and backward did not, at once, on a rank (what
    it holds activations for)."""
    held, most = 0, 0
    for action in actions:
        held += {"F": 1, "B": -1, "W": 0}[action.kind]
        most = max(most, held)
    return most
