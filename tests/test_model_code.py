"""Model code as the ecosystem writes it, on sharded modules: outputs in any container (a
transformers ``ModelOutput`` is an ``OrderedDict`` and a dataclass), plain tensors made inside
the forward (positions, masks) taken as replicated, plans with transformers' strings, and
``PrepareModuleInput`` with keyword inputs, checked as torch checks them.

Gradients are compared with one device's, not only values: a constant factor on every gradient
(each tensor-parallel replica's contribution summed once too often) hides behind AdamW.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch
from common import assert_close
from torch import nn

import functional_dtensor as fd

R, S = fd.Replicate(), fd.Shard


class DictOutput(collections.OrderedDict):
    """A ``ModelOutput``-like container: an ``OrderedDict`` subclass."""


@dataclasses.dataclass
class DataOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class TupleOutput(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class MLP(nn.Module):
    """Positions made inside the forward (a plain tensor) meet the sharded activations; the
    output is one of the containers."""

    def __init__(self, container: str):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.container = container

    def forward(self, x):
        positions = torch.arange(x.shape[-1], dtype=x.dtype) / 8.0  # plain: the same everywhere
        logits = self.down(torch.relu(self.up(x + positions)))
        loss = (logits * logits).mean()
        if self.container == "dict":
            return DictOutput(loss=loss, logits=logits)
        if self.container == "dataclass":
            return DataOutput(loss, logits)
        return TupleOutput(loss, logits)


PLANS = {
    "fd styles": {"up": fd.ColwiseParallel(), "down": fd.RowwiseParallel()},
    "transformers' strings": {"up": "colwise", "down": "rowwise"},
}


def _reference(container: str):
    torch.manual_seed(0)
    model = MLP(container).double()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = model(x)
    loss = out["loss"] if container == "dict" else out.loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return model, x, loss.detach(), dict(zip([n for n, _ in model.named_parameters()], grads))


def job_containers(mesh, container: str, plan_name: str):
    model, x, _, _ = _reference(container)
    sharded = fd.parallelize_module(model, mesh, PLANS[plan_name])
    out = sharded.apply(sharded.params, fd.distribute_tensor(x, mesh, fd.P("dp")))
    assert type(out) is type(model(x))  # the container comes back as it was
    loss = out["loss"] if container == "dict" else out.loss
    grads = torch.autograd.grad(loss, list(sharded.params.values()))
    return loss.full_tensor().detach(), {n: g.full_tensor() for n, g in zip(sharded.params, grads)}


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize("container", ["dict", "dataclass", "namedtuple"])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_outputs_in_any_container_give_one_devices_gradients(backend, mesh, container, plan_name):
    _, _, loss, grads = _reference(container)
    for got_loss, got_grads in backend.run(job_containers, (2, 2), ("dp", "tp"), container, plan_name):
        assert_close(got_loss, loss)
        for name, grad in grads.items():
            assert_close(got_grads[name], grad, msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_plan_strings_lay_out_as_the_styles_they_name():
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    by_strings = fd.parallelize_module(MLP("dict"), mesh, PLANS["transformers' strings"])
    by_styles = fd.parallelize_module(MLP("dict"), mesh, PLANS["fd styles"])
    assert {n: p.spec for n, p in by_strings.params.items()} == {
        n: p.spec for n, p in by_styles.params.items()
    }
    one_axis = fd.simulated_mesh(2, "model")  # a mesh of one axis: the strings shard over it
    sharded = fd.parallelize_module(MLP("dict"), one_axis, {"up": "colwise_gather_output"})
    assert sharded.params["up.weight"].placements == (S(0),)
    with pytest.raises(fd.InputTypeError, match="packed"):
        fd.parallelize_module(MLP("dict"), mesh, {"up": "packed_colwise"})
    with pytest.raises(fd.InputTypeError, match="tensor-parallel axis"):
        fd.parallelize_module(MLP("dict"), fd.simulated_mesh((2, 2), ("a", "b")), {"up": "colwise"})


def test_plain_tensors_are_replicated_inside_a_sharded_forward_and_refused_outside():
    mesh = fd.simulated_mesh(2, "x")
    x = fd.distribute_tensor(torch.ones(4, 3), mesh, fd.P("x"))
    with pytest.raises(fd.InputTypeError, match="implicit_replication"):
        x + torch.arange(3.0)
    leaf = torch.arange(3.0, requires_grad=True)
    with fd.implicit_replication():
        y = x * leaf
    assert y.placements == (S(0),)
    (grad,) = torch.autograd.grad(y.full_tensor().sum(), leaf)
    assert torch.equal(grad, torch.full((3,), 4.0))  # four rows, as on one device
    with pytest.raises(fd.InputTypeError):  # the scope ends
        x + torch.arange(3.0)


SEEN: dict = {}


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, *, mask):
        if isinstance(x, fd.DTensor):
            SEEN.update(x=x.placements, mask=mask.placements)
        return self.proj(x) * mask


def test_prepare_module_input_lays_out_keyword_inputs_and_checks_arity():
    mesh = fd.simulated_mesh(2, "tp")
    torch.manual_seed(0)
    module = Masked()
    x, mask = torch.randn(4, 4), (torch.arange(4) % 2).float()
    style = fd.PrepareModuleInput(
        input_layouts=(R,),
        desired_input_layouts=(S(0),),
        input_kwarg_layouts={"mask": R},
        desired_input_kwarg_layouts={"mask": S(0)},
    )
    sharded = fd.parallelize_module(module, mesh, {"": style})
    out = sharded.apply(sharded.params, fd.distribute_tensor(x, mesh, fd.P()), mask=mask)
    assert SEEN == {"x": (S(0),), "mask": (S(0),)}
    assert_close(out.full_tensor(), module(x, mask=mask))
    with pytest.raises(fd.InputTypeError, match="positional inputs"):
        sharded.apply(sharded.params, x, x, mask=mask)
    with pytest.raises(fd.InputTypeError, match="one per input layout"):
        fd.PrepareModuleInput(input_layouts=(R, R), desired_input_layouts=(S(0),))
    with pytest.raises(fd.InputTypeError, match="keyword inputs"):
        fd.PrepareModuleInput(input_kwarg_layouts={"mask": R}, desired_input_kwarg_layouts={"m": R})
    assert fd.ColwiseParallel(use_local_output=True).use_local_output  # taken, as in torch


class Stack(nn.Module):
    """A body, then a norm and a head that torchtitan shards as one FSDP unit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 6)

    def forward(self, x):
        return self.output(self.norm(self.body(x)))


def job_unit_of_modules(mesh, grouped: bool) -> dict:
    model = Stack().double()
    unit = {("norm", "output"): fd.FullyShard("dp")}
    if not grouped:
        unit = {"norm": fd.FullyShard("dp"), "output": fd.FullyShard("dp")}
    sharded = fd.parallelize_module(model, mesh, {"body": fd.FullyShard("dp"), **unit})
    x = fd.distribute_tensor(torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(4, 8), mesh, fd.P("dp"))
    with fd.CommDebugMode() as comm:
        loss = sharded.apply(sharded.params, x).square().sum()
        grads = torch.autograd.grad(loss, list(sharded.params.values()))
    return {
        "loss": loss.full_tensor(),
        "grads": {n: g.full_tensor() for n, g in zip(sharded.params, grads)},
        "counts": comm.get_comm_counts(),
        "layouts": {n: p.placements for n, p in sharded.params.items()},
    }


@pytest.mark.meshes((2,))
def test_a_fully_sharded_unit_of_several_modules_gathers_them_together(backend, mesh):
    """``("norm", "output"): fd.FullyShard("dp")`` (torch's ``fully_shard([norm, output])``):
    both modules' parameters sharded, gathered in one all-gather when the first of them runs,
    their gradients reduce-scattered in one collective; one device's loss and gradients."""
    model = Stack().double()
    x = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(4, 8)
    want_loss = model(x).square().sum()
    want = dict(zip(dict(model.named_parameters()), torch.autograd.grad(want_loss, list(model.parameters()))))
    for grouped, gathers in ((True, 2), (False, 3)):
        for got in backend.run(job_unit_of_modules, mesh.shape, ("dp",), grouped):
            assert_close(got["loss"], want_loss)
            assert_close(got["grads"], want)
            assert got["layouts"]["output.weight"] == (fd.Shard(0),)
            assert got["counts"]["all_gather"] == gathers
            assert got["counts"]["reduce_scatter"] == gathers


def test_a_unit_of_several_modules_takes_fully_shard_alone_and_names_modules_that_exist():
    mesh = fd.simulated_mesh((2,), ("dp",))
    with pytest.raises(fd.InputTypeError, match=r"one fully-sharded unit.*expected fd.FullyShard"):
        fd.parallelize_module(Stack(), mesh, {("norm", "output"): fd.ColwiseParallel(axis="dp")})
    with pytest.raises(fd.LayoutError, match="the pattern matches no module.*'head'"):
        fd.parallelize_module(Stack(), mesh, {("norm", "head"): fd.FullyShard("dp")})
    with pytest.raises(fd.InputTypeError, match="plan keys are module names"):
        fd.parallelize_module(Stack(), mesh, {("norm", 3): fd.FullyShard("dp")})
