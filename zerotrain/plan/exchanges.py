"""What model parallelism exchanges besides ZeRO's collectives, priced on the probed links:
tensor parallelism's all-reduces of activations, Ulysses' all-to-alls, the experts' token
exchanges (the cost model, zerotrain/plan/cost.py, adds them to a candidate's collectives).
Each follows compute on every rank, so each is priced on the probe's ``interleaved`` fit
where it has one: every rank waits for the slowest rank's compute before each."""

from __future__ import annotations

from zerotrain.comm.communicator import ring_sent
from zerotrain.plan.candidates import Candidate
from zerotrain.plan.expert_share import ExpertShare
from zerotrain.plan.probe import Machine
from zerotrain.plan.sequence_share import SequenceShare
from zerotrain.plan.tensor_share import TensorShare

__all__ = ["expert_parallel_seconds", "sequence_parallel_seconds", "tensor_parallel_seconds"]


def expert_parallel_seconds(
    candidate: Candidate, experts: ExpertShare, tokens: int, element: int, machine: Machine
) -> float:
    """The MoE layers' exchanges of a step ([Note: an expert-parallel rank's share] in
    zerotrain/plan/expert_share.py): per micro-batch and layer, the counts of units per rank,
    then the tokens' hidden states and their slots (a weight and an expert in fp32) to the
    experts and the outputs back, each rank sending (ep-1)/ep of its units (a token's top-k
    choices, capacity drops not counted) in the forward (again in a checkpointed backward's
    recomputation), and the same exchanges reversed in the backward but the counts, for
    ``tokens`` tokens a sample. Each follows compute on every rank: priced on the probe's
    ``interleaved`` fit where it has one, as tensor and sequence parallelism's are."""
    link = machine.interleaved or machine.links.get("all_to_all")
    if experts.degree == 1 or link is None:
        return 0.0
    ep = experts.degree
    units = candidate.micro_batch * tokens * experts.choices

    def exchange(nbytes: float) -> float:
        return link.seconds("all_to_all", int(nbytes * (ep - 1) / ep), ep)

    rows = exchange(units * experts.hidden * element)
    slots = exchange(units * 2 * 4)
    backward = 2 * rows + slots
    forward = link.seconds("all_to_all", 0, ep) + backward
    forwards = 2 if candidate.activation_checkpointing else 1
    return candidate.accumulation * experts.layers * (forwards * forward + backward)


def tensor_parallel_seconds(
    candidate: Candidate, share: TensorShare, tokens: int, element: int, machine: Machine
) -> float:
    """The tensor-parallel all-reduces of a step ([Note: a tensor-parallel rank's share] in
    zerotrain/plan/tensor_share.py): per micro-batch the row-wise layers' in the forward (and
    in a checkpointed backward's recomputation), the column-wise layers' in the backward, on
    the probed link of an all-reduce that follows compute on every rank (``interleaved``: each
    waits for the slowest rank's compute, at every layer; the 30M GPT's tp 2 rows of
    bench/plan.py were 18-28% under with the back-to-back all-reduce's fit)."""
    link = machine.interleaved or machine.links.get("all_reduce")
    if link is None:
        return 0.0
    tp, tokens = candidate.tp, candidate.micro_batch * tokens

    def seconds(calls: int, elements: int) -> float:
        sent = ring_sent("all_reduce", tokens * elements * element, tp)
        return calls * link.seconds("all_reduce", 0, tp) + sent / link.beta

    forwards = 2 if candidate.activation_checkpointing else 1
    micro = forwards * seconds(share.forward_calls, share.forward_elements) + seconds(
        share.backward_calls, share.backward_elements
    )
    return candidate.accumulation * micro


def sequence_parallel_seconds(
    candidate: Candidate, share: SequenceShare, element: int, machine: Machine
) -> float:
    """Ulysses' exchanges of a step ([Note: a sequence-parallel rank's share] in
    zerotrain/plan/sequence_share.py): per micro-batch and attention layer, the all-to-alls of
    q, k, v and the output in the forward (again in a checkpointed backward's recomputation)
    and of their gradients in the backward, each rank sending (sp-1)/sp of its share; and the
    loss's three all-reduces of a scalar (the token count, the sum and its gradient:
    zerotrain/sequence/loss.py) and the position ids' check in every forward (an all-gather
    of the sizes, then of the objects). Each follows compute on every rank, as tensor
    parallelism's all-reduces do: priced on the probe's ``interleaved`` fit where it has one
    (the Llama's sp 2 rows of bench/plan.py were 15-35% under with the back-to-back fits)."""
    link = machine.interleaved or machine.links.get("all_to_all")
    if link is None:
        return 0.0
    sp, tokens = share.degree, candidate.micro_batch * share.tokens
    layer = sum(
        link.seconds("all_to_all", int(tokens * e * element * (sp - 1) / sp), sp)
        for e in share.exchanged_elements
    )
    forwards = 2 if candidate.activation_checkpointing else 1
    checks = 3 * link.seconds("all_reduce", 0, sp) + 2 * forwards * link.seconds(
        "all_gather", 0, sp
    )
    return candidate.accumulation * ((forwards + 1) * share.layers * layer + checks)
