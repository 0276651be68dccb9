"""A loss averaged over every valid token of a sample, when the sequence-parallel ranks hold
its tokens between them.

[Note: the loss under sequence parallelism]
Each rank computes the sum of its tokens' losses s_r over n_r valid labels; the sample's loss
is L = (s_1 + ... + s_sp) / (n_1 + ... + n_sp), token-weighted (a mean of the ranks' means
would weigh a rank with 3 valid labels like one with 300). Every rank returns the same L, made
by a differentiable sum over the ranks, whose backward sums the ranks' incoming gradients: each
rank's s_r thus gets sp x dL/ds_r, and the shard group, which averages gradients over the
data- and sequence-parallel ranks together (it divides by dp x sp), gives exactly the gradient
of the mean of the data-parallel ranks' losses. DeepSpeed's ALST scripts make L with a
differentiable all-gather of the ranks' means and token counts instead; that is the same
function with the same gradients, so such a script trains exactly too, and applying both (the
script's aggregation over L from here) still gives L and the same gradients.
"""

from __future__ import annotations

import torch

from zerotrain.comm import Communicator


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator):
        ctx.comm = comm
        total = x.clone()
        comm.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        total = grads[0].clone()
        ctx.comm.all_reduce(total)
        return total, None


def token_mean(
    loss_sum: torch.Tensor, valid: torch.Tensor | int, comm: Communicator
) -> torch.Tensor:
    """The mean over the valid tokens every rank of ``comm`` holds, from this rank's sum of
    token losses and count of valid tokens; the same value on every rank (see [Note: the loss
    under sequence parallelism]). A sample with no valid token has loss 0."""
    count = torch.as_tensor(valid, dtype=torch.float32, device=loss_sum.device).detach().clone()
    if comm.world_size == 1:
        return loss_sum / count.clamp(min=1)
    comm.all_reduce(count)
    return _SumOverRanks.apply(loss_sum, comm) / count.clamp(min=1)
