"""Parameters replicated over a mesh axis are held once on the simulated mesh, as
``fd.parallelize_module`` lays them out and as each ``fd.Optimizer`` step gives them back: the
optimizer writes each distinct block once, their gradients come back
summed over the data-parallel axis straight into the held blocks, and a linear layer whose batch
is split over that axis runs one product per held block (the rows of the devices along it end
to end), or crossed: one product per outer position on the held blocks, the input stacked or
held once over the other axis (no block copied to the devices that share it). A fully-sharded
unit's parameters are gathered held once. Values, gradients (first and second order) and
communication equal one device's, the stacked form's and the distributed backend's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backends import events
from common import assert_close, held_at_any_size
from torch import nn

import functional_dtensor as fd
from functional_dtensor._dtensor import held_of
from functional_dtensor._simulated import batched, crossed, storage

#: (mesh shape, axis names, plan): tensor parallel over "tp" with data parallel over "dp"
#: (either order of the axes), and data parallel alone (every parameter replicated)
PLANS = {
    "dp-tp": ((2, 2), ("dp", "tp"), "tp"),
    "tp-dp": ((2, 2), ("tp", "dp"), "tp"),
    "dp": ((4,), ("dp",), None),
}
STEPS = 3


def model(hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 8)).double()


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(
        8, 8, generator=g, dtype=torch.float64
    )


def plan(tp: str | None) -> dict:
    styles = {"": fd.ReplicateParallel("dp")}
    if tp is not None:
        styles |= {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel()}
    return styles


def train_on_mesh(mesh, tp: str | None, held: bool) -> dict:
    """``STEPS`` steps of AdamW with clipping on the mesh: each step's loss, gradients,
    collectives and which parameters and gradients are held, and the last parameters."""
    out = {"losses": [], "grads": [], "comm": [], "held params": [], "held grads": []}
    with held_at_any_size() if held else _held_never():
        sharded = fd.parallelize_module(model(), mesh, plan(tp))
        params = sharded.params
        opt = fd.Optimizer(torch.optim.AdamW, params, lr=0.05)
        for step in range(STEPS):
            x, y = (fd.distribute_tensor(t, mesh, fd.P("dp")) for t in batch(step))
            with fd.CommDebugMode() as comm:
                loss = ((sharded.apply(params, x) - y) ** 2).mean()
                grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
            out["held params"].append(sorted(n for n, p in params.items() if held_of(p) is not None))
            out["held grads"].append(sorted(n for n, g in grads.items() if held_of(g) is not None))
            grads, _ = fd.clip_grad_norm(grads, 0.5)
            out["losses"].append(loss.full_tensor().detach())
            out["grads"].append({n: g.full_tensor() for n, g in grads.items()})
            out["comm"].append(events(comm))
            params = opt.step(params, grads)
    out["params"] = {n: p.full_tensor() for n, p in params.items()}
    return out


class _held_never:
    """Nothing held once (the stacked form throughout)."""

    def __enter__(self):
        self.before, storage.HELD_MIN_ELEMENTS = storage.HELD_MIN_ELEMENTS, float("inf")

    def __exit__(self, *exc):
        storage.HELD_MIN_ELEMENTS = self.before


def train_on_one_device() -> dict:
    one = model()
    opt = torch.optim.AdamW(one.parameters(), lr=0.05)
    out = {"losses": [], "grads": []}
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = ((one(x) - y) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(one.parameters(), 0.5)
        out["losses"].append(loss.detach())
        out["grads"].append({n: p.grad.clone() for n, p in one.named_parameters()})
        opt.step()
    out["params"] = {n: p.detach() for n, p in one.named_parameters()}
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_data_parallel_parameters_are_held_once_and_train_as_one_device(monkeypatch, name):
    shape, names, tp = PLANS[name]
    folded = []
    monkeypatch.setattr(batched, "folded_linear", _spy(batched.folded_linear, folded))
    got = train_on_mesh(fd.simulated_mesh(shape, names), tp, held=True)
    want = train_on_one_device()
    for key in ("losses", "grads", "params"):
        assert_close(got[key], want[key])
    # every parameter (as laid out, then as each step gives it) and gradient is held once:
    # each is replicated over "dp"
    everything = sorted(want["params"])
    assert got["held params"] == [everything] * STEPS
    assert got["held grads"] == [everything] * STEPS
    assert len(folded) == 2 * STEPS  # both linear layers of each step, folded
    # the same collectives as the stacked form's, step by step
    stacked = train_on_mesh(fd.simulated_mesh(shape, names), tp, held=False)
    assert got["comm"] == stacked["comm"]
    assert stacked["held params"] == [[]] * STEPS


def _spy(kernel, calls: list):
    def spied(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    return spied


def held_training_job(mesh, tp) -> dict:
    with held_at_any_size():
        got = train_on_mesh(mesh, tp, held=True)
    return {key: got[key] for key in ("losses", "grads", "params", "comm")}


@pytest.mark.meshes((2, 2))
def test_held_parameters_train_as_the_distributed_backend(backend, mesh):
    """A rank holds one block anyway: the same values, gradients and collectives."""
    results = backend.run(held_training_job, mesh.shape, ("dp", "tp"), "tp", timeout=120)
    expected = held_training_job(fd.simulated_mesh(mesh.shape, ("dp", "tp")), "tp")
    values = ("losses", "grads", "params")
    for result in results:
        assert_close({k: result[k] for k in values}, {k: expected[k] for k in values})
        assert result["comm"] == expected["comm"]


def test_a_second_derivative_through_held_parameters_equals_one_device():
    """A gradient penalty differentiates the data-parallel sum of held gradients again."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    with held_at_any_size():
        sharded = fd.parallelize_module(model(), mesh, plan("tp"))
        params = sharded.params
        opt = fd.Optimizer(torch.optim.SGD, params, lr=0.1)
        x, y = (fd.distribute_tensor(t, mesh, fd.P("dp")) for t in batch(0))
        loss = ((sharded.apply(params, x) - y) ** 2).mean()
        params = opt.step(params, dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
        assert all(held_of(p) is not None for p in params.values())
        with fd.CommDebugMode() as comm:
            loss = ((sharded.apply(params, x) - y) ** 2).mean()
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            penalty = sum((g**2).sum() for g in grads)
            second = torch.autograd.grad(penalty, list(params.values()))
    one = model()
    with torch.no_grad():
        for n, p in one.named_parameters():
            p.copy_(params[n].full_tensor())
    x, y = batch(0)
    want_loss = ((one(x) - y) ** 2).mean()
    want_grads = torch.autograd.grad(want_loss, list(one.parameters()), create_graph=True)
    want_second = torch.autograd.grad(sum((g**2).sum() for g in want_grads), list(one.parameters()))
    assert_close([g.full_tensor() for g in grads], list(want_grads))
    assert_close([g.full_tensor() for g in second], list(want_second))
    assert sum(e.op == "all_reduce" for e in comm.events) >= 2  # the gradients' sums, both ways


def test_a_held_parameter_read_outside_autograd_still_takes_its_gradient():
    """Its storage, made from the held blocks while autograd is off, is not kept for later
    differentiated uses: those reach the blocks."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    with held_at_any_size():
        w = fd.distribute_tensor(torch.arange(8.0).reshape(4, 2).requires_grad_(), mesh, fd.P(None, "tp"))
        opt = fd.Optimizer(torch.optim.SGD, {"w": w}, lr=0.5)
        w = opt.step({"w": w}, {"w": torch.ones_like(w)})["w"]
        assert held_of(w) is not None
        with torch.no_grad():
            read = w.local_shards()
        x = fd.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, fd.P("dp", "tp"))
        (grad,) = torch.autograd.grad((w * x).sum(), [w])  # (a product split over dp: stacked)
    assert len(read) == 4
    assert torch.equal(grad.full_tensor(), torch.arange(8.0).reshape(4, 2))


def test_only_large_parameters_are_held():
    """Below the simulated storage's threshold a block stays stacked: the Python of holding
    it outweighs the copies it saves."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    sharded = fd.parallelize_module(model(), mesh, plan("tp"))
    params = sharded.params
    opt = fd.Optimizer(torch.optim.SGD, params, lr=0.1)
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    assert all(held_of(p) is None for p in opt.step(params, grads).values())
    big = {"w": fd.distribute_tensor(torch.zeros(2 * storage.HELD_MIN_ELEMENTS, 2), mesh, fd.P(None, "tp"))}
    opt = fd.Optimizer(torch.optim.SGD, big, lr=0.1)
    stepped = opt.step(big, {"w": torch.ones_like(big["w"])})
    assert held_of(stepped["w"]) is not None and held_of(stepped["w"]).shape[0] == 2
    assert torch.equal(stepped["w"].full_tensor(), torch.full((2 * storage.HELD_MIN_ELEMENTS, 2), -0.1))


def test_a_compiled_loss_takes_held_parameters_without_compiling_again():
    """Held parameters read eagerly (their storage kept) or not at all (an optimizer's new
    ones) run the graph compiled already, with the eager values and gradients."""
    torch._dynamo.reset()
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    with held_at_any_size():
        params = {
            "w": fd.distribute_tensor(
                torch.randn(8, 6, generator=g).requires_grad_(), mesh, fd.P(None, "tp")
            ),
            "b": fd.distribute_tensor(torch.randn(6, generator=g).requires_grad_(), mesh, fd.P("tp")),
        }
        opt = fd.Optimizer(torch.optim.SGD, params, lr=0.1)
        params = opt.step(params, {n: torch.ones_like(p) for n, p in params.items()})
        x = fd.distribute_tensor(torch.randn(4, 8, generator=g), mesh, fd.P("dp"))

        def loss_of(params):
            return (torch.matmul(x, params["w"]) + params["b"]).square().mean()

        compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
        for step in range(3):
            if step == 0:  # compiled after an eager call, which made and kept the storages
                want = loss_of(params)
                want_grads = torch.autograd.grad(want, list(params.values()))
            got = compiled(params)
            grads = torch.autograd.grad(got, list(params.values()))
            if step == 0:
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            else:  # then on an optimizer's new parameters, never read
                want = loss_of(params)
                want_grads = torch.autograd.grad(want, list(params.values()))
            assert_close(got.full_tensor(), want.full_tensor())
            assert_close([g.full_tensor() for g in grads], [g.full_tensor() for g in want_grads])
            assert all(held_of(p) is not None for p in params.values())
            params = opt.step(params, dict(zip(params, grads)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")], ids="-".join)
@pytest.mark.parametrize("rows", [(2, 3), (3, 2)], ids=str)
def test_a_folded_linear_equals_one_device(monkeypatch, names, rows):
    """Batches of several dims, one split unevenly over "dp"; a column- and a row-parallel
    layer with biases (wide enough to fold): values and gradients are one device's."""
    folded = []
    monkeypatch.setattr(batched, "folded_linear", _spy(batched.folded_linear, folded))
    mesh = fd.simulated_mesh((2, 2), names)
    x = torch.randn(*rows, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with held_at_any_size():
        sharded = fd.parallelize_module(model(64), mesh, plan("tp"))
        params = sharded.params
        out = sharded.apply(params, fd.distribute_tensor(x.requires_grad_(), mesh, fd.P("dp")))
        loss = (out.full_tensor() ** 2).sum()
        grads = torch.autograd.grad(loss, [x, *params.values()])
    one = model(64)
    want_out = one(x)
    want = torch.autograd.grad((want_out**2).sum(), [x, *one.parameters()])
    assert len(folded) == 2
    assert_close(out.full_tensor(), want_out)
    assert_close([grads[0], *[g.full_tensor() for g in grads[1:]]], list(want))


def _deep_model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8)]
    return nn.Sequential(*layers).double()


#: the second column-parallel layer's input is the first row-parallel layer's output, summed
#: over "tp": held once there, as the weight is over "dp"
_DEEP_PLAN = {
    "": fd.ReplicateParallel("dp"),
    "0": fd.ColwiseParallel(),
    "2": fd.RowwiseParallel(),
    "3": fd.ColwiseParallel(),
    "5": fd.RowwiseParallel(),
}


def _deep_run(mesh, held: bool, rows=(4, 2), plan=None) -> dict:
    """Output, first- and second-order gradients and collectives of the deep model on ``mesh``."""
    x = torch.randn(*rows, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with held_at_any_size() if held else _held_never():
        sharded = fd.parallelize_module(_deep_model(), mesh, plan or _DEEP_PLAN)
        params = sharded.params
        x_d = fd.distribute_tensor(x.requires_grad_(), mesh, fd.P("dp"))
        with fd.CommDebugMode() as comm:
            out = sharded.apply(params, x_d)
            grads = torch.autograd.grad((out**2).sum(), [x, *params.values()], create_graph=True)
            second = torch.autograd.grad(sum((g**2).sum() for g in grads[1:]), list(params.values()))
    return {
        "out": out.full_tensor().detach(),
        "grads": [grads[0].detach(), *[g.full_tensor().detach() for g in grads[1:]]],
        "second": [g.full_tensor() for g in second],
        "comm": events(comm),
    }


def _deep_on_one_device(rows=(4, 2)) -> dict:
    x = torch.randn(*rows, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    one = _deep_model()
    out = one(x.requires_grad_())
    grads = torch.autograd.grad((out**2).sum(), [x, *one.parameters()], create_graph=True)
    second = torch.autograd.grad(sum((g**2).sum() for g in grads[1:]), list(one.parameters()))
    return {"out": out.detach(), "grads": [g.detach() for g in grads], "second": list(second)}


@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")], ids="-".join)
def test_a_crossed_linear_equals_one_device(monkeypatch, names):
    """A column-parallel layer whose input is held once over "tp" and whose weight is held
    once over "dp", and a row-parallel one whose input's rows outweigh its weight (with its
    all-reduce at once), run on the held blocks (no weight copied to the devices that share
    it): values, first- and second-order gradients are one device's, and the collectives are
    the stacked form's."""
    calls, reduced = [], []
    monkeypatch.setattr(crossed, "crossed_linear", _spy(crossed.crossed_linear, calls))
    monkeypatch.setattr(crossed, "reduced_linear", _spy(crossed.reduced_linear, reduced))
    mesh = fd.simulated_mesh((2, 2), names)
    got = _deep_run(mesh, held=True)
    # the second column-parallel layer's input held (a block per "dp" position); the last
    # row-parallel layer's stacked (its rows outweigh the weight: not folded), and its
    # all-reduce over "tp" summed by its products
    assert calls == [torch.Size([2, 2, 2, 8])]
    assert reduced == [torch.Size([4, 2, 2, 6])]
    want = _deep_on_one_device()
    for key in ("out", "grads", "second"):
        assert_close(got[key], want[key])
    assert got["comm"] == _deep_run(mesh, held=False)["comm"]


#: sequence parallel between the two pairs: the first row-parallel layer's output
#: reduce-scattered over "tp" along the sequence, gathered again by the next layer
_SEQUENCE_PLAN = _DEEP_PLAN | {
    "2": fd.RowwiseParallel(output_layouts=fd.Shard(1)),
    "3": fd.ColwiseParallel(input_layouts=fd.Shard(1)),
}


@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")], ids="-".join)
def test_a_row_parallel_layer_reduce_scattered_at_once_equals_one_device(monkeypatch, names):
    """Row-parallel layers whose rows outweigh their weight, one reduce-scattered along the
    sequence (sequence parallelism) and one all-reduced, each with its collective at once: the
    products of the devices along "tp" summed as they are written. Values, first- and
    second-order gradients are one device's; the collectives are the stacked form's."""
    reduced = []
    monkeypatch.setattr(crossed, "reduced_linear", _spy(crossed.reduced_linear, reduced))
    mesh = fd.simulated_mesh((2, 2), names)
    got = _deep_run(mesh, held=True, rows=(4, 4), plan=_SEQUENCE_PLAN)
    assert reduced == [torch.Size([4, 2, 4, 8]), torch.Size([4, 2, 4, 6])]
    want = _deep_on_one_device(rows=(4, 4))
    for key in ("out", "grads", "second"):
        assert_close(got[key], want[key])
    stacked = _deep_run(mesh, held=False, rows=(4, 4), plan=_SEQUENCE_PLAN)
    assert got["comm"] == stacked["comm"]
    assert ("reduce_scatter", ("tp",)) in [e[:2] for e in got["comm"]]


def _deep_job(mesh) -> dict:
    return _deep_run(mesh, held=True)


#: the deep model's tensor parallelism, its parameters sharded over "dp" (FSDP)
_FSDP_PLAN = _DEEP_PLAN | {"": fd.FullyShard("dp")}


def _fsdp_job(mesh) -> dict:
    return _deep_run(mesh, held=True, plan=_FSDP_PLAN)


def _sequence_job(mesh) -> dict:
    return _deep_run(mesh, held=True, rows=(4, 4), plan=_SEQUENCE_PLAN)


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize(
    "job", [_deep_job, _fsdp_job, _sequence_job], ids=["crossed", "fully sharded", "sequence parallel"]
)
def test_held_linear_layers_run_as_the_distributed_backend(backend, mesh, job):
    """Crossed linear layers (with their all-reduce or reduce-scatter at once), and their
    parameters gathered held once: a rank holds one block anyway, and computes the same
    values, gradients and collectives."""
    results = backend.run(job, mesh.shape, ("dp", "tp"), timeout=120)
    expected = job(fd.simulated_mesh(mesh.shape, ("dp", "tp")))
    for result in results:
        for key in ("out", "grads", "second"):
            assert_close(result[key], expected[key])
        assert result["comm"] == expected["comm"]


@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")], ids="-".join)
def test_fully_sharded_parameters_are_gathered_held_once(monkeypatch, names):
    """A unit's all-gather writes each gathered block once, and backward each device's shard
    is its slice of the held gradient: values, first- and second-order gradients are one
    device's, the collectives (one all-gather and one reduce-scatter for the unit) the stacked
    form's."""
    from functional_dtensor._backend import Backend

    gathered = []
    move = Backend.all_gather_held

    def spy(self, held, *args, **kwargs):
        if not kwargs.get("counted", True):  # (a unit's gather: counted as its bucket)
            gathered.append(tuple(held.shape))
        return move(self, held, *args, **kwargs)

    monkeypatch.setattr(Backend, "all_gather_held", spy)
    mesh = fd.simulated_mesh((2, 2), names)
    got = _fsdp_job(mesh)
    # every parameter gathered held, in the forward and in the second order's backward
    assert len(gathered) == 2 * len(_deep_model().state_dict())
    want = _deep_on_one_device()
    for key in ("out", "grads", "second"):
        assert_close(got[key], want[key])
    stacked = _deep_run(mesh, held=False, plan=_FSDP_PLAN)
    assert got["comm"] == stacked["comm"]
    # the unit's: one all-gather and one reduce-scatter, then both again for the second order
    unit = [e[:2] for e in got["comm"] if e[0] in ("all_gather", "reduce_scatter")]
    assert unit == [("all_gather", ("dp",)), ("reduce_scatter", ("dp",))] * 2


@pytest.mark.parametrize("x_held", [True, False], ids=["held input", "stacked input"])
@pytest.mark.parametrize("x_outer", [True, False], ids=["input outer", "weight outer"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
def test_the_crossed_kernel_is_every_devices_product_to_any_order(x_held, x_outer, bias):
    """Every device's block times its weight's, in device order (2 positions along the weight's
    held axes, 3 along its own): reverse mode to the second order and forward mode by torch's
    numerical checks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 if x_held else 6, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    operands = (x, w, b) if bias else (x, w)

    def layer(x, w, b=None):
        return crossed.crossed_linear(x, w, b, x_outer, x_held)

    devices = [(i, j) for i in range(2) for j in range(3)]  # (position along the held axes, own)
    if not x_outer:
        devices = [(i, j) for j in range(3) for i in range(2)]
    blocks = [x[i] if x_held else x[k] for k, (i, _) in enumerate(devices)]
    want = torch.stack(
        [F.linear(block, w[j], b[j] if bias else None) for block, (_, j) in zip(blocks, devices)]
    )
    assert_close(layer(*operands), want)
    assert torch.autograd.gradcheck(layer, operands, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(layer, operands)


@pytest.mark.parametrize("x_outer", [True, False], ids=["input outer", "weight outer"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
def test_the_reduced_kernel_is_the_sum_of_the_devices_products_to_any_order(x_outer, bias):
    """A row-parallel layer and its all-reduce at once: for each position along the weight's
    held axes (2), the sum over its own positions (3) of each device's block times its
    weight's, plus its part of the bias. Reverse mode to the second order and forward mode by
    torch's numerical checks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    operands = (x, w, b) if bias else (x, w)

    def layer(x, w, b=None):
        return crossed.reduced_linear(x, w, b, x_outer)

    def device(i, j):  # the block of the device at (position along the held axes, own)
        return x[3 * i + j] if x_outer else x[2 * j + i]

    want = torch.stack(
        [sum(F.linear(device(i, j), w[j], b[j] if bias else None) for j in range(3)) for i in range(2)]
    )
    assert_close(layer(*operands), want)
    assert torch.autograd.gradcheck(layer, operands, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(layer, operands)
