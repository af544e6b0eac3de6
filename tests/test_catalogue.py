"""The systematic catalogue (``catalogue.py``, in the manner of JAX's ShardMapSystematicTest)
on both backends.

Every program of the catalogue runs on the simulated backend and on gloo ranks (2 and 4), over
the axes of a mesh in any order, eagerly, under autograd, under ``torch.func.grad`` and under
``torch.func.vmap``; each device's shard is compared with its block of the single-device
reference (the plain-loop oracle of :mod:`backends`), the gradients with the reference's, and
the collectives with the catalogue's (on gloo: with those the simulated backend runs, bytes
included). Hypothesis then draws meshes (1-d to 3-d), axes in any order and programs on the
simulated backend.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections import Counter

import pytest
import torch
from backends import Mesh, block, coordinates, per_device
from catalogue import Case, cases, global_inputs, mapped, mesh_and_axes, pick, reference, run_case
from common import assert_close
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd

CASE_NAMES = [c.name for c in cases(fd.simulated_mesh(2, "x"), ("x",))]
# gloo's meshes and the axes mapped over (any order); the simulated backend adds odd and 3-d ones
MESHES = [
    Mesh((2,), axes=("x",)),
    Mesh((4,), axes=("x",)),
    Mesh((2, 2), axes=("x",)),
    Mesh((2, 2), axes=("y",)),
    Mesh((2, 2), axes=("x", "y")),
    Mesh((2, 2), axes=("y", "x")),
    Mesh((3,), axes=("x",)),
    Mesh((2, 3), axes=("y", "x")),
    Mesh((2, 3, 2), axes=("z", "x")),
]


def named(*labels: str) -> list[Mesh]:
    found = [m for m in MESHES if str(m) in labels]
    assert len(found) == len(labels), labels
    return found


UNCHECKED = ["psum", "pmax", "psum of replicated", "all_gather", "psum_scatter tiled", "all_to_all"]
UNCHECKED += ["ppermute ring", "tensor-parallel matmul + psum", "mlp"]


def close(got, want, what: str) -> None:
    assert_close(got, want, msg=lambda m: f"{what}: {m}")


def check_case(backend, mesh: Mesh, name: str, check_rep: bool | None, seed: int) -> None:
    sim_mesh = mesh.simulated()
    case = pick(sim_mesh, mesh.axes, name, check_rep)
    want = reference(case, seed)
    placements = fd.Layout.from_spec(sim_mesh, case.out_specs).normalized(want["full"].dim()).placements
    results = backend.run(run_case, mesh.shape, mesh.names, mesh.axes, name, check_rep, seed)
    assert len(results) == (backend.world_size or 1)
    for p, got in enumerate(results):
        at = f"{name} on {mesh}, process {p}"
        assert (got["shape"], got["placements"]) == (tuple(want["full"].shape), placements), at
        close(got["full"], want["full"], f"{at}: full_tensor vs reference")
        for i, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            close(torch.zeros_like(w) if g is None else g, w, f"{at}: gradient of input {i}")
        assert Counter(op for op, _, _ in got["forward"]) == Counter(case.comm), at
    shards = per_device(results, "shards")
    assert len(shards) == mesh.size
    for d, coordinate in enumerate(coordinates(mesh.shape)):
        expected = block(want["full"], mesh.shape, mesh.names, case.out_specs, coordinate)
        close(shards[d], expected, f"{name} on {mesh}: device {d} at {coordinate} vs its reference block")
    if not backend.is_simulated:  # the same collectives, bytes included, in forward and backward
        sim = run_case(sim_mesh, mesh.axes, name, check_rep, seed)
        for p, got in enumerate(results):
            assert got["forward"] == sim["forward"], f"{name} on {mesh}, rank {p}: forward collectives"
            assert got["backward"] == sim["backward"], f"{name} on {mesh}, rank {p}: backward collectives"


def seed_of(*parts) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode()) % 1000


@pytest.mark.meshes(*MESHES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_catalogue_case(backend, mesh, name):
    check_case(backend, mesh, name, None, seed_of(mesh, name))


@pytest.mark.meshes(*named("2:x", "2x2:y", "2x2:xy", "2x2:yx", "2x3x2:zx"))
@pytest.mark.parametrize("name", UNCHECKED)
def test_catalogue_case_unchecked(backend, mesh, name):
    check_case(backend, mesh, name, False, 7)


# --- torch.func over every case --------------------------------------------------------------


def _square_sum(f, *args):
    out = f(*args)
    return (out.full_tensor() if isinstance(out, fd.DTensor) else out).square().sum()


def job_func_grad(mesh, axes) -> dict:
    """torch.func.grad of a loss of every catalogue case."""
    out = {}
    for case in cases(mesh, axes):
        inputs = global_inputs(case, seed=3)
        loss = functools.partial(_square_sum, mapped(case, mesh))
        out[case.name] = torch.func.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    return out


TRANSFORM_MESHES = named("2:x", "2x2:y", "2x2:xy", "2x2:yx", "2x3:yx")


@pytest.mark.meshes(*TRANSFORM_MESHES)
def test_func_grad_of_every_case(backend, mesh):
    results = backend.run(job_func_grad, mesh.shape, mesh.names, mesh.axes)
    for case in cases(mesh.simulated(), mesh.axes):
        inputs = global_inputs(case, seed=3)
        loss = functools.partial(_square_sum, case.reference)
        want = torch.func.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
        for p, answers in enumerate(results):
            for i, (g, w) in enumerate(zip(answers[case.name], want, strict=True)):
                close(g, w, f"process {p}, {case.name}: torch.func.grad of input {i}")


def _stacked_shards(f, *args):
    return torch.stack(f(*args).local_shards())


def job_vmapped_shards(mesh, axes) -> dict:
    """torch.func.vmap of every catalogue case over a batch of two: the local shards, batch
    first."""
    out = {}
    for case in cases(mesh, axes):
        batch = [torch.stack([t, 2 * t]) for t in global_inputs(case, seed=4)]
        out[case.name] = torch.func.vmap(functools.partial(_stacked_shards, mapped(case, mesh)))(*batch)
    return out


@pytest.mark.meshes(*TRANSFORM_MESHES)
def test_vmap_of_every_case(backend, mesh):
    results = backend.run(job_vmapped_shards, mesh.shape, mesh.names, mesh.axes)
    for case in cases(mesh.simulated(), mesh.axes):
        batch = [torch.stack([t, 2 * t]) for t in global_inputs(case, seed=4)]
        want = torch.func.vmap(case.reference)(*batch)
        got = torch.cat([answers[case.name] for answers in results], dim=1)  # (batch, device, ...)
        assert got.shape[:2] == (2, mesh.size), case.name
        for d, coordinate in enumerate(coordinates(mesh.shape)):
            for b in range(2):
                expected = block(want[b], mesh.shape, mesh.names, case.out_specs, coordinate)
                close(got[b, d], expected, f"{case.name}, batch {b}, device {d}")


# --- drawn meshes, axes in any order and programs (simulated) ----------------------------------


def unchecked_if(case: Case, unchecked: bool) -> Case:
    return dataclasses.replace(case, check_rep=False) if unchecked else case


@given(mesh_and_axes(), st.sampled_from(CASE_NAMES), st.booleans())
def test_drawn_values_match_reference_on_every_device(mesh, name, unchecked):
    sim_mesh = mesh.simulated()
    case = unchecked_if(pick(sim_mesh, mesh.axes, name), unchecked)
    inputs = global_inputs(case)
    with fd.CommDebugMode() as comm:
        out = mapped(case, sim_mesh)(*inputs)
    expected = case.reference(*inputs)
    assert out.shape == expected.shape
    assert_close(out.full_tensor(), expected)
    for d, coordinate in enumerate(coordinates(mesh.shape)):  # the plain loop over mesh coordinates
        want = block(expected, mesh.shape, mesh.names, case.out_specs, coordinate)
        assert_close(out.to_local(device=d), want)
    assert comm.get_comm_counts() == case.comm


@given(mesh_and_axes(), st.sampled_from(CASE_NAMES), st.booleans())
def test_drawn_gradients_match_single_device_autograd(mesh, name, unchecked):
    case = unchecked_if(pick(mesh.simulated(), mesh.axes, name), unchecked)
    want = reference(case)
    got = run_case(mesh.simulated(), mesh.axes, name, case.check_rep)
    for g, w in zip(got["grads"], want["grads"], strict=True):
        assert_close(torch.zeros_like(w) if g is None else g, w)


@given(mesh_and_axes(max_devices=8), st.sampled_from(CASE_NAMES))
def test_drawn_func_grad_and_vmap_compose(mesh, name):
    sim_mesh = mesh.simulated()
    case = pick(sim_mesh, mesh.axes, name)
    inputs = global_inputs(case)
    argnums = tuple(range(len(inputs)))
    got = torch.func.grad(functools.partial(_square_sum, mapped(case, sim_mesh)), argnums=argnums)(*inputs)
    want = torch.func.grad(functools.partial(_square_sum, case.reference), argnums=argnums)(*inputs)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)
    batch = [torch.stack([t, 2 * t]) for t in inputs]
    got = torch.func.vmap(lambda *a: mapped(case, sim_mesh)(*a).full_tensor())(*batch)
    assert_close(got, torch.func.vmap(case.reference)(*batch))


@given(mesh_and_axes(max_devices=8), st.sampled_from(CASE_NAMES))
def test_drawn_user_vmap_inside_the_per_device_function(mesh, name):
    sim_mesh = mesh.simulated()
    case = pick(sim_mesh, mesh.axes, name)
    inputs = global_inputs(case)
    batched = dataclasses.replace(
        case,
        f=lambda *a: torch.func.vmap(lambda s: case.f(*a) * s)(
            torch.tensor([1.0, -2.0], dtype=torch.float64)
        ),
        out_specs=fd.P(None, *case.out_specs),
        check_rep=False,  # replication is not tracked through transforms inside f
    )
    out = mapped(batched, sim_mesh)(*inputs).full_tensor()
    expected = case.reference(*inputs)
    assert_close(out, torch.stack([expected, -2 * expected]))
