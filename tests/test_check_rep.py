"""Replication tracking: which axes local values vary over, and what it saves in transposes."""

from __future__ import annotations

import pytest
import torch
from common import assert_close

import functional_dtensor as fd
from functional_dtensor._varying import axes_varying

mesh = fd.simulated_mesh((2, 2), ("x", "y"))


def varying_of(f, in_specs=fd.P("x"), shape=(4, 4)):
    seen = {}

    def probe(*args):
        out = f(*args)
        seen["axes"] = axes_varying(out)
        return out * 0

    fd.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=fd.P("x", "y"), check_rep=True)(
        torch.ones(shape)
    )
    return seen["axes"]


@pytest.mark.parametrize(
    "f, expected",
    [
        (lambda x: x + 1, {"x"}),
        (lambda x: torch.ones(2, 2), set()),
        (lambda x: fd.psum(x, "x"), set()),
        (lambda x: fd.pmax(x, ("x", "y")), set()),
        (lambda x: fd.all_gather(x, "x", tiled=True), {"x"}),
        (lambda x: fd.ppermute(x, "x", [(0, 1), (1, 0)]), {"x"}),
        (lambda x: fd.psum(x, "y"), {"x"}),
        (lambda x: fd.psum(x, "x") + fd.axis_index("y"), {"y"}),
        (lambda x: torch.rand(2, 2), {"x", "y"}),
        (lambda x: torch.nn.functional.dropout(fd.psum(x, "x")), {"x", "y"}),
        (lambda x: torch.cat([fd.psum(x, "x"), x]), {"x"}),
    ],
)
def test_varying_axes_follow_jax_rules(f, expected):
    assert varying_of(f) == expected


def mlp_step(check_rep: bool):
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    w1 = torch.randn(6, 8, requires_grad=True)
    w2 = torch.randn(8, 6, requires_grad=True)
    f = fd.shard_map(
        lambda x, a, b: fd.psum(torch.relu(x @ a) @ b, "y"),
        mesh=mesh,
        in_specs=(fd.P("x"), fd.P(None, "y"), fd.P("y")),
        out_specs=fd.P("x"),
        check_rep=check_rep,
    )
    with fd.CommDebugMode() as forward:
        y = f(x, w1, w2).full_tensor()
    with fd.CommDebugMode() as backward:
        grads = torch.autograd.grad(y.square().sum(), (x, w1, w2))
    return forward, backward, grads


def test_tracked_transposes_need_no_defensive_all_reduce():
    forward, backward, grads = mlp_step(check_rep=True)
    assert forward.get_comm_counts() == {"all_reduce": 1, "all_gather": 1}  # the psum; full_tensor's gather
    # psum transposes to a broadcast. The three backward all-reduces are the ones a gradient
    # needs: x's over "y" (replicated rows met column blocks), w1's and w2's over "x"
    # (replicated weights met row blocks), each the transpose of an inserted pvary.
    assert backward.get_comm_counts() == {"all_reduce": 3}
    f2, b2, grads_unchecked = mlp_step(check_rep=False)
    assert f2.get_comm_counts() == {"all_reduce": 1, "all_gather": 1}
    assert b2.get_comm_counts() == {"all_reduce": 4}  # plus the defensive psum of psum's cotangent
    for a, b in zip(grads, grads_unchecked, strict=True):
        assert_close(a, b)


def test_psum_of_a_sum_of_replicated_values_has_a_free_transpose():
    w = torch.randn(3, requires_grad=True)
    f = fd.shard_map(lambda w: fd.psum(w * 2, "x"), mesh=mesh, in_specs=fd.P(), out_specs=fd.P())
    with fd.CommDebugMode() as comm:
        (g,) = torch.autograd.grad(f(w).full_tensor().sum(), w)
    assert_close(g, torch.full((3,), 4.0))
    # forward: one all_reduce; backward: pvary's transpose sums over "x", nothing else
    assert comm.get_comm_counts() == {"all_reduce": 2}
