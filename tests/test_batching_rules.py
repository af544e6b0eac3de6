"""The simulated backend's own batching rule: a replicated activation times column blocks runs as
one matmul with the whole weight. Values and gradients must equal the unsharded computation
whether the rule applies or falls back to functorch's, and the rule must apply where it should."""

from __future__ import annotations

import operator

import pytest
import torch
from common import assert_close
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor._simulated import batching as simulated_batching

OPS = {
    "@": operator.matmul,
    "torch.matmul": torch.matmul,
    "Tensor.matmul": torch.Tensor.matmul,
    "torch.mm": torch.mm,
    "Tensor.mm": torch.Tensor.mm,
}


@pytest.fixture
def applied(monkeypatch):
    """Whether the rule computed each matmul (True) or fell back (False), in call order."""
    calls = []
    for func, rule in list(simulated_batching.RULES.items()):

        def spy(level, size, args, kwargs, rule=rule):
            out = rule(level, size, args, kwargs)
            calls.append(out is not None)
            return out

        monkeypatch.setitem(simulated_batching.RULES, func, spy)
    return calls


def _grads(loss, inputs):
    return torch.autograd.grad(loss, inputs)


@given(
    devices=st.sampled_from([1, 2, 4]),
    lead=st.sampled_from([(), (3,), (5,), (2, 3)]),
    k=st.integers(1, 4),
    m=st.integers(1, 3),
    op=st.sampled_from(sorted(OPS)),
    check_rep=st.booleans(),
)
def test_replicated_times_column_blocks_equals_unsharded(devices, lead, k, m, op, check_rep):
    if op.endswith("mm") and len(lead) != 1:
        lead = (3,)
    matmul = OPS[op]
    mesh = fd.simulated_mesh(devices, "tp")
    x = torch.randn(*lead, k, dtype=torch.float64, requires_grad=True)
    w = torch.randn(k, devices * m, dtype=torch.float64, requires_grad=True)
    f = fd.shard_map(
        lambda a, b: matmul(a, b),
        mesh=mesh,
        in_specs=(fd.P(), fd.P(None, "tp")),
        out_specs=fd.P(*[None] * len(lead), "tp"),
        check_rep=check_rep,
    )
    got = f(x, w).full_tensor()
    want = matmul(x, w)
    assert_close(got, want)
    cotangent = torch.randn_like(want)
    for g, h in zip(
        _grads((got * cotangent).sum(), (x, w)), _grads((want * cotangent).sum(), (x, w)), strict=True
    ):
        assert_close(g, h)


@pytest.mark.parametrize("check_rep", [True, False])
def test_rule_applies_to_column_blocks_only(applied, check_rep):
    mesh = fd.simulated_mesh(4, "tp")
    x = torch.randn(3, 5)
    columns = fd.shard_map(
        lambda a, b: a @ b,
        mesh=mesh,
        in_specs=(fd.P(), fd.P(None, "tp")),
        out_specs=fd.P(None, "tp"),
        check_rep=check_rep,
    )
    assert_close(columns(x, w := torch.randn(5, 8)).full_tensor(), x @ w)
    rows = fd.shard_map(
        lambda a, b: fd.psum(a[:, :2] @ b, "tp"),
        mesh=mesh,
        in_specs=(fd.P(), fd.P("tp", None)),
        out_specs=fd.P(),
        check_rep=check_rep,
    )
    v = torch.randn(8, 5)
    assert_close(rows(x, v).full_tensor(), x[:, :2] @ v.reshape(4, 2, 5).sum(0))
    # row blocks do not fold into the columns of one matrix: functorch's rule runs
    assert applied == [True, False]


def test_rule_falls_back_when_blocks_do_not_fold(applied):
    """Blocks stored one after another (from_local of separate shards) do not fold into the
    columns of one matrix without a copy: functorch's rule runs, with the same values."""
    mesh = fd.simulated_mesh(2, "tp")
    shards = [torch.randn(5, 3), torch.randn(5, 3)]
    w = fd.from_local(shards, mesh, fd.P(None, "tp"))
    x = torch.randn(4, 5)
    y = fd.shard_map(
        lambda a, b: a @ b, mesh=mesh, in_specs=(fd.P(), fd.P(None, "tp")), out_specs=fd.P(None, "tp")
    )
    assert_close(y(x, w).full_tensor(), x @ torch.cat(shards, dim=1))
    assert applied == [False]


def test_rule_under_outer_transforms(applied):
    mesh = fd.simulated_mesh(4, "tp")
    f = fd.shard_map(
        lambda a, b: fd.psum(torch.relu(a @ b).sum(-1, keepdim=True), "tp"),
        mesh=mesh,
        in_specs=(fd.P(), fd.P(None, "tp")),
        out_specs=fd.P(),
    )
    x, w = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    reference = lambda a, b: torch.relu(a @ b).sum(-1, keepdim=True)  # noqa: E731
    grad = torch.func.grad(lambda b: f(x, b).full_tensor().sum())(w)
    assert_close(grad, torch.func.grad(lambda b: reference(x, b).sum())(w))
    batched = torch.func.vmap(lambda a: f(a, w).full_tensor())(x.unsqueeze(1))
    assert_close(batched, torch.func.vmap(lambda a: reference(a, w))(x.unsqueeze(1)))
    assert True in applied


def test_rule_counts_no_communication():
    mesh = fd.simulated_mesh(4, "tp")
    f = fd.shard_map(
        lambda a, b: a @ b, mesh=mesh, in_specs=(fd.P(), fd.P(None, "tp")), out_specs=fd.P(None, "tp")
    )
    x, w = torch.randn(3, 5, requires_grad=True), torch.randn(5, 8)
    with fd.CommDebugMode() as comm:
        f(x, w).full_tensor().sum().backward()
    # the forward moves nothing but full_tensor's gather; x's gradient is summed over the
    # devices (pvary's transpose)
    assert comm.get_comm_counts() == {"all_gather": 1, "all_reduce": 1}
