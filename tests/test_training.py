"""Training sharded models: module plans, the optimizer on shards, gradient clipping.

The acceptance test trains the example's transformer on a 2 x 2 ("dp", "tp") mesh in every
variant (tensor parallel, sequence parallel, FSDP-style, both, tied embeddings) and compares
every step's loss and the final parameters with the same training on one device, on the
simulated mesh and on 4 gloo ranks. The other tests check each piece against torch on one
device: plans drawn by hypothesis, the optimizer, clipping, and the errors.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from common import assert_close, in_float64
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import functional_dtensor as fd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_transformer as tt  # noqa: E402

R, S = fd.Replicate(), fd.Shard
SMALL = tt.Config(vocab=32, dim=16, heads=2, hidden=32, layers=1, seq=8, batch=4)
STEPS = 3


def _model(cfg: tt.Config) -> nn.Module:
    torch.manual_seed(0)
    return tt.Transformer(cfg)


def one_device(cfg: tt.Config, steps: int) -> tuple[dict, dict]:
    """The reference training on one device in float64 and in float32: ``{"losses", "params"}``
    each, the float32 one giving the error that plain torch's float32 training makes."""
    runs = []
    for model in (in_float64(_model(cfg)), _model(cfg)):
        losses, trained = tt.train_single(model, cfg, steps)
        dtype = next(trained.parameters()).dtype
        params = {name: p.detach() for name, p in trained.named_parameters()}
        runs.append({"losses": torch.tensor(losses, dtype=dtype), "params": params})
    return runs[0], runs[1]


def job_train(mesh, variant: str, tied: bool) -> dict:
    cfg = SMALL if not tied else tt.Config(**{**SMALL.__dict__, "tied": True})
    losses, params, _, opt = tt.train_sharded(_model(cfg), cfg, mesh, variant, STEPS)
    state = opt.state_dict()["state"]
    return {
        "losses": losses,
        "params": {name: p.full_tensor() for name, p in params.items()},
        "exp_avg": {path: s["exp_avg"].full_tensor() for path, s in state.items()},
        "layouts": {name: str(p.spec) for name, p in params.items()},
    }


CASES = [("tp", False), ("sp", False), ("fsdp", False), ("sp+fsdp", False), ("sp+fsdp", True), ("cp", False)]


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize("variant, tied", CASES, ids=[f"{v}{'-tied' if t else ''}" for v, t in CASES])
def test_training_equals_one_device(backend, mesh, variant, tied):
    cfg = SMALL if not tied else tt.Config(**{**SMALL.__dict__, "tied": True})
    want, want32 = one_device(cfg, STEPS)
    for got in backend.run(job_train, (2, 2), tt.axes_of(variant), variant, tied, timeout=120):
        assert got["params"].keys() == want["params"].keys()
        assert_close({"losses": torch.tensor(got["losses"]), "params": got["params"]}, want, want32)
        assert len(got["exp_avg"]) == len(want["params"])
        if "fsdp" in variant:  # every parameter sharded over dp
            assert all("dp" in layout for layout in got["layouts"].values()), got["layouts"]
        if variant == "cp":  # attention went round the ring: the parameters stay replicated
            assert set(got["layouts"].values()) == {"P()"}, got["layouts"]
    assert want["losses"][-1] < want["losses"][0]  # it learns


def test_fully_sharded_holds_a_quarter():
    cfg = SMALL
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    _, params, _, opt = tt.train_sharded(_model(cfg), cfg, mesh, "sp+fsdp", 1)
    whole = sum(p.numel() * p.element_size() for p in _model(cfg).parameters())
    held = tt.bytes_per_device(params)
    assert held <= whole / 4 * 1.1  # 1/4 of every matrix (small vectors split unevenly)
    assert tt.bytes_per_device(opt.state_dict()["state"]) == 2 * held  # AdamW: two moments


def test_the_example_runs_and_prints(capsys):
    tt.main(["--variant", "sp+fsdp", "--steps", "2"])
    out = capsys.readouterr().out
    assert "largest parameter difference" in out and "all_gather" in out and "reduce_scatter" in out


# --- plans drawn by hypothesis ----------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.norm = nn.LayerNorm(sizes[-1])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return self.norm(x)


@st.composite
def plans(draw):
    shape = draw(st.sampled_from([(2,), (4,), (2, 2), (1, 2)]))
    names = ("tp",) if len(shape) == 1 else ("dp", "tp")
    depth = draw(st.integers(1, 3))
    sizes = [draw(st.sampled_from([4, 6, 8])) for _ in range(depth + 1)]
    plan = {}
    for i in range(depth):
        style = draw(st.sampled_from(["col", "row", "rep", None]))
        if style is not None:
            plan[f"layers.{i}"] = {
                "col": fd.ColwiseParallel(),
                "row": fd.RowwiseParallel(),
                "rep": fd.ReplicateParallel(),
            }[style]
    if "dp" in names and draw(st.booleans()):
        plan["layers.*"] = fd.FullyShard("dp")  # beside the tensor-parallel style of layers.0
        plan[""] = fd.FullyShard("dp")
    batch = draw(st.sampled_from([4, 8]))
    return shape, names, sizes, plan, batch


@settings(max_examples=25, deadline=None)
@given(plans())
def test_drawn_plans_equal_one_device(case):
    shape, names, sizes, plan, batch = case
    torch.manual_seed(0)
    model = MLP(sizes)
    mesh = fd.simulated_mesh(shape, names)
    sharded = fd.parallelize_module(model, mesh, plan)
    x = torch.randn(batch, sizes[0])
    data = fd.P("dp") if "dp" in names else fd.P()
    out = sharded.apply(sharded.params, fd.distribute_tensor(x, mesh, data))
    grads = dict(zip(sharded.params, torch.autograd.grad((out * out).sum(), list(sharded.params.values()))))

    def one_device(model, x):
        y = model(x)
        return {
            "y": y,
            "grads": dict(zip(sharded.params, torch.autograd.grad((y * y).sum(), list(model.parameters())))),
        }

    got = {"y": out.full_tensor(), "grads": {name: g.full_tensor() for name, g in grads.items()}}
    assert_close(got, one_device(*in_float64((model, x))), one_device(model, x))
    for name, g in grads.items():
        assert g.sharding == sharded.params[name].sharding


def test_styles_lay_out_parameters_as_dtensor():
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    model = nn.ModuleDict({"col": nn.Linear(4, 8), "row": nn.Linear(8, 4), "emb": nn.Embedding(6, 4)})
    plan = {"col": fd.ColwiseParallel(), "row": fd.RowwiseParallel(), "emb": fd.RowwiseParallel()}
    params = fd.parallelize_module(model, mesh, plan).params
    specs = {name: p.spec for name, p in params.items()}
    assert specs == {
        "col.weight": fd.P("tp"),
        "col.bias": fd.P("tp"),
        "row.weight": fd.P(None, "tp"),
        "row.bias": fd.P(),
        "emb.weight": fd.P("tp"),
    }
    fsdp = fd.parallelize_module(model, mesh, {**plan, "": fd.FullyShard("dp")}).params
    assert fsdp["col.weight"].spec == fd.P(("tp", "dp")) and fsdp["row.weight"].spec == fd.P("dp", "tp")
    assert fsdp["emb.weight"].spec == fd.P(("tp", "dp"))


def test_rowwise_output_layouts_and_sequence_parallel():
    torch.manual_seed(0)
    mesh = fd.simulated_mesh(2, "tp")
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    plan = {
        "0": fd.SequenceParallel(),
        "1": fd.ColwiseParallel(),
        "3": fd.RowwiseParallel(output_layouts=S(1)),
    }
    sharded = fd.parallelize_module(model, mesh, plan)
    x = torch.randn(2, 6, 8)
    with fd.CommDebugMode() as comm:
        y = sharded.apply(sharded.params, fd.distribute_tensor(x, mesh, fd.P(None, "tp")))
    assert y.placements == (S(1),)
    assert comm.get_comm_counts() == {"all_gather": 1, "reduce_scatter": 1}
    assert_close(y.full_tensor(), model(x))


@pytest.mark.parametrize("output", [R, S(1)], ids=["all-reduced", "reduce-scattered"])
def test_a_row_parallel_bias_is_added_after_the_all_reduce(monkeypatch, output):
    """Megatron's RowParallelLinear: an all-reduced output gets the replicated bias once after
    the sum, the bias never moved to a Partial part on one device (a redistribute of its own,
    forward and back). A reduce-scattered output keeps the bias in the Partial sum (its gradient
    would otherwise take an all-reduce of its own). Values and gradients are one device's."""
    from functional_dtensor import _redistribute

    moves, real = [], _redistribute._moved
    spy = lambda x, target: moves.append((x.placements, target.placements)) or real(x, target)  # noqa: E731
    monkeypatch.setattr(_redistribute, "_moved", spy)
    torch.manual_seed(0)
    mesh = fd.simulated_mesh(2, "tp")
    model = in_float64(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))
    plan = {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel(output_layouts=output)}
    sharded = fd.parallelize_module(model, mesh, plan)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    params = sharded.params
    y = sharded.apply(params, fd.distribute_tensor(x, mesh, fd.P()))
    to_bias_part = [m for m in moves if m == ((R,), (fd.Partial(),))]
    assert len(to_bias_part) == (0 if output == R else 1), moves
    grads = torch.autograd.grad((y**2).sum(), list(params.values()))
    want = model(x)
    want_grads = torch.autograd.grad((want**2).sum(), list(model.parameters()))
    assert_close(y.full_tensor(), want)
    assert_close([g.full_tensor() for g in grads], list(want_grads))


def test_the_module_is_not_changed_and_apply_is_pure():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    before = copy.deepcopy(model.state_dict())
    mesh = fd.simulated_mesh(2, "tp")
    sharded = fd.parallelize_module(model, mesh, {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel()})
    x = fd.distribute_tensor(torch.randn(3, 4), mesh, fd.P())
    a = sharded.apply(sharded.params, x).full_tensor()
    b = sharded.apply(sharded.params, x).full_tensor()
    assert torch.equal(a, b)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert not model._forward_pre_hooks and not model[0]._forward_hooks
    assert isinstance(model[0].weight, nn.Parameter)


def test_buffers_are_replicated_constants():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0, 4.0]))

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    model = Scaled()
    mesh = fd.simulated_mesh(2, "tp")
    sharded = fd.parallelize_module(model, mesh, {"lin": fd.ColwiseParallel()})
    assert set(sharded.params) == {"lin.weight", "lin.bias"}
    assert sharded.apply.buffers["scale"].placements == (R,)
    x = torch.randn(3, 4)
    y = sharded.apply(sharded.params, fd.distribute_tensor(x, mesh, fd.P()))
    assert_close(y.full_tensor(), model(x))


def test_distribute_module_partition_input_and_output_fns():
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    mesh = fd.simulated_mesh(2, "x")

    def partition(name, module, mesh):
        return {"weight": [S(0)], "bias": fd.P("x")} if isinstance(module, nn.Linear) else None

    def input_fn(module, inputs, mesh):
        return tuple(fd.distribute_tensor(t, mesh, fd.P()) for t in inputs)

    def output_fn(module, outputs, mesh):
        return outputs.full_tensor()

    sharded = fd.distribute_module(model, mesh, partition, input_fn, output_fn)
    assert sharded.params["weight"].placements == (S(0),)
    x = torch.randn(3, 4)
    out = sharded.apply(sharded.params, x)
    assert type(out) is torch.Tensor
    assert_close(out, model(x))


# --- the optimizer ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, options",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adam, {"lr": 0.01}),
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    ],
    ids=["sgd-momentum", "adam", "adamw"],
)
@pytest.mark.parametrize("spec", [fd.P("x"), fd.P(None, "y"), fd.P(("x", "y")), fd.P()], ids=str)
def test_optimizer_steps_equal_torch(make, options, spec):
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    torch.manual_seed(0)
    w0 = torch.randn(6, 4)  # 6 rows over 4 devices: uneven
    target = torch.randn(6, 4)
    w = w0.clone().requires_grad_()
    reference = make([w], **options)
    params = {"w": fd.redistribute(fd.parallelize_module(_Holder(w0), mesh, {}).params["w"], spec)}
    opt = fd.Optimizer(make, params, **options)
    for _ in range(3):
        loss = ((w - target) ** 2).sum()
        reference.zero_grad()
        loss.backward()
        reference.step()
        sharded_loss = ((params["w"] - fd.distribute_tensor(target, mesh, spec)) ** 2).sum()
        (g,) = torch.autograd.grad(sharded_loss, [params["w"]])
        old = params["w"].full_tensor()
        params = opt.step(params, {"w": g})
        assert not torch.equal(old, params["w"].full_tensor())
    assert_close(params["w"].full_tensor(), w.detach())
    assert params["w"].sharding.placements == fd.Layout.from_spec(mesh, spec).placements
    state = opt.state_dict()["state"]["['w']"]
    for key, v in state.items():
        if isinstance(v, fd.DTensor):
            assert_close(v.full_tensor(), reference.state[w][key])


def test_the_optimizer_takes_torchs_quickest_form_where_torch_would_choose():
    """Left to torch (no ``foreach``, ``fused`` or ``differentiable``), a stock optimizer steps
    the blocks by its fused form where torch has one (Adam, AdamW: float32 or float64 blocks),
    to the values of ``fused=True`` given, and the loop's within rounding; by its foreach form
    otherwise, to the loop's values exactly. A choice given is kept."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    torch.manual_seed(0)
    params = {
        "w": fd.distribute_tensor(torch.randn(8, 4), mesh, fd.P("x")),
        "b": fd.distribute_tensor(torch.randn(4), mesh, fd.P()),
    }
    grads = {k: fd.distribute_tensor(torch.randn(v.shape), mesh, v.placements) for k, v in params.items()}
    left = fd.Optimizer(torch.optim.AdamW, params, lr=0.1, weight_decay=0.1)
    fused = fd.Optimizer(torch.optim.AdamW, params, lr=0.1, weight_decay=0.1, fused=True)
    loop = fd.Optimizer(torch.optim.AdamW, params, lr=0.1, weight_decay=0.1, foreach=False)
    assert left.param_groups[0]["fused"] is True and left.param_groups[0]["foreach"] is None
    assert fused.param_groups[0]["foreach"] is None and loop.param_groups[0]["foreach"] is False
    sgd_left = fd.Optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    sgd_loop = fd.Optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9, foreach=False)
    assert sgd_left.param_groups[0]["foreach"] is True and not sgd_left.param_groups[0]["fused"]
    halves = {k: v.to(torch.bfloat16) for k, v in params.items()}
    assert fd.Optimizer(torch.optim.AdamW, halves, lr=0.1).param_groups[0]["foreach"] is True
    a = b = c = d = e = params
    for _ in range(3):
        a, b, c = left.step(a, grads), fused.step(b, grads), loop.step(c, grads)
        d, e = sgd_left.step(d, grads), sgd_loop.step(e, grads)
    for key in params:
        assert torch.equal(a[key].full_tensor(), b[key].full_tensor())
        assert_close(a[key].full_tensor(), c[key].full_tensor())
        assert torch.equal(d[key].full_tensor(), e[key].full_tensor())


def test_a_fused_update_reads_a_gapped_gradient_right_whichever_groups_ask_for_it():
    """Torch's fused kernels pair a block's elements with its gradient's and state's by their
    order in memory: a gradient whose rows have gaps between them (a slice of a wider value, as
    a reduce-scatter bucket's are) is made row-major, in an optimizer made fused and in one made
    with ``foreach`` whose loaded state's groups ask for the fused form; both step as torch's
    loop does."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    torch.manual_seed(0)
    params = {"w": fd.distribute_tensor(torch.randn(8, 4), mesh, fd.P("x"))}
    grads = {"w": fd.distribute_tensor(torch.randn(8, 8), mesh, fd.P("x"))[:, :4]}  # rows with gaps
    made_fused = fd.Optimizer(torch.optim.AdamW, params, lr=0.1)
    loaded = fd.Optimizer(torch.optim.AdamW, params, lr=0.1, foreach=True)
    loaded.load_state_dict(made_fused.state_dict())
    loop = fd.Optimizer(torch.optim.AdamW, params, lr=0.1, foreach=False)
    assert made_fused.param_groups[0]["fused"] and loaded.param_groups[0]["fused"]
    a = b = c = params
    for _ in range(2):
        a, b, c = made_fused.step(a, grads), loaded.step(b, grads), loop.step(c, grads)
    assert_close(a["w"].full_tensor(), c["w"].full_tensor())
    assert_close(b["w"].full_tensor(), c["w"].full_tensor())


class _Holder(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w.clone())


@pytest.mark.meshes((2,))
@pytest.mark.parametrize("spec", [fd.P(), fd.P("x")], ids=str)
def test_optimizer_does_not_change_the_values_given(backend, mesh, spec):
    """Neither the values given nor those returned change; a step from the last step's result
    (whose distinct blocks the optimizer holds already) and from an older one both start from
    the values given."""
    backend.run(_job_optimizer_values, (2,), ("x",), spec)


def _job_optimizer_values(mesh, spec):
    params = {"w": fd.distribute_tensor(torch.ones(4, 2), mesh, spec)}
    opt = fd.Optimizer(torch.optim.SGD, params, lr=1.0)
    grads = {"w": fd.distribute_tensor(torch.ones(4, 2), mesh, fd.P())}
    first = opt.step(params, grads)
    second = opt.step(first, grads)
    again = opt.step(first, grads)  # back to an older value
    third = opt.step(again, grads)
    assert params["w"].full_tensor().eq(1).all()
    assert first["w"].full_tensor().eq(0).all() and second["w"].full_tensor().eq(-1).all()
    assert again["w"].full_tensor().eq(-1).all() and third["w"].full_tensor().eq(-2).all()


def test_optimizer_state_loads_onto_another_layout():
    torch.manual_seed(0)
    w0, g0 = torch.randn(8, 4), torch.randn(8, 4)
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    a = {"w": fd.redistribute(fd.parallelize_module(_Holder(w0), mesh, {}).params["w"], fd.P("x", "y"))}
    b = {"w": fd.redistribute(a["w"], fd.P(("y", "x")))}
    opt_a = fd.Optimizer(torch.optim.Adam, a, lr=0.1)
    a = opt_a.step(a, {"w": fd.distribute_tensor(g0, mesh, fd.P("x", "y"))})
    opt_b = fd.Optimizer(torch.optim.Adam, b, lr=0.1)
    opt_b.load_state_dict(opt_a.state_dict())
    b = {"w": fd.redistribute(a["w"], fd.P(("y", "x")))}
    a = opt_a.step(a, {"w": fd.distribute_tensor(g0, mesh, fd.P("x", "y"))})
    b = opt_b.step(b, {"w": fd.distribute_tensor(g0, mesh, fd.P(("y", "x")))})
    assert_close(a["w"].full_tensor(), b["w"].full_tensor())
    assert b["w"].spec == fd.P(("y", "x"))


def _clip_case(dtype):
    """Gradients in several layouts: split over both axes, over both into uneven blocks (a device
    with none), replicated, split over one axis and replicated over the other, and a Partial sum
    (reduced before its norm)."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, dtype=dtype, generator=g) for s in ((6, 4), (5,), (4, 4), (4, 6), (3, 2))]
    return tensors, [fd.P("x", "y"), fd.P(("x", "y")), fd.P(), fd.P(None, "y"), fd.P()]


def _job_clip(mesh, norm_type: float, dtype, distinct_from: int | None = None) -> dict:
    """``distinct_from``: the gradients' size from which their norms read distinct blocks alone
    (None: the library's; 0: every gradient's), for this job only."""
    from functional_dtensor import _clip

    saved = _clip._DISTINCT_FROM
    _clip._DISTINCT_FROM = saved if distinct_from is None else distinct_from
    try:
        return _clipped(mesh, norm_type, dtype)
    finally:
        _clip._DISTINCT_FROM = saved


def _clipped(mesh, norm_type: float, dtype) -> dict:
    tensors, specs = _clip_case(dtype)
    grads = {f"g{i}": fd.distribute_tensor(t, mesh, s) for i, (t, s) in enumerate(zip(tensors, specs))}
    last = len(tensors) - 1  # as a Partial sum: each device's part a quarter of it
    grads[f"g{last}"] = fd.from_local(
        tensors[last] / mesh.size, mesh, (fd.Partial(),) * mesh.ndim, shape=tensors[last].shape
    )
    with fd.CommDebugMode() as comm:
        clipped, total = fd.clip_grad_norm(grads, 1.0, norm_type)
    return {
        "total": total.full_tensor(),
        "clipped": {name: v.full_tensor() for name, v in clipped.items()},
        "placements": {name: v.placements for name, v in clipped.items()},
        "counts": comm.get_total_counts(),
    }


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize("distinct_from", [None, 0], ids=["small", "as large"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_equals_torch(backend, mesh, norm_type, dtype, distinct_from):
    """The clipped gradients and the total norm are torch's, in the gradients' dtype (a float64
    norm is not rounded to float32), with one all-reduce for the norm of gradients split over
    different sets of axes (and the reduction of the Partial one); for small gradients, and for
    gradients taken as large (their norms read each distinct block once)."""
    tensors, _ = _clip_case(dtype)
    reference = [t.clone() for t in tensors]
    for t in reference:
        t.grad = t.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0, norm_type)
    for got in backend.run(_job_clip, mesh.shape, mesh.names, norm_type, dtype, distinct_from):
        assert got["total"].dtype == expected.dtype == dtype
        assert_close(got["total"], expected)
        for i, t in enumerate(reference):
            assert_close(got["clipped"][f"g{i}"], t.grad)
        assert got["placements"]["g4"] == (fd.Partial(),) * 2  # clipped as given
        assert got["counts"] == 2  # the Partial's reduction, then the norm's parts at once


# --- errors -----------------------------------------------------------------------------------


def test_bad_plans_and_calls_are_clear_errors():
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 1))
    with pytest.raises(fd.LayoutError, match="matches no module"):
        fd.parallelize_module(model, mesh, {"nope.*": fd.ColwiseParallel()})
    with pytest.raises(fd.InputTypeError, match="nn.Linear and nn.Embedding"):
        fd.parallelize_module(model, mesh, {"1": fd.ColwiseParallel()})
    with pytest.raises(fd.LayoutError, match="mesh axis"):
        fd.parallelize_module(model, mesh, {"0": fd.ColwiseParallel("model")})
    with pytest.raises(fd.InputTypeError, match="plan string"):
        fd.parallelize_module(model, mesh, {"0": "colwize"})
    with pytest.raises(fd.InputTypeError, match="dict"):
        fd.parallelize_module(model, mesh, [("0", fd.ColwiseParallel())])
    with pytest.raises(fd.InputTypeError, match="nn.Module"):
        fd.parallelize_module(lambda x: x, mesh, {})
    sharded = fd.parallelize_module(nn.Linear(4, 4), mesh, {"": fd.ColwiseParallel()})
    x = fd.distribute_tensor(torch.randn(2, 4), mesh, fd.P())
    with pytest.raises(fd.InputTypeError, match=r"missing \['bias'\]"):
        sharded.apply({"weight": sharded.params["weight"]}, x)
    with pytest.raises(fd.InputTypeError, match=r"\['weight'\]"):
        sharded.apply({**sharded.params, "weight": torch.zeros(4, 4)}, x)


def test_bad_optimizer_inputs_are_clear_errors():
    mesh = fd.simulated_mesh(2, "x")
    params = fd.parallelize_module(_Holder(torch.ones(4, 2)), mesh, {}).params
    with pytest.raises(fd.InputTypeError, match="elementwise"):
        fd.Optimizer(torch.optim.LBFGS, params)
    with pytest.raises(fd.InputTypeError, match="torch.optim class"):
        fd.Optimizer(torch.optim.SGD([torch.zeros(1)], lr=1), params)
    with pytest.raises(fd.InputTypeError, match=r"params\['w'\]"):
        fd.Optimizer(torch.optim.SGD, {"w": torch.ones(2)}, lr=1.0)
    opt = fd.Optimizer(torch.optim.SGD, params, lr=1.0)
    with pytest.raises(fd.InputTypeError, match="structure"):
        opt.step(params, {"v": params["w"]})
    with pytest.raises(fd.ShapeError, match=r"shape \(4, 2\)"):
        opt.step(params, {"w": fd.distribute_tensor(torch.ones(2, 2), mesh, fd.P())})
    with pytest.raises(fd.InputTypeError, match="fd.DTensor"):
        opt.step(params, {"w": torch.ones(4, 2)})
    with pytest.raises(fd.InputTypeError, match="fd.DTensor"):
        fd.clip_grad_norm({"w": torch.ones(2)}, 1.0)
    elsewhere = fd.distribute_tensor(torch.ones(2), fd.simulated_mesh(2, "z"), fd.P())
    with pytest.raises(fd.MeshError, match="every gradient on"):
        fd.clip_grad_norm({"w": params["w"], "v": elsewhere}, 1.0)


# --- checkpoints of a training run ------------------------------------------------------------


def _steps(apply, params, opt, mesh, batches) -> tuple[list[float], dict]:
    losses = []
    for tokens, targets in batches:
        tokens_d = fd.distribute_tensor(tokens, mesh, fd.P("dp"))
        targets_d = fd.distribute_tensor(targets, mesh, fd.P("dp"))
        loss = tt.loss_of(apply(params, tokens_d), targets_d)
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        grads, _ = fd.clip_grad_norm(grads, 1.0)
        params = opt.step(params, grads)
        losses.append(loss.item())
    return losses, params


def job_resume(mesh, path: str) -> dict:
    """Load a checkpoint of two steps of ``sp+fsdp`` onto the ``tp`` layout, and train on."""
    sharded = fd.parallelize_module(_model(SMALL), mesh, tt.plan_for("tp"))
    opt = fd.Optimizer(torch.optim.AdamW, sharded.params, lr=1e-2)
    like = {"params": sharded.params, "optim": opt.state_template(), "step": 0}
    loaded = fd.checkpoint.load(path, like)
    opt.load_state_dict(loaded["optim"])
    batches = list(tt.batches(SMALL, 4))[loaded["step"] :]
    losses, params = _steps(sharded.apply, loaded["params"], opt, mesh, batches)
    return {
        "losses": losses,
        "params": {name: p.full_tensor() for name, p in params.items()},
        "loaded": {name: loaded["params"][name].spec == p.spec for name, p in sharded.params.items()},
    }


@pytest.mark.meshes((2, 2))
def test_a_checkpoint_resumes_training_on_another_layout_and_backend(backend, mesh, tmp_path):
    """Two steps under sp+fsdp on the simulated mesh, saved (parameters, AdamW state, step);
    loaded onto the tensor-parallel layout (simulated, or 4 gloo ranks) for two more steps:
    the same losses and parameters as four steps on one device."""
    want, want32 = one_device(SMALL, 4)
    simulated = fd.simulated_mesh((2, 2), ("dp", "tp"))
    sharded = fd.parallelize_module(_model(SMALL), simulated, tt.plan_for("sp+fsdp"))
    opt = fd.Optimizer(torch.optim.AdamW, sharded.params, lr=1e-2)
    first, params = _steps(sharded.apply, sharded.params, opt, simulated, list(tt.batches(SMALL, 2)))
    path = str(tmp_path / "ckpt")
    fd.checkpoint.save(path, {"params": params, "optim": opt.state_dict(), "step": 2})
    assert_close(torch.tensor(first), want["losses"][:2], want32["losses"][:2], msg="first two steps")
    for got in backend.run(job_resume, (2, 2), ("dp", "tp"), path, timeout=120):
        assert all(got["loaded"].values())
        got = {"losses": torch.tensor(got["losses"]), "params": got["params"]}
        assert_close(got, {**want, "losses": want["losses"][2:]}, {**want32, "losses": want32["losses"][2:]})


# --- data parallelism: one gradient reduction ---------------------------------------------------


class _Mixed(nn.Module):
    """A linear layer, plus terms that use the weights without the batch (a regularizer on
    the weight, a replicated scale): their gradients come back whole, not per device."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)  # rows split evenly over the 4 devices
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        y = self.lin(x) * self.scale
        return y, (self.lin.weight * self.lin.weight).sum() * self.scale


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_data_parallel_gradients_are_reduced_once(style):
    torch.manual_seed(0)
    model = _Mixed()
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    unit = fd.ReplicateParallel("dp") if style == "replicate" else fd.FullyShard("dp")
    sharded = fd.parallelize_module(model, mesh, {"": unit, "lin": fd.ColwiseParallel()})
    x = torch.randn(8, 4)
    with fd.CommDebugMode() as comm:
        y, reg = sharded.apply(sharded.params, fd.distribute_tensor(x, mesh, fd.P("dp")))
        loss = (y * y).sum() + reg
        forward = comm.get_comm_counts()
        grads = torch.autograd.grad(loss, list(sharded.params.values()))

    def one_device(model, x):
        y, reg = model(x)
        return dict(zip(sharded.params, torch.autograd.grad((y * y).sum() + reg, list(model.parameters()))))

    got = {name: g.full_tensor() for name, g in zip(sharded.params, grads)}
    assert_close(got, one_device(*in_float64((model, x))), one_device(model, x))
    backward = {op: n - forward.get(op, 0) for op, n in comm.get_comm_counts().items()}
    if style == "replicate":  # every parameter's dp sum in one all-reduce
        dp_reductions = [  # (the forward's: the loss's partial sums, read as its global value)
            e for e in comm.events if e.op == "all_reduce" and e.axes == ("dp",) and e.phase == "backward"
        ]
        assert len(dp_reductions) == 1, comm.events
    else:  # the gathered parameters' gradients reduce-scattered into their shards together
        assert backward.get("reduce_scatter", 0) == 1, backward  # weight and bias (the scale is 0-d)
        assert forward.get("all_gather", 0) == 1, forward


@pytest.mark.meshes((2, 2))
def test_a_fully_sharded_unit_gathers_its_parameters_in_one_collective(backend, mesh):
    """Parameters of one FullyShard unit: those of even blocks in one all-gather of their
    concatenation (mixed dtypes: one per dtype) and one reduce-scatter of their gradients, an
    uneven one on its own; values, gradients and second derivatives equal one device's."""
    backend.run(_job_fully_sharded_unit, (2, 2), ("dp", "tp"))


class _Unit(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)  # weight rows 6 over (tp, dp): even; bias 6: even
        self.b = nn.Linear(6, 5)  # rows 5: uneven over dp
        self.c = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).sum(-1, keepdim=True) * (self.c.to(x.dtype).sum() + x[..., :1])


def _job_fully_sharded_unit(mesh):
    torch.manual_seed(0)
    model = _Unit()
    sharded = fd.parallelize_module(model, mesh, {"": fd.FullyShard("dp"), "a": fd.ColwiseParallel()})
    x = torch.randn(8, 4)
    params = sharded.params
    with fd.CommDebugMode() as comm:
        y = sharded.apply(params, fd.distribute_tensor(x, mesh, fd.P("dp")))
        forward = dict(comm.get_comm_counts())
        grads = torch.autograd.grad(y.sum(), list(params.values()), create_graph=True)
    gathers = [e for e in comm.events if e.op == "all_gather" and e.axes == ("dp",) and e.phase == "forward"]
    scatters = [e for e in comm.events if e.op == "reduce_scatter" and e.axes == ("dp",)]
    assert len(gathers) == 3, gathers  # float32 bucket, float64 bucket, the uneven b.weight
    assert len(scatters) == 3, scatters
    assert forward.get("all_gather", 0) >= 3
    # second order: the gradient of the squared gradient norm of a.weight with respect to c
    index = list(params).index("a.weight")
    (second,) = torch.autograd.grad((grads[index] * grads[index]).sum(), [params["c"]])

    def one_device(model, x):
        y, leaves = model(x), dict(model.named_parameters())
        grads = torch.autograd.grad(y.sum(), [leaves[n] for n in params], create_graph=True)
        (second,) = torch.autograd.grad((grads[index] * grads[index]).sum(), [leaves["c"]])
        return {"y": y, "grads": dict(zip(params, grads, strict=True)), "second": second}

    got = {"y": y.full_tensor(), "grads": {n: g.full_tensor() for n, g in zip(params, grads)}}
    assert_close(
        {**got, "second": second.full_tensor()}, one_device(*in_float64((model, x))), one_device(model, x)
    )


SECOND_ORDER_PLANS = {
    "replicate": {"": fd.ReplicateParallel("dp")},
    "fully_shard": {"": fd.FullyShard("dp")},
    "fully_shard+colwise": {"": fd.FullyShard("dp"), "a": fd.ColwiseParallel()},
}


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize("plan", list(SECOND_ORDER_PLANS))
def test_second_derivatives_through_data_parallel_parameters(backend, mesh, plan):
    """The gradient of a gradient's squared norm, through parameters varied over dp (summed
    in one all-reduce, or gathered and reduce-scattered), equals one device's: the transposes
    of those collectives are all-gathers and broadcasts, not splits into parts."""
    backend.run(_job_second_order, (2, 2), ("dp", "tp"), plan)


def _job_second_order(mesh, plan):
    torch.manual_seed(0)
    model = _Unit()
    sharded = fd.parallelize_module(model, mesh, SECOND_ORDER_PLANS[plan])
    x = torch.randn(8, 4)
    params = sharded.params
    y = sharded.apply(params, fd.distribute_tensor(x, mesh, fd.P("dp")))
    grads = dict(zip(params, torch.autograd.grad(y.sum(), list(params.values()), create_graph=True)))
    names = ("a.weight", "b.weight")  # b.weight: rows uneven over dp
    got = {
        name: torch.autograd.grad((grads[name] * grads[name]).sum(), [params["c"]], retain_graph=True)[0]
        for name in names
    }

    def one_device(model, x):
        leaves = dict(model.named_parameters())
        grads = dict(
            zip(leaves, torch.autograd.grad(model(x).sum(), list(leaves.values()), create_graph=True))
        )
        return {
            name: torch.autograd.grad((grads[name] * grads[name]).sum(), [leaves["c"]], retain_graph=True)[0]
            for name in names
        }

    assert_close(
        {n: g.full_tensor() for n, g in got.items()},
        one_device(*in_float64((model, x))),
        one_device(model, x),
    )


class _SequenceNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.LayerNorm(6)
        self.mix = nn.Linear(6, 6)
        self.last = nn.LayerNorm(6)

    def forward(self, x):  # x: (batch, sequence, 6)
        return torch.tanh(self.last(self.mix(self.first(x))))


@pytest.mark.meshes((2, 2))
@pytest.mark.parametrize("data", ["replicate", "fully_shard"])
def test_sequence_parallel_gradients_are_summed_once(backend, mesh, data):
    """Parameters under ``SequenceParallel`` meet a sequence split over "tp": their gradients,
    each device's part, are summed over "tp" in one all-reduce per step for all of them
    (Megatron's), with a data axis's sum in the same one where it is replicated (with
    ``FullyShard`` the reduce-scatter over "dp" comes first); gradients and second derivatives
    equal one device's."""
    backend.run(_job_sequence_norms, (2, 2), ("dp", "tp"), data)


def _job_sequence_norms(mesh, data):
    torch.manual_seed(0)
    model = _SequenceNorms()
    unit = fd.ReplicateParallel("dp") if data == "replicate" else fd.FullyShard("dp")
    plan = {
        "": unit,
        "first": fd.SequenceParallel(),
        "mix": fd.SequenceParallel(),
        "last": fd.SequenceParallel(),
    }
    sharded = fd.parallelize_module(model, mesh, plan)
    x = torch.randn(4, 8, 6)
    params = sharded.params
    with fd.CommDebugMode() as comm:
        y = sharded.apply(params, fd.distribute_tensor(x, mesh, fd.P("dp")))
        loss = (y * y).sum()
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), create_graph=True)))
    summed = [e for e in comm.events if e.op == "all_reduce" and e.phase == "backward"]
    want_axes = ("dp", "tp") if data == "replicate" else ("tp",)
    assert [e.axes for e in summed] == [want_axes], comm.events  # the six gradients at once
    if data == "fully_shard":
        assert [e.op for e in comm.events if e.axes == ("dp",) and e.phase == "backward"] == [
            "reduce_scatter"
        ]
    got = {"grads": {n: g.full_tensor() for n, g in grads.items()}}
    (got["second"],) = torch.autograd.grad((grads["first.weight"] ** 2).sum(), [params["mix.weight"]])
    got["second"] = got["second"].full_tensor()

    def one_device(model, x):
        leaves = dict(model.named_parameters())
        y = model(x)
        grads = torch.autograd.grad((y * y).sum(), list(leaves.values()), create_graph=True)
        grads = dict(zip(leaves, grads, strict=True))
        (second,) = torch.autograd.grad((grads["first.weight"] ** 2).sum(), [leaves["mix.weight"]])
        return {"grads": grads, "second": second}

    assert_close(got, one_device(*in_float64((model, x))), one_device(model, x))
