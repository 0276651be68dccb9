"""``zerotrain.zero.GatheredParameters``: full parameters for a moment, outside forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.comm.functional import control_device
from zerotrain.zero.init import (
    ParamOwner,
    gather_param,
    is_init_partitioned,
    owner_of,
    partition_comm,
    partition_param,
)


@contextlib.contextmanager
def GatheredParameters(  # noqa: N802 - DeepSpeed's name, used as a context manager
    params: nn.Parameter | Iterable[nn.Parameter],
    modifier_rank: int | None = None,
    fwd_module: nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    """Inside the block, ``params`` hold their full values on every rank (a collective: every
    rank enters it with the same parameters).

    Works for parameters partitioned by :class:`zerotrain.zero.Init` and for parameters an
    engine manages (stage 3 gathers them; stages 0-2 hold them whole already). With
    ``modifier_rank``, changes that rank makes *in place* (``p.data.normal_()``, ``p.copy_``)
    are broadcast and kept, fp32 master weights included; without it, changes are discarded
    where the parameter is partitioned. ``fwd_module`` is accepted for DeepSpeed compatibility.
    An Init chunk partitioned over a site's ranks (Init given a ``sites`` section) is gathered
    over them; ``modifier_rank``'s changes reach every site (one broadcast over every rank).
    """
    del fwd_module
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if not enabled or not params:
        yield
        return
    everyone = Communicator(device=control_device())  # NCCL: its collectives take GPU tensors
    init_params = [p for p in params if is_init_partitioned(p)]
    owners: dict[int, tuple[ParamOwner, list[nn.Parameter]]] = {}
    for param in params:
        owner = owner_of(param)
        if owner is not None:
            owners.setdefault(id(owner), (owner, []))[1].append(param)
    chunks = {}
    for param in init_params:
        chunks[id(param)] = param.data
        param.data = gather_param(param, partition_comm(param)).clone()
    accesses = [(owner, owner.begin_access(ps)) for owner, ps in owners.values()]
    try:
        yield
    finally:
        for owner, access in accesses:
            owner.end_access(access, modifier_rank)
        for param in init_params:
            if modifier_rank is None:
                param.data = chunks[id(param)]
            else:
                comm, src = partition_comm(param), modifier_rank
                if comm.world_size < everyone.world_size:  # a site's chunk: the value to all
                    on_wire = param.data.to(everyone.device)
                    everyone.broadcast(on_wire, src=modifier_rank)
                    param.data.copy_(on_wire)
                    src = comm.root
                partition_param(param, comm, dtype=chunks[id(param)].dtype, src=src)
