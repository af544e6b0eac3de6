"""``DTensor.to_local`` and ``DTensor.full_tensor`` with ``grad_placements``: the gradient that
flows into the returned tensor, in the given layout, converted to the value's own.

Each job runs one SPMD program: every process differentiates the terms of the devices it holds
(all of them on the simulated backend, its own rank's on gloo), so the gradients of the global
input agree across backends and with the hand computation.
"""

from __future__ import annotations

import pytest
import torch
from backends import local_devices
from common import assert_close

import functional_dtensor as fd

R, S, Pa = fd.Replicate(), fd.Shard, fd.Partial

N = 12  # divisible by every mesh size below


def weights(n: int) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, n)


def job_to_local_grad(mesh, placements, grad_placements) -> torch.Tensor:
    """Device d's term: (d + 1) * its shard, summed; the gradient of the global input."""
    t = torch.arange(float(N), requires_grad=True)
    x = fd.distribute_tensor(t, mesh, placements)
    loss = sum(
        [((d + 1) * x.to_local(d, grad_placements=grad_placements)).sum() for d in local_devices(mesh)]
    )
    loss.backward()
    return t.grad


def job_full_tensor_grad(mesh, placements, grad_placements) -> torch.Tensor:
    """Every process: the weighted sum of the full tensor; the gradient of the global input."""
    t = torch.arange(float(N), requires_grad=True)
    x = fd.distribute_tensor(t, mesh, placements)
    (x.full_tensor(grad_placements=grad_placements) * weights(N)).sum().backward()
    return t.grad


def device_weights(mesh_size: int) -> torch.Tensor:
    """Element i's weight when device d's term is (d + 1) * its shard of a Shard(0) value."""
    return torch.arange(1.0, mesh_size + 1).repeat_interleave(N // mesh_size)


@pytest.mark.meshes((2,), (4,))
def test_to_local_replicate_with_partial_gradients_sums_them(backend, mesh):
    expected = torch.full((N,), mesh.size * (mesh.size + 1) / 2)
    for grad in backend.run(job_to_local_grad, mesh.shape, mesh.names, (R,), (Pa(),)):
        assert_close(grad, expected)


@pytest.mark.meshes((2,), (4,))
def test_to_local_grad_placements_of_the_value_layout_are_the_default(backend, mesh):
    for grad_placements in (None, (S(0),), fd.P("x")):
        for grad in backend.run(job_to_local_grad, mesh.shape, mesh.names, (S(0),), grad_placements):
            assert_close(grad, device_weights(mesh.size))


@pytest.mark.meshes((2, 2))
def test_to_local_shard_with_partial_gradients_on_the_other_axis(backend, mesh):
    """Shard over x, Replicate over y: the y devices' gradients of a block are summed."""
    rows, cols = mesh.shape
    per_block = [float(sum(i * cols + j + 1 for j in range(cols))) for i in range(rows)]
    expected = torch.tensor(per_block).repeat_interleave(N // rows)
    for grad in backend.run(job_to_local_grad, mesh.shape, mesh.names, (S(0), R), (S(0), Pa())):
        assert_close(grad, expected)


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_full_tensor_shard_with_partial_gradients_reduce_scatters(backend, mesh):
    placements = fd.P(mesh.names)
    for grad in backend.run(
        job_full_tensor_grad, mesh.shape, mesh.names, placements, (Pa(),) * len(mesh.shape)
    ):
        assert_close(grad, mesh.size * weights(N))


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_full_tensor_shard_with_replicate_gradients_slices(backend, mesh):
    placements = fd.P(mesh.names)
    for grad_placements in (None, (R,) * len(mesh.shape), fd.P()):
        for grad in backend.run(job_full_tensor_grad, mesh.shape, mesh.names, placements, grad_placements):
            assert_close(grad, weights(N))


@pytest.mark.meshes((2, 2))
def test_full_tensor_partial_on_one_axis_counts_that_axis(backend, mesh):
    for grad in backend.run(job_full_tensor_grad, mesh.shape, mesh.names, fd.P("y"), (Pa(), R)):
        assert_close(grad, mesh.shape[0] * weights(N))


def job_bad_grad_placements(mesh) -> list[str]:
    x = fd.distribute_tensor(torch.arange(float(N)), mesh, fd.P("x"))
    device = local_devices(mesh)[0]
    calls = [
        lambda: x.to_local(device, grad_placements=(R,)),
        lambda: x.to_local(device, grad_placements=(Pa("max"),)),
        lambda: x.to_local(device, grad_placements=(S(0), R)),
        lambda: x.to_local(device, grad_placements="x"),
        lambda: x.full_tensor(grad_placements=fd.P("x")),
        lambda: x.full_tensor(grad_placements=fd.P("x", None)),
    ]
    errors = []
    for call in calls:
        try:
            call()
        except (fd.LayoutError, fd.InputTypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
        else:
            errors.append("no error")
    return errors


@pytest.mark.meshes((2,))
def test_bad_grad_placements_are_refused(backend, mesh):
    for errors in backend.run(job_bad_grad_placements, mesh.shape, mesh.names):
        shaped, max_op, length, kind, full_shard, too_long = errors
        assert shaped.startswith("LayoutError") and "to_local(grad_placements)" in shaped, shaped
        assert max_op.startswith("LayoutError") and "Partial('max')" in max_op, max_op
        assert length.startswith("LayoutError") and "one placement per mesh axis" in length, length
        assert kind.startswith("InputTypeError"), kind
        assert full_shard.startswith("LayoutError") and "full_tensor(grad_placements)" in full_shard
        assert too_long.startswith("LayoutError") and "more entries" in too_long, too_long


def test_grad_placements_leave_forward_mode_as_it_is():
    """A tangent flows forward through the value, whatever layout the gradient will have."""
    mesh = fd.simulated_mesh(2, "x")
    w = torch.arange(6.0).reshape(6, 1)

    def local(v):
        x = fd.distribute_tensor(v, mesh, fd.P())
        return x.to_local(device=1, grad_placements=[fd.Partial()]) * 3

    def full(v):
        return fd.distribute_tensor(v, mesh, fd.P("x")).full_tensor(grad_placements=[fd.Partial()]) * 3

    for f in (local, full):
        value, tangent = torch.func.jvp(f, (w,), (torch.ones_like(w),))
        assert_close(value, 3 * w)
        assert_close(tangent, torch.full_like(w, 3.0))
