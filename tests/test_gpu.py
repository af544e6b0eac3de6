"""The simulated backend on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

import functional_dtensor as fd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_shard_map_mlp_on_a_simulated_cuda_mesh_matches_cpu():
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
    results = []
    for device in ("cpu", "cuda"):
        mesh = fd.simulated_mesh(8, "tp", device_type=device)
        mlp = fd.shard_map(
            lambda x, a, b: fd.psum(torch.relu(x @ a) @ b, "tp"),
            mesh=mesh,
            in_specs=(fd.P(), fd.P(None, "tp"), fd.P("tp")),
            out_specs=fd.P(),
        )
        inputs = [t.to(device).requires_grad_() for t in (x, w1, w2)]
        y = mlp(*inputs).full_tensor()
        assert y.device.type == device
        grads = torch.autograd.grad(y.square().sum(), inputs)
        results.append([y.cpu(), *[g.cpu() for g in grads]])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_redistribute_on_a_simulated_cuda_mesh():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"), device_type="cuda")
    t = torch.arange(64.0).reshape(8, 8)
    x = fd.distribute_tensor(t, mesh, fd.P("x", "y"))
    y = fd.redistribute(x, fd.P("y", "x"))
    assert y.to_local(device=1).device.type == "cuda"
    torch.testing.assert_close(y.full_tensor().cpu(), t)


def test_random_draws_on_cuda_equal_the_cpu_draws():
    """Integer and uniform draws are the same bits on CUDA (integer ops and exact conversions);
    the normal's polynomials use only correctly rounded ``+ - * /``, so its bits agree too."""
    key = fd.random.key(7)
    for device in ("cpu", "cuda"):
        mesh = fd.simulated_mesh((2, 2), ("x", "y"), device_type=device)
        draws = [
            fd.random.uniform(key, (9, 7), mesh=mesh, placements=fd.P("x", "y")),
            fd.random.normal(key, (9, 7), torch.float64, mesh=mesh, placements=fd.P(None, ("y", "x"))),
            fd.random.normal(key, (9, 7), mesh=mesh, placements=fd.P("y")),
            fd.random.randint(key, (9, 7), -3, 50, mesh=mesh, placements=fd.P("x")),
        ]
        values = [d.full_tensor().cpu() for d in draws]
        if device == "cpu":
            expected = values
    for got, want in zip(values, expected, strict=True):
        assert torch.equal(got, want)
    local = fd.random.normal(key.cuda(), (5, 3))
    assert local.device.type == "cuda" and torch.equal(local.cpu(), fd.random.normal(key, (5, 3)))
