"""The training ecosystem around sharded values: ``torch.optim.lr_scheduler`` schedulers driving
``fd.Optimizer``, and backpropagation from an ``fd.DTensor`` with a gradient that is itself an
``fd.DTensor`` of any layout (``y.backward(g)``, ``torch.autograd.backward``,
``torch.autograd.grad``).

Each job runs on the simulated mesh and on gloo ranks and computes in float64; the test compares
what came back with plain torch on one device (a torch AdamW driven by the same scheduler, the
same function's gradients).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from common import assert_close
from torch.optim import lr_scheduler

import functional_dtensor as fd
from functional_dtensor import checkpoint as ckpt

# ---------------------------------------------------------------------------------------------
# Learning-rate schedulers

STEPS, RESUME = 6, 3
OPTIONS = {"lr": 0.05, "weight_decay": 0.1}
SHAPES = {"w": (7, 6), "b": (5,), "v": (3, 5)}  # uneven over 4 devices

SCHEDULES = {
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1),  # betas too
    "LinearLR": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4),
    "SequentialLR": lambda opt: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2), lr_scheduler.ExponentialLR(opt, 0.8)],
        milestones=[2],
    ),
    "ReduceLROnPlateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}


def initial() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {k: torch.randn(s, generator=generator, dtype=torch.float64) for k, s in SHAPES.items()}


def gradients(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(s, generator=generator, dtype=torch.float64) for k, s in SHAPES.items()}


def advance(scheduler) -> None:
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
        scheduler.step(1.0)  # a loss that does not improve: the rate falls every step
    else:
        scheduler.step()


def specs(mesh: fd.DeviceMesh, resumed: bool) -> dict[str, fd.P]:
    first, last = mesh.axis_names[0], mesh.axis_names[-1]
    if resumed:  # another layout of every parameter
        return {"w": fd.P(None, mesh.axis_names), "b": fd.P(last), "v": fd.P(first)}
    return {"w": fd.P(first), "b": fd.P(), "v": fd.P(None, last)}


def job_schedules(mesh, names: list[str]) -> dict:
    """Every schedule: ``STEPS`` steps of fd.Optimizer(AdamW) under it, resumed at ``RESUME``
    into a fresh optimizer and scheduler (over another layout) from their state dicts."""
    out = {}
    for name in names:
        layouts = specs(mesh, resumed=False)
        params = {k: fd.distribute_tensor(t, mesh, layouts[k]) for k, t in initial().items()}
        opt = fd.Optimizer(torch.optim.AdamW, params, **OPTIONS)
        scheduler = SCHEDULES[name](opt)
        lrs = []
        with warnings.catch_warnings():
            # the scheduler sees each opt.step: it would warn of a scheduler step before one
            warnings.simplefilter("error")
            for step in range(STEPS):
                if step == RESUME:
                    saved = copy.deepcopy((opt.state_dict(), scheduler.state_dict()))
                    layouts = specs(mesh, resumed=True)
                    params = {k: fd.redistribute(v, layouts[k]) for k, v in params.items()}
                    opt = fd.Optimizer(torch.optim.AdamW, params, **OPTIONS)
                    scheduler = SCHEDULES[name](opt)
                    opt.load_state_dict(saved[0])
                    scheduler.load_state_dict(saved[1])
                grads = {k: fd.distribute_tensor(g, mesh, fd.P()) for k, g in gradients(step).items()}
                params = opt.step(params, grads)
                advance(scheduler)
                lrs.append((float(scheduler.get_last_lr()[0]), float(opt.param_groups[0]["lr"])))
        out[name] = {
            "params": {k: v.full_tensor() for k, v in params.items()},
            "lrs": lrs,
            "betas": tuple(opt.param_groups[0]["betas"]),
            "layouts": {k: v.spec for k, v in params.items()},
        }
    return out


def one_device(name: str) -> dict:
    """torch's AdamW on one device, under the same schedule, without interruption."""
    params = {k: t.clone().requires_grad_() for k, t in initial().items()}
    opt = torch.optim.AdamW(list(params.values()), **OPTIONS)
    scheduler = SCHEDULES[name](opt)
    lrs = []
    for step in range(STEPS):
        for k, g in gradients(step).items():
            params[k].grad = g.clone()
        opt.step()
        advance(scheduler)
        lrs.append((float(scheduler.get_last_lr()[0]), float(opt.param_groups[0]["lr"])))
    return {
        "params": {k: v.detach() for k, v in params.items()},
        "lrs": lrs,
        "betas": tuple(opt.param_groups[0]["betas"]),
    }


@pytest.mark.meshes((4,), (2, 2))
def test_lr_schedulers_drive_fd_optimizer_as_a_torch_optimizer(backend, mesh):
    """Each scheduler of torch's gives the learning rates, and the parameters, of torch's AdamW
    under it on one device, resumed halfway from the state dicts of both onto another layout."""
    answers = backend.run(job_schedules, mesh.shape, mesh.names, list(SCHEDULES), timeout=120)
    for name in SCHEDULES:
        want = one_device(name)
        assert len({lr for lr, _ in want["lrs"]}) > 1, name  # the schedule changes the rate
        for got in answers:
            assert got[name]["lrs"] == want["lrs"], name
            assert got[name]["betas"] == want["betas"], name
            assert_close(got[name]["params"], want["params"], msg=name)
            assert got[name]["layouts"] == specs(mesh.simulated(), resumed=True), name


def test_fd_optimizer_is_a_torch_optimizer_over_its_shards():
    mesh = fd.simulated_mesh(2, "x")
    params = {"w": fd.ones(4, 2, mesh=mesh, placements=fd.P("x"))}
    opt = fd.Optimizer(torch.optim.SGD, params, lr=1.0)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups and opt.defaults["lr"] == 1.0
    seen = []
    # a step hook sees the step's arguments (after the optimizer): the parameters and gradients
    opt.register_step_post_hook(lambda optimizer, args, kwargs: seen.append([list(a) for a in args[1:]]))
    opt.param_groups[0]["lr"] = 0.5  # what a scheduler does: the next step reads it
    grads = {"w": fd.ones(4, 2, mesh=mesh, placements=fd.P())}
    params = opt.step(params, grads)
    assert params["w"].full_tensor().eq(0.5).all() and seen == [[["w"], ["w"]]]
    twin = copy.deepcopy(opt)  # a copy steps on its own
    assert twin.step(params, grads)["w"].full_tensor().eq(0.0).all()
    assert opt.step(params, grads)["w"].full_tensor().eq(0.0).all()
    with pytest.raises(fd.InputTypeError, match=r"add_param_group.*whole pytree"):
        opt.add_param_group({"params": [torch.zeros(2)]})


def test_a_scheduled_run_resumes_from_a_checkpoint(tmp_path):
    """The optimizer's state (its groups' ``initial_lr`` included) and the scheduler's go through
    fd.checkpoint; a fresh optimizer's ``state_template`` is the ``like`` of the saved state."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    make = SCHEDULES["OneCycleLR"]
    layouts = specs(mesh, resumed=False)
    params = {k: fd.distribute_tensor(t, mesh, layouts[k]) for k, t in initial().items()}
    opt = fd.Optimizer(torch.optim.AdamW, params, **OPTIONS)
    scheduler = make(opt)
    for step in range(STEPS):
        if step == RESUME:
            state = {"params": params, "optim": opt.state_dict(), "scheduler": scheduler.state_dict()}
            ckpt.save(tmp_path / "ckpt", state)
            fresh = {
                k: fd.zeros(SHAPES[k], dtype=torch.float64, mesh=mesh, placements=fd.P()) for k in SHAPES
            }
            opt = fd.Optimizer(torch.optim.AdamW, fresh, **OPTIONS)
            scheduler = make(opt)
            like = {"params": fresh, "optim": opt.state_template(), "scheduler": scheduler.state_dict()}
            assert "initial_lr" in like["optim"]["param_groups"][0]
            loaded = ckpt.load(tmp_path / "ckpt", like)
            opt.load_state_dict(loaded["optim"])
            scheduler.load_state_dict(loaded["scheduler"])
            params = loaded["params"]
        grads = {k: fd.distribute_tensor(g, mesh, fd.P()) for k, g in gradients(step).items()}
        params = opt.step(params, grads)
        scheduler.step()
    want = one_device("OneCycleLR")
    assert_close({k: v.full_tensor() for k, v in params.items()}, want["params"])
    assert float(scheduler.get_last_lr()[0]) == want["lrs"][-1][0]


# ---------------------------------------------------------------------------------------------
# Backpropagation with fd.DTensor gradients


def function(w: torch.Tensor, m: torch.Tensor) -> tuple:
    """Two outputs of ``w`` (6, 4) with every kind of dependence: elementwise, a reduction, a
    matmul. Plain torch and global ops alike."""
    y = torch.tanh(w) * w + w.sum(0)
    z = (w @ m).sin()
    return y, z


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = {"w": (6, 4), "m": (4, 3), "gy": (6, 4), "gy2": (6, 4), "gz": (6, 3)}
    return {k: torch.randn(s, generator=generator, dtype=torch.float64) for k, s in shapes.items()}


def gradient_layouts(mesh: fd.DeviceMesh) -> list:
    first, last = mesh.axis_names[0], mesh.axis_names[-1]
    partial = [fd.Partial()] + [fd.Replicate()] * (mesh.ndim - 1)  # a sum of parts
    return [fd.P(None, last), fd.P(mesh.axis_names), partial, fd.P(first)]


def job_backward(mesh) -> dict:
    """``.grad`` after each way of backpropagating with fd.DTensor gradients of other layouts
    than the outputs', accumulated as torch accumulates; and ``torch.autograd.grad``'s."""
    t = inputs()
    first = mesh.axis_names[0]
    layouts = gradient_layouts(mesh)
    # a leaf whose value is w: zeros that need a gradient, plus w
    leaf = fd.zeros(6, 4, dtype=torch.float64, mesh=mesh, placements=fd.P(first), requires_grad=True)
    w = leaf + fd.distribute_tensor(t["w"], mesh, fd.P(first))
    m = fd.distribute_tensor(t["m"], mesh, fd.P())
    y, z = function(w, m)
    gy = fd.distribute_tensor(t["gy"], mesh, layouts[0])
    gy2 = fd.distribute_tensor(t["gy2"], mesh, layouts[1])
    gz = fd.distribute_tensor(t["gz"], mesh, layouts[2])
    out = {}
    y.backward(gy, retain_graph=True)
    out["backward"] = leaf.grad.full_tensor()
    torch.autograd.backward(y, gy2, retain_graph=True)  # accumulates
    out["autograd.backward"] = leaf.grad.full_tensor()
    torch.autograd.backward([y, z], [gy, gz], retain_graph=True, inputs=[leaf])
    out["two outputs"] = leaf.grad.full_tensor()
    (g,) = torch.autograd.grad(z, [leaf], fd.distribute_tensor(t["gz"], mesh, layouts[3]))
    out["autograd.grad"] = g.full_tensor()
    out["layout"] = str(leaf.grad.sharding)
    return out


def job_backward_errors(mesh) -> list[str]:
    leaf = fd.zeros(
        6, 4, dtype=torch.float64, mesh=mesh, placements=fd.P(mesh.axis_names[0]), requires_grad=True
    )
    y = leaf * 2
    wrong = fd.ones(4, 6, dtype=torch.float64, mesh=mesh, placements=fd.P())
    messages = []
    for call in (lambda: y.backward(wrong), lambda: torch.autograd.backward([y], [wrong])):
        try:
            call()
        except fd.ShapeError as error:
            messages.append(str(error))
    return messages


def backward_reference() -> dict:
    t = inputs()
    w = t["w"].clone().requires_grad_()
    y, z = function(w, t["m"])
    out = {}
    y.backward(t["gy"], retain_graph=True)
    out["backward"] = w.grad.clone()
    torch.autograd.backward(y, t["gy2"], retain_graph=True)
    out["autograd.backward"] = w.grad.clone()
    torch.autograd.backward([y, z], [t["gy"], t["gz"]], retain_graph=True, inputs=[w])
    out["two outputs"] = w.grad.clone()
    (out["autograd.grad"],) = torch.autograd.grad(z, [w], t["gz"])
    return out


@pytest.mark.meshes((4,), (2, 2))
def test_backward_with_fd_dtensor_gradients_of_any_layout(backend, mesh):
    want = backward_reference()
    for got in backend.run(job_backward, mesh.shape, mesh.names):
        layout = got.pop("layout")
        assert_close(got, want, terms=mesh.size)  # sums over shards, in another order
        assert layout == f"{str(fd.Shard(0))}{'R' * (len(mesh.shape) - 1)}"  # .grad laid out like the value
    for messages in backend.run(job_backward_errors, mesh.shape, mesh.names):
        assert len(messages) == 2, messages
        assert "fd.DTensor.backward(gradient)" in messages[0]
        assert "torch.autograd.backward(grad_tensors[0])" in messages[1]
        assert all("expected shape (6, 4), got shape (4, 6)" in m and "Fix:" in m for m in messages)


def test_autograd_backward_has_a_rule_of_its_own():
    """``torch.autograd.backward`` on fd.DTensor has a handler (not the fallback of ops without
    a rule, which strict mode refuses), and takes a plain tensor of the global shape as a
    gradient, as ``y.backward`` does."""
    mesh = fd.simulated_mesh(2, "x")
    leaf = fd.zeros(4, 2, mesh=mesh, placements=fd.P("x"), requires_grad=True)
    y = leaf * 3
    with fd.strict_ops():
        torch.autograd.backward(
            [y], [fd.ones(4, 2, mesh=mesh, placements=fd.P(None, "x"))], retain_graph=True
        )
    torch.autograd.backward(y, torch.ones(4, 2))
    assert leaf.grad.full_tensor().eq(6).all()


def test_autograd_grad_takes_its_arguments_by_position_or_name():
    """``torch.autograd.grad`` on fd.DTensor reads its arguments as torch does, however they are
    passed; an unknown keyword is torch's TypeError."""
    mesh = fd.simulated_mesh(2, "x")
    leaf = fd.distribute_tensor(torch.arange(4.0).requires_grad_(), mesh, fd.P("x"))
    y = leaf * leaf
    cotangent = fd.ones(4, mesh=mesh, placements=fd.P())
    calls = [
        lambda: torch.autograd.grad(y, leaf, cotangent, True),
        lambda: torch.autograd.grad(y, [leaf], grad_outputs=[cotangent], retain_graph=True),
        lambda: torch.autograd.grad(outputs=y, inputs=(leaf,), grad_outputs=cotangent, retain_graph=True),
        lambda: torch.autograd.grad(y.sum(), leaf, retain_graph=True, create_graph=False),
    ]
    for call in calls:
        (grad,) = call()
        assert torch.equal(grad.full_tensor(), 2 * torch.arange(4.0))
        assert grad.placements == leaf.placements
    with pytest.raises(TypeError, match="retian_graph"):
        torch.autograd.grad(y.sum(), leaf, retian_graph=True)


def test_backward_from_a_leaf_keeps_its_value_its_gradient_and_the_one_passed_in_apart():
    """Backpropagating from a leaf whose global value is its storage or a view of it (an even
    split) reads that storage without copying it; the gradient passed in is copied (autograd
    may keep the tensor it is given as ``.grad`` and accumulate into it later): the leaf's
    value, the gradient passed in and ``.grad`` stay three values, accumulated as torch
    accumulates."""
    for mesh in (fd.simulated_mesh(2, "x"), fd.simulated_mesh((2, 2), ("a", "b"))):
        for placements in (fd.P(), fd.P(mesh.axis_names[0]), fd.P(mesh.axis_names)):
            leaf = fd.ones(4, mesh=mesh, placements=placements, requires_grad=True)
            gradient = fd.full((4,), 2.0, mesh=mesh, placements=placements)
            leaf.backward(gradient)
            leaf.backward(gradient)
            torch.autograd.backward([leaf], [gradient])
            assert torch.equal(leaf.grad.full_tensor(), torch.full((4,), 6.0)), placements
            assert torch.equal(gradient.full_tensor(), torch.full((4,), 2.0)), placements
            assert torch.equal(leaf.full_tensor(), torch.ones(4)), placements
