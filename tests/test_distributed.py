"""The distributed backend on real gloo ranks (loopback, 2 and 4 processes, never mocked),
against the simulated backend on a mesh of the same shape and the single-device references.

Ranks live in session-long pools (``distributed_pool.py``, fixture ``gloo`` from
``conftest_pool.py``): a test sends a module-level ``job_*`` function to every rank and compares
what comes back here, where the simulated backend runs the same program. Tests that leave a pool
broken on purpose (a stuck rank, a collective one rank skips) come last in the file, so that
the session pools are rarely restarted.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import traceback
import warnings
import zlib
from collections import Counter

import pytest
import torch
from catalogue import Case, cases, global_inputs
from conftest_pool import gloo  # noqa: F401  (the session fixture)
from distributed_pool import RankError, RankPool
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

pytestmark = pytest.mark.distributed

S, R, Pa = fd.Shard, fd.Replicate, fd.Partial

# name -> (world size, mesh shape, axis names, the mesh axes a catalogue case maps over)
CONFIGS = {
    "2:x": (2, (2,), ("x",), ("x",)),
    "4:x": (4, (4,), ("x",), ("x",)),
    "2x2:x": (4, (2, 2), ("x", "y"), ("x",)),
    "2x2:y": (4, (2, 2), ("x", "y"), ("y",)),
    "2x2:xy": (4, (2, 2), ("x", "y"), ("x", "y")),
}
CASE_NAMES = [c.name for c in cases(fd.simulated_mesh(2, "x"), ("x",))]


def _gloo_mesh(shape, names) -> fd.DeviceMesh:
    return fd.init_device_mesh("cpu", shape, names)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _close(got, want, what: str) -> None:
    if got is None or want is None:
        got = torch.zeros_like(want) if got is None and want is not None else got
        want = torch.zeros_like(got) if want is None and got is not None else want
        if got is None:
            return
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


# --- catalogue programs: the same run on either backend ------------------------------------------


def reversed_axes_cases(mesh, axes=("y", "x")) -> list[Case]:
    """Collectives over a tuple of axes out of mesh order (block ``i`` is the ``i``-th device
    counting the first named axis as major) on a 2x2 mesh. No reference: the simulated backend
    is the oracle (and :func:`test_block_order_of_axes_out_of_mesh_order` checks the order)."""
    n, spec = mesh.axis_size(axes), fd.P(("x", "y"))
    ring = [(i, (i + 1) % n) for i in range(n)]

    def case(name, f, out_specs, shape, comm=None):
        return Case(name, f, (spec,), out_specs, (shape,), None, comm or {})

    return [
        case("psum", lambda x: fd.psum(x, axes), fd.P(), (8, 2), {"all_reduce": 1}),
        case("pmax", lambda x: fd.pmax(x, axes), fd.P(), (8, 2), {"all_reduce": 1}),
        case("all_gather", lambda x: fd.all_gather(x, axes, axis=1), spec, (8, 2), {"all_gather": 1}),
        case(
            "all_gather tiled", lambda x: fd.all_gather(x, axes, tiled=True), spec, (8, 2), {"all_gather": 1}
        ),
        case(
            "psum_scatter tiled",
            lambda x: fd.psum_scatter(torch.sin(x), axes, scatter_dimension=0, tiled=True),
            spec,
            (32, 2),
            {"reduce_scatter": 1},
        ),
        case(
            "all_to_all tiled",
            lambda x: fd.all_to_all(x, axes, 1, 0, tiled=True),
            spec,
            (8, 8),
            {"all_to_all": 1},
        ),
        case("ppermute ring", lambda x: fd.ppermute(x, axes, ring), spec, (8, 2), {"ppermute": 1}),
        case("axis_index", lambda x: x * (fd.axis_index(axes) + 1), spec, (8, 2)),
    ]


FAMILIES = {"catalogue": cases, "reversed axes": reversed_axes_cases}


def pick(mesh, axes, name: str, check_rep: bool | None = None, family: str = "catalogue") -> Case:
    case = next(c for c in FAMILIES[family](mesh, axes) if c.name == name)
    return case if check_rep is None else dataclasses.replace(case, check_rep=check_rep)


def _events(comm: fd.CommDebugMode) -> list[tuple]:
    return [(e.op, e.axes, e.nbytes) for e in comm.events]


def run_case(
    mesh, axes, name: str, check_rep: bool | None = None, seed: int = 0, family: str = "catalogue"
) -> dict:
    """One catalogue case on ``mesh``: the output's shards and global value, the gradients of
    the global inputs for a fixed cotangent, and the collectives of the forward and backward."""
    case = pick(mesh, axes, name, check_rep, family)
    inputs = [t.requires_grad_() for t in global_inputs(case, seed=seed)]
    mapped = fd.shard_map(
        case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs, check_rep=case.check_rep
    )
    with fd.CommDebugMode() as forward:
        out = mapped(*inputs)
    full = out.full_tensor()
    cotangent = torch.randn(full.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(seed + 1))
    with fd.CommDebugMode() as backward:
        grads = torch.autograd.grad(full, inputs, cotangent, allow_unused=True)
    return {
        "shape": tuple(out.shape),
        "placements": out.placements,
        "full": full.detach(),
        "shards": [s.detach() for s in out.local_shards()],
        "grads": [None if g is None else g.detach() for g in grads],
        "forward": _events(forward),
        "backward": _events(backward),
    }


def reference(case: Case, seed: int = 0) -> dict:
    inputs = [t.requires_grad_() for t in global_inputs(case, seed=seed)]
    out = case.reference(*inputs)
    cotangent = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(out, inputs, cotangent, allow_unused=True)
    return {"full": out.detach(), "grads": list(grads)}


def job_case(shape, names, axes, name, check_rep, seed, family="catalogue") -> dict:
    return run_case(_gloo_mesh(shape, names), axes, name, check_rep, seed, family)


def check_against_simulated(
    config: str, name: str, check_rep: bool | None, seed: int, pools, family: str = "catalogue"
) -> None:
    world, shape, names, axes = CONFIGS[config]
    sim_mesh = fd.simulated_mesh(shape, names)
    case = pick(sim_mesh, axes, name, check_rep, family)
    sim = run_case(sim_mesh, axes, name, check_rep, seed, family)
    want = (
        reference(case, seed) if case.reference is not None else {"full": sim["full"], "grads": sim["grads"]}
    )
    assert Counter(op for op, _, _ in sim["forward"]) == Counter(case.comm)
    ranks = pools.run(world, job_case, shape, names, axes, name, check_rep, seed, family)
    assert len(ranks) == world
    for rank, got in enumerate(ranks):
        at = f"rank {rank}"
        assert (got["shape"], got["placements"]) == (sim["shape"], sim["placements"]), at
        _close(got["full"], want["full"], f"{at}: full_tensor vs reference")
        _close(got["full"], sim["full"], f"{at}: full_tensor vs simulated")
        assert len(got["shards"]) == 1, at
        _close(got["shards"][0], sim["shards"][rank], f"{at}: local shard vs simulated device {rank}")
        for i, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            _close(g, w, f"{at}: gradient of input {i} vs reference")
        assert got["forward"] == sim["forward"], f"{at}: forward collectives differ from simulated"
        assert got["backward"] == sim["backward"], f"{at}: backward collectives differ from simulated"


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_catalogue_on_gloo_matches_simulated(config, name, gloo):  # noqa: F811
    check_against_simulated(config, name, None, zlib.crc32(f"{config}:{name}".encode()) % 1000, gloo)


def job_no_grad(shape, names, axes, name, seed) -> dict:
    """A catalogue case run with and without autograd: without, the collectives run directly."""
    mesh = _gloo_mesh(shape, names)
    with_grad = run_case(mesh, axes, name, None, seed)
    case = pick(mesh, axes, name, None, "catalogue")
    inputs = [t.requires_grad_() for t in global_inputs(case, seed=seed)]
    mapped = fd.shard_map(case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs)
    with torch.no_grad(), fd.CommDebugMode() as comm:
        out = mapped(*inputs)
        full = out.full_tensor()
    return {
        "with_grad": with_grad,
        "full": full,
        "requires_grad": out.requires_grad,
        "forward": _events(comm),
    }


NO_GRAD_CASES = ["psum", "pmax", "all_gather then psum_scatter", "ppermute ring", "mlp"]


@pytest.mark.parametrize("name", NO_GRAD_CASES)
@pytest.mark.parametrize("config", ["2:x", "2x2:xy"])
def test_no_grad_matches_grad_on_gloo(config, name, gloo):  # noqa: F811
    world, shape, names, axes = CONFIGS[config]
    for rank, got in enumerate(gloo.run(world, job_no_grad, shape, names, axes, name, 3)):
        assert not got["requires_grad"], rank
        _close(got["full"], got["with_grad"]["full"], f"rank {rank}: no_grad value vs with grad")
        assert got["forward"] == got["with_grad"]["forward"], f"rank {rank}: collectives differ"


def job_pvary_leaves_its_input() -> list:
    from functional_dtensor._varying import axes_varying

    mesh = _gloo_mesh((2,), ("x",))
    seen = []

    def f(v):
        w = fd.pvary(v, "x")
        seen.append((axes_varying(v), axes_varying(w), w is v))
        return fd.psum(w, "x")

    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            fd.shard_map(f, mesh=mesh, in_specs=fd.P(), out_specs=fd.P())(torch.ones(2, requires_grad=True))
    return seen


def test_pvary_returns_a_new_value_on_gloo(gloo):  # noqa: F811
    for got in gloo.run(2, job_pvary_leaves_its_input):
        assert got == [(frozenset(), frozenset({"x"}), False)] * 2


UNCHECKED = ["psum", "pmax", "psum of replicated", "all_gather", "psum_scatter tiled", "all_to_all"]
UNCHECKED += ["ppermute ring", "tensor-parallel matmul + psum", "mlp"]


@pytest.mark.parametrize("name", UNCHECKED)
@pytest.mark.parametrize("config", ["2:x", "2x2:y", "2x2:xy"])
def test_catalogue_unchecked_on_gloo_matches_simulated(config, name, gloo):  # noqa: F811
    check_against_simulated(config, name, False, 7, gloo)


REVERSED_NAMES = [c.name for c in reversed_axes_cases(fd.simulated_mesh((2, 2), ("x", "y")))]


@pytest.mark.parametrize("check_rep", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("name", REVERSED_NAMES)
def test_axes_out_of_mesh_order_on_gloo_match_simulated(name, check_rep, gloo):  # noqa: F811
    check_against_simulated("2x2:xy", name, check_rep, 11, gloo, family="reversed axes")


def job_block_order(axes) -> dict:
    """What device (x, y) sees of the flat indices along ``axes``: its own, everyone's gathered,
    the one ppermute's ring brings, and its block of a psum_scatter."""
    from functional_dtensor._distributed import runtime as distributed

    mesh = _gloo_mesh((2, 2), ("x", "y"))
    n = 4
    ring = [(i, (i + 1) % n) for i in range(n)]

    def per_device():
        index = fd.axis_index(axes).reshape(1).double()
        one_hot = (torch.arange(n) == index).double()  # my index, as a block per destination
        return (
            index,
            fd.all_gather(index, axes, tiled=True),
            fd.ppermute(index, axes, ring),
            fd.psum_scatter(one_hot * torch.arange(n).double(), axes, tiled=True),
        )

    spec = fd.P(("x", "y"))
    index, gathered, from_ring, scattered = fd.shard_map(
        per_device, mesh=mesh, in_specs=(), out_specs=spec, check_rep=False
    )()
    return {
        "coordinate": distributed.coordinate(mesh),
        "index": int(index.to_local()),
        "gathered": [int(v) for v in gathered.to_local().tolist()],
        "from_ring": int(from_ring.to_local()),
        "scattered": int(scattered.to_local()),
    }


@pytest.mark.parametrize("axes", [("x", "y"), ("y", "x")], ids=["xy", "yx"])
def test_block_order_of_axes_out_of_mesh_order(axes, gloo):  # noqa: F811
    """Block ``i`` of a collective over ``axes`` is the device with flat index ``i``, counting
    the first named axis as major (independent of the simulated backend)."""
    for rank, got in enumerate(gloo.run(4, job_block_order, axes)):
        x, y = got["coordinate"]
        assert (x, y) == divmod(rank, 2)
        me = 2 * x + y if axes == ("x", "y") else 2 * y + x
        assert got["index"] == me, f"rank {rank} at (x={x}, y={y}): {got}"
        assert got["gathered"] == [0, 1, 2, 3], f"rank {rank}: all_gather order {got}"
        assert got["from_ring"] == (me - 1) % 4, f"rank {rank}: ppermute {got}"
        assert got["scattered"] == me, f"rank {rank}: psum_scatter block {got}"


# --- global values: distribute_tensor / full_tensor / from_local / factories ----------------------


def _value(shape, dtype: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == "int64":
        return torch.randint(-5, 6, shape, generator=generator)
    return torch.randn(shape, generator=generator, dtype=getattr(torch, dtype))


def round_trip(mesh, items) -> list[dict]:
    """distribute_tensor then full_tensor for each ``(shape, placements, dtype, seed)``; with
    the gradient of the round trip (the identity) for floating values."""
    out = []
    for shape, placements, dtype, seed in items:
        value = _value(shape, dtype, seed)
        x = value.clone().requires_grad_(value.is_floating_point())
        d = fd.distribute_tensor(x, mesh, placements)
        full = d.full_tensor()
        grad = None
        if value.is_floating_point():
            (grad,) = torch.autograd.grad(full, x, torch.ones_like(full) * 3 + value)
        out.append(
            {
                "shape": tuple(d.shape),
                "placements": d.placements,
                "shards": [s.detach() for s in d.local_shards()],
                "full": full.detach(),
                "grad": grad,
            }
        )
    return out


def job_round_trip(shape, names, items) -> list[dict]:
    return round_trip(_gloo_mesh(shape, names), items)


def check_round_trips(world, shape, names, items, gloo) -> None:  # noqa: F811
    sim = round_trip(fd.simulated_mesh(shape, names), items)
    ranks = gloo.run(world, job_round_trip, shape, names, items)
    for k, (item, want) in enumerate(zip(items, sim, strict=True)):
        value = _value(item[0], item[2], item[3])
        _close(want["full"], value, f"item {k} {item}: simulated round trip")
        if want["grad"] is not None:
            _close(want["grad"], torch.ones_like(value) * 3 + value, f"item {k} {item}: simulated gradient")
        for rank, answers in enumerate(ranks):
            got, at = answers[k], f"rank {rank}, item {k} {item}"
            assert (got["shape"], got["placements"]) == (want["shape"], want["placements"]), at
            _close(got["shards"][0], want["shards"][rank], f"{at}: shard vs simulated")
            _close(got["full"], value, f"{at}: full_tensor vs the global value")
            _close(got["grad"], want["grad"], f"{at}: gradient of the round trip")


LAYOUTS_1D = [
    ((5, 3), (R(),), "float64"),
    ((5, 3), (S(0),), "float64"),  # uneven: 3+2 on 2 ranks, 2+2+1+0 on 4
    ((2, 7), (S(1),), "float32"),
    ((1,), (S(0),), "float64"),  # trailing ranks empty
    ((0, 2), (S(0),), "float64"),  # empty global value
    ((7,), (S(0),), "int64"),
    ((3, 2), (Pa("sum"),), "float64"),
    ((3, 2), (Pa("avg"),), "float64"),
    ((3, 2), (Pa("max"),), "float64"),
    ((3, 2), (Pa("min"),), "float64"),
    ((3, 2), (Pa("sum"),), "int64"),
    ((3,), (Pa("max"),), "int64"),
]
LAYOUTS_2D = [
    ((5, 3), (S(0), S(1)), "float64"),
    ((7, 2), (S(0), S(0)), "float64"),  # dim 0 split over both axes, unevenly
    ((3, 5), (S(1), S(0)), "float32"),
    ((5,), (R(), S(0)), "float64"),
    ((2, 2), (R(), R()), "float64"),
    ((5, 2), (Pa("sum"), S(0)), "float64"),
    ((2, 3), (S(1), Pa("max")), "float64"),
    ((3,), (Pa("avg"), Pa("min")), "float64"),
    ((4,), (Pa("sum"), Pa("sum")), "int64"),
    ((1, 3), (S(0), Pa("sum")), "float64"),
]


@pytest.mark.parametrize(
    "world, shape, layouts",
    [(2, (2,), LAYOUTS_1D), (4, (4,), LAYOUTS_1D), (4, (2, 2), LAYOUTS_2D)],
    ids=["2", "4", "2x2"],
)
def test_distribute_and_full_tensor_round_trip(world, shape, layouts, gloo):  # noqa: F811
    names = ("x", "y")[: len(shape)]
    items = [(s, p, dtype, k) for k, (s, p, dtype) in enumerate(layouts)]
    check_round_trips(world, shape, names, items, gloo)


@st.composite
def _round_trip_batches(draw, shape):
    mesh = fd.simulated_mesh(shape, ("x", "y")[: len(shape)])
    items = []
    for k in range(draw(st.integers(1, 6))):
        global_shape = draw(fds.global_shapes(max_dims=3, max_side=6, max_elements=64))
        placements = draw(fds.placements(mesh, len(global_shape), allow_partial=True))
        dtype = draw(st.sampled_from(["float64", "float32", "int64"]))
        if dtype == "int64" and any(p.is_partial() and p.op == "avg" for p in placements):
            dtype = "float64"  # an integer average is not an integer
        items.append((global_shape, placements, dtype, k))
    return items


@settings(max_examples=6, deadline=None)
@given(
    st.sampled_from([(2, (2,)), (4, (4,)), (4, (2, 2))]).flatmap(
        lambda ws: st.tuples(st.just(ws), _round_trip_batches(ws[1]))
    )
)
def test_drawn_round_trips_match_simulated(gloo, drawn):  # noqa: F811
    (world, shape), items = drawn
    check_round_trips(world, shape, ("x", "y")[: len(shape)], items, gloo)


def redistributed(mesh, items) -> list[dict]:
    """fd.redistribute from one layout to another for each ``(shape, src, dst, dtype, seed)``:
    the result's shards and value, the collectives it ran, the gradient of the input."""
    out = []
    for shape, src, dst, dtype, seed in items:
        value = _value(shape, dtype, seed)
        x = value.clone().requires_grad_(value.is_floating_point())
        d = fd.distribute_tensor(x, mesh, src)
        with fd.CommDebugMode() as comm:
            moved = fd.redistribute(d, dst)
        full = moved.full_tensor()
        grad = None
        if value.is_floating_point():
            (grad,) = torch.autograd.grad(full, x, torch.ones_like(full) * 2 - value)
        out.append(
            {
                "placements": moved.placements,
                "shards": [s.detach() for s in moved.local_shards()],
                "full": full.detach(),
                "grad": grad,
                "comm": _events(comm),
            }
        )
    return out


def job_redistributed(shape, names, items) -> list[dict]:
    return redistributed(_gloo_mesh(shape, names), items)


def check_redistributed(world, shape, items, pools) -> None:
    names = ("x", "y")[: len(shape)]
    sim = redistributed(fd.simulated_mesh(shape, names), items)
    ranks = pools.run(world, job_redistributed, shape, names, items)
    for k, (item, want) in enumerate(zip(items, sim, strict=True)):
        value = _value(item[0], item[3], item[4])
        _close(want["full"], value, f"item {k} {item}: simulated redistribute")
        for rank, answers in enumerate(ranks):
            got, at = answers[k], f"rank {rank}, item {k} {item}"
            assert got["placements"] == want["placements"], at
            _close(got["shards"][0], want["shards"][rank], f"{at}: shard vs simulated")
            _close(got["full"], value, f"{at}: value")
            _close(got["grad"], want["grad"], f"{at}: gradient vs simulated")
            assert got["comm"] == want["comm"], f"{at}: collectives differ from simulated"


REDISTRIBUTIONS = {
    "2": [
        ((5, 3), (S(0),), (S(1),), "float64"),
        ((5, 3), (S(0),), (R(),), "float64"),
        ((4, 2), (R(),), (S(0),), "float64"),
        ((3, 2), (Pa("sum"),), (S(0),), "float64"),
        ((3, 2), (Pa("max"),), (R(),), "float64"),
        ((7,), (S(0),), (R(),), "int64"),
    ],
    "2x2": [
        ((4, 6), (S(0), S(1)), (S(1), S(0)), "float64"),
        ((5, 3), (S(0), R()), (R(), S(1)), "float64"),
        ((6, 2), (S(0), S(0)), (R(), R()), "float64"),
        ((3, 4), (Pa("sum"), S(1)), (S(0), S(1)), "float64"),
        ((2, 3), (R(), Pa("avg")), (S(1), R()), "float64"),
    ],
}


# the planner's catalogue, on even shapes: every step kind runs on gloo
for key in ("2", "4"):
    REDISTRIBUTIONS.setdefault(key, [])
    REDISTRIBUTIONS[key] += [
        ((8, 8), (S(0),), (R(),), "float64"),
        ((8, 8), (S(0),), (S(1),), "float64"),
        ((8, 8), (Pa("sum"),), (R(),), "float64"),
        ((8, 8), (Pa("sum"),), (S(0),), "float64"),
        ((8, 8), (R(),), (S(0),), "float64"),
        ((8, 8), (S(1),), (R(),), "float64"),
        ((8, 8), (R(),), (Pa("sum"),), "float64"),
    ]
REDISTRIBUTIONS["2x2"] += [
    ((8, 8), (S(0), S(1)), (S(1), S(0)), "float64"),
    ((8, 8), (S(0), S(1)), (R(), R()), "float64"),
    ((8, 8), (Pa("sum"), Pa("sum")), (R(), R()), "float64"),
    ((8, 8), (S(0), R()), (R(), S(0)), "float64"),
    ((8, 8), (S(0), S(0)), (R(), R()), "float64"),
    ((8, 8), (Pa("sum"), S(0)), (S(0), R()), "float64"),
    ((8, 8), (Pa("avg"), S(1)), (S(1), R()), "float64"),
    ((8, 8), (R(), S(1)), (S(1), R()), "int64"),
]


@pytest.mark.parametrize(
    "world, shape, key", [(2, (2,), "2"), (4, (4,), "4"), (4, (2, 2), "2x2")], ids=["2", "4", "2x2"]
)
def test_redistribute_on_gloo_matches_simulated(world, shape, key, gloo):  # noqa: F811
    items = [(s, src, dst, dtype, k) for k, (s, src, dst, dtype) in enumerate(REDISTRIBUTIONS[key])]
    check_redistributed(world, shape, items, gloo)


@st.composite
def _redistribute_batches(draw, shape):
    mesh = fd.simulated_mesh(shape, ("x", "y")[: len(shape)])
    items = []
    for k in range(draw(st.integers(1, 5))):
        global_shape = draw(fds.global_shapes(min_dims=1, max_dims=3, max_side=6, max_elements=64))
        src = draw(fds.placements(mesh, len(global_shape), allow_partial=True))
        dst = draw(fds.placements(mesh, len(global_shape)))
        items.append((global_shape, src, dst, "float64", k))
    return items


@settings(max_examples=4, deadline=None)
@given(
    st.sampled_from([(2, (2,)), (4, (2, 2))]).flatmap(
        lambda ws: st.tuples(st.just(ws), _redistribute_batches(ws[1]))
    )
)
def test_drawn_redistributions_match_simulated(gloo, drawn):  # noqa: F811
    (world, shape), items = drawn
    check_redistributed(world, shape, items, gloo)


def job_from_local(shape, names, items, run_check: bool) -> list[dict]:
    """Each rank passes its own shard (the simulated mesh's shard of the same device)."""
    mesh, sim_mesh = _gloo_mesh(shape, names), fd.simulated_mesh(shape, names)
    out = []
    for global_shape, placements, dtype, seed in items:
        value = _value(global_shape, dtype, seed)
        local = fd.distribute_tensor(value, sim_mesh, placements).to_local(device=_rank())
        d = fd.from_local(local, mesh, placements, shape=global_shape, run_check=run_check)
        out.append({"full": d.full_tensor(), "shape": tuple(d.shape)})
    return out


@pytest.mark.parametrize(
    "world, shape, layouts",
    [(2, (2,), LAYOUTS_1D), (4, (2, 2), LAYOUTS_2D)],
    ids=["2", "2x2"],
)
def test_from_local_with_run_check(world, shape, layouts, gloo):  # noqa: F811
    names = ("x", "y")[: len(shape)]
    items = [(s, p, dtype, k) for k, (s, p, dtype) in enumerate(layouts)]
    for run_check in (True, False):
        ranks = gloo.run(world, job_from_local, shape, names, items, run_check)
        for k, (global_shape, placements, dtype, seed) in enumerate(items):
            value = _value(global_shape, dtype, seed)
            for rank, answers in enumerate(ranks):
                at = f"rank {rank}, {placements} {global_shape}, run_check={run_check}"
                assert answers[k]["shape"] == tuple(global_shape), at
                _close(answers[k]["full"], value, at)


def job_from_local_even(shape, names) -> dict:
    """from_local without ``shape``: the split is taken to be even."""
    mesh = _gloo_mesh(shape, names)
    local = torch.arange(6.0).reshape(2, 3) + 10 * _rank()
    d = fd.from_local(local, mesh, (S(0),) + (R(),) * (len(shape) - 1), run_check=False)
    return {"shape": tuple(d.shape), "full": d.full_tensor()}


def job_from_local_bad_replicas(shape, names) -> str:
    """Shards that differ along a Replicate axis: every rank must raise."""
    mesh = _gloo_mesh(shape, names)
    try:
        fd.from_local(torch.full((2,), float(_rank())), mesh, (R(),), run_check=True)
    except fd.LayoutError as e:
        return type(e).__name__ + ": " + str(e)
    return "no error"


def test_from_local_even_and_bad_replicas(gloo):  # noqa: F811
    for got in gloo.run(2, job_from_local_even, (2,), ("x",)):
        assert got["shape"] == (4, 3)
        torch.testing.assert_close(
            got["full"], torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(2)])
        )
    for rank, got in enumerate(gloo.run(2, job_from_local_bad_replicas, (2,), ("x",))):
        assert got.startswith("LayoutError") and "Replicate" in got, (rank, got)


FACTORIES = [
    ("zeros", (5, 3), (S(0),)),
    ("ones", (5, 3), (S(1),)),
    ("ones", (4,), (Pa("sum"),)),
    ("full", (3, 2), (R(),)),
    ("full", (7,), (S(0),)),
    ("empty", (5, 2), (S(0),)),
    ("rand", (6, 2), (S(0),)),
    ("randn", (3, 3), (R(),)),
]


def make_factories(mesh) -> list[dict]:
    out = []
    for name, shape, placements in FACTORIES:
        placements = placements + (R(),) * (mesh.ndim - len(placements))
        if name == "full":
            d = fd.full(shape, 2.5, mesh=mesh, placements=placements, dtype=torch.float64)
        else:
            d = getattr(fd, name)(shape, mesh=mesh, placements=placements, dtype=torch.float64)
        full = d.full_tensor()
        out.append(
            {"shape": tuple(d.shape), "dtype": d.dtype, "shards": list(d.local_shards()), "full": full}
        )
    return out


def job_factories(shape, names) -> list[dict]:
    return make_factories(_gloo_mesh(shape, names))


@pytest.mark.parametrize("world, shape", [(2, (2,)), (4, (2, 2))], ids=["2", "2x2"])
def test_factories_match_simulated(world, shape, gloo):  # noqa: F811
    names = ("x", "y")[: len(shape)]
    sim = make_factories(fd.simulated_mesh(shape, names))
    ranks = gloo.run(world, job_factories, shape, names)
    for k, (name, _, placements) in enumerate(FACTORIES):
        for rank, answers in enumerate(ranks):
            got, want, at = answers[k], sim[k], f"rank {rank}: fd.{name} {placements}"
            assert (got["shape"], got["dtype"]) == (want["shape"], want["dtype"]), at
            assert got["shards"][0].shape == want["shards"][rank].shape, at
            assert got["full"].shape == want["full"].shape, at
            if name in ("zeros", "ones", "full"):
                _close(got["shards"][0], want["shards"][rank], at)
                _close(got["full"], want["full"], at)


def job_sharded_rand(seed: int) -> torch.Tensor:
    """fd.rand with a Shard placement, every rank's generator seeded alike (as usual)."""
    torch.manual_seed(seed)
    return fd.rand((8,), mesh=_gloo_mesh((2,), ("x",)), placements=(S(0),)).full_tensor()


def test_sharded_rand_draws_distinct_blocks(gloo):  # noqa: F811
    for full in gloo.run(2, job_sharded_rand, 0):
        assert not torch.equal(full[:4], full[4:]), f"both shards hold {full[:4]}"


def job_integer_partial_avg():
    """full_tensor of an int64 value placed Partial('avg'); an error is returned, not raised
    (every rank fails alike in the same collective)."""
    mesh = _gloo_mesh((2,), ("x",))
    try:
        return fd.distribute_tensor(torch.tensor([5, 2, -4]), mesh, (Pa("avg"),)).full_tensor()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def test_integer_partial_avg_round_trip(gloo):  # noqa: F811
    sim = fd.distribute_tensor(torch.tensor([5, 2, -4]), fd.simulated_mesh(2, "x"), (Pa("avg"),))
    assert torch.equal(sim.full_tensor(), torch.tensor([5, 2, -4]))
    for rank, got in enumerate(gloo.run(2, job_integer_partial_avg)):
        assert isinstance(got, torch.Tensor), f"rank {rank}: {got}"
        assert torch.equal(got, torch.tensor([5, 2, -4])), f"rank {rank}: {got}"


def chained(mesh) -> dict:
    """Two shard_maps chained through a DTensor (a pre-distributed input, an output fed on),
    differentiated end to end."""
    names = mesh.axis_names
    rows = fd.P(names)  # dim 0 split over every axis
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    x_rows = fd.distribute_tensor(x, mesh, rows)
    first = fd.shard_map(lambda a, b: torch.tanh(a @ b), mesh=mesh, in_specs=(rows, fd.P()), out_specs=rows)
    second = fd.shard_map(
        lambda h: fd.psum(h.square().sum(0, keepdim=True), names), mesh=mesh, in_specs=rows, out_specs=fd.P()
    )
    with fd.CommDebugMode() as comm:
        h = first(x_rows, w)
        out = second(h)
    full = out.full_tensor()
    gx, gw = torch.autograd.grad(full.sum(), (x, w))
    return {
        "h": [s.detach() for s in h.local_shards()],
        "full": full.detach(),
        "grads": (gx, gw),
        "comm": _events(comm),
        "reference": torch.tanh(x @ w).square().sum(0, keepdim=True).detach(),
    }


def job_chained(shape, names) -> dict:
    return chained(_gloo_mesh(shape, names))


@pytest.mark.parametrize("world, shape", [(2, (2,)), (4, (2, 2))], ids=["2", "2x2"])
def test_chained_shard_maps_on_dtensors(world, shape, gloo):  # noqa: F811
    names = ("x", "y")[: len(shape)]
    sim = chained(fd.simulated_mesh(shape, names))
    _close(sim["full"], sim["reference"], "simulated vs reference")
    for rank, got in enumerate(gloo.run(world, job_chained, shape, names)):
        _close(got["h"][0], sim["h"][rank], f"rank {rank}: intermediate shard")
        _close(got["full"], sim["reference"], f"rank {rank}: output")
        for g, w, what in zip(got["grads"], sim["grads"], "xw", strict=True):
            _close(g, w, f"rank {rank}: gradient of {what}")
        assert got["comm"] == sim["comm"], rank


def raised(mesh) -> list[str]:
    """The errors of a few invalid calls (each raised before any collective runs)."""
    out = []
    calls = [
        lambda: fd.shard_map(lambda v: v, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"))(torch.ones(5)),
        lambda: fd.shard_map(lambda v: v, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())(torch.ones(4)),
        lambda: fd.shard_map(lambda v: fd.psum(v, "z"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())(
            torch.ones(4)
        ),
        lambda: fd.shard_map(lambda v: v, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"))(
            fd.distribute_tensor(torch.ones(4), mesh, fd.P())
        ),
        lambda: fd.from_local(torch.ones(3), mesh, fd.P("x"), shape=(4,)),
    ]
    for call in calls:
        try:
            call()
            out.append("no error")
        except fd.FunctionalDTensorError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def job_raised(shape, names) -> list[str]:
    return raised(_gloo_mesh(shape, names))


def test_errors_on_gloo_match_simulated(gloo):  # noqa: F811
    want = raised(fd.simulated_mesh(2, "x"))
    assert "no error" not in want, want
    for rank, got in enumerate(gloo.run(2, job_raised, (2,), ("x",))):
        for g, w in zip(got, want, strict=True):
            assert g.split(":")[0] == w.split(":")[0], (rank, g, w)


# --- transformations on gloo: torch.func, torch.compile ------------------------------------------


def _square_sum(mapped, *args):
    return mapped(*args).full_tensor().square().sum()


def _square_sum_plain(f, *args):
    return f(*args).square().sum()


def _stacked_shards(mapped, *args):
    return torch.stack(mapped(*args).local_shards())


def job_func_grad(shape, names, axes) -> dict:
    """torch.func.grad over every catalogue case; the gradients, for the parent to check."""
    mesh = _gloo_mesh(shape, names)
    out = {}
    for case in cases(mesh, axes):
        mapped = fd.shard_map(
            case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs, check_rep=case.check_rep
        )
        inputs = global_inputs(case, seed=3)
        argnums = tuple(range(len(inputs)))
        loss = functools.partial(_square_sum, mapped)
        out[case.name] = torch.func.grad(loss, argnums=argnums)(*inputs)
    return out


@pytest.mark.parametrize("config", ["2:x", "2x2:xy", "2x2:y"])
def test_func_grad_on_gloo(config, gloo):  # noqa: F811
    world, shape, names, axes = CONFIGS[config]
    ranks = gloo.run(world, job_func_grad, shape, names, axes)
    for case in cases(fd.simulated_mesh(shape, names), axes):
        inputs = global_inputs(case, seed=3)
        argnums = tuple(range(len(inputs)))
        want = torch.func.grad(functools.partial(_square_sum_plain, case.reference), argnums=argnums)(*inputs)
        for rank, answers in enumerate(ranks):
            for i, (g, w) in enumerate(zip(answers[case.name], want, strict=True)):
                _close(g, w, f"rank {rank}, {case.name}: torch.func.grad of input {i}")


def vmapped_shards(mesh, axes) -> dict:
    """torch.func.vmap over each catalogue case (a batch of two), the output's local shards."""
    out = {}
    for case in cases(mesh, axes):
        mapped = fd.shard_map(
            case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs, check_rep=case.check_rep
        )
        batch = [torch.stack([t, 2 * t]) for t in global_inputs(case, seed=4)]
        out[case.name] = torch.func.vmap(functools.partial(_stacked_shards, mapped))(*batch)
    return out


def job_vmapped_shards(shape, names, axes) -> dict:
    return vmapped_shards(_gloo_mesh(shape, names), axes)


@pytest.mark.parametrize("config", ["2:x", "2x2:xy"])
def test_vmap_over_shard_map_on_gloo(config, gloo):  # noqa: F811
    world, shape, names, axes = CONFIGS[config]
    sim = vmapped_shards(fd.simulated_mesh(shape, names), axes)
    for rank, answers in enumerate(gloo.run(world, job_vmapped_shards, shape, names, axes)):
        for name, want in sim.items():
            _close(answers[name][:, 0], want[:, rank], f"rank {rank}, {name}: vmapped shard")


def job_vmap_full_tensor():
    """vmap over distribute_tensor + full_tensor; an error is returned, not raised (every rank
    fails alike, before any data moves)."""
    mesh = _gloo_mesh((2,), ("x",))
    batch = torch.arange(16.0).reshape(2, 4, 2)
    try:
        return torch.func.vmap(lambda a: fd.distribute_tensor(a, mesh, fd.P("x")).full_tensor())(batch)
    except Exception:
        return traceback.format_exc()


def test_vmap_of_full_tensor_on_gloo(gloo):  # noqa: F811
    for rank, got in enumerate(gloo.run(2, job_vmap_full_tensor)):
        assert isinstance(got, torch.Tensor), f"rank {rank}:\n{got}"
        torch.testing.assert_close(
            got, torch.arange(16.0).reshape(2, 4, 2), msg=lambda m, r=rank: f"rank {r}: {m}"
        )


def job_compile(backend: str, name: str) -> dict:
    """Eager vs ``torch.compile(fullgraph=True)`` of a catalogue case on a 2-rank mesh, forward
    and backward. A compile error is returned, not raised: every rank fails alike while tracing,
    before any collective runs, so the pool stays usable."""
    warnings.filterwarnings("ignore", message=".*lru_cache.*")
    torch._dynamo.reset()
    mesh = _gloo_mesh((2,), ("x",))
    case = pick(mesh, ("x",), name)
    mapped = fd.shard_map(
        case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs, check_rep=case.check_rep
    )

    def step(*args):
        return mapped(*args).full_tensor()

    inputs = [t.requires_grad_() for t in global_inputs(case, seed=5)]
    eager = step(*inputs)
    cotangent = torch.randn(eager.shape, dtype=eager.dtype, generator=torch.Generator().manual_seed(6))
    eager_grads = torch.autograd.grad(eager, inputs, cotangent, allow_unused=True)
    try:
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        got = compiled(*inputs)
        got_grads = torch.autograd.grad(got, inputs, cotangent, allow_unused=True)
        again = compiled(*[t.detach() * 2 for t in inputs])  # a second call reuses the graph
    except Exception:
        return {"error": traceback.format_exc()}
    return {
        "eager": eager.detach(),
        "compiled": got.detach(),
        "eager_grads": eager_grads,
        "compiled_grads": got_grads,
        "again": again.detach(),
        "again_eager": step(*[t.detach() * 2 for t in inputs]).detach(),
    }


def check_compiled(ranks: list[dict]) -> None:
    for rank, got in enumerate(ranks):
        assert "error" not in got, f"rank {rank}: torch.compile failed:\n{got['error']}"
        _close(got["compiled"], got["eager"], f"rank {rank}: compiled forward")
        _close(got["again"], got["again_eager"], f"rank {rank}: second compiled call")
        for i, (g, w) in enumerate(zip(got["compiled_grads"], got["eager_grads"], strict=True)):
            _close(g, w, f"rank {rank}: compiled backward, input {i}")


@pytest.mark.parametrize("name", ["mlp", "all_gather then psum_scatter"])
def test_compile_aot_eager_on_gloo(name, gloo):  # noqa: F811
    check_compiled(gloo.run(2, job_compile, "aot_eager", name, timeout=300))


def test_compile_ppermute_on_gloo(gloo):  # noqa: F811
    check_compiled(gloo.run(2, job_compile, "aot_eager", "ppermute ring", timeout=300))


def job_compile_redistribute(shape: tuple[int, ...], source, target) -> dict:
    """Eager vs compiled (aot_eager, fullgraph) fd.redistribute of local shards, forward and
    backward; errors returned, as in :func:`job_compile`."""
    torch._dynamo.reset()
    mesh = _gloo_mesh(shape, ("x", "y")[: len(shape)])
    value = torch.arange(64.0).reshape(8, 8)

    def step(local):
        moved = fd.redistribute(fd.from_local(local, mesh, source, shape=(8, 8)), target)
        return moved.to_local()

    local = fd.distribute_tensor(value, mesh, source).to_local().detach().requires_grad_()
    eager = step(local)
    (eager_grad,) = torch.autograd.grad(eager, local, torch.ones_like(eager))
    try:
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        got = compiled(local)
        (got_grad,) = torch.autograd.grad(got, local, torch.ones_like(got))
    except Exception:
        return {"error": traceback.format_exc()}
    return {
        "eager": eager.detach(),
        "compiled": got.detach(),
        "eager_grad": eager_grad,
        "compiled_grad": got_grad,
    }


@pytest.mark.parametrize(
    "source, target",
    [((S(0), S(1)), (S(1), S(0))), ((Pa("sum"), S(0)), (S(0), R())), ((S(0), R()), (R(), R()))],
)
def test_compile_redistribute_on_gloo(source, target, gloo):  # noqa: F811
    for rank, got in enumerate(gloo.run(4, job_compile_redistribute, (2, 2), source, target, timeout=300)):
        assert "error" not in got, f"rank {rank}: torch.compile failed:\n{got['error']}"
        _close(got["compiled"], got["eager"], f"rank {rank}: compiled forward")
        _close(got["compiled_grad"], got["eager_grad"], f"rank {rank}: compiled backward")


@pytest.mark.slow
def test_compile_inductor_on_gloo(gloo):  # noqa: F811
    check_compiled(gloo.run(2, job_compile, "inductor", "mlp", timeout=400))


# --- runtime state ---------------------------------------------------------------------------------


def job_groups_reused() -> dict:
    """Process groups are built once per (mesh, axes) and reused by later calls."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from functional_dtensor._distributed import runtime as distributed

    mesh = _gloo_mesh((2, 2), ("x", "y"))
    rounds = []
    for _ in range(3):
        for axes in (("x",), ("y",), ("x", "y")):
            run_case(mesh, axes, "psum")
            run_case(mesh, axes, "all_gather then psum_scatter")
        run_case(mesh, ("y", "x"), "ppermute ring", family="reversed axes")
        mine = {k[1]: v for k, v in distributed._groups.items() if k[0] == mesh}
        rounds.append(
            {
                "keys": sorted(mine),
                "ids": {k: id(v) for k, v in mine.items()},
                "sizes": {k: v.size() for k, v in mine.items()},
                "process_groups": len(c10d._world.pg_map),
            }
        )
    again = _gloo_mesh((2, 2), ("x", "y"))
    return {"rounds": rounds, "same_mesh": again == mesh, "world": dist.get_world_size()}


def test_process_groups_are_created_once_and_reused(gloo):  # noqa: F811
    for rank, got in enumerate(gloo.run(4, job_groups_reused)):
        first, *later = got["rounds"]
        # one group per axis and per flattened tuple; a tuple in another order is the same group
        assert first["keys"] == [("x",), ("x", "y"), ("y",), ("y", "x")], (rank, first["keys"])
        assert first["ids"][("y", "x")] == first["ids"][("x", "y")], rank
        assert first["sizes"] == {("x",): 2, ("y",): 2, ("x", "y"): 4, ("y", "x"): 4}, rank
        for other in later:
            assert other == first, f"rank {rank}: groups were rebuilt: {first} then {other}"
        assert got["same_mesh"]


def job_sub_mesh_groups() -> list[list[int]]:
    """The ``dist.new_group`` calls made to build the groups of ``mesh['y']`` (the sub-mesh
    through this rank of a 2x2 mesh). The calls are recorded and stopped, not run: run, they
    can hang (ranks of different sub-meshes rendezvous under one group name)."""
    import torch.distributed.device_mesh as torch_device_mesh

    from functional_dtensor._distributed import runtime as distributed

    mesh = _gloo_mesh((2, 2), ("x", "y"))
    sub = mesh["y"]
    calls: list[list[int]] = []

    class Stop(Exception):
        pass

    def recording_new_group(ranks=None, **kwargs):
        calls.append(sorted(ranks))
        raise Stop

    real = torch_device_mesh.new_group
    torch_device_mesh.new_group = recording_new_group
    try:
        distributed.group(sub, ("y",))
    except Stop:
        pass
    finally:
        torch_device_mesh.new_group = real
    return [sub.device_ids, distributed.group_ids(sub), calls]


def test_sub_mesh_groups_are_created_consistently(gloo):  # noqa: F811
    answers = gloo.run(4, job_sub_mesh_groups)
    for rank, (ids, mine, _) in enumerate(answers):
        assert ids == (0, 1, 2, 3), rank  # pure data: the same on every rank
        assert mine == ((0, 1) if rank < 2 else (2, 3)), rank
    calls = [c for *_, c in answers]
    assert all(c == calls[0] for c in calls), f"new_group calls per rank: {calls}"
    for rank, got in enumerate(gloo.run(4, job_sub_mesh_psum, timeout=20)):
        _close(got["full"], got["value"][:2] + got["value"][2:], f"rank {rank}: psum over mesh['y']")


def job_sub_mesh_psum() -> dict:
    """shard_map on ``mesh['y']``: each row of the 2x2 mesh sums its own value."""
    mesh = _gloo_mesh((2, 2), ("x", "y"))
    sub = mesh["y"]
    f = fd.shard_map(lambda v: fd.psum(v, "y"), mesh=sub, in_specs=fd.P("y"), out_specs=fd.P())
    from functional_dtensor._distributed import runtime

    value = torch.arange(4.0) + 10 * runtime.group_ids(sub)[0]
    return {"full": f(value).full_tensor(), "value": value}


# --- failures: these leave their pool broken, so they run last ----------------------------------


def job_run_check_mixed() -> str:
    """run_check on a 2x2 mesh, (Replicate, Replicate): only rank 0's shard differs, so the
    axis-'x' check fails in group {0, 2} and passes in group {1, 3}."""
    mesh = _gloo_mesh((2, 2), ("x", "y"))
    local = torch.full((2,), 1.0 if _rank() == 0 else 0.0)
    try:
        fd.from_local(local, mesh, (R(), R()), run_check=True)
    except fd.LayoutError:
        return "LayoutError"
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    return "no error"


def test_from_local_run_check_raises_on_every_rank(gloo):  # noqa: F811
    try:
        answers = gloo.run(4, job_run_check_mixed, timeout=3)
    except RankError as e:
        answers = [o.value if o is not None and o.ok else (o.error if o else "no answer") for o in e.outcomes]
    assert answers == ["LayoutError"] * 4, answers


COLLECTIVE_TIMEOUT = 5.0


def job_stuck_rank(mode: str) -> dict | None:
    """Rank 1 skips a collective (returns to its job loop, or exits); rank 0 runs psum and
    reports how it ended."""
    mesh = _gloo_mesh((2,), ("x",))
    f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())
    f(torch.ones(2))  # both ranks: the groups exist and work
    if _rank() == 1:
        if mode == "exit":
            os._exit(3)
        return None  # alive, but never joins rank 0's psum
    start = time.monotonic()
    try:
        f(torch.ones(2)).full_tensor()
    except BaseException as e:
        return {
            "elapsed": time.monotonic() - start,
            "types": [c.__name__ for c in type(e).__mro__],
            "message": str(e)[:500],
        }
    return {"elapsed": time.monotonic() - start, "types": [], "message": "no error"}


def test_stuck_rank_becomes_an_error_within_the_timeout():
    """A rank that never joins a collective: the others raise when the group's timeout fires
    (a pool of its own, with a short timeout, discarded after)."""
    with RankPool(2, timeout=COLLECTIVE_TIMEOUT) as pool:
        pool.wait_ready()
        start = time.monotonic()
        got = pool.run(job_stuck_rank, "skip", timeout=COLLECTIVE_TIMEOUT + 25)[0]
        elapsed = time.monotonic() - start
        pool.discard()  # rank 0's group timed out: it is unusable
    assert "CommunicationError" in got["types"] and "RuntimeError" in got["types"], got
    assert COLLECTIVE_TIMEOUT * 0.8 < got["elapsed"] < COLLECTIVE_TIMEOUT + 10, got  # the timeout fired
    assert elapsed < COLLECTIVE_TIMEOUT + 15, elapsed


_dead_rank: dict = {}


def dead_rank_outcome(pools) -> tuple[RankError, float]:
    """Rank 1 of the session's 2-rank pool exits while rank 0 runs psum (once per session: it
    leaves the pool broken, and the next use starts a fresh one)."""
    if not _dead_rank:
        start = time.monotonic()
        with pytest.raises(RankError, match="rank 1 died") as info:
            pools.run(2, job_stuck_rank, "exit", timeout=60)
        _dead_rank["outcome"] = (info.value, time.monotonic() - start)
    return _dead_rank["outcome"]


def test_dead_rank_becomes_an_error(gloo):  # noqa: F811
    error, elapsed = dead_rank_outcome(gloo)
    rank0 = error.outcomes[0]
    assert rank0 is not None and rank0.ok, error
    got = rank0.value
    assert "RuntimeError" in got["types"], got
    assert got["elapsed"] < 10, got
    assert elapsed < 30, elapsed


def test_dead_rank_error_is_a_communication_error(gloo):  # noqa: F811
    error, _ = dead_rank_outcome(gloo)
    got = error.outcomes[0].value
    assert "CommunicationError" in got["types"] and "RuntimeError" in got["types"], got
