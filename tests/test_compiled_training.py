"""``torch.compile`` of global ops and of a sharded module's training step, on both backends:
compiled values and gradients equal the eager ones, with no graph break under
``fullgraph=True``, and a call with a new size compiles again (Dynamo makes a size that changed
dynamic; the library's decisions take it as a constant, guarded).

The optimizer step compiles as torch's own does: with the graph breaks ``torch.optim`` puts
around its update (no ``fullgraph``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import assert_close
from torch import nn

import functional_dtensor as fd

COMPILER = "aot_eager"


def global_ops(t: torch.Tensor, w: torch.Tensor, mesh) -> torch.Tensor:
    """Global ops whose decisions depend on sizes: a reshape by the value's own sizes, a
    concatenation of a list and of a tuple (inside ``fd.implicit_replication``: Dynamo looks
    for fd.DTensor inside lists, not tuples), slices, a maximum with its gradient, a matmul, a
    plain tensor replicated."""
    x = fd.distribute_tensor(t, mesh, fd.P("x"))
    rows, cols = x.shape
    y = torch.cat([torch.sin(x), x], dim=1).reshape(rows, 2, cols).sum(1)
    with fd.implicit_replication():
        y = torch.cat((y[..., : cols // 2], y[..., cols // 2 :] * torch.ones(cols - cols // 2)), dim=-1)
    top = torch.amax(y, 1, keepdim=True)
    w = fd.distribute_tensor(w, mesh, fd.P())
    return torch.matmul(torch.sub(y, top), w).square().mean().full_tensor()


def job_global_ops(mesh) -> list[dict]:
    """For two sizes of the sharded dim (the second compiles again, the size made dynamic): the
    value and the gradients, eager and compiled."""
    torch._dynamo.reset()
    compiled = torch.compile(global_ops, fullgraph=True, backend=COMPILER)
    w = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3).requires_grad_()
    found = []
    for rows in (4, 8):
        t = torch.linspace(-2, 2, rows * 5, dtype=torch.float64).reshape(rows, 5).requires_grad_()
        each = {}
        for run, fn in (("eager", global_ops), ("compiled", compiled)):
            out = fn(t, w, mesh)
            each[run] = (out.detach(), *torch.autograd.grad(out, (t, w)))
        found.append(each)
    return found


@pytest.mark.meshes((2,), slow=("gloo-2",))
def test_compiled_global_ops_compile_again_for_a_new_size(backend, mesh):
    for got in backend.run(job_global_ops, mesh.shape, mesh.names, timeout=300):
        for rows, each in zip((4, 8), got, strict=True):
            assert_close(each["compiled"], each["eager"], msg=lambda m, r=rows: f"{r} rows: {m}")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = Block()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


PLAN = {
    "body.up": fd.ColwiseParallel(),
    "body.down": fd.RowwiseParallel(),
    "body": fd.FullyShard("dp"),
    ("norm", "head"): fd.FullyShard("dp"),  # one unit of two modules, as torchtitan groups them
}


def job_module(mesh) -> dict:
    """A tensor-parallel and fully-sharded model: the loss and gradients of ``apply``, eager and
    compiled (fullgraph), for two batch sizes; then one optimizer step, eager and compiled."""
    torch._dynamo.reset()
    model = Model().double()
    sharded = fd.parallelize_module(model, mesh, PLAN)
    params = sharded.params

    def loss_of(params, x):
        return sharded.apply(params, x).square().mean()

    compiled = torch.compile(loss_of, fullgraph=True, backend=COMPILER)
    found: dict = {"steps": []}
    grads = None
    for rows in (4, 8):
        t = torch.linspace(-1, 1, rows * 8, dtype=torch.float64).reshape(rows, 8)
        x = fd.distribute_tensor(t, mesh, fd.P("dp"))
        each = {}
        for run, fn in (("eager", loss_of), ("compiled", compiled)):
            loss = fn(params, x)
            grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
            each[run] = (loss.full_tensor().detach(), {n: g.full_tensor() for n, g in grads.items()})
        found["steps"].append(each)
    for run in ("eager", "compiled"):
        opt = fd.Optimizer(torch.optim.AdamW, params, lr=1e-2)
        step = opt.step if run == "eager" else torch.compile(opt.step, backend=COMPILER)
        found[run] = {n: p.full_tensor() for n, p in step(params, grads).items()}
    # new parameters (an optimizer step's) of the same shapes run the graphs compiled already
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(opt.step(params, grads), x)
    found["graphs compiled for new parameters"] = (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    )
    return found


@pytest.mark.meshes((2, 2), slow=("gloo-4",))
def test_a_compiled_training_step_equals_the_eager_one(backend, mesh):
    for got in backend.run(job_module, (2, 2), ("dp", "tp"), timeout=400):
        for rows, each in zip((4, 8), got["steps"], strict=True):
            assert_close(each["compiled"], each["eager"], msg=lambda m, r=rows: f"{r} rows: {m}")
        # compiled, torch's AdamW computes its bias corrections from a step counter in the
        # default dtype (float32; eagerly a Python float): float32's tolerance, as for
        # torch.compile(opt.step) of a plain float64 module
        assert_close(
            got["compiled"], got["eager"], dtypes=(torch.float32,), msg=lambda m: f"optimizer step: {m}"
        )
        assert got["graphs compiled for new parameters"] == 0


def job_whole_step(mesh) -> dict:
    """Three training steps (forward, ``torch.autograd.grad``, AdamW), eager and with the whole
    step compiled (no fullgraph: Dynamo breaks the graph at the gradient call and around the
    optimizer's update, as for torch's own modules): losses and final parameters."""
    torch._dynamo.reset()
    model = Model().double()
    sharded = fd.parallelize_module(model, mesh, PLAN)
    found = {}
    for run in ("eager", "compiled"):
        params = sharded.params
        opt = fd.Optimizer(torch.optim.AdamW, params, lr=1e-2)

        def step(params, x, opt=opt):
            loss = sharded.apply(params, x).square().mean()
            grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
            return loss.full_tensor(), opt.step(params, grads)

        if run == "compiled":
            step = torch.compile(step, backend=COMPILER)
        losses = []
        for k in range(3):
            t = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(4, 8) * (k + 1)
            loss, params = step(params, fd.distribute_tensor(t, mesh, fd.P("dp")))
            losses.append(loss.detach())
        found[run] = (losses, {n: p.full_tensor() for n, p in params.items()})
    return found


@pytest.mark.slow
@pytest.mark.meshes((2, 2))
def test_a_whole_compiled_training_step_equals_the_eager_one(backend, mesh):
    for got in backend.run(job_whole_step, (2, 2), ("dp", "tp"), timeout=400):
        # float32's tolerance: compiled AdamW's step counter (see the test above)
        assert_close(got["compiled"], got["eager"], dtypes=(torch.float32,))


def test_compiled_ops_the_simulated_mesh_runs_device_by_device():
    """Regression: a global op the simulated mesh runs device by device (a softmax of uneven
    blocks; a layer norm of blocks large enough for torch's fused kernel once per device) failed
    to compile (Dynamo traced optree's flattening of the keywords' dict). Compiled with
    ``fullgraph``, values and gradients equal the eager ones."""
    torch._dynamo.reset()
    mesh = fd.simulated_mesh(2, "x")
    uneven = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)
    large = torch.linspace(-2, 2, 2 * 128 * 128, dtype=torch.float64).reshape(2, 128, 128).sin()
    weight = torch.linspace(0.5, 1.5, 128, dtype=torch.float64)

    def loss_of(u, t, w):
        u, t = fd.distribute_tensor(u, mesh, fd.P("x")), fd.distribute_tensor(t, mesh, fd.P("x"))
        w = fd.distribute_tensor(w, mesh, fd.P())
        normalized = F.layer_norm(t, (128,), w)
        return (torch.softmax(u, -1).square().sum() + normalized.square().mean()).full_tensor()

    found = {}
    compiled = torch.compile(loss_of, fullgraph=True, backend=COMPILER)
    for run, fn in (("eager", loss_of), ("compiled", compiled)):
        leaves = [x.clone().requires_grad_() for x in (uneven, large, weight)]
        loss = fn(*leaves)
        found[run] = (loss.detach(), torch.autograd.grad(loss, leaves))
    assert_close(found["compiled"], found["eager"])


def test_a_compiled_fully_sharded_step_compiles_again_for_new_parameter_shapes():
    """Regression: compiled again for parameters of new shapes (Dynamo makes their sizes
    symbolic), a fully-sharded unit's backward sorted its gradients' dims by their strides for
    the reduce-scatter, which Dynamo cannot do with symbolic strides. Three widths, values and
    gradients equal the eager ones."""
    torch._dynamo.reset()
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    plan = {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel(), "": fd.FullyShard("dp")}

    def loss_of(sharded, params, x):
        return sharded.apply(params, x).square().mean().full_tensor()

    compiled = torch.compile(loss_of, fullgraph=True, backend=COMPILER)
    x = fd.distribute_tensor(torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(4, 8), mesh, fd.P("dp"))
    for width in (16, 32, 48):
        model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 8)).double()
        sharded = fd.parallelize_module(model, mesh, plan)
        found = {}
        for run, fn in (("eager", loss_of), ("compiled", compiled)):
            loss = fn(sharded, sharded.params, x)
            grads = torch.autograd.grad(loss, list(sharded.params.values()))
            found[run] = (loss.detach(), [g.full_tensor() for g in grads])
        assert_close(found["compiled"], found["eager"], msg=lambda m, w=width: f"width {w}: {m}")
