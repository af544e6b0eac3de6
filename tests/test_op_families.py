"""Rules generated from families, on both backends: every reduction torch tags
``torch.Tag.reduction`` (its reduced dims whole or combined as a Partial, the other dims kept
sharded) and the view family (permutations, repeats, ``atleast_*``, ``broadcast_to``, the
complex views), each read from torch itself on a meta probe.

Each case compares values and gradients with torch on the global tensor (float64), and the
collectives the call runs with what its rule promises: none where the reduced or moved dims are
whole already.
"""

from __future__ import annotations

import pytest
import torch
from common import assert_close

import functional_dtensor as fd


def values(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


#: name -> (global shape, spec by axis names, call, collectives on a mesh of more than one device)
CASES = {
    # reductions by torch's tag: a dim not reduced stays sharded, with no communication
    "var over a whole dim": ((8, 6), lambda a: (a[0],), lambda x: torch.var(x, 1), 0),
    "std over the sharded dim": ((8, 6), lambda a: (a[0],), lambda x: x.std(dim=0), 1),
    "logsumexp keepdim": ((8, 6), lambda a: (a[0],), lambda x: torch.logsumexp(x, 1, keepdim=True), 0),
    "var_mean": ((8, 6, 3), lambda a: (None, a[0]), lambda x: torch.var_mean(x, (0, 2)), 0),
    "nansum over the sharded dim: Partial": ((8, 6), lambda a: (a[0],), lambda x: torch.nansum(x, 0), 0),
    "count_nonzero": ((8, 6), lambda a: (None, a[0]), lambda x: torch.count_nonzero(x > 0, dim=0), 0),
    "any": ((8, 6), lambda a: (a[0],), lambda x: torch.any(x > 1, 1), 0),
    "aminmax": ((8, 6), lambda a: (None, a[0]), lambda x: torch.aminmax(x, dim=0), 0),
    "std of all": ((8, 6), lambda a: (a[0],), lambda x: x.std(), 1),
    # the view family
    "movedim": ((8, 6, 5), lambda a: (a[0],), lambda x: torch.movedim(x, 0, 2), 0),
    "moveaxis": ((8, 6, 5), lambda a: (None, a[0]), lambda x: x.moveaxis(1, 0), 0),
    "repeat of other dims": ((8, 6, 5), lambda a: (a[0],), lambda x: x.repeat(1, 2, 3), 0),
    "repeat of the sharded dim": ((8, 6, 5), lambda a: (a[0],), lambda x: x.repeat(2, 1, 1), 1),
    "tile": ((8, 6), lambda a: (a[0],), lambda x: torch.tile(x, (2, 1, 2)), 0),
    "atleast_3d": ((8, 6), lambda a: (None, a[0]), lambda x: torch.atleast_3d(x), 0),
    "broadcast_to": ((8, 6), lambda a: (a[0],), lambda x: torch.broadcast_to(x, (3, 8, 6)), 0),
    "expand_as": ((8, 1), lambda a: (a[0],), lambda x: x.expand_as(torch.empty(8, 4)), 0),
    "view_as": ((8, 6), lambda a: (a[0],), lambda x: x.view_as(torch.empty(8, 3, 2)), 0),
    "complex views": (
        (8, 6),
        lambda a: (a[0],),
        lambda x: torch.view_as_real(torch.view_as_complex(x.reshape(8, 3, 2)) * (1 + 2j)),
        0,
    ),
}


def _global(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(o.full_tensor() if isinstance(o, fd.DTensor) else o for o in outs)


def job_families(mesh):
    """Every case on this mesh: its outputs, its input's gradient, the collectives it ran."""
    results = {}
    for name, (shape, spec_of, call, _) in CASES.items():
        x = values(shape, 1).requires_grad_(True)
        value = fd.distribute_tensor(x, mesh, fd.P(*spec_of(mesh.axis_names)))
        with fd.CommDebugMode() as comm:
            out = call(value)
        outs = _global(out)
        floating = [o for o in outs if o.is_floating_point() or o.is_complex()]
        grad = None
        if floating:
            seed = sum(torch.view_as_real(o).sum() if o.is_complex() else o.sum() for o in floating)
            (grad,) = torch.autograd.grad(seed, x)
        results[name] = (tuple(o.detach() for o in outs), grad, comm.get_total_counts())
    return results


@pytest.mark.meshes((4,), (2, 2))
def test_families_equal_torch_with_the_communication_their_rules_promise(backend, mesh):
    for got in backend.run(job_families, mesh.shape, mesh.names):
        for name, (shape, _, call, collectives) in CASES.items():
            x = values(shape, 1).requires_grad_(True)
            outs = _global(call(x))
            floating = [o for o in outs if o.is_floating_point() or o.is_complex()]
            grad = None
            if floating:
                seed = sum(torch.view_as_real(o).sum() if o.is_complex() else o.sum() for o in floating)
                (grad,) = torch.autograd.grad(seed, x)
            outputs, got_grad, count = got[name]
            assert_close(outputs, tuple(o.detach() for o in outs), msg=lambda m, n=name: f"{n}: {m}")
            if grad is not None:
                assert_close(got_grad, grad, msg=lambda m, n=name: f"{n} (gradient): {m}")
            assert count == collectives, f"{name}: {count} collectives, the rule promises {collectives}"


def test_a_tagged_reduction_is_decided_by_its_rule_not_the_fallback():
    mesh = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(values((8, 6)), mesh, fd.P("x"))
    report = fd.explain(torch.var, x, 1)
    assert "no rule" not in str(report)
    assert torch.var(x, 1).placements == (fd.Shard(0),)


def job_warnings(mesh):
    """The warnings a reduction of uneven blocks raises here (a device holds no column)."""
    import warnings

    x = fd.distribute_tensor(values((8, 6)), mesh, fd.P(None, mesh.axis_names[0]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.var(x, 0).full_tensor()
    return [str(w.message) for w in caught]


@pytest.mark.meshes((4,))
def test_a_device_holding_an_empty_block_warns_of_nothing(backend, mesh):
    """torch warns of ``var`` over no elements; on one device the op sees the whole value."""
    for caught in backend.run(job_warnings, mesh.shape, mesh.names):
        assert caught == []


def test_where_with_a_zero_keeps_a_partial_sum_and_with_another_number_reduces_it():
    """``torch.where(keep, x, 0)`` is linear in ``x``: a Partial sum stays one (a masked loss of
    a sharded class dim); ``where(keep, x, 1)`` is not, and decided apart from it."""
    mesh = fd.simulated_mesh(4, "x")
    x = fd.distribute_tensor(values((8, 6)), mesh, fd.P(None, "x")).sum(1)  # Partial(sum)
    keep = fd.distribute_tensor(values((8,), 2) > 0, mesh, fd.P())
    for other, partial in ((0.0, True), (0, True), (1.0, False)):
        with fd.CommDebugMode() as comm:
            out = torch.where(keep, x, other)
        assert out.placements[0].is_partial() == partial, other
        assert comm.get_total_counts() == (0 if partial else 1)
        want = torch.where(keep.full_tensor(), x.full_tensor(), other)
        assert_close(out.full_tensor(), want, terms=6)
