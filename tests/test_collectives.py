"""Every collective on both backends (simulated; gloo with 2 and 4 ranks), against a plain loop
over mesh coordinates: float and integer values, over every tuple of mesh axes in every order,
with results expressed as out specs. Then the block order of a tuple of axes seen from gloo
ranks, pvary, the pmean of integers, and the errors of collectives."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from backends import Mesh, block, coordinates, events, group_of, index_along, per_device
from common import assert_close, check
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd

# the meshes of the collective tests: gloo's, and on the simulated backend odd, 3-d and size-1 axes
MESHES = [(2,), (4,), (2, 2), (3,), (2, 3), (2, 3, 2), (1, 2, 2)]
REDUCTIONS = {"psum": fd.psum, "pmean": fd.pmean, "pmax": fd.pmax, "pmin": fd.pmin}
# the collectives whose result is the same along their axes (its out spec names only the
# others); all_gather's too, but replication tracking does not know it (check_rep=False only)
INVARIANT = set(REDUCTIONS)
GATHERS = {"all_gather", "all_gather tiled"}
COLLECTIVES = [
    *REDUCTIONS,
    "all_gather",
    "all_gather tiled",
    "psum_scatter",
    "psum_scatter tiled",
    "all_to_all",
    "all_to_all tiled",
    "ppermute ring",
    "ppermute to one",
    "axis_index",
    "axis_size",
]
# the op each one runs (CommDebugMode), each device contributing its local input
RUNS = {name: "all_reduce" for name in REDUCTIONS} | {
    "all_gather": "all_gather",
    "all_gather tiled": "all_gather",
    "psum_scatter": "reduce_scatter",
    "psum_scatter tiled": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all tiled": "all_to_all",
    "ppermute ring": "ppermute",
    "ppermute to one": "ppermute",
}


def ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def to_one(n: int) -> list[tuple[int, int]]:
    return [(0, n - 1)]


def per_device_program(name: str, axes: tuple[str, ...], n: int):
    """The per-device function of a collective over ``axes`` (``n`` devices), on a local value
    of shape ``(2 * mesh size, 2)``."""
    if name in REDUCTIONS:
        return lambda v: REDUCTIONS[name](v, axes)
    return {
        "all_gather": lambda v: fd.all_gather(v, axes, axis=0),
        "all_gather tiled": lambda v: fd.all_gather(v, axes, axis=1, tiled=True),
        "psum_scatter": lambda v: fd.psum_scatter(v.reshape(n, -1), axes, scatter_dimension=0),
        "psum_scatter tiled": lambda v: fd.psum_scatter(v, axes, scatter_dimension=0, tiled=True),
        "all_to_all": lambda v: fd.all_to_all(v.reshape(n, -1), axes, 0, 1),
        "all_to_all tiled": lambda v: fd.all_to_all(v, axes, 0, 1, tiled=True),
        "ppermute ring": lambda v: fd.ppermute(v, axes, ring(n)),
        "ppermute to one": lambda v: fd.ppermute(v, axes, to_one(n)),
        "axis_index": lambda v: fd.axis_index(axes).reshape(1),
        "axis_size": lambda v: v * fd.axis_size(axes),
    }[name]


def out_spec(name: str, names: tuple[str, ...], axes: tuple[str, ...], check_rep: bool) -> fd.P:
    """How the result is expressed: the same along ``axes``, it is split over the other axes
    only (in reverse mesh order: any order will do); axis_index varies along ``axes`` alone;
    the others vary along every axis (the others major, then ``axes`` in their order)."""
    rest = tuple(reversed([a for a in names if a not in axes]))
    if name == "axis_index":
        return fd.P(axes)
    if name in INVARIANT or (name in GATHERS and not check_rep):
        return fd.P(rest)
    return fd.P((*rest, *axes))


def axis_orders(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every non-empty tuple of distinct mesh axes, in every order."""
    return [p for r in range(1, len(names) + 1) for p in itertools.permutations(names, r)]


def in_spec(names: tuple[str, ...]) -> fd.P:
    """Dim 0 of the input split over every axis, in reverse mesh order (an order of its own)."""
    return fd.P(tuple(reversed(names)))


def global_input(mesh_size: int, dtype: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (mesh_size * 2 * mesh_size, 2)
    if dtype == "int64":
        return torch.randint(-20, 21, shape, generator=generator)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def job_collectives(mesh, names_to_run, dtype: str, check_rep: bool) -> list[dict]:
    """Every collective of ``names_to_run`` over every tuple of axes in every order: the
    output's local shards and global value, and the collectives it ran."""
    x = global_input(mesh.size, dtype)
    out = []
    for name in names_to_run:
        for axes in axis_orders(mesh.axis_names):
            f = per_device_program(name, axes, mesh.axis_size(axes))
            mapped = fd.shard_map(
                f,
                mesh=mesh,
                in_specs=in_spec(mesh.axis_names),
                out_specs=out_spec(name, mesh.axis_names, axes, check_rep),
                check_rep=check_rep,
            )
            differentiable = x.is_floating_point() and name != "axis_index"
            x_in = x.clone().requires_grad_(differentiable)
            with fd.CommDebugMode() as comm:
                y = mapped(x_in)
            full = y.full_tensor()
            answer = {
                "call": (name, axes),
                "dtype": y.dtype,
                "shards": [s.detach() for s in y.local_shards()],
                "full": full.detach(),
                "events": events(comm),
            }
            if differentiable:
                with fd.CommDebugMode() as comm:
                    (answer["grad"],) = torch.autograd.grad(full, x_in, cotangent(full.shape))
                answer["backward"] = events(comm)
            out.append(answer)
    return out


def cotangent(shape) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(shape)))


# --- the oracle: a plain loop over mesh coordinates ----------------------------------------------


def expected_local(name: str, mesh: Mesh, axes, coordinate, x: torch.Tensor) -> torch.Tensor:
    """What the device at ``coordinate`` computes, from the local inputs of its group."""
    spec = in_spec(mesh.names)
    group = group_of(mesh.shape, mesh.names, axes, coordinate)
    inputs = [block(x, mesh.shape, mesh.names, spec, c) for c in group]  # by index along axes
    n, me = len(group), index_along(mesh.shape, mesh.names, axes, coordinate)
    stacked = torch.stack(inputs)
    total = stacked.sum(0)
    integral = not x.is_floating_point()
    if name == "psum":
        return total
    if name == "pmean":
        return total.div(n, rounding_mode="floor") if integral else total / n
    if name == "pmax":
        return stacked.amax(0)
    if name == "pmin":
        return stacked.amin(0)
    if name == "all_gather":
        return stacked
    if name == "all_gather tiled":
        return torch.cat(inputs, dim=1)
    if name == "psum_scatter":
        return total.reshape(n, -1)[me]
    if name == "psum_scatter tiled":
        return total.chunk(n, 0)[me]
    if name == "all_to_all":
        return torch.stack([v.reshape(n, -1)[me] for v in inputs], dim=1)
    if name == "all_to_all tiled":
        return torch.cat([v.chunk(n, 0)[me] for v in inputs], dim=1)
    if name.startswith("ppermute"):
        perm = ring(n) if name == "ppermute ring" else to_one(n)
        sources = [src for src, dst in perm if dst == me]
        return inputs[sources[0]] if sources else torch.zeros_like(inputs[me])
    if name == "axis_index":
        return torch.tensor([me])
    assert name == "axis_size"
    return inputs[me] * n


def check_collectives(backend, mesh: Mesh, names_to_run, dtype: str, check_rep: bool) -> int:
    results = backend.run(job_collectives, mesh.shape, mesh.names, names_to_run, dtype, check_rep)
    sim = None if backend.is_simulated else job_collectives(mesh.simulated(), names_to_run, dtype, check_rep)
    x = global_input(mesh.size, dtype)
    here = coordinates(mesh.shape)
    calls = [(name, axes) for name in names_to_run for axes in axis_orders(mesh.names)]
    checked = 0
    for k, (name, axes) in enumerate(calls):
        answers = [r[k] for r in results]
        assert all(a["call"] == (name, axes) for a in answers)
        spec = out_spec(name, mesh.names, axes, check_rep)
        shards = per_device(answers, "shards")
        assert len(shards) == mesh.size
        for d, coordinate in enumerate(here):
            at = f"{name} over {axes} ({dtype}, check_rep={check_rep}) on {mesh}: device {d} at {coordinate}"
            want = expected_local(name, mesh, axes, coordinate, x)
            if name != "axis_index":
                assert shards[d].dtype == x.dtype, at
            assert_equal(shards[d], want, at)
            for p, answer in enumerate(answers):  # the global value, expressed by the out spec
                assert_equal(
                    block(answer["full"], mesh.shape, mesh.names, spec, coordinate), want, f"{at}, {p}"
                )
            checked += 1
        group = math.prod([mesh.shape[mesh.names.index(a)] for a in axes])
        op = RUNS.get(name) if group > 1 else None  # a group of one device communicates nothing
        nbytes = x.element_size() * x.numel() // mesh.size
        for answer in answers:  # one collective, or none
            assert answer["events"] == ([] if op is None else [(op, axes, nbytes)]), f"{name} over {axes}"
        if "grad" in answers[0]:
            check_gradients(mesh, name, axes, check_rep, x, answers, sim[k] if sim else None)
    return checked


def reference_full(name: str, mesh: Mesh, axes, check_rep: bool, x: torch.Tensor, shape) -> torch.Tensor:
    """The global value by the plain loop: each device's result put at its block of the out
    spec (one replica of each), a differentiable function of ``x``."""
    spec = out_spec(name, mesh.names, axes, check_rep)
    positions = torch.arange(math.prod(shape)).reshape(shape)
    full = torch.zeros(math.prod(shape), dtype=x.dtype)
    for coordinate in coordinates(mesh.shape):
        if all(c == 0 for c, n in zip(coordinate, mesh.names) if n not in spec.axis_names):
            where = block(positions, mesh.shape, mesh.names, spec, coordinate).flatten()
            value = expected_local(name, mesh, axes, coordinate, x).flatten()
            full = full + torch.zeros_like(full).scatter(0, where, value)
    return full.reshape(shape)


def check_gradients(mesh: Mesh, name: str, axes, check_rep: bool, x, answers, simulated) -> None:
    x = x.clone().requires_grad_()
    full = reference_full(name, mesh, axes, check_rep, x, answers[0]["full"].shape)
    (want,) = torch.autograd.grad(full, x, cotangent(full.shape))
    for p, answer in enumerate(answers):
        at = f"{name} over {axes} (check_rep={check_rep}) on {mesh}, process {p}: gradient"
        assert_close(answer["grad"], want, msg=lambda m, at=at: f"{at}: {m}")
        if simulated is not None:  # the transposes run the same collectives as the simulated ones
            assert answer["backward"] == simulated["backward"], at


def assert_equal(got: torch.Tensor, want: torch.Tensor, at: str) -> None:
    assert got.shape == want.shape, f"{at}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.is_floating_point():
        assert_close(got, want.to(got.dtype), msg=lambda m: f"{at}: {m}")
    else:
        assert torch.equal(got, want.to(got.dtype)), f"{at}:\n{got}\nexpected\n{want}"


@pytest.mark.meshes(*MESHES)
@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_every_collective_over_every_order_of_axes(backend, mesh, dtype):
    checked = check_collectives(backend, mesh, COLLECTIVES, dtype, check_rep=True)
    assert checked == len(COLLECTIVES) * len(axis_orders(mesh.names)) * mesh.size


@pytest.mark.meshes((2,), (2, 2), (2, 3, 2))
def test_collectives_unchecked(backend, mesh):
    check_collectives(backend, mesh, COLLECTIVES, "float64", check_rep=False)


@pytest.mark.parametrize("shape", [(2, 2), (3,), (2, 3, 2)])
def test_a_reduce_scatter_outside_autograd_writes_each_devices_block(shape):
    """Outside autograd the simulated mesh writes a reduce-scatter's sum straight into the
    devices' blocks (an add for two parts, a sum for more; summed, then copied into them where
    the groups interleave on three axes): every block the oracle's, for every tuple of axes."""
    mesh = Mesh(shape)
    x = global_input(mesh.size, "float64")
    for name in ("psum_scatter", "psum_scatter tiled"):
        for axes in axis_orders(mesh.names):
            mapped = fd.shard_map(
                per_device_program(name, axes, math.prod([shape[mesh.names.index(a)] for a in axes])),
                mesh=mesh.simulated(),
                in_specs=in_spec(mesh.names),
                out_specs=out_spec(name, mesh.names, axes, True),
            )
            with torch.no_grad():
                shards = mapped(x).local_shards()
            for d, coordinate in enumerate(coordinates(shape)):
                want = expected_local(name, mesh, axes, coordinate, x)
                assert_equal(shards[d], want, f"{name} over {axes} on {mesh}: device {d}")


def test_the_oracle_on_a_case_worked_by_hand():
    """On a 2 x 2 mesh, device (x, y) is index 2 y + x along ('y', 'x')."""
    mesh = Mesh((2, 2))
    assert [index_along(mesh.shape, mesh.names, ("y", "x"), c) for c in coordinates(mesh.shape)] == [
        0,
        2,
        1,
        3,
    ]
    assert group_of(mesh.shape, mesh.names, ("y",), (1, 0)) == [(1, 0), (1, 1)]
    assert group_of(mesh.shape, mesh.names, ("y", "x"), (0, 0)) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    x = torch.arange(16).reshape(16, 1)
    # in_spec P(('y', 'x')): device (x, y) holds the rows 4 (2 y + x) ... 4 (2 y + x) + 3
    assert block(x, mesh.shape, mesh.names, in_spec(mesh.names), (1, 0)).flatten().tolist() == [4, 5, 6, 7]
    # the sum over the four devices is [24, 28, 32, 36]; the one at index 2 along ('y', 'x') keeps 32
    got = expected_local("psum_scatter tiled", mesh, ("y", "x"), (0, 1), x)
    assert got.flatten().tolist() == [32]
    ring_got = expected_local("ppermute ring", mesh, ("y", "x"), (0, 1), x)  # from index 1: (1, 0)
    assert ring_got.flatten().tolist() == [4, 5, 6, 7]


def test_collectives_over_axis_tuples_in_any_order_example():
    """A tuple of axes indexes devices major first in the order given."""
    mesh_xy = fd.simulated_mesh((2, 3), ("x", "y"))
    x = torch.arange(6.0)
    for axes in (("x", "y"), ("y", "x")):
        index = fd.shard_map(
            lambda v, axes=axes: v * 0 + fd.axis_index(axes),
            mesh=mesh_xy,
            in_specs=fd.P(("x", "y")),
            out_specs=fd.P(("x", "y")),
        )(x).full_tensor()
        # device (i, j) in mesh order; with ("y", "x") its index is j * 2 + i
        expected = [i * 3 + j if axes == ("x", "y") else j * 2 + i for i in range(2) for j in range(3)]
        assert index.tolist() == expected
        gathered = fd.shard_map(
            lambda v, axes=axes: fd.all_gather(v, axes, tiled=True),
            mesh=mesh_xy,
            in_specs=fd.P(("x", "y")),
            out_specs=fd.P(),
            check_rep=False,
        )(x).full_tensor()
        order = sorted(range(6), key=lambda d: expected[d])
        assert gathered.tolist() == [float(d) for d in order]


# --- the block order of a tuple of axes, seen by each gloo rank ---------------------------------


def job_block_order(mesh, axes) -> dict:
    """What each device of this process sees of the flat indices along ``axes``: its own,
    everyone's gathered, the one a ring brings and its block of a psum_scatter."""
    n = mesh.axis_size(axes)

    def per_device():
        index = fd.axis_index(axes).reshape(1).double()
        one_hot = (torch.arange(n) == index).double()  # my index, as a block per destination
        return (
            index,
            fd.all_gather(index, axes, tiled=True),
            fd.ppermute(index, axes, ring(n)),
            fd.psum_scatter(one_hot * torch.arange(n).double(), axes, tiled=True),
        )

    spec = fd.P(mesh.axis_names)
    outputs = fd.shard_map(per_device, mesh=mesh, in_specs=(), out_specs=spec, check_rep=False)()
    return {
        key: [s.tolist() for s in value.local_shards()]
        for key, value in zip(["index", "gathered", "from_ring", "scattered"], outputs, strict=True)
    }


@pytest.mark.meshes((2, 2), (2, 3, 2))
def test_block_order_of_axes_in_any_order(backend, mesh):
    """Block ``i`` of a collective over ``axes`` is the device with index ``i`` along them,
    the first named axis major (independent of the simulated backend)."""
    for axes in axis_orders(mesh.names):
        if len(axes) < len(mesh.names):
            continue
        got = backend.run(job_block_order, mesh.shape, mesh.names, axes)
        n = mesh.size
        for d, coordinate in enumerate(coordinates(mesh.shape)):
            me = index_along(mesh.shape, mesh.names, axes, coordinate)
            at = f"{axes}, device {d} at {coordinate}"
            assert per_device(got, "index")[d] == [me], at
            assert per_device(got, "gathered")[d] == list(range(n)), at
            assert per_device(got, "from_ring")[d] == [(me - 1) % n], at
            assert per_device(got, "scattered")[d] == [me], at


# --- pvary, pmean of integers --------------------------------------------------------------------


def job_pvary_leaves_its_input(mesh) -> list:
    from functional_dtensor._varying import axes_varying

    seen = []

    def f(v):
        w = fd.pvary(v, "x")
        seen.append((axes_varying(v), axes_varying(w), w is v))
        return fd.psum(w, "x")

    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            fd.shard_map(f, mesh=mesh, in_specs=fd.P(), out_specs=fd.P())(torch.ones(2, requires_grad=True))
    return seen


@pytest.mark.meshes((2,))
def test_pvary_returns_a_new_value(backend, mesh):
    for got in backend.run(job_pvary_leaves_its_input, mesh.shape, mesh.names):
        assert got == [(frozenset(), frozenset({"x"}), False)] * 2


INT_MEAN_SPECS = [fd.P(), fd.P("x"), fd.P("y"), fd.P(("y", "x")), fd.P(None, "x")]


def job_integer_pmean(mesh, x) -> list[dict]:
    """pmean of an int64 value over every tuple of axes in every order, for inputs replicated
    or split over some of the axes; unchecked and checked."""
    out = []
    for spec in INT_MEAN_SPECS:
        for axes in axis_orders(mesh.axis_names):
            for check_rep in (True, False):
                mapped = fd.shard_map(
                    lambda v, axes=axes: fd.pmean(v, axes),
                    mesh=mesh,
                    in_specs=spec,
                    out_specs=fd.P(mesh.axis_names),
                    check_rep=check_rep,
                )
                y = mapped(x)
                out.append({"call": (spec, axes, check_rep), "dtype": y.dtype, "shards": y.local_shards()})
    return out


@pytest.mark.meshes((2, 2), (2, 3))
def test_pmean_of_integers_over_some_axes_rounds_down_and_keeps_the_dtype(backend, mesh):
    """Regression: an int64 pmean over some of the mesh axes crashed on the simulated backend."""
    rows, cols = 2 * mesh.size, 2 * mesh.shape[0]
    x = torch.arange(rows * cols).reshape(rows, cols) * 7 % 23 - 11  # signed, odd and even
    results = backend.run(job_integer_pmean, mesh.shape, mesh.names, x)
    calls = [(s, a, c) for s in INT_MEAN_SPECS for a in axis_orders(mesh.names) for c in (True, False)]
    for k, (spec, axes, check_rep) in enumerate(calls):
        answers = [r[k] for r in results]
        assert all(a["dtype"] == torch.int64 for a in answers)
        shards = per_device(answers, "shards")
        for d, coordinate in enumerate(coordinates(mesh.shape)):
            group = group_of(mesh.shape, mesh.names, axes, coordinate)
            inputs = [block(x, mesh.shape, mesh.names, spec, c) for c in group]
            want = torch.stack(inputs).sum(0).div(len(group), rounding_mode="floor")
            assert torch.equal(shards[d], want), (spec, axes, check_rep, coordinate, shards[d], want)


# --- drawn programs: chains of collectives in any order, against a reference -------------------


def job_chain(mesh, x, first, second) -> list:
    """all_gather over ``first`` then psum_scatter over ``second`` (tuples of axes in any
    order): the output's local shards."""
    spec = fd.P(first)
    f = fd.shard_map(
        lambda v: fd.psum_scatter(fd.all_gather(v, first, tiled=True), second, tiled=True),
        mesh=mesh,
        in_specs=spec,
        out_specs=fd.P(second),
        check_rep=False,
    )
    return f(x).local_shards()


@pytest.mark.meshes((4,), (2, 2), (2, 3, 2))
@settings(max_examples=8)
@given(data=st.data())
def test_gather_then_scatter_over_axes_in_any_order(backend, mesh, data):
    first = data.draw(st.permutations(mesh.names))
    second = data.draw(st.permutations(mesh.names))
    x = torch.randn(2 * mesh.size, 3, dtype=torch.float64)
    shards = per_device(backend.run(job_chain, mesh.shape, mesh.names, x, tuple(first), tuple(second)))
    for d, coordinate in enumerate(coordinates(mesh.shape)):  # everyone gathers x, each keeps n x's block
        want = block(mesh.size * x, mesh.shape, mesh.names, fd.P(tuple(second)), coordinate)
        assert_close(shards[d], want)


# --- errors ----------------------------------------------------------------------------------------

ERROR_MESH = fd.simulated_mesh((2, 2), ("x", "y"))


def mapped(f, in_specs=fd.P("x"), out_specs=fd.P("x"), **kw):
    return fd.shard_map(f, mesh=ERROR_MESH, in_specs=in_specs, out_specs=out_specs, **kw)


def test_collective_outside_shard_map_is_an_unbound_axis():
    check(fd.AxisNameError, NameError, lambda: fd.psum(torch.ones(2), "x"), "no shard_map binds", "'x'")


def test_collective_with_an_axis_of_no_mesh():
    f = mapped(lambda x: fd.psum(x, "z"), out_specs=fd.P())
    check(fd.AxisNameError, NameError, lambda: f(torch.ones(4)), "'z'")


def test_collective_of_a_non_tensor():
    f = mapped(lambda x: fd.psum([x], "x"), out_specs=fd.P())
    check(fd.InputTypeError, TypeError, lambda: f(torch.ones(4)), "fd.psum(x)", "list")


def test_collective_shape_errors():
    f = mapped(lambda x: fd.psum_scatter(x, "x"), in_specs=fd.P(), out_specs=fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: f(torch.ones(3)), "tiled=True")
    g = mapped(lambda x: fd.all_to_all(x, "x", 0, 0, tiled=True), in_specs=fd.P(), out_specs=fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: g(torch.ones(3)), "3 = 1 * 2 + 1")
    h = mapped(lambda x: fd.ppermute(x, "x", [(0, 1), (1, 1)]), out_specs=fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: h(torch.ones(4)), "perm")
    k = mapped(lambda x: fd.all_gather(x, "x", axis=3))
    check(fd.ShapeError, ValueError, lambda: k(torch.ones(4)), "axis")


def _on_one_device_axis(v):
    """Every collective over 'y', an axis of size 1."""
    return (
        fd.psum(v, "y"),
        fd.pmax(v, "y"),
        fd.all_gather(v, "y"),
        fd.all_gather(v, "y", axis=1, tiled=True),
        fd.psum_scatter(v[None], "y"),
        fd.psum_scatter(v, "y", scatter_dimension=1, tiled=True),
        fd.all_to_all(v[:, None], "y", 1, 0),
        fd.all_to_all(v, "y", 1, 0, tiled=True),
        fd.ppermute(v, "y", [(0, 0)]),
        fd.ppermute(v, "y", []),
        fd.psum(v, ("x", "y")),
    )


def job_size_1_axis(mesh, check_rep: bool) -> dict:
    f = fd.shard_map(
        _on_one_device_axis, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P(("x", "y")), check_rep=check_rep
    )
    x = torch.arange(24.0).reshape(4, 6).requires_grad_()
    with fd.CommDebugMode() as comm:
        outs = f(x)
    loss = sum((o.full_tensor() * (k + 1)).sum() for k, o in enumerate(outs))
    (grad,) = torch.autograd.grad(loss, x)
    return {"outs": [o.full_tensor().detach() for o in outs], "events": events(comm), "grad": grad}


@pytest.mark.meshes((2, 1))
@pytest.mark.parametrize("check_rep", [True, False])
def test_a_collective_over_an_axis_of_size_1_never_communicates(backend, mesh, check_rep):
    """Each collective over a group of one device is its local form: no collective runs (only
    the psum over ('x', 'y'), a group of 2), and values and gradients are those of one device."""
    x = torch.arange(24.0).reshape(4, 6).requires_grad_()
    blocks = x.reshape(2, 2, 6)
    summed = blocks.sum(0)
    reference = [x] * 9 + [torch.zeros_like(x), torch.cat([summed, summed])]  # one device's values
    loss = sum((o * (k + 1)).sum() for k, o in enumerate(reference))
    (want_grad,) = torch.autograd.grad(loss, x)
    x, summed = x.detach(), summed.detach()
    for p, got in enumerate(backend.run(job_size_1_axis, mesh.shape, mesh.names, check_rep)):
        outs = got["outs"]
        for k in (0, 1, 3, 5, 7, 8):
            assert torch.equal(outs[k], x), (p, k)
        assert outs[2].shape == (2, 2, 6) and torch.equal(outs[2].reshape(4, 6), x), p  # a new dim of 1
        assert torch.equal(outs[4], x) and torch.equal(outs[6].reshape(4, 6), x), p
        assert torch.equal(outs[9], torch.zeros_like(x)), p
        assert torch.equal(outs[10], torch.cat([summed, summed])), p
        assert [(op, axes) for op, axes, _ in got["events"]] == [("all_reduce", ("x", "y"))], (
            p,
            got["events"],
        )
