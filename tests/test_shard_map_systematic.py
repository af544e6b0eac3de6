"""Systematic shard_map tests (in the manner of JAX's ShardMapSystematicTest).

Hypothesis draws a simulated mesh (1-d to 3-d), the mesh axes to map a catalogue program over,
and a program from the catalogue; each runs eagerly, under autograd, under torch.func.grad and
under torch.func.vmap, and is compared with its single-device reference, device by device.
"""

from __future__ import annotations

import torch
from catalogue import Case, cases, global_inputs
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor._sharding import shard_table


@st.composite
def mesh_and_axes(draw, max_devices: int = 16):
    ndim = draw(st.integers(1, 3))
    shape = []
    for _ in range(ndim):
        budget = max_devices // max(1, (1 if not shape else __import__("math").prod(shape)))
        shape.append(draw(st.integers(1, max(1, min(4, budget)))))
    names = ("x", "y", "z")[:ndim]
    mesh = fd.simulated_mesh(tuple(shape), names)
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=ndim, unique=True))
    axes = tuple(sorted(chosen, key=names.index))
    return mesh, axes


CASE_NAMES = [c.name for c in cases(fd.simulated_mesh(2, "x"), ("x",))]


def pick(mesh, axes, name) -> Case:
    return next(c for c in cases(mesh, axes) if c.name == name)


def run(case: Case, mesh, inputs):
    mapped = fd.shard_map(
        case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs, check_rep=case.check_rep
    )
    return mapped(*inputs)


@given(mesh_and_axes(), st.sampled_from(CASE_NAMES), st.booleans())
def test_values_match_reference_on_every_device(mesh_axes, name, unchecked):
    mesh, axes = mesh_axes
    case = pick(mesh, axes, name)
    if unchecked:
        case = Case(**{**case.__dict__, "check_rep": False})
    inputs = global_inputs(case)
    with fd.CommDebugMode() as comm:
        out = run(case, mesh, inputs)
    expected = case.reference(*inputs)
    assert out.shape == expected.shape
    torch.testing.assert_close(out.full_tensor(), expected)
    table = shard_table(out.layout, tuple(expected.shape))
    for device in range(mesh.size):  # the plain loop over mesh coordinates
        block = tuple(slice(o, o + s) for o, s in zip(table.offsets[device], table.local_shapes[device]))
        torch.testing.assert_close(out.to_local(device=device), expected[block])
    assert comm.get_comm_counts() == case.comm


@given(mesh_and_axes(), st.sampled_from(CASE_NAMES), st.booleans())
def test_gradients_match_single_device_autograd(mesh_axes, name, unchecked):
    mesh, axes = mesh_axes
    case = pick(mesh, axes, name)
    if unchecked:
        case = Case(**{**case.__dict__, "check_rep": False})
    inputs = [t.requires_grad_() for t in global_inputs(case)]
    expected = case.reference(*inputs)
    cotangent = torch.randn(expected.shape, dtype=expected.dtype)
    want = torch.autograd.grad(expected, inputs, cotangent, allow_unused=True)
    got = torch.autograd.grad(run(case, mesh, inputs).full_tensor(), inputs, cotangent, allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(
            g if g is not None else torch.zeros_like(w), w if w is not None else torch.zeros_like(g)
        )


@given(mesh_and_axes(max_devices=8), st.sampled_from(CASE_NAMES))
def test_func_grad_and_vmap_compose(mesh_axes, name):
    mesh, axes = mesh_axes
    case = pick(mesh, axes, name)
    inputs = global_inputs(case)

    def loss(*args):
        return run(case, mesh, args).full_tensor().square().sum()

    def ref_loss(*args):
        return case.reference(*args).square().sum()

    argnums = tuple(range(len(inputs)))
    got = torch.func.grad(loss, argnums=argnums)(*inputs)
    want = torch.func.grad(ref_loss, argnums=argnums)(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)

    batch = [torch.stack([t, 2 * t]) for t in inputs]
    got = torch.func.vmap(lambda *a: run(case, mesh, a).full_tensor())(*batch)
    want = torch.func.vmap(case.reference)(*batch)
    torch.testing.assert_close(got, want)


@given(mesh_and_axes(max_devices=8), st.sampled_from(CASE_NAMES))
def test_user_vmap_inside_the_per_device_function(mesh_axes, name):
    mesh, axes = mesh_axes
    case = pick(mesh, axes, name)
    inputs = global_inputs(case)
    batched = Case(
        **{
            **case.__dict__,
            "f": lambda *a: torch.func.vmap(lambda s: case.f(*a) * s)(
                torch.tensor([1.0, -2.0], dtype=torch.float64)
            ),
            "out_specs": fd.P(None, *case.out_specs),
            "check_rep": False,  # replication is not tracked through transforms inside f
        }
    )
    out = run(batched, mesh, inputs).full_tensor()
    expected = case.reference(*inputs)
    torch.testing.assert_close(out, torch.stack([expected, -2 * expected]))
