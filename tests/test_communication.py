"""No more communication than torch's DTensor where its tests count collectives, on both
backends: Partial values stay Partial through the ops that keep them (an average plus a
replicated value or times a number, the maximum of maxima, amax of a Partial max), a view that
splits and merges a sharded dim keeps it sharded, and a multi-dim layer norm under sequence
parallel moves nothing; each with torch's values (and gradients where they are taken)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import assert_close

import functional_dtensor as fd

T = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
U = torch.randn(4, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

#: name -> (placement of T, of U, the op on global values)
PARTIAL_CASES = {
    "avg + replicated": ("avg", "R", lambda a, b: a + b),
    "replicated - avg": ("avg", "R", lambda a, b: b - a),
    "avg * 2.0 + 1": ("avg", None, lambda a, b: a * 2.0 + 1),
    "avg * replicated": ("avg", "R", lambda a, b: a * b),
    "avg / replicated": ("avg", "R", lambda a, b: a / b),
    "sum of avg": ("avg", None, lambda a, b: a.sum(0)),
    "maximum of maxima": ("max", "max", torch.maximum),
    "minimum of minima": ("min", "min", torch.minimum),
    "maximum with replicated": ("max", "R", torch.maximum),
    "amax of max": ("max", None, lambda a, b: torch.amax(a, 1)),
    "amin of min": ("min", None, lambda a, b: torch.amin(a)),
}


def _placed(t, kind, mesh):
    placement = fd.Replicate() if kind == "R" else fd.Partial(kind)
    return fd.distribute_tensor(t, mesh, [placement] * mesh.ndim)


def job_partial_values(mesh) -> dict:
    out = {}
    for name, (kind_a, kind_b, op) in PARTIAL_CASES.items():
        a, b = _placed(T, kind_a, mesh), None if kind_b is None else _placed(U, kind_b, mesh)
        with fd.CommDebugMode() as comm:
            y = op(a, b)
        out[name] = (comm.get_comm_counts(), y.placements, y.full_tensor())
    return out


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_partial_values_stay_partial_with_no_communication(backend, mesh):
    for got in backend.run(job_partial_values, mesh.shape, mesh.names):
        for name, (_, _, op) in PARTIAL_CASES.items():
            counts, placements, value = got[name]
            assert counts == {}, (name, counts)
            assert all(p.is_partial() for p in placements), (name, placements)
            assert_close(value, op(T, U), msg=name)


def job_gradients_through_partial_averages(mesh) -> dict:
    """With gradients, a replicated operand is never part of an average's parts (its gradient
    would sum n contributions): values and gradients are torch's."""
    grads = {}
    for name in ("avg + replicated", "avg * replicated", "avg / replicated", "maximum with replicated"):
        kind_a, kind_b, op = PARTIAL_CASES[name]
        a, b = T.clone().requires_grad_(), U.clone().requires_grad_()
        y = op(_placed(a, kind_a, mesh), _placed(b, kind_b, mesh))
        (y.full_tensor() * torch.arange(24.0).reshape(4, 6)).sum().backward()
        grads[name] = (a.grad, b.grad)
    return grads


@pytest.mark.meshes((2,), (4,))
def test_gradients_through_partial_values_equal_torch(backend, mesh):
    for got in backend.run(job_gradients_through_partial_averages, mesh.shape, mesh.names):
        for name, (a_grad, b_grad) in got.items():
            a, b = T.clone().requires_grad_(), U.clone().requires_grad_()
            (PARTIAL_CASES[name][2](a, b) * torch.arange(24.0).reshape(4, 6)).sum().backward()
            assert_close((a_grad, b_grad), (a.grad, b.grad), msg=name)


def job_views_and_norms(mesh) -> dict:
    """(48, 35, 26) -> (24, 4, 35, 13) on [Replicate, Shard(0)]: the first dims of the merged
    and split group both divide by the devices, so the shard stays; a layer norm over the last
    two dims of a sequence-sharded value runs where it is."""
    t = torch.arange(48 * 35 * 26, dtype=torch.float64).reshape(48, 35, 26)
    x = fd.distribute_tensor(t, mesh, [fd.Replicate(), fd.Shard(0)])
    h = torch.randn(8, 16, 6, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    hs = fd.distribute_tensor(h, mesh, fd.P(None, mesh.axis_names))
    w = fd.distribute_tensor(torch.ones(6, 4, dtype=torch.float64), mesh, fd.P())
    with fd.CommDebugMode() as comm:
        y = x.view(24, 4, 35, 13)
        z = F.layer_norm(hs, (6, 4), w)
    return {
        "counts": comm.get_comm_counts(),
        "view": (y.placements, y.full_tensor()),
        "norm": z.full_tensor(),
    }


@pytest.mark.meshes((2, 2))
def test_views_and_layer_norms_under_sequence_parallel_move_nothing(backend, mesh):
    t = torch.arange(48 * 35 * 26, dtype=torch.float64).reshape(48, 35, 26)
    h = torch.randn(8, 16, 6, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for got in backend.run(job_views_and_norms, mesh.shape, mesh.names):
        assert got["counts"] == {}
        placements, value = got["view"]
        assert placements == (fd.Replicate(), fd.Shard(0)) and torch.equal(value, t.view(24, 4, 35, 13))
        assert_close(got["norm"], F.layer_norm(h, (6, 4), torch.ones(6, 4, dtype=torch.float64)))


def job_full_tensor_counts(mesh) -> dict:
    x = fd.distribute_tensor(torch.arange(8.0), mesh, fd.P(mesh.axis_names[0]))
    p = fd.distribute_tensor(torch.arange(8.0), mesh, [fd.Partial()] * mesh.ndim)
    with fd.CommDebugMode() as comm:
        x.full_tensor()
        p.full_tensor()
    return comm.get_comm_counts()


@pytest.mark.meshes((2,), (4,))
def test_full_tensor_counts_the_same_on_both_backends(backend, mesh):
    """As torch's CommDebugMode counts a full_tensor(): a gather of the shards, a reduction of
    the parts."""
    for counts in backend.run(job_full_tensor_counts, mesh.shape, mesh.names):
        assert counts == {"all_gather": 1, "all_reduce": 1}
