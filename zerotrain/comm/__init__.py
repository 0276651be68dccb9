"""The only layer of zerotrain that talks to ``torch.distributed``.

Every collective zerotrain issues goes through a :class:`Communicator`, which applies the
process group's timeout, turns a failed or timed-out collective into a :class:`CollectiveError`
that names the operation, and counts calls and bytes per operation.
"""

from zerotrain.comm.communicator import CollectiveError, Communicator, OpStats, PendingOp
from zerotrain.comm.log import CommsLog
from zerotrain.comm.setup import (
    DEFAULT_TIMEOUT,
    destroy_distributed,
    init_distributed,
    is_initialized,
    local_rank,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "CommsLog",
    "Communicator",
    "OpStats",
    "PendingOp",
    "destroy_distributed",
    "init_distributed",
    "is_initialized",
    "local_rank",
]
