"""DeepSpeed's module-level communication functions: ``import zerotrain.comm as dist``.

Scripts written for DeepSpeed call ``deepspeed.comm.get_rank()``, ``barrier()``,
``all_reduce(t)``... on the default group or a group they made. These functions keep
DeepSpeed's names and signatures (its ``prof``, ``log_name`` and ``debug`` arguments are
accepted; the comms logger of an engine labels user calls by the calling function) and run
through a :class:`Communicator`, so every call is bounded by the group's timeout, a failure
names the operation, and bytes are counted in :data:`user_stats`. ``group=None`` is the
default group, as in ``torch.distributed``. Without an initialized process group the queries
answer for a single process and the collectives act as in a group of one, except ``send``,
``recv``, ``gather``, ``scatter`` and ``all_to_all``, which raise.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerotrain.comm.communicator import Communicator, OpStats
from zerotrain.comm.setup import collective_timeout, destroy_distributed, is_initialized

ReduceOp = dist.ReduceOp
"""The reduction operations (``ReduceOp.SUM``, ``MAX``, ``MIN``, ``PRODUCT``, ``AVG``, ...)."""

user_stats: dict[str, OpStats] = {}
"""Calls, bytes and time of the collectives issued through these functions, per operation."""


def control_device() -> torch.device:
    """Where the default process group's collectives take their tensors."""
    # NCCL moves its scalars through the GPU; gloo through the CPU.
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _comm(group=None) -> Communicator:
    return Communicator(group, device=control_device(), stats=user_stats)


def _require_group(name: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"zerotrain.comm.{name}: no process group is initialized; call "
            "zerotrain.init_distributed() (or zerotrain.initialize) first"
        )


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _run(name: str, nbytes: int, launch: Callable[[bool], object], group, async_op: bool, sent):
    _require_group(name)
    return _comm(group).issue(name, nbytes, launch, async_op, sent=sent)


# -- identity ----------------------------------------------------------------------------------
def is_available() -> bool:
    """Whether ``torch.distributed`` is built in."""
    return dist.is_available()


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    """The number of ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The default-group rank of rank ``group_rank`` of ``group``."""
    if group is None or not is_initialized():
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    """The default-group ranks of ``group``'s members, in group order."""
    if not is_initialized():
        return [0]
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def get_world_group():
    """The default process group."""
    _require_group("get_world_group")
    return dist.group.WORLD


def new_group(ranks: list[int]):
    """A process group of ``ranks`` (every rank of the default group must call it), with the
    default group's collective timeout."""
    _require_group("new_group")
    return dist.new_group(ranks=ranks, timeout=collective_timeout())


def destroy_process_group(group=None) -> None:
    """Tear down ``group``, or the default group and every other (None)."""
    if group is None:
        destroy_distributed()
    elif is_initialized():
        dist.destroy_process_group(group)


# -- collectives ---------------------------------------------------------------------------------
def barrier(
    group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None
):
    """Wait until every rank of ``group`` arrives (bounded by the group's timeout)."""
    del async_op, device_ids, prof, log_name, debug  # one bounded, synchronous barrier
    _comm(group).barrier()


def all_reduce(
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_reduce",
    debug=None,
):
    """Reduce ``tensor`` in place over ``group``."""
    return _comm(group).all_reduce(tensor, op, async_op=async_op)


def inference_all_reduce(
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_reduce",
    debug=None,
):
    """:func:`all_reduce` (DeepSpeed's inference kernels are a CUDA optimisation)."""
    return all_reduce(tensor, op, group, async_op)


def broadcast(
    tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None
):
    """Copy ``tensor`` from default-group rank ``src`` to every rank of ``group``."""
    return _comm(group).broadcast(tensor, src=src, async_op=async_op)


def all_gather_into_tensor(
    output_tensor,
    tensor,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_gather_into_tensor",
    debug=None,
):
    """Every rank's ``tensor``, concatenated in rank order, into ``output_tensor``."""
    return _comm(group).all_gather(output_tensor, tensor, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    """DeepSpeed's name for :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def reduce_scatter_tensor(
    output_tensor,
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="reduce_scatter_tensor",
    debug=None,
):
    """Reduce ``tensor`` (world-size equal pieces) over ``group``; this rank's piece to
    ``output_tensor``."""
    if op != ReduceOp.SUM:
        return _run(
            "reduce_scatter",
            _nbytes(tensor),
            lambda a: dist.reduce_scatter_tensor(output_tensor, tensor, op, group, a),
            group,
            async_op,
            sent=None,
        )
    return _comm(group).reduce_scatter(output_tensor, tensor, async_op=async_op)


def reduce_scatter_fn(
    output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None
):
    """DeepSpeed's name for :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output_tensor, tensor, op, group, async_op)


def all_gather(
    tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None
):
    """Every rank's ``tensor`` into ``tensor_list`` (one tensor per rank)."""
    if not is_initialized():
        tensor_list[0].copy_(tensor)
        return None
    world = get_world_size(group)
    return _run(
        "all_gather",
        _nbytes(tensor) * world,
        lambda a: dist.all_gather(tensor_list, tensor, group, a),
        group,
        async_op,
        sent=_nbytes(tensor) * (world - 1),
    )


def reduce_scatter(
    output,
    input_list,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="reduce_scatter",
    debug=None,
):
    """Reduce the i-th tensors of every rank's ``input_list``; rank i gets the result."""
    if not is_initialized():
        output.copy_(input_list[0])
        return None
    return _run(
        "reduce_scatter",
        _nbytes(*input_list),
        lambda a: dist.reduce_scatter(output, input_list, op, group, a),
        group,
        async_op,
        sent=_nbytes(*input_list) - _nbytes(output),
    )


def reduce(
    tensor,
    dst,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="reduce",
    debug=None,
):
    """Reduce ``tensor`` over ``group`` into default-group rank ``dst``'s copy."""
    if not is_initialized():
        return None
    return _run(
        "reduce",
        _nbytes(tensor),
        lambda a: dist.reduce(tensor, dst, op, group, a),
        group,
        async_op,
        sent=0 if get_rank() == dst else _nbytes(tensor),
    )


def all_to_all_single(
    output,
    tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_to_all_single",
    debug=None,
):
    """Split ``tensor`` over the ranks of ``group`` and receive their pieces into ``output``."""
    if not is_initialized():
        output.copy_(tensor)
        return None
    world = get_world_size(group)
    return _run(
        "all_to_all_single",
        _nbytes(tensor),
        lambda a: dist.all_to_all_single(
            output, tensor, output_split_sizes, input_split_sizes, group, a
        ),
        group,
        async_op,
        sent=_nbytes(tensor) * (world - 1) // world,
    )


def all_to_all(
    output_tensor_list,
    input_tensor_list,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_to_all",
    debug=None,
):
    """Send ``input_tensor_list[i]`` to rank i; receive rank i's into ``output_tensor_list[i]``."""
    rank = get_rank(group)
    return _run(
        "all_to_all",
        _nbytes(*input_tensor_list),
        lambda a: dist.all_to_all(output_tensor_list, input_tensor_list, group, a),
        group,
        async_op,
        sent=_nbytes(*input_tensor_list) - _nbytes(input_tensor_list[rank]),
    )


def gather(
    tensor,
    gather_list=None,
    dst=0,
    group=None,
    async_op=False,
    prof=False,
    log_name="gather",
    debug=None,
):
    """Every rank's ``tensor`` into ``gather_list`` on default-group rank ``dst``."""
    return _run(
        "gather",
        _nbytes(tensor),
        lambda a: dist.gather(tensor, gather_list, dst, group, a),
        group,
        async_op,
        sent=0 if get_rank() == dst else _nbytes(tensor),
    )


def scatter(
    tensor,
    scatter_list=None,
    src=0,
    group=None,
    async_op=False,
    prof=False,
    log_name="scatter",
    debug=None,
):
    """The i-th tensor of ``scatter_list`` on default-group rank ``src`` to rank i's ``tensor``."""
    return _run(
        "scatter",
        _nbytes(tensor),
        lambda a: dist.scatter(tensor, scatter_list, src, group, a),
        group,
        async_op,
        sent=_nbytes(tensor) * (get_world_size(group) - 1) if get_rank() == src else 0,
    )


def all_gather_object(
    object_list, obj, group=None, prof=False, log_name="all_gather_object", debug=None
):
    """Every rank's picklable ``obj`` into ``object_list``, in rank order."""
    object_list[:] = _comm(group).all_gather_object(obj)


def broadcast_object_list(
    object_list,
    src,
    group=None,
    device=None,
    prof=False,
    log_name="broadcast_object_list",
    debug=None,
):
    """Default-group rank ``src``'s picklable objects into every rank's ``object_list``."""
    if not is_initialized():
        return None
    return _run(
        "broadcast_object_list",
        0,
        lambda _: dist.broadcast_object_list(object_list, src, group, device),
        group,
        False,
        sent=0,
    )


# -- point to point ------------------------------------------------------------------------------
def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    """Send ``tensor`` to default-group rank ``dst`` (blocking)."""
    _run("send", _nbytes(tensor), lambda _: dist.send(tensor, dst, group, tag), group, False, None)


def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    """Receive into ``tensor`` from ``src`` (any rank if None); returns the sender's rank."""
    return _run(
        "recv", _nbytes(tensor), lambda _: dist.recv(tensor, src, group, tag), group, False, 0
    )


def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    """Start sending ``tensor`` to ``dst``; returns a handle with ``wait()``."""
    return _run(
        "send", _nbytes(tensor), lambda _: dist.isend(tensor, dst, group, tag), group, True, None
    )


def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    """Start receiving into ``tensor`` from ``src``; returns a handle with ``wait()``."""
    return _run(
        "recv", _nbytes(tensor), lambda _: dist.irecv(tensor, src, group, tag), group, True, 0
    )


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """The user collectives' counts per operation (an engine's own are in
    ``engine.comms_summary()``); printed on rank 0, or returned with ``return_dict``."""
    summary = {
        name: {"calls": s.calls, "bytes": s.bytes, "sent": s.sent, "seconds": s.seconds}
        for name, s in sorted(user_stats.items())
    }
    if return_dict:
        return summary
    if get_rank() == 0:
        for name, stats in summary.items():
            print(f"{name}: {stats}")
    return None
