"""fd.redistribute: any layout to any layout, the same global value, gradients back in the
source layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds


@st.composite
def pairs(draw):
    case = draw(fds.sharded_cases(mesh=fds.meshes(max_devices=8), dtype=torch.float64, allow_partial=True))
    target = draw(fds.layouts(case.mesh, len(case.global_shape), allow_partial=True))
    return case, target


@given(pairs())
def test_same_global_value_and_the_target_blocks(pair):
    case, target = pair
    t = torch.randn(case.global_shape, dtype=torch.float64)
    x = fd.distribute_tensor(t, case.mesh, case.layout)
    y = fd.redistribute(x, target.placements)
    assert y.layout == target and y.shape == x.shape
    torch.testing.assert_close(y.full_tensor(), t)
    if not target.has_partial:
        want = fd.distribute_tensor(t, case.mesh, target)
        for got_shard, want_shard in zip(y.local_shards(), want.local_shards()):
            torch.testing.assert_close(got_shard, want_shard)


@given(pairs())
def test_gradient_comes_back_in_the_source_layout(pair):
    case, target = pair
    t = torch.randn(case.global_shape, dtype=torch.float64, requires_grad=True)
    y = fd.redistribute(fd.distribute_tensor(t, case.mesh, case.layout), target)
    (g,) = torch.autograd.grad(y.full_tensor().square().sum(), t)
    torch.testing.assert_close(g, 2 * t.detach())


def test_method_spec_and_identity():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = fd.distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, fd.P("x", "y"))
    assert x.redistribute(fd.P("x", "y")) is x
    assert x.redistribute([fd.Replicate(), fd.Shard(0)]).layout == fd.Layout.from_spec(mesh, fd.P("y"))


def test_partial_source_gets_a_replicate_gradient():
    mesh = fd.simulated_mesh(2, "x")
    w = torch.ones(2, 2, requires_grad=True)
    parts = fd.distribute_tensor(w, mesh, [fd.Partial()])
    with fd.CommDebugMode() as comm:
        total = fd.redistribute(parts, fd.P()).full_tensor()
    assert comm.get_comm_counts() == {"all_reduce": 1}
    (g,) = torch.autograd.grad(total.sum(), w)
    torch.testing.assert_close(g, torch.ones(2, 2))


def test_not_a_dtensor():
    with pytest.raises(fd.InputTypeError, match="fd.distribute_tensor"):
        fd.redistribute(torch.ones(2), fd.P())
