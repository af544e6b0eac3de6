"""Higher-order and forward-mode differentiation through ``shard_map``, every collective and
``redistribute``, compared with single-device torch.

Four modes, each a derivative that the first-order tests cannot see:

* ``hvp``: a Hessian-vector product, the gradient of ``<grad, v>`` by
  ``torch.autograd.grad(create_graph=True)`` (every backward differentiated again);
* ``jvp``: ``torch.func.jvp`` (forward mode);
* ``linearize``: ``torch.func.linearize`` (forward mode, traced once, run on a tangent);
* ``jvp of grad``: forward over reverse, ``torch.func.jvp(torch.func.grad(loss))``.

The loss of a program's output is ``sum(sin(y) * y)``, whose second derivative is not constant,
so a Hessian-vector product goes through the backward of every collective. Hypothesis draws
meshes (1-d to 3-d), the axes a catalogue program maps over (any order), programs and
``check_rep`` on the simulated backend, and pairs of layouts (Partial ones too) for
``redistribute``; a fixed representative set runs on gloo ranks (2 and 4) through the
``backend`` fixture, captured values included.
"""

from __future__ import annotations

import pytest
import torch
from backends import Mesh
from catalogue import (
    cases,
    check_rep_as,
    compare,
    derivatives,
    global_inputs,
    loss,
    mapped,
    mesh_and_axes,
    pick,
)
from common import assert_close, with_long_run
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

MODES = ("hvp", "jvp", "linearize", "jvp of grad")
CASE_NAMES = [c.name for c in cases(fd.simulated_mesh(2, "x"), ("x",))]
DRAWN, DRAWN_LONG = 20, 100  # examples per mode in the default run, and in the slow tier's twin


# --- drawn on the simulated backend ----------------------------------------------------------


@with_long_run(
    DRAWN_LONG,
    mesh_and_axes(max_devices=8),
    st.sampled_from(CASE_NAMES),
    st.booleans(),
    st.integers(0, 99),
    default_examples=DRAWN,
)
@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")  # torch.func.linearize's
@pytest.mark.parametrize("mode", MODES)
def test_drawn_programs_match_single_device(mode, mesh, name, check_rep, seed):
    sim_mesh = mesh.simulated()
    case = check_rep_as(pick(sim_mesh, mesh.axes, name), check_rep)
    xs, vs = global_inputs(case, seed=seed), global_inputs(case, seed=seed + 100)
    got = derivatives(mode, mapped(case, sim_mesh), xs, vs)
    want = derivatives(mode, case.reference, xs, vs)
    compare(got, want, f"{mode} of {name} on {mesh}, check_rep={case.check_rep}")


@st.composite
def layout_pairs(draw):
    """A global shape, a source layout (Partial axes too) and a target layout, on a mesh of up
    to 8 devices; shapes uneven too."""
    case = draw(fds.sharded_cases(mesh=fds.meshes(max_devices=8), dtype=torch.float64, allow_partial=True))
    target = draw(fds.layouts(case.mesh, len(case.global_shape), allow_partial=True))
    return case.global_shape, case.layout, target


def through_layouts(source: fd.Layout, target: fd.Layout):
    """The identity on global tensors, by way of ``source`` and ``redistribute`` to ``target``."""
    return lambda x: fd.redistribute(fd.distribute_tensor(x, source.mesh, source), target)


@with_long_run(DRAWN_LONG, layout_pairs(), st.integers(0, 99), default_examples=DRAWN)
@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")
@pytest.mark.parametrize("mode", MODES)
def test_drawn_redistributions_match_single_device(mode, pair, seed):
    shape, source, target = pair
    generator = torch.Generator().manual_seed(seed)
    x, v = (torch.randn(shape, dtype=torch.float64, generator=generator) for _ in range(2))
    got = derivatives(mode, through_layouts(source, target), [x], [v])
    compare(got, derivatives(mode, lambda t: t, [x], [v]), f"{mode} of {source} -> {target} {shape}")


# --- a fixed set on both backends ------------------------------------------------------------

GLOO_CASES = [
    "local matmul",
    "psum",
    "pmean",
    "pmax",
    "psum of replicated",
    "all_gather",
    "all_gather tiled, unchecked",
    "psum_scatter tiled",
    "all_to_all",
    "ppermute ring",
    "tensor-parallel matmul + psum",
    "all_gather then psum_scatter",
    "mlp",
]
GLOO_LAYOUTS = [(fd.P("x"), fd.P()), (fd.P(), fd.P(None, "x")), (fd.P("x"), fd.P(None, "x"))]


def layout_pairs_on(mesh) -> list[tuple[fd.Layout, fd.Layout]]:
    """Representative pairs of layouts on ``mesh`` (Partial ones too)."""
    partial = fd.Layout(mesh, (fd.Partial(),) * mesh.ndim)
    pairs = [(fd.Layout.from_spec(mesh, a), fd.Layout.from_spec(mesh, b)) for a, b in GLOO_LAYOUTS]
    return [
        *pairs,
        (partial, fd.Layout.from_spec(mesh, fd.P("x"))),
        (fd.Layout.from_spec(mesh, fd.P()), partial),
    ]


def job_derivatives(mesh, axes, x: torch.Tensor, v: torch.Tensor) -> dict:
    """Every mode's derivatives of each representative catalogue case (``check_rep`` on and
    off), of ``redistribute`` (through a few pairs of layouts) at ``x`` in direction ``v``, and
    of a program that captures a value; keyed by what was differentiated."""
    out = {}
    for name in GLOO_CASES:
        for check_rep in (True, False):
            case = check_rep_as(pick(mesh, axes, name), check_rep)
            xs, vs = global_inputs(case, seed=1), global_inputs(case, seed=2)
            for mode in MODES:
                out[(name, case.check_rep, mode)] = derivatives(mode, mapped(case, mesh), xs, vs)
    for source, target in layout_pairs_on(mesh):
        for mode in MODES:
            out[(str(source), str(target), mode)] = derivatives(
                mode, through_layouts(source, target), [x], [v]
            )
    for check_rep in (True, False):
        out[("captured", check_rep)] = hvp_of_captured(mesh, check_rep)
    return out


def hvp_of_captured(mesh, check_rep: bool) -> list[torch.Tensor]:
    """The gradient and a Hessian-vector product, with respect to a value the per-device
    function captures, of ``loss(rows * scale)`` (on a single device: ``mesh`` None)."""
    x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2) / 8
    scale = torch.tensor([0.5, -1.5], dtype=torch.float64, requires_grad=True)
    if mesh is None:
        y = x * scale
    else:
        f = fd.shard_map(
            lambda rows: rows * scale, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"), check_rep=check_rep
        )
        y = f(x).full_tensor()
    (grad,) = torch.autograd.grad(loss(y), scale, create_graph=True)
    (second,) = torch.autograd.grad((grad * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum(), scale)
    return [grad.detach(), second]


@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")
@pytest.mark.meshes(
    Mesh((2,), axes=("x",)), Mesh((4,), axes=("x",)), Mesh((2, 2), axes=("y", "x")), slow=("gloo-4",)
)
def test_representative_programs_on_both_backends(backend, mesh):
    x, v = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    results = backend.run(job_derivatives, mesh.shape, mesh.names, mesh.axes, x, v)
    sim_mesh = mesh.simulated()
    wants = {}
    for name in GLOO_CASES:
        for check_rep in (True, False):
            case = check_rep_as(pick(sim_mesh, mesh.axes, name), check_rep)
            xs, vs = global_inputs(case, seed=1), global_inputs(case, seed=2)
            for mode in MODES:
                wants[(name, case.check_rep, mode)] = derivatives(mode, case.reference, xs, vs)
    for source, target in layout_pairs_on(sim_mesh):
        for mode in MODES:
            wants[(str(source), str(target), mode)] = derivatives(mode, lambda t: t, [x], [v])
    for check_rep in (True, False):
        wants[("captured", check_rep)] = hvp_of_captured(None, check_rep)
    for p, got in enumerate(results):
        assert got.keys() == wants.keys()
        for key, want in wants.items():
            compare(got[key], want, f"process {p} on {mesh}: {key}")


def job_transforms_inside_and_around(mesh) -> dict:
    """``check_rep=False``: the gradient of a sharded input through a ``torch.func.vmap`` inside
    the per-device function, and ``torch.func.grad`` (and grad of grad) of a value captured
    from around it."""
    x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4) / 8
    inner = fd.shard_map(
        lambda cols: torch.func.vmap(lambda row: fd.psum((row**3).sum(), "x"))(cols),
        mesh=mesh,
        in_specs=fd.P(None, "x"),
        out_specs=fd.P(),
        check_rep=False,
    )
    x_leaf = x.clone().requires_grad_()
    (through_vmap,) = torch.autograd.grad(inner(x_leaf).full_tensor().sum(), x_leaf)

    def around(s):
        scaled = fd.shard_map(
            lambda rows: rows * s, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"), check_rep=False
        )
        return loss(scaled(x.reshape(8)).full_tensor())

    s = torch.tensor(0.7, dtype=torch.float64)
    return {
        "through vmap": through_vmap,
        "grad": torch.func.grad(around)(s),
        "grad of grad": torch.func.grad(torch.func.grad(around))(s),
    }


@pytest.mark.meshes((2,), (4,))
def test_transforms_inside_and_around_the_function_unchecked(backend, mesh):
    x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4) / 8
    s = torch.tensor(0.7, dtype=torch.float64)
    want = {
        "through vmap": 3 * x**2,
        "grad": torch.func.grad(lambda s: loss(x * s))(s),
        "grad of grad": torch.func.grad(torch.func.grad(lambda s: loss(x * s)))(s),
    }
    for p, got in enumerate(backend.run(job_transforms_inside_and_around, mesh.shape, mesh.names)):
        for key, value in want.items():
            assert_close(got[key], value, msg=lambda m, key=key, p=p: f"process {p}, {key}: {m}")
