"""Ops without a sharding rule run on replicated inputs, visibly, on both backends: their
values and gradients are torch's on the global tensors, the gather shows in CommDebugMode,
fd.explain and the rules log, strict mode refuses them, and ops drawing from torch's global
generator are refused with fd.random's equivalent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from common import assert_close, in_float64

import functional_dtensor as fd

#: ops with no rule of their own, as a user calls them (value -> output)
OPS = {
    "median": lambda x: torch.median(x),
    "sort": lambda x: torch.sort(x, dim=0).values,
    "topk": lambda x: x.topk(3, dim=-1).values,
    "cummax": lambda x: torch.cummax(x, dim=0).values,
    "diff": lambda x: torch.diff(x, dim=1),
    "logsumexp": lambda x: torch.logsumexp(x, dim=0),
    "tril": lambda x: torch.tril(x),
    "flip": lambda x: torch.flip(x, (0,)),
    "rot90": lambda x: torch.rot90(x),
    "fft": lambda x: torch.fft.rfft(x, dim=0).abs(),
}
DATA = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))


def _global(out):
    return out.full_tensor() if isinstance(out, fd.DTensor) else out


def job_no_rule_ops(mesh) -> dict:
    """Each op on a row-sharded value of 7 rows (uneven): output values and the gradient of
    their sum, and whether every device's replica of the output is equal."""
    results = {}
    for name, op in OPS.items():
        leaf = DATA.clone().requires_grad_()
        out = op(fd.distribute_tensor(leaf, mesh, fd.P(mesh.axis_names[0])))
        assert out.placements == (fd.Replicate(),) * mesh.ndim, name
        value = out.full_tensor()
        value.sum().backward()
        shards = out.local_shards()
        results[name] = {
            "value": value.detach(),
            "grad": leaf.grad,
            "replicas agree": all(torch.equal(s, shards[0]) for s in shards),
        }
    return results


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_ops_without_a_rule_equal_torch_values_and_gradients(backend, mesh):
    for name, op in OPS.items():
        leaf = DATA.clone().requires_grad_()
        op(leaf).sum().backward()
        wide = in_float64(DATA).requires_grad_()
        op(wide).sum().backward()
        for got in backend.run(job_no_rule_ops, mesh.shape, mesh.names):
            assert got[name]["replicas agree"], name
            assert_close(got[name]["value"], op(in_float64(DATA)).detach(), op(DATA).detach(), msg=name)
            assert_close(got[name]["grad"], wide.grad, leaf.grad, msg=name)


def job_outputs_of_every_kind(mesh) -> dict:
    x = fd.distribute_tensor(
        torch.tensor([[0.0, 2.0], [3.0, 0.0], [1.0, 1.0]]), mesh, fd.P(mesh.axis_names[0])
    )
    nonzero = torch.nonzero(x)  # a data-dependent shape
    unique = torch.unique(x, return_counts=True)  # a tuple of tensors
    return {
        "nonzero": nonzero.full_tensor(),
        "unique": tuple(u.full_tensor() for u in unique),
        "numel": torch.numel(x),  # a Python number
        "is_nonzero": torch.is_nonzero(x.sum()),
        "rows": [row.full_tensor() for row in x],
    }


@pytest.mark.meshes((2,), (4,))
def test_outputs_of_every_kind_come_back(backend, mesh):
    t = torch.tensor([[0.0, 2.0], [3.0, 0.0], [1.0, 1.0]])
    for got in backend.run(job_outputs_of_every_kind, mesh.shape, mesh.names):
        assert torch.equal(got["nonzero"], torch.nonzero(t))
        assert all(torch.equal(a, b) for a, b in zip(got["unique"], torch.unique(t, return_counts=True)))
        assert got["numel"] == 6 and got["is_nonzero"] is True
        assert all(torch.equal(a, b) for a, b in zip(got["rows"], t))


def test_the_gather_is_visible_in_comm_debug_mode_explain_and_the_log(capsys):
    mesh = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(torch.arange(8.0), mesh, fd.P("x"))
    with fd.CommDebugMode() as comm:
        torch.median(x)
    assert comm.get_comm_counts() == {"all_gather": 1}
    report = fd.explain(torch.median, x)
    assert "all_gather(x)" in str(report) and report.output == fd.Layout(mesh, (fd.Replicate(),))
    assert report.total_bytes == 24  # 6 of the 8 float32 elements come from the other devices
    capsys.readouterr()
    fd.set_logs("rules")
    try:
        torch.median(x)
    finally:
        fd.set_logs()
    assert "[fd.rules] median: S(0) -> R (no rule: run on replicated inputs)" in capsys.readouterr().err


def test_a_replicated_input_needs_no_communication():
    mesh = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(torch.arange(8.0), mesh, fd.P())
    with fd.CommDebugMode() as comm:
        assert torch.median(x).full_tensor() == 3.0
    assert comm.get_comm_counts() == {}


def test_strict_mode_refuses_and_can_be_left():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.arange(4.0), mesh, fd.P("x"))
    with fd.strict_ops():
        with pytest.raises(fd.FunctionalDTensorError, match="strict"):
            torch.median(x)
        with pytest.raises(fd.FunctionalDTensorError, match="strict"):
            fd.explain(torch.median, x)
        assert (x + 1).placements == (fd.Shard(0),)  # ops with a rule run as ever
        with fd.strict_ops(False):
            assert torch.median(x).full_tensor() == 1.0


def test_the_environment_variable_makes_strict_the_default():
    code = (
        "import torch, functional_dtensor as fd\n"
        "x = fd.distribute_tensor(torch.arange(4.0), fd.simulated_mesh(2, 'x'), fd.P('x'))\n"
        "try:\n    torch.median(x)\n"
        "except fd.FunctionalDTensorError as e:\n    print('refused', 'strict' in str(e))\n"
    )
    env = {**os.environ, "FD_STRICT_OPS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "refused True"


def test_ops_that_draw_random_numbers_are_refused_with_fd_random_named():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.full((4, 4), 0.5), mesh, fd.P("x"))
    with pytest.raises(fd.FunctionalDTensorError, match="fd.random.bernoulli"):
        torch.bernoulli(x)  # tagged nondeterministic_seeded: refused before running
    state = torch.random.get_rng_state()
    with pytest.raises(fd.FunctionalDTensorError, match="global generator"):
        F.gumbel_softmax(x, tau=1.0)  # a Python composite that draws: refused after, undone
    assert torch.equal(torch.random.get_rng_state(), state)


def test_in_place_torch_functions_are_refused():
    x = fd.distribute_tensor(torch.ones(4), fd.simulated_mesh(2, "x"), fd.P("x"))
    with pytest.raises(fd.ImmutableError, match="torch.zero"):
        torch.zero_(x)
    assert torch.equal(x.full_tensor(), torch.ones(4))


def test_tensor_methods_and_attributes_keep_torchs_meanings():
    mesh = fd.simulated_mesh(4, "x")
    t = torch.arange(12.0).reshape(6, 2)
    x = fd.distribute_tensor(t, mesh, fd.P("x"))
    assert x.layout is torch.strided and x.sharding == fd.Layout(mesh, (fd.Shard(0),))
    assert x.itemsize == 4 and x.nbytes == 48 and not x.is_cuda and not x.is_sparse
    assert torch.equal(x.max(dim=1).values.full_tensor(), t.max(dim=1).values)
    assert torch.equal(x.argmax(dim=1).full_tensor(), t.argmax(dim=1))
    assert torch.equal(x.new_zeros(3).full_tensor(), torch.zeros(3))
    assert torch.equal(x.view_as(x).full_tensor(), t)
    assert torch.equal(x.repeat(2, 1).full_tensor(), t.repeat(2, 1))
    assert torch.equal(x.narrow(0, 1, 3).full_tensor(), t.narrow(0, 1, 3))
    assert [u.full_tensor().tolist() for u in x.unbind(1)] == [u.tolist() for u in t.unbind(1)]
    assert torch.equal((x // 2).full_tensor(), t // 2) and (x // 2).placements == (fd.Shard(0),)
    assert (x.numpy() == t.numpy()).all() and f"{x.sum():.1f}" == "66.0" and 5.0 in x
    assert [r.full_tensor().tolist() for r in x] == t.tolist()  # iteration ends
    xi = fd.distribute_tensor(torch.arange(8), mesh, fd.P("x"))
    assert torch.equal((xi & 3).full_tensor(), torch.arange(8) & 3)  # bitwise, as torch
    assert torch.equal((~xi).full_tensor(), ~torch.arange(8))
    with pytest.raises(fd.UnsupportedAttributeError, match="to_local"):
        x.data_ptr()
    assert not hasattr(x, "no_such_attribute")


def test_second_derivatives_of_an_op_without_a_rule_equal_torch():
    """The replica an op without a rule runs on and the replicated value it returns are each
    other's derivative, to any order (a plain expand's derivative would sum the devices')."""
    mesh = fd.simulated_mesh(2, "x")
    t = torch.tensor([0.3, -1.2], dtype=torch.float64)
    direction = torch.tensor([0.5, 2.0], dtype=torch.float64)

    def derivatives(f):
        x = t.clone().requires_grad_()
        (first,) = torch.autograd.grad((f(x) ** 2 * 0.7).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad((first * direction).sum(), x)
        return first.detach(), second

    want = derivatives(torch.std)
    for spec in (fd.P(), fd.P("x")):
        got = derivatives(lambda x, spec=spec: torch.std(fd.distribute_tensor(x, mesh, spec)).full_tensor())
        assert_close(got, want)
