"""fd.redistribute: any layout to any layout, the same global value, gradients back in the
source layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor._plan import Regather, lower_bound, plan, step_bytes
from functional_dtensor._sharding import shard_table
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
    y = fd.redistribute(x, target)
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


@st.composite
def even_pairs(draw):
    """Meshes up to 8 devices, 1-3 dims of sizes multiple of the mesh size: every layout splits
    evenly, so the planner (not the fallback) runs."""
    mesh = draw(fds.meshes(max_devices=8))
    ndim = draw(st.integers(1, 3))
    shape = tuple(mesh.size * draw(st.integers(1, 2)) for _ in range(ndim))
    source = draw(fds.layouts(mesh, ndim, allow_partial=True))
    target = draw(fds.layouts(mesh, ndim, allow_partial=True))
    return mesh, shape, source, target


@given(even_pairs())
def test_planned_steps_give_the_target_blocks_and_count_what_they_run(case):
    mesh, shape, source, target = case
    t = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    x = fd.distribute_tensor(t, mesh, source)
    steps = plan(source, target, shape, 8)
    assert not any(isinstance(s, Regather) for s in steps)
    with fd.CommDebugMode() as comm:
        y = fd.redistribute(x, target)
    expected = [event for s in steps for event in _events(s)]
    assert [(e.op, e.axes) for e in comm.events] == expected
    torch.testing.assert_close(y.full_tensor(), t)
    if not target.has_partial:
        for got, want in zip(y.local_shards(), fd.distribute_tensor(t, mesh, target).local_shards()):
            torch.testing.assert_close(got, want)
    (g,) = torch.autograd.grad(y.full_tensor().square().sum(), t)
    torch.testing.assert_close(g, 2 * t.detach())


def _events(step):
    if not step.collective:
        return []
    return [(step.collective, step.names)]


S, R, PS = fd.Shard, fd.Replicate(), fd.Partial()
CATALOGUE = [
    ((2,), (S(0),), (R,)),
    ((2,), (S(0),), (S(1),)),
    ((2,), (PS,), (R,)),
    ((2,), (PS,), (S(0),)),
    ((2,), (R,), (S(0),)),
    ((2,), (S(1),), (R,)),
    ((4,), (S(0),), (R,)),
    ((4,), (S(0),), (S(1),)),
    ((4,), (PS,), (R,)),
    ((4,), (PS,), (S(0),)),
    ((4,), (R,), (S(0),)),
    ((4,), (S(1),), (R,)),
    ((2, 2), (S(0), S(1)), (S(1), S(0))),
    ((2, 2), (S(0), S(1)), (R, R)),
    ((2, 2), (PS, PS), (R, R)),
    ((2, 2), (S(0), R), (R, S(0))),
    ((2, 2), (S(0), S(0)), (R, R)),
    ((2, 2), (PS, S(0)), (S(0), R)),
]


@pytest.mark.parametrize("mesh_shape, source, target", CATALOGUE)
def test_catalogue_plans_are_at_the_lower_bound_with_one_collective(mesh_shape, source, target):
    mesh = fd.simulated_mesh(mesh_shape, ("x", "y")[: len(mesh_shape)])
    src, dst = fd.Layout(mesh, source), fd.Layout(mesh, target)
    steps = plan(src, dst, (2048, 2048), 4)
    assert sum(step_bytes(s, (2048, 2048), 4) for s in steps) == lower_bound(src, dst, (2048, 2048), 4)
    assert sum(1 for s in steps if s.collective) <= 1


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 3), (2, 2, 2)])
@pytest.mark.parametrize(
    "source, target, collective",
    [
        ((S(0), S(1)), (S(1), S(0)), "ppermute"),
        ((S(0), R), (R, S(0)), "ppermute"),
        ((R, S(1)), (S(1), R), "ppermute"),
        ((PS, S(0)), (S(0), R), "reduce+broadcast"),
        ((fd.Partial("avg"), S(1)), (S(1), R), "reduce+broadcast"),
    ],
)
def test_point_to_point_plans(mesh_shape, source, target, collective):
    names = ("x", "y", "z")[: len(mesh_shape)]
    mesh = fd.simulated_mesh(mesh_shape, names)
    extra = (S(2),) if len(mesh_shape) == 3 else ()  # a third axis on a third dim
    t = torch.randn(36, 36, 2, dtype=torch.float64, requires_grad=True)
    x = fd.distribute_tensor(t, mesh, source + extra)
    with fd.CommDebugMode() as comm:
        y = fd.redistribute(x, target + extra)
    if collective == "ppermute" or mesh_shape[0] == 2:  # over 3 devices, a cheaper plan exists
        assert [e.op for e in comm.events] == [collective]
    torch.testing.assert_close(y.full_tensor(), t)
    for got, want in zip(y.local_shards(), fd.distribute_tensor(t, mesh, target + extra).local_shards()):
        torch.testing.assert_close(got, want)
    (g,) = torch.autograd.grad(y.full_tensor().sum(), t)
    torch.testing.assert_close(g, torch.ones_like(t))


def test_plans_are_the_same_in_every_process():
    """Every rank plans for itself: the plan must not depend on per-process hash seeds."""
    import os
    import subprocess
    import sys

    script = (
        "import functional_dtensor as fd\n"
        "from functional_dtensor._plan import plan\n"
        "mesh = fd.simulated_mesh((2, 2, 2), ('x', 'y', 'z'))\n"
        "ops = [fd.Partial('sum'), fd.Partial('max'), fd.Partial('avg')]\n"
        "src, dst = fd.Layout(mesh, tuple(ops)), fd.Layout(mesh, (fd.Replicate(),) * 3)\n"
        "print([str(s) for s in plan(src, dst, (8, 8), 4)])\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2)
    }
    assert len(outputs) == 1


@given(pairs())
def test_reported_bytes_are_never_below_the_lower_bound(pair):
    case, target = pair
    report = fd.explain_redistribute(case.layout, target, case.global_shape, show=False)
    assert report.total_bytes >= report.lower_bound


@st.composite
def integer_partial_pairs(draw):
    """An int64 value from arbitrary local shards on a layout with Partial axes (any ops, mixed),
    and any target layout."""
    mesh = draw(fds.meshes(max_devices=8))
    ndim = draw(st.integers(1, 2))
    shape = tuple(mesh.size * draw(st.integers(1, 2)) for _ in range(ndim))
    source = draw(fds.layouts(mesh, ndim, allow_partial=True))
    target = draw(fds.layouts(mesh, ndim, allow_partial=True))
    return mesh, shape, source, target, draw(st.integers(0, 2**16))


@given(integer_partial_pairs())
def test_integer_partial_values_redistribute_to_their_own_full_tensor(case):
    """Integer averages round down, so the order of reductions matters: every plan reduces as
    the global value defines it, and keeps the dtype."""
    mesh, shape, source, target, seed = case
    shards = []
    for device, local in enumerate(shard_table(source, shape).local_shapes):
        # equal along Replicate axes, different along the others
        key = [c for c, p in zip(mesh.coordinate(device), source.placements) if not p.is_replicate()]
        generator = torch.Generator().manual_seed(hash((seed, *key)) % 2**31)
        shards.append(torch.randint(-50, 50, local, generator=generator))
    x = fd.from_local(shards, mesh, source, shape=shape, run_check=True)
    y = fd.redistribute(x, target)
    assert y.dtype == torch.int64
    assert torch.equal(y.full_tensor(), x.full_tensor())
