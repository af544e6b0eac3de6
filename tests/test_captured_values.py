"""Values the per-device function did not get through its specs: closures, arguments passed
through with a None spec, module parameters, constants; and functions with no inputs."""

from __future__ import annotations

import pytest
import torch

import functional_dtensor as fd

mesh = fd.simulated_mesh(4, "x")


@pytest.mark.parametrize("check_rep", [True, False])
def test_closure_gradient_is_the_global_gradient(check_rep):
    s = torch.tensor(2.0, requires_grad=True)
    f = fd.shard_map(lambda v: v * s, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"), check_rep=check_rep)
    f(torch.arange(8.0)).full_tensor().sum().backward()
    assert s.grad.item() == 28.0


@pytest.mark.parametrize("check_rep", [True, False])
def test_pass_through_argument_and_module_parameters(check_rep):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    scale = torch.tensor(1.5, requires_grad=True)
    x = torch.randn(8, 3)
    f = fd.shard_map(
        lambda v, k: layer(v) * k,
        mesh=mesh,
        in_specs=(fd.P("x"), None),
        out_specs=fd.P("x"),
        check_rep=check_rep,
    )
    got = torch.autograd.grad(f(x, scale).full_tensor().square().sum(), (layer.weight, layer.bias, scale))
    want = torch.autograd.grad((layer(x) * scale).square().sum(), (layer.weight, layer.bias, scale))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("check_rep", [True, False])
def test_replicated_output_computed_from_a_closure(check_rep):
    s = torch.tensor([1.0, 2.0], requires_grad=True)
    f = fd.shard_map(lambda v: s * 2, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P(), check_rep=check_rep)
    (g,) = torch.autograd.grad(f(torch.ones(4)).full_tensor().sum(), s)
    torch.testing.assert_close(g, torch.full((2,), 2.0))


def test_function_without_tensor_inputs():
    f = fd.shard_map(lambda: fd.axis_index("x").reshape(1), mesh=mesh, in_specs=(), out_specs=fd.P("x"))
    assert f().full_tensor().tolist() == [0, 1, 2, 3]
    g = fd.shard_map(
        lambda k: torch.full((1,), k) + fd.axis_index("x"), mesh=mesh, in_specs=None, out_specs=fd.P("x")
    )
    assert g(10).full_tensor().tolist() == [10, 11, 12, 13]


def test_transforms_inside_the_function_need_check_rep_off():
    inner = lambda v: torch.func.vmap(lambda r: r * 2)(v)  # noqa: E731
    f = fd.shard_map(inner, mesh=mesh, in_specs=fd.P(None, "x"), out_specs=fd.P(None, "x"))
    with pytest.raises(fd.FunctionalDTensorError, match="check_rep=False"):
        f(torch.ones(2, 4))
    x = torch.ones(2, 4, requires_grad=True)
    g = fd.shard_map(inner, mesh=mesh, in_specs=fd.P(None, "x"), out_specs=fd.P(None, "x"), check_rep=False)
    (grad,) = torch.autograd.grad(g(x).full_tensor().sum(), x)
    torch.testing.assert_close(grad, torch.full((2, 4), 2.0))
    h = fd.shard_map(
        lambda v: torch.func.grad(lambda t: fd.psum(t.sum(), "x"))(v),
        mesh=mesh,
        in_specs=fd.P("x"),
        out_specs=fd.P("x"),
        check_rep=False,
    )
    # unchecked, psum transposes to psum (as JAX with check_vma=False): each device's
    # gradient of the replicated total counts every device's copy
    torch.testing.assert_close(h(torch.randn(8)).full_tensor(), torch.full((8,), 4.0))
