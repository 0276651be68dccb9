"""The device mesh: rank arithmetic of the parallel axes, and their process groups."""

from __future__ import annotations

import pytest
import torch
from distributed import run_distributed

from zerotrain.comm import Communicator, Mesh


def test_axes_number_ranks_with_tensor_parallel_innermost():
    mesh = Mesh.__new__(Mesh)  # rank arithmetic only: no process group needed
    mesh.sizes = {"site": 1, "pp": 2, "dp": 2, "ep": 1, "sp": 1, "tp": 2}
    assert mesh.axis_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.axis_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.axis_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.axis_ranks("ep") == [[r] for r in range(8)]
    assert mesh.coordinates(6) == {"site": 0, "pp": 1, "dp": 1, "ep": 0, "sp": 0, "tp": 0}
    for rank in range(8):
        assert mesh.rank_at(mesh.coordinates(rank)) == rank


def test_a_site_s_ranks_are_consecutive_and_the_site_axis_joins_their_peers():
    """Sites are outermost: a site's ranks are consecutive (a torchrun node's), its own data-
    parallel group averages gradients, the site axis joins the ranks holding the same part at
    every site, and the data is split over both."""
    mesh = Mesh.__new__(Mesh)
    mesh.sizes = {"site": 2, "pp": 1, "dp": 2, "ep": 1, "sp": 1, "tp": 2}
    assert mesh.axis_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.axis_ranks("site") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.axis_ranks("site", "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.coordinates(5) == {"site": 1, "pp": 0, "dp": 0, "ep": 0, "sp": 0, "tp": 1}


def test_sequence_parallel_peers_are_consecutive_and_zero_spans_them():
    """Ulysses' groups are consecutive ranks, as DeepSpeed's; ZeRO's group holds a data-parallel
    group's ranks and their sequence-parallel peers."""
    mesh = Mesh.__new__(Mesh)
    mesh.sizes = {"site": 1, "pp": 1, "dp": 2, "ep": 1, "sp": 2, "tp": 1}
    assert mesh.axis_ranks("sp") == [[0, 1], [2, 3]]
    assert mesh.axis_ranks("dp") == [[0, 2], [1, 3]]
    assert mesh.axis_ranks("dp", "ep", "sp") == [[0, 1, 2, 3]]


def test_sizes_that_do_not_cover_the_world_are_refused():
    with pytest.raises(ValueError, match=r"multiply to 3, but there are 1 ranks"):
        Mesh(Communicator(), dp=1, tp=3)
    with pytest.raises(ValueError, match="no axis 'xp'"):
        Mesh(Communicator()).axis("xp")


def _groups():
    world = Communicator()
    data_only = Mesh(world)
    assert data_only.dp is world  # spans every rank: no new group
    tensor = Mesh(world, tp=2)
    out = {"dp_size": tensor.dp.world_size, "tp_size": tensor.axis("tp").world_size}
    value = torch.tensor([float(world.rank + 1)])
    tensor.axis("tp").all_reduce(value)
    out["tp_sum"] = value.item()
    return out


def test_axis_groups_communicate():
    for got in run_distributed(_groups, 2):
        assert got == {"dp_size": 1, "tp_size": 2, "tp_sum": 3.0}
