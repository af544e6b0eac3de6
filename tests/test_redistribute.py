"""fd.redistribute on both backends: any layout to any layout (a dim's axes in any order,
Partial axes, uneven shapes), the same global value, every device's block of the target layout
(the plain-loop oracle), the gradient back in the source layout, and the collectives of the
plan, bytes included. Integer values keep their dtype and reduce as their own full_tensor does.
(The planner alone is tested in test_plan.py.)"""

from __future__ import annotations

import functools
import itertools
import zlib

import pytest
import torch
from backends import (
    Mesh,
    block,
    coordinates,
    events,
    local_of,
    per_device,
    reduce_partial,
    relayout,
    spec_of_shards,
)
from common import assert_close, check, even_pairs
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor._plan import Permute, Regather, Relabel, lower_bound, plan
from functional_dtensor._sharding import shard_table
from functional_dtensor.testing import strategies as fds

S, R, Pa = fd.Shard, fd.Replicate(), fd.Partial
PS = Pa("sum")


def value_of(shape, dtype: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == "int64":
        return torch.randint(-50, 51, shape, generator=generator)
    return torch.randn(shape, generator=generator, dtype=getattr(torch, dtype))


def expected_events(source: fd.Layout, target: fd.Layout, shape, dtype: str) -> list[tuple]:
    """``(op, axes)`` of each collective the plan runs (a regather: an all-reduce per Partial
    axis, then one all-gather over the Shard axes)."""
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    out = []
    for step in plan(source, target, tuple(shape), itemsize, dtype == "int64"):
        if isinstance(step, Regather):
            names, placements = source.mesh.axis_names, source.placements
            out += [("all_reduce", (n,)) for n, p in zip(names, placements) if p.is_partial()]
            sharding = tuple(n for n, p in zip(names, placements) if p.is_shard())
            out += [("all_gather", sharding)] if sharding else []
        elif step.collective:
            out.append((step.collective, step.names))
    return out


def job_redistribute(mesh, items) -> list[dict]:
    """fd.redistribute for each ``(shape, source, target, dtype, seed)``: the result's layout,
    shards and value, the collectives it ran, the gradient of the input."""
    out = []
    for shape, source, target, dtype, seed in items:
        value = value_of(shape, dtype, seed)
        x = value.clone().requires_grad_(value.is_floating_point())
        d = fd.distribute_tensor(x, mesh, relayout(mesh, source))
        with fd.CommDebugMode() as comm:
            moved = fd.redistribute(d, relayout(mesh, target))
        full = moved.full_tensor()
        grad = None
        if value.is_floating_point():
            (grad,) = torch.autograd.grad(full, x, torch.ones_like(full) * 2 - value)
        out.append(
            {
                "layout": (moved.placements, moved.sharding.shard_order),
                "dtype": moved.dtype,
                "shards": [s.detach() for s in moved.local_shards()],
                "full": full.detach(),
                "grad": grad,
                "events": events(comm),
            }
        )
    return out


def check_redistribute(backend, mesh: Mesh, items) -> list:
    results = backend.run(job_redistribute, mesh.shape, mesh.names, items)
    sim = job_redistribute(mesh.simulated(), items) if not backend.is_simulated else None
    for k, (shape, source, target, dtype, seed) in enumerate(items):
        value = value_of(shape, dtype, seed)
        answers = [r[k] for r in results]
        at = f"{source} -> {target} {shape} {dtype} on {mesh}"
        want_events = expected_events(source, target, shape, dtype)
        for p, got in enumerate(answers):
            assert got["layout"] == (target.placements, target.shard_order), at
            assert got["dtype"] == value.dtype, at
            if value.is_floating_point():
                assert_close(got["full"], value, msg=lambda m, at=f"{at}, process {p}": f"{at}: {m}")
                assert_close(got["grad"], torch.ones_like(value) * 2 - value)  # the identity's
            else:
                assert torch.equal(got["full"], value), at
            assert [(op, axes) for op, axes, _ in got["events"]] == want_events, f"{at}: {got['events']}"
            if sim is not None:  # bytes too, as the simulated backend counts them
                assert got["events"] == sim[k]["events"], at
        shards = per_device(answers, "shards")
        blocks = reduce_partial(shards, mesh.shape, target.placements)
        spec = spec_of_shards(target)
        for coordinate, got in blocks.items():
            want = block(value, mesh.shape, mesh.names, spec, coordinate)
            assert_close(got, want, msg=lambda m, at=f"{at}: device at {coordinate}": f"{at}: {m}")
    return results


def items_for(mesh: Mesh, rows) -> list[tuple]:
    sim = mesh.simulated()
    out = []
    for k, (shape, source, target, dtype) in enumerate(rows):
        as_layout = (
            (lambda t: fd.Layout.from_spec(sim, t))
            if isinstance(source, fd.P)
            else (lambda t: fd.Layout(sim, t))
        )
        seed = zlib.crc32(f"{mesh}:{k}".encode()) % 1000
        out.append((shape, as_layout(source), as_layout(target), dtype, seed))
    return out


ROWS_1D = [
    ((5, 3), (S(0),), (S(1),), "float64"),
    ((5, 3), (S(0),), (R,), "float64"),
    ((4, 2), (R,), (S(0),), "float64"),
    ((3, 2), (PS,), (S(0),), "float64"),
    ((3, 2), (Pa("max"),), (R,), "float64"),
    ((3, 2), (Pa("avg"),), (S(1),), "float32"),
    ((7,), (S(0),), (R,), "int64"),
    ((7, 3), (Pa("min"),), (S(0),), "int64"),
    # the planner's catalogue on even shapes: every step kind
    ((8, 8), (S(0),), (R,), "float64"),
    ((8, 8), (S(0),), (S(1),), "float64"),
    ((8, 8), (PS,), (R,), "float64"),
    ((8, 8), (PS,), (S(0),), "float64"),
    ((8, 8), (R,), (S(0),), "float64"),
    ((8, 8), (S(1),), (R,), "float64"),
    ((8, 8), (R,), (PS,), "float64"),
    ((8, 8), (R,), (Pa("max"),), "int64"),
]
ROWS_2D = [
    ((4, 6), (S(0), S(1)), (S(1), S(0)), "float64"),
    ((5, 3), (S(0), R), (R, S(1)), "float64"),
    ((6, 2), (S(0), S(0)), (R, R), "float64"),
    ((3, 4), (PS, S(1)), (S(0), S(1)), "float64"),
    ((2, 3), (R, Pa("avg")), (S(1), R), "float64"),
    ((8, 8), (S(0), S(1)), (S(1), S(0)), "float64"),
    ((8, 8), (S(0), S(1)), (R, R), "float64"),
    ((8, 8), (PS, PS), (R, R), "float64"),
    ((8, 8), (S(0), R), (R, S(0)), "float64"),
    ((8, 8), (S(0), S(0)), (R, R), "float64"),
    ((8, 8), (PS, S(0)), (S(0), R), "float64"),
    ((8, 8), (Pa("avg"), S(1)), (S(1), R), "float64"),
    ((8, 8), (R, S(1)), (S(1), R), "int64"),
    ((8, 8), (Pa("avg"), Pa("sum")), (S(0), R), "int64"),
    # a dim's axes in any order
    ((8, 8), fd.P(("y", "x")), fd.P(("x", "y")), "float64"),
    ((8, 8), fd.P(("x", "y")), fd.P(("y", "x")), "int64"),
    ((8, 8), fd.P(("y", "x")), fd.P(None, ("y", "x")), "float64"),
    ((8, 8), fd.P(("y", "x")), fd.P("x", "y"), "float64"),
    ((8, 8), fd.P(("y", "x")), fd.P(), "float64"),
    ((8, 8), fd.P("y"), fd.P(("y", "x")), "float64"),
    ((7, 5), fd.P(("y", "x")), fd.P(None, ("y", "x")), "float64"),  # uneven: regathered
    ((6, 4), fd.P(None, ("y", "x")), fd.P("y", "x"), "float32"),
]
ROWS_3D = [
    ((12, 12), fd.P(("z", "y", "x")), fd.P(("x", "y", "z")), "float64"),
    ((12, 12), fd.P(("z", "x"), "y"), fd.P(("x", "z"), "y"), "float64"),
    ((12, 12), fd.P(("y", "x"), "z"), fd.P("z", ("x", "y")), "float64"),
    ((12, 12), fd.P(("z", "x")), fd.P(None, ("y", "z")), "int64"),
    ((12, 12), (PS, S(0), S(0)), (R, S(1), S(0)), "float64"),
    ((7, 5), fd.P(("z", "y")), fd.P(None, ("x", "z")), "float64"),
]
ROWS = {(2,): ROWS_1D, (4,): ROWS_1D, (2, 2): ROWS_2D, (2, 3, 2): ROWS_3D, (2, 2, 2): ROWS_3D}


@pytest.mark.meshes(*ROWS)
def test_redistribute(backend, mesh):
    check_redistribute(backend, mesh, items_for(mesh, ROWS[mesh.shape]))


@pytest.mark.meshes((2, 2), (2, 4), (2, 3, 2))
def test_a_reorder_of_one_dims_axes_is_one_ppermute_of_a_block(backend, mesh):
    """Every reorder of dim 0's axes (dim 1 split by the axes left): one ppermute, each device
    sending and receiving one block."""
    items = []
    for r in range(2, len(mesh.names) + 1):
        for axes in itertools.combinations(mesh.names, r):
            rest = tuple(a for a in mesh.names if a not in axes) or None
            for a, b in itertools.permutations(list(itertools.permutations(axes)), 2):
                items.append(((2 * mesh.size, mesh.size), fd.P(a, rest), fd.P(b, rest), "float64"))
    items = items_for(mesh, items)
    for shape, source, target, _, _ in items:
        assert [type(s) for s in plan(source, target, shape, 8)] == [Permute]
    results = check_redistribute(backend, mesh, items)
    for k, (shape, source, _, _, _) in enumerate(items):
        one_block = block(
            torch.zeros(shape), mesh.shape, mesh.names, spec_of_shards(source), (0,) * len(mesh.shape)
        )
        for got in results:
            assert got[k]["events"][0][2] == 8 * one_block.numel()


@pytest.mark.meshes((2, 1), (1, 2), (1, 2, 2), (2, 1, 2))
def test_a_change_on_axes_of_size_1_communicates_nothing(backend, mesh):
    """Placements that differ only on mesh axes of size 1 (a reorder of a dim's axes, Shard or
    Partial against Replicate) keep every device's block: one local relabel, no collective.
    Regression: a reorder involving a size-1 axis ran a needless ppermute (its bound is 0)."""
    ones = [a for a, n in zip(mesh.names, mesh.shape) if n == 1]
    rest = [a for a, n in zip(mesh.names, mesh.shape) if n > 1]
    rows = []
    for one in ones:
        for other in rest:
            rows.append(((2 * mesh.size, 3), fd.P((one, other)), fd.P((other, one)), "float32"))
            rows.append(((2 * mesh.size, 3), fd.P((other, one)), fd.P(other), "float32"))
        rows.append(((4, 2 * mesh.size), fd.P(None, one), fd.P(), "float64"))
        partial = tuple(fd.Partial() if a == one else fd.Replicate() for a in mesh.names)
        rows.append(((3,), partial, (fd.Replicate(),) * len(mesh.names), "float32"))
    items = items_for(mesh, rows)
    for shape, source, target, _, _ in items:
        steps = plan(source, target, shape, 4)
        assert [type(s) for s in steps] == [Relabel], [str(s) for s in steps]
        assert lower_bound(source, target, shape, 4) == 0
    for got in check_redistribute(backend, mesh, items):
        assert all(r["events"] == [] for r in got)


UNEVEN_REDUCE_SCATTER = {
    (2,): [
        ((5, 3), (fd.Partial(),), (fd.Shard(0),), "float32"),
        ((3,), (fd.Partial("avg"),), (fd.Shard(0),), "float64"),
    ],
    (4,): [
        ((10,), (fd.Partial(),), (fd.Shard(0),), "float32"),
        ((2, 3), (fd.Partial(),), (fd.Shard(0),), "int64"),
    ],
    (2, 2): [((5, 3), (fd.Partial(), fd.Shard(1)), (fd.Shard(0), fd.Shard(1)), "float32")],
}


@pytest.mark.meshes(*UNEVEN_REDUCE_SCATTER)
def test_partial_to_shard_of_an_uneven_dim_runs_one_reduce_scatter(backend, mesh):
    """Regression: it ran an all_reduce and an all_gather through the global value."""
    for got in check_redistribute(backend, mesh, items_for(mesh, UNEVEN_REDUCE_SCATTER[mesh.shape])):
        for result in got:
            assert [op for op, _, _ in result["events"]] == ["reduce_scatter"], result["events"]


@pytest.mark.meshes((1, 2, 2), (2, 2, 2), (2, 3, 2))
def test_a_reorder_beside_partial_axes(backend, mesh):
    """Axes y and z reorder dim 0 while x holds Partial parts: one ppermute of a block, the
    parts staying on their Partial coordinate (floats and integers, every op)."""
    sim = mesh.simulated()
    items = []
    for k, (op, dtype) in enumerate(itertools.product(["sum", "avg", "max", "min"], ["float64", "int64"])):
        placements = (Pa(op), S(0), S(0))
        source = fd.Layout(sim, placements, ((0, (2, 1)),))
        items.append(((4 * mesh.size, 3), source, fd.Layout(sim, placements), dtype, k))
    for shape, source, target, dtype, _ in items:
        assert [type(s) for s in plan(source, target, shape, 8, dtype == "int64")] == [Permute]
    check_redistribute(backend, mesh, items)


@st.composite
def drawn_items(draw, mesh: Mesh, n: int):
    sim = mesh.simulated()
    items = []
    for k in range(n):
        shape = draw(fds.global_shapes(min_dims=1, max_dims=3, max_side=6, max_elements=64))
        source = draw(fds.layouts(sim, len(shape), allow_partial=True))
        target = draw(fds.layouts(sim, len(shape), allow_partial=True))
        dtype = draw(st.sampled_from(["float64", "int64"]))
        items.append((shape, source, target, dtype, k))
    return items


@pytest.mark.meshes((2,), (2, 2), (2, 3, 2))
@settings(max_examples=5)
@given(data=st.data())
def test_drawn_redistributions(backend, mesh, data):
    check_redistribute(backend, mesh, data.draw(drawn_items(mesh, 6)))


# --- integer Partial values: their own full_tensor, in their dtype ------------------------------


def integer_shards(mesh_shape, layout: fd.Layout, shape, seed: int) -> list[torch.Tensor]:
    """Every device's int64 shard: equal along Replicate axes, different along the others."""
    shards = []
    local_shapes = shard_table(layout, shape).local_shapes
    for coordinate, local in zip(coordinates(mesh_shape), local_shapes, strict=True):
        key = [c for c, p in zip(coordinate, layout.placements, strict=True) if not p.is_replicate()]
        generator = torch.Generator().manual_seed(zlib.crc32(repr((seed, *key)).encode()))
        shards.append(torch.randint(-50, 50, local, generator=generator))
    return shards


def job_integer_partial(mesh, items) -> list[dict]:
    out = []
    for shape, source, target, shards in items:
        x = fd.from_local(local_of(mesh, shards), mesh, relayout(mesh, source), shape=shape, run_check=True)
        y = fd.redistribute(x, relayout(mesh, target))
        out.append({"dtype": y.dtype, "y": y.full_tensor(), "x": x.full_tensor()})
    return out


INTEGER_PARTIAL = {
    (2,): [((8,), (Pa("avg"),), (R,)), ((8,), (Pa("avg"),), (S(0),)), ((5,), (Pa("avg"),), (S(0),))],
    (4,): [((8,), (Pa("avg"),), (R,)), ((8,), (Pa("avg"),), (S(0),))],
    (2, 2): [
        ((8,), (Pa("avg"), Pa("avg")), (R, R)),
        ((8,), (Pa("avg"), Pa("sum")), (R, S(0))),
        ((8,), (Pa("sum"), Pa("avg")), (S(0), R)),
        ((8,), (Pa("max"), Pa("avg")), (R, R)),
        ((8, 4), (Pa("avg"), S(0)), (S(0), R)),
        ((8, 4), (S(1), Pa("avg")), (R, S(0))),
        ((6,), (Pa("avg"), Pa("min")), (S(0), S(0))),
    ],
}


@pytest.mark.meshes(*INTEGER_PARTIAL)
def test_integer_partial_values_redistribute_to_their_own_full_tensor(backend, mesh):
    """Regression: an int64 Partial('avg') value must redistribute to its own full_tensor (an
    integer average rounds down, so the order of the reductions matters), dtype kept."""
    sim = mesh.simulated()
    items, wants = [], []
    for k, (shape, source, target) in enumerate(INTEGER_PARTIAL[mesh.shape]):
        layout = fd.Layout(sim, source)
        shards = integer_shards(mesh.shape, layout, shape, seed=k)
        items.append((shape, layout, fd.Layout(sim, target), shards))
        # the oracle: reduce the Partial axes in mesh order, then put the blocks together
        reduced = reduce_partial(shards, mesh.shape, layout.placements)
        want = torch.zeros(shape, dtype=torch.int64)
        table = shard_table(layout, shape)
        for coordinate, part in reduced.items():
            d = coordinates(mesh.shape).index(coordinate)
            index = tuple(
                slice(o, o + n) for o, n in zip(table.offsets[d], table.local_shapes[d], strict=True)
            )
            want[index] = part
        wants.append(want)
    for p, answers in enumerate(backend.run(job_integer_partial, mesh.shape, mesh.names, items)):
        for (shape, source, target, _), got, want in zip(items, answers, wants, strict=True):
            at = f"{source} -> {target} {shape}, process {p}"
            assert got["dtype"] == torch.int64, at
            assert torch.equal(got["x"], want), at
            assert torch.equal(got["y"], want), f"{at}: {got['y']} vs {want}"


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
def test_drawn_integer_partial_values_redistribute_to_their_own_full_tensor(case):
    """Integer averages round down, so the order of reductions matters: every plan reduces as
    the global value defines it, and keeps the dtype."""
    mesh, shape, source, target, seed = case
    shards = integer_shards(mesh.shape, source, shape, seed)
    x = fd.from_local(shards, mesh, source, shape=shape, run_check=True)
    y = fd.redistribute(x, target)
    assert y.dtype == torch.int64
    assert torch.equal(y.full_tensor(), x.full_tensor())


# --- simulated: drawn pairs of layouts ---------------------------------------------------------


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
    assert y.sharding == target and y.shape == x.shape
    assert_close(y.full_tensor(), t)
    mesh = case.mesh
    blocks = reduce_partial(y.local_shards(), mesh.shape, target.placements)
    for coordinate, got in blocks.items():
        assert_close(got, block(t, mesh.shape, mesh.axis_names, spec_of_shards(target), coordinate))


@given(pairs())
def test_gradient_comes_back_in_the_source_layout(pair):
    case, target = pair
    t = torch.randn(case.global_shape, dtype=torch.float64, requires_grad=True)
    y = fd.redistribute(fd.distribute_tensor(t, case.mesh, case.layout), target)
    (g,) = torch.autograd.grad(y.full_tensor().square().sum(), t)
    assert_close(g, 2 * t.detach())


@given(even_pairs())
def test_planned_steps_give_the_target_blocks_and_count_what_they_run(case):
    mesh, shape, source, target = case
    t = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    x = fd.distribute_tensor(t, mesh, source)
    steps = plan(source, target, shape, 8)
    assert not any(isinstance(s, Regather) for s in steps)
    with fd.CommDebugMode() as comm:
        y = fd.redistribute(x, target)
    assert [(e.op, e.axes) for e in comm.events] == [(s.collective, s.names) for s in steps if s.collective]
    assert_close(y.full_tensor(), t)
    blocks = reduce_partial(y.local_shards(), mesh.shape, target.placements)
    for coordinate, got in blocks.items():
        assert_close(got, block(t, mesh.shape, mesh.axis_names, spec_of_shards(target), coordinate))
    (g,) = torch.autograd.grad(y.full_tensor().square().sum(), t)
    assert_close(g, 2 * t.detach())


@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 3), (2, 2, 2)])
@pytest.mark.parametrize(
    "source, target, collective",
    [
        ((S(0), S(1)), (S(1), S(0)), "ppermute"),
        ((S(0), R), (R, S(0)), "ppermute"),
        ((R, S(1)), (S(1), R), "ppermute"),
        ((PS, S(0)), (S(0), R), "reduce+broadcast"),
        ((Pa("avg"), S(1)), (S(1), R), "reduce+broadcast"),
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
    ops = [e.op for e in comm.events]
    if collective == "ppermute" or mesh_shape[0] == 2:
        assert ops == [collective]
    else:  # over 3 devices a cheaper plan than a reduce to the diagonal exists
        assert collective not in ops and ops
    assert_close(y.full_tensor(), t)
    for got, want in zip(
        y.local_shards(), fd.distribute_tensor(t, mesh, target + extra).local_shards(), strict=True
    ):
        assert_close(got, want)
    (g,) = torch.autograd.grad(y.full_tensor().sum(), t)
    assert_close(g, torch.ones_like(t))


# --- the API -----------------------------------------------------------------------------------


def test_method_spec_and_identity():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = fd.distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, fd.P("x", "y"))
    assert x.redistribute(fd.P("x", "y")) is x
    assert x.redistribute([fd.Replicate(), fd.Shard(0)]).sharding == fd.Layout.from_spec(mesh, fd.P("y"))
    swapped = x.redistribute(fd.P(("y", "x")))
    assert str(swapped.sharding) == "S(0)[1]S(0)[0]" and swapped.redistribute(fd.P(("y", "x"))) is swapped


def test_partial_source_gets_a_replicate_gradient():
    mesh = fd.simulated_mesh(2, "x")
    w = torch.ones(2, 2, requires_grad=True)
    parts = fd.distribute_tensor(w, mesh, [fd.Partial()])
    with fd.CommDebugMode() as comm:
        total = fd.redistribute(parts, fd.P()).full_tensor()
    assert comm.get_comm_counts() == {"all_reduce": 1}
    (g,) = torch.autograd.grad(total.sum(), w)
    assert_close(g, torch.ones(2, 2))


def test_not_a_dtensor():
    with pytest.raises(fd.InputTypeError, match="fd.distribute_tensor"):
        fd.redistribute(torch.ones(2), fd.P())


@pytest.mark.parametrize(
    "dtype, op", [(torch.complex64, "max"), (torch.complex128, "min"), (torch.bool, "avg")]
)
def test_a_partial_reduction_the_dtype_lacks_is_the_librarys_error(dtype, op):
    """Regression (fuzz): complex Partial('max') failed in torch's amax at full_tensor, and a
    bool Partial('avg') came back as int64 zeros; both are refused where the layout is given."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = torch.ones(4, 3, dtype=dtype)
    layout = [fd.Partial(op), fd.Shard(1)]
    check(fd.LayoutError, ValueError, lambda: fd.distribute_tensor(x, mesh, layout), "distribute_tensor")
    check(fd.LayoutError, ValueError, lambda: fd.from_local(x, mesh, layout), "from_local", str(dtype))
    d = fd.distribute_tensor(x, mesh, fd.P("x"))
    check(fd.LayoutError, ValueError, lambda: fd.redistribute(d, layout), "fd.redistribute", "Fix:")
    check(fd.LayoutError, ValueError, lambda: d.redistribute(mesh, layout), f"Partial('{op}')")
    ok = fd.distribute_tensor(x, mesh, [fd.Partial("sum"), fd.Shard(1)])  # sum is defined on both
    assert ok.dtype == dtype and torch.equal(ok.redistribute(mesh, fd.P()).full_tensor(), x)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_a_narrow_integer_average_over_many_devices_does_not_wrap(dtype):
    """Regression (fuzz): a uint8 Partial('avg') value of 4s on 64 devices summed to 256, which
    wraps to 0 in uint8: its full_tensor and redistributes gave 0 (and exp of it 1)."""
    mesh = fd.simulated_mesh((8, 8), ("x", "y"))
    info = torch.iinfo(dtype)
    x = torch.arange(16 * 8).reshape(16, 8).remainder(7).to(dtype) + min(info.max // 2, 100)
    for source in ([Pa("avg"), Pa("avg")], [Pa("avg"), S(0)], [S(1), Pa("avg")]):
        d = fd.distribute_tensor(x, mesh, source)
        assert torch.equal(d.full_tensor(), x), source
        for target in ([R, R], [S(0), R], [R, S(0)], [S(0), S(1)], [Pa("sum"), S(0)]):
            y = d.redistribute(mesh, target)
            assert y.dtype == dtype and torch.equal(y.full_tensor(), x), (source, target)


@pytest.mark.meshes((2, 2))
def test_a_narrow_integer_average_does_not_wrap_on_any_backend(backend, mesh):
    """uint8 Partial('avg') parts of 200 average to 200: summed in int64 (on gloo too: its
    all-reduce of the parts wrapped at 256 before)."""
    for got in backend.run(_job_narrow_average, (2, 2), ("x", "y")):
        assert got == [200] * 4


def _job_narrow_average(mesh):
    x = torch.full((4, 2), 200, dtype=torch.uint8)
    d = fd.distribute_tensor(x, mesh, [Pa("avg"), Pa("avg")])
    out = []
    for target in ([R, R], [S(0), R], [R, S(0)], [S(0), S(1)]):
        out.append(int(d.redistribute(mesh, target).full_tensor().max()))
    out[0] = int(d.full_tensor().min())
    return out


# --- derivatives of every order ----------------------------------------------------------------

#: functions of a redistributed value whose higher derivatives pass through the redistribute's
#: backward: a reduction over its (sharded) dims meets the value again
DERIVATIVE_PROGRAMS = {
    "y * sum(exp y)": lambda y: y * y.exp().sum(),
    "y * sum(exp y, 0)": lambda y: y * y.exp().sum(0),
    "softmax(y) * y": lambda y: torch.softmax(y, -1) * y,
}
DERIVATIVE_PLACEMENTS = {"R": fd.Replicate(), "S0": fd.Shard(0), "S1": fd.Shard(1), "P": fd.Partial()}


def derivatives(program, leaf, value, seed=5):
    """The first, second and third derivatives of ``program`` at ``value`` (a function of
    ``leaf``): the gradient of a drawn product, of the gradient's product with a drawn tensor,
    and of the second derivative's square."""
    out = program(value)
    out = out.full_tensor() if isinstance(out, fd.DTensor) else out
    generator = torch.Generator().manual_seed(seed)
    c = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    d = torch.randn(leaf.shape, generator=generator, dtype=torch.float64)
    (first,) = torch.autograd.grad((out * c).sum(), [leaf], create_graph=True)
    (second,) = torch.autograd.grad((first * d).sum(), [leaf], create_graph=True)
    (third,) = torch.autograd.grad(second.square().sum(), [leaf])
    return first.detach(), second.detach(), third


def derivative_cases(ndim: int) -> list[tuple]:
    names = list(DERIVATIVE_PLACEMENTS)
    pairs = list(itertools.product(itertools.product(names, repeat=ndim), repeat=2))
    if ndim > 1:  # a spread of the 256 pairs of a 2-d mesh
        pairs = pairs[::7]
    return [(s, t, p) for s, t in pairs for p in DERIVATIVE_PROGRAMS]


def _moved(program, layout, value):
    return program(fd.redistribute(value, layout))


def job_derivatives(mesh) -> list:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = []
    for source, target, program in derivative_cases(mesh.ndim):
        leaf = x.clone().requires_grad_()
        value = fd.distribute_tensor(leaf, mesh, [DERIVATIVE_PLACEMENTS[p] for p in source])
        layout = fd.Layout(mesh, tuple(DERIVATIVE_PLACEMENTS[p] for p in target))
        moved = functools.partial(_moved, DERIVATIVE_PROGRAMS[program], layout)
        out.append(derivatives(moved, leaf, value))
    return out


@pytest.mark.meshes((2,), (2, 2))
def test_derivatives_of_every_order_through_redistributes(backend, mesh):
    """Regression: a second derivative through the sum of parts (a reduction over a sharded
    dim, a Partial value made whole) was the device's own contribution, not their sum (every
    ``y * y.sum()`` of a sharded ``y``); through a Partial value made from a global tensor, the
    devices' sum of a replicated one. The backward of a redistribute is now a redistribute whose
    backward is the forward (JAX's psum and pvary), to every order."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cases = derivative_cases(len(mesh.shape))
    expected = []
    for _, _, program in cases:
        leaf = x.clone().requires_grad_()
        expected.append(derivatives(DERIVATIVE_PROGRAMS[program], leaf, leaf))
    for result in backend.run(job_derivatives, mesh.shape, mesh.names, timeout=240):
        for case, got, want in zip(cases, result, expected):
            for order, (g, w) in enumerate(zip(got, want), 1):
                assert_close(g, w, msg=f"{case}, order {order}")  # float64: its tolerance
