"""Torch ops on fd.DTensor against the same ops on one device: values and gradients for drawn
meshes, layouts (uneven too) and shapes, the layouts the rules give (as DTensor's), the
communication they cost, both backends, and the errors of mixed and unsupported inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from backends import per_device
from common import assert_close, check, in_float64, op_catalogue
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor import _global_ops
from functional_dtensor._plan import step_bytes
from functional_dtensor.testing import strategies as fds

S, R = fd.Shard, fd.Replicate()


def values(shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def spread(t, layout, requires_grad=False):
    leaf = t.clone().requires_grad_(requires_grad)
    return leaf, fd.distribute_tensor(leaf, layout.mesh, layout)


def close(got, expected):
    assert_close(got, expected)  # float64 values: float64's tolerance


@st.composite
def layouts_for(draw, shapes, max_devices=8, allow_partial=False):
    mesh = draw(fds.meshes(max_dims=3, max_devices=max_devices))
    return [
        draw(fds.layouts(mesh, len(shape), allow_partial=allow_partial, partial_ops=("sum", "avg")))
        for shape in shapes
    ]


# --- elementwise ---------------------------------------------------------------------------------

BINARY = [torch.add, torch.sub, torch.mul, torch.div, torch.maximum, torch.atan2]


@st.composite
def broadcast_pairs(draw):
    shape = draw(fds.global_shapes(1, 3, min_side=1, max_side=7, max_elements=200))
    drop = draw(st.integers(0, len(shape) - 1))
    other = tuple(1 if draw(st.booleans()) and i > 0 else n for i, n in enumerate(shape[drop:]))
    return shape, other


@given(pair=broadcast_pairs(), data=st.data(), op=st.sampled_from(BINARY))
def test_binary_elementwise_with_broadcasting(pair, data, op):
    shape, other = pair
    lx, ly = data.draw(layouts_for([shape, other], allow_partial=True))
    ly = fd.Layout(lx.mesh, ly.placements, ly.shard_order)
    x, y = values(shape, 1), values(other, 2)
    tx, dx = spread(x, lx, True)
    ty, dy = spread(y, ly, True)
    out = op(dx, dy)
    expected = op(x, y)
    close(out.full_tensor(), expected)
    out.full_tensor().square().sum().backward()
    gx, gy = torch.autograd.grad(op(x.requires_grad_(), y.requires_grad_()).square().sum(), (x, y))
    close(tx.grad, gx)
    close(ty.grad, gy)


@given(shape=fds.global_shapes(0, 3, max_side=7, max_elements=200), data=st.data())
def test_unary_ops_scalars_and_zero_d_tensors(shape, data):
    (layout,) = data.draw(layouts_for([shape]))
    x = values(shape, 3)
    _, d = spread(x, layout)
    program = lambda v: (
        torch.exp(torch.tanh(v) * 2.0 - 1) + torch.relu(v) ** 2 / (1 + torch.sigmoid(v)) - torch.tensor(0.5)
    )
    close(program(d).full_tensor(), program(x))
    close((-d + 3).full_tensor(), -x + 3)
    close((2 - d).full_tensor(), 2 - x)
    close(torch.where(d > 0, d, d * 0.1).full_tensor(), torch.where(x > 0, x, x * 0.1))
    close(torch.clamp(d, -0.5, 0.5).full_tensor(), torch.clamp(x, -0.5, 0.5))
    assert torch.equal((d > 0).full_tensor(), x > 0)
    assert torch.equal((d == d).full_tensor(), torch.ones(shape, dtype=torch.bool))


def test_partial_values_stay_partial_where_the_op_is_linear():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    a = fd.distribute_tensor(values((4, 6), 1), mesh, fd.P(None, "x"))
    b = fd.distribute_tensor(values((6, 4), 2), mesh, fd.P("x"))
    p = a @ b
    assert p.placements == (fd.Partial("sum"), R)
    assert (p * 2).placements == p.placements and (p + p).placements == p.placements
    assert (-p).placements == p.placements
    assert not torch.exp(p).sharding.has_partial  # not linear: the partial sums are reduced first (scattered)
    close(torch.exp(p).full_tensor(), torch.exp(values((4, 6), 1) @ values((6, 4), 2)))


# --- matmul --------------------------------------------------------------------------------------


@given(
    m=st.integers(1, 7),
    k=st.integers(1, 7),
    n=st.integers(1, 7),
    batch=st.sampled_from([(), (3,), (2, 1)]),
    data=st.data(),
)
def test_matmul_values_and_gradients(m, k, n, batch, data):
    a_shape, b_shape = (*batch, m, k), (*batch[len(batch) // 2 :], k, n)
    la, lb = data.draw(layouts_for([a_shape, b_shape], allow_partial=True))
    lb = fd.Layout(la.mesh, lb.placements, lb.shard_order)
    a, b = values(a_shape, 4), values(b_shape, 5)
    ta, da = spread(a, la, True)
    tb, db = spread(b, lb, True)
    out = da @ db
    close(out.full_tensor(), a @ b)
    out.full_tensor().sin().sum().backward()
    ga, gb = torch.autograd.grad((a.requires_grad_() @ b.requires_grad_()).sin().sum(), (a, b))
    close(ta.grad, ga)
    close(tb.grad, gb)


@pytest.mark.parametrize(
    "pa, pb, expected, collectives",
    [
        (S(1), S(0), fd.Partial("sum"), 0),
        (S(0), R, S(0), 0),
        (R, S(1), S(1), 0),
        (R, R, R, 0),
        (S(0), S(1), fd.Partial("sum"), 2),  # two all_to_alls move less than one all_gather
    ],
)
def test_matmul_layouts_as_dtensor(pa, pb, expected, collectives):
    mesh = fd.simulated_mesh(4, "x")
    a = fd.distribute_tensor(values((8, 8), 1), mesh, [pa])
    b = fd.distribute_tensor(values((8, 8), 2), mesh, [pb])
    with fd.CommDebugMode() as comm:
        out = torch.matmul(a, b)
    assert out.placements == (expected,)
    assert comm.get_total_counts() == collectives
    close(out.full_tensor(), values((8, 8), 1) @ values((8, 8), 2))


@given(
    data=st.data(),
    batch=st.sampled_from([(), (5,), (3, 4)]),
    n=st.integers(1, 6),
    k=st.integers(1, 5),
    with_bias=st.booleans(),
)
@settings(max_examples=40)
def test_linear_as_one_op_on_every_layout(data, batch, n, k, with_bias):
    """``F.linear(x, w, b)`` is one op with a rule of its own (``x @ w.T + b``): on every
    layout, uneven blocks and Partial inputs included, values and derivatives of two orders
    equal one device's; where its rule needs no redistribute, no communication (the row-parallel
    product's replicated bias becomes a Partial sum's part with none)."""
    shapes = [(*batch, k), (n, k)] + ([(n,)] if with_bias else [])
    layouts = data.draw(layouts_for(shapes, allow_partial=True))
    tensors = [values(shape, seed) for seed, shape in enumerate(shapes, 1)]
    two_orders(lambda *ts: F.linear(*ts), tensors, layouts)
    inputs = [fd.distribute_tensor(t, lay.mesh, lay) for t, lay in zip(tensors, layouts)]
    _, _, decision = _global_ops.decision_for(F.linear, inputs, {})
    with fd.CommDebugMode() as comm:
        F.linear(*inputs)
    if decision.cost == 0:
        assert comm.get_total_counts() == 0


def test_linear_runs_as_one_product_with_its_bias_on_stacked_devices():
    """On the simulated mesh a linear layer's forward is one ``baddbmm`` for every device (the
    bias written with the product, as torch's ``addmm`` on one device): no add of its own, and
    ``fd.explain`` shows its one decision."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x = fd.distribute_tensor(values((4, 3, 8), 1), mesh, fd.P("dp"))
    w = fd.distribute_tensor(values((6, 8), 2).requires_grad_(), mesh, fd.P("tp"))
    bias = fd.distribute_tensor(values((6,), 3).requires_grad_(), mesh, fd.P("tp"))
    F.linear(x, w, bias)  # (decided: the decision runs the op on meta tensors)
    with torch.profiler.profile() as prof:
        y = F.linear(x, w, bias)
    ops = [e.name for e in prof.events()]
    assert "aten::baddbmm" in ops and not {"aten::add", "aten::bmm", "aten::matmul"} & set(ops), ops
    assert y.placements == (S(0), S(2))
    assert "linear: no communication" in str(fd.explain(F.linear, x, w, bias))


def test_linear_addmm_and_the_decision_cache():
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x = fd.distribute_tensor(values((8, 6), 1), mesh, fd.P("dp"))
    w = fd.distribute_tensor(values((4, 6), 2), mesh, fd.P("tp"))
    bias = fd.distribute_tensor(values((4,), 3), mesh, fd.P("tp"))
    y = F.linear(x, w, bias)
    assert y.placements == (S(0), S(1))
    close(y.full_tensor(), F.linear(values((8, 6), 1), values((4, 6), 2), values((4,), 3)))
    close(torch.addmm(bias, x, w.t()).full_tensor(), y.full_tensor())
    before = len(_global_ops._DECISIONS)
    F.linear(x, w, bias)
    assert len(_global_ops._DECISIONS) == before  # decided once


# --- reductions ----------------------------------------------------------------------------------

REDUCTIONS = ["sum", "mean", "amax", "amin", "prod"]


@given(
    shape=fds.global_shapes(1, 3, min_side=1, max_side=6, max_elements=120),
    data=st.data(),
    kind=st.sampled_from(REDUCTIONS),
)
def test_reductions_over_dims_or_all(shape, data, kind):
    (layout,) = data.draw(layouts_for([shape], allow_partial=True))
    dims = data.draw(
        st.one_of(
            st.none(), st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True)
        )
    )
    keepdim = data.draw(st.booleans())
    x = values(shape, 6)
    leaf, d = spread(x, layout, True)
    op = getattr(torch, kind)
    if kind == "prod":
        dims = None if dims is None else dims[:1]
        call = (lambda v: op(v)) if dims is None else (lambda v: op(v, dims[0], keepdim=keepdim))
    else:
        call = (lambda v: op(v)) if dims is None else (lambda v: op(v, dim=dims, keepdim=keepdim))
    out = call(d)
    close(out.full_tensor(), call(x))
    out.full_tensor().sum().backward()
    (expected,) = torch.autograd.grad(call(x.requires_grad_()).sum(), x)
    close(leaf.grad, expected)


def test_reductions_leave_partial_where_dtensor_does():
    mesh = fd.simulated_mesh(4, "x")
    d = fd.distribute_tensor(values((8, 6), 1), mesh, fd.P("x"))
    with fd.CommDebugMode() as comm:
        assert d.sum().placements == (fd.Partial("sum"),)
        assert d.sum(1).placements == (S(0),)
        assert d.mean(0).placements == (fd.Partial("sum"),)
        assert d.detach().amax(0).placements == (fd.Partial("max"),)
    assert comm.get_total_counts() == 0
    close(d.max().full_tensor(), values((8, 6), 1).max())
    close(d.norm().full_tensor(), values((8, 6), 1).norm())
    v, i = torch.max(d, 1)
    close(v.full_tensor(), values((8, 6), 1).max(1).values)
    assert torch.equal(i.full_tensor(), values((8, 6), 1).max(1).indices)


# --- views ---------------------------------------------------------------------------------------


@given(shape=fds.global_shapes(2, 3, min_side=1, max_side=6, max_elements=150), data=st.data())
def test_views(shape, data):
    (layout,) = data.draw(layouts_for([shape], allow_partial=True))
    x = values(shape, 7)
    leaf, d = spread(x, layout, True)
    programs = [
        lambda v: v.transpose(0, 1),
        lambda v: v.permute(*reversed(range(v.dim()))),
        lambda v: v.reshape(-1),
        lambda v: v.flatten(1),
        lambda v: v.unsqueeze(1).squeeze(1),
        lambda v: v[1:, ...],
        lambda v: v[:, None, 0],
        lambda v: v.unsqueeze(0).expand(2, *v.shape),
    ]
    for program in programs:
        close(program(d).full_tensor(), program(x))
    total = sum(program(d).full_tensor().sum() for program in programs)
    total.backward()
    (expected,) = torch.autograd.grad(sum(p(x.requires_grad_()).sum() for p in programs), x)
    close(leaf.grad, expected)


def test_views_keep_shards_where_the_dims_allow():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    d = fd.distribute_tensor(values((8, 6, 4), 1), mesh, fd.P("x", "y"))
    assert d.transpose(0, 1).placements == (S(1), S(0))
    assert d.T.placements == (S(2), S(1))
    assert d.reshape(8, 24).placements[0] == S(0)
    assert d.unsqueeze(0).placements == (S(1), S(2))
    assert d[:, :, 1:].placements == (S(0), S(1))


# --- along whole dims, joining, lookups, attention -------------------------------------------------


@given(shape=fds.global_shapes(2, 3, min_side=1, max_side=6, max_elements=150), data=st.data())
def test_softmax_and_norms_along_the_last_dim(shape, data):
    (layout,) = data.draw(layouts_for([shape]))
    mesh = layout.mesh
    x, w, b = values(shape, 8), values(shape[-1:], 9), values(shape[-1:], 10)
    leaf, d = spread(x, layout, True)
    wl, dw = spread(w, fd.Layout(mesh, (R,) * mesh.ndim), True)
    bl, db = spread(b, fd.Layout(mesh, (R,) * mesh.ndim), True)

    def program(v, weight, bias):
        return F.softmax(v, -1) + F.log_softmax(v, dim=-1) * F.layer_norm(v, v.shape[-1:], weight, bias)

    out = program(d, dw, db)
    close(out.full_tensor(), program(x, w, b))
    out.full_tensor().sum().backward()
    grads = torch.autograd.grad(
        program(x.requires_grad_(), w.requires_grad_(), b.requires_grad_()).sum(), (x, w, b)
    )
    for got, expected in zip((leaf.grad, wl.grad, bl.grad), grads):
        close(got, expected)


def test_cat_stack_split_chunk():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    a, b = values((4, 6), 1), values((4, 6), 2)
    da = fd.distribute_tensor(a, mesh, fd.P("x", "y"))
    db = fd.distribute_tensor(b, mesh, fd.P(None, "y"))
    close(torch.cat([da, db], dim=0).full_tensor(), torch.cat([a, b]))
    close(torch.stack([da, db], 1).full_tensor(), torch.stack([a, b], 1))
    for got, expected in zip(torch.split(da, [1, 3], dim=0), torch.split(a, [1, 3])):
        close(got.full_tensor(), expected)
    for got, expected in zip(da.chunk(3, dim=1), a.chunk(3, dim=1)):
        close(got.full_tensor(), expected)


@pytest.mark.parametrize(
    "table_spec", [fd.P(), fd.P("x"), fd.P(None, "x"), fd.P(("x", "y")), fd.P(("y", "x"))]
)
def test_embedding_with_row_sharded_tables(table_spec):
    """(Rows split by two axes in the order ("y", "x") were looked up as if split in mesh
    order: rows read from the wrong blocks.)"""
    mesh = fd.simulated_mesh((2, 3), ("x", "y"))
    table = values((11, 4), 1)
    indices = torch.tensor([[0, 10, 3], [5, 5, 7]])
    leaf = table.clone().requires_grad_()
    dt = fd.distribute_tensor(leaf, mesh, table_spec)
    di = fd.distribute_tensor(indices, mesh, fd.P("y"))
    out = F.embedding(di, dt)
    close(out.full_tensor(), F.embedding(indices, table))
    out.full_tensor().sum().backward()
    (expected,) = torch.autograd.grad(F.embedding(indices, table.requires_grad_()).sum(), table)
    close(leaf.grad, expected)


@pytest.mark.parametrize("rows", [11, 12])
@pytest.mark.parametrize("table_spec", [fd.P(), fd.P("x"), fd.P(("y", "x")), fd.P(None, "y")])
def test_embedding_gradients_even_and_uneven_tables(table_spec, rows):
    """Even tables take the simulated mesh's one lookup over every device's table (a wrong
    offset per device reads another device's rows); uneven ones the per-device form. First
    and second derivatives against one device."""
    mesh = fd.simulated_mesh((2, 3), ("x", "y"))
    table = values((rows, 6), 2).double()
    indices = torch.tensor([[0, rows - 1, 3, 6], [5, 5, 7, 11 % rows]])
    weights = values((2, 4, 6), 3).double()

    def first_and_second(lookup, table):
        leaf = table.clone().requires_grad_()
        out = lookup(leaf)
        (grad,) = torch.autograd.grad((out.sin() * weights).sum(), leaf, create_graph=True)
        (second,) = torch.autograd.grad(grad.square().sum(), leaf)
        return out.detach(), grad.detach(), second

    def sharded(t):
        di, dt = fd.distribute_tensor(indices, mesh, fd.P("x")), fd.distribute_tensor(t, mesh, table_spec)
        return F.embedding(di, dt).full_tensor()

    want = first_and_second(lambda t: F.embedding(indices, t), table)
    for got, expected in zip(first_and_second(sharded, table), want):
        close(got, expected)


def test_attention_with_batch_and_heads_sharded():
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    q, k, v = (values((2, 4, 5, 8), s) for s in (1, 2, 3))
    dq, dk, dv = (fd.distribute_tensor(t, mesh, fd.P("dp", "tp")) for t in (q, k, v))
    with fd.CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    assert out.placements == (S(0), S(1)) and comm.get_total_counts() == 0
    close(out.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_dropout_factories_and_value_comparisons():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = values((6, 5), 1)
    d = fd.distribute_tensor(x, mesh, fd.P("x", "y"))
    torch.manual_seed(3)
    first = F.dropout(d, 0.5).full_tensor()
    torch.manual_seed(3)
    again = F.dropout(fd.distribute_tensor(x, mesh, fd.P(None, "x")), 0.5).full_tensor()
    assert torch.equal(first, again)  # the same mask for every layout
    assert torch.equal(F.dropout(d, 0.5, training=False).full_tensor(), x)
    z = torch.zeros_like(d)
    assert z.placements == d.placements and torch.equal(
        z.full_tensor(), torch.zeros(6, 5, dtype=torch.float64)
    )
    partial = fd.distribute_tensor(x, mesh, fd.P(None, "x")) @ fd.distribute_tensor(x.t(), mesh, fd.P("x"))
    assert partial.placements[0] == fd.Partial("sum")
    assert torch.ones_like(partial).placements == (R, R)  # a Partial layout's ones are replicated
    assert torch.allclose(d, fd.distribute_tensor(x, mesh, fd.P("y")))
    assert torch.equal(d, d) and not torch.equal(d, d + 1)


def test_methods_and_properties():
    mesh = fd.simulated_mesh(2, "x")
    x = values((4, 3), 1)
    d = fd.distribute_tensor(x, mesh, fd.P("x"))
    assert d.numel() == 12 and d.dim() == 2 and d.device.type == "cpu"
    assert d.float().dtype == torch.float32 and d.to(torch.float16).dtype == torch.float16
    close(d.sum().item() + 0.0, float(x.sum()))
    assert d.type_as(d.float()).dtype == torch.float32
    assert d.clone().placements == d.placements and not d.detach().requires_grad


def test_to_its_own_dtype_and_device_is_the_value():
    """As torch's: ``.to`` that converts nothing returns the value itself (one dispatch less
    for the no-op conversions model code is full of); ``copy=True`` and a new dtype convert."""
    mesh = fd.simulated_mesh(2, "x")
    d = fd.distribute_tensor(values((4, 3), 1).requires_grad_(), mesh, fd.P("x"))
    for same in (d.to(d.dtype), d.to(dtype=d.dtype), d.to("cpu", d.dtype), d.to(device="cpu"), d.to()):
        assert same is d
    copied = d.to(d.dtype, copy=True)
    assert copied is not d and torch.equal(copied.full_tensor(), d.full_tensor())
    half = d.to(torch.float16)
    assert half.dtype == torch.float16 and half.placements == d.placements
    (grad,) = torch.autograd.grad(half.float().sum().full_tensor(), d)
    assert grad.dtype == d.dtype and torch.equal(grad.full_tensor(), torch.ones(4, 3, dtype=d.dtype))


# --- both backends -------------------------------------------------------------------------------


def job_program(mesh):
    """A small model of global ops: linear layers, softmax, a reduction; the local shards of
    the output and of the gradients."""
    names = mesh.axis_names
    x = fd.distribute_tensor(values((8, 6), 1), mesh, fd.P(names[0]))
    w1 = values((6, 8), 2).requires_grad_()
    w2 = values((8, 4), 3).requires_grad_()
    h = torch.relu(x @ fd.distribute_tensor(w1, mesh, fd.P(None, names[-1])))
    y = F.softmax(h @ fd.distribute_tensor(w2, mesh, fd.P(names[-1])), dim=-1)
    loss = (y * y).sum()
    loss.backward()
    return {"y": list(y.local_shards()), "loss": loss.full_tensor(), "w1": w1.grad, "w2": w2.grad}


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_global_ops_are_the_same_on_both_backends(backend, mesh):
    results = backend.run(job_program, mesh.shape, mesh.names)
    expected = job_program(mesh.simulated())
    for a, b in zip(per_device(results, "y"), expected["y"]):
        close(a, b)
    for result in results:
        for name in ("loss", "w1", "w2"):
            close(result[name], expected[name])
    x, w1, w2 = values((8, 6), 1), values((6, 8), 2).requires_grad_(), values((8, 4), 3).requires_grad_()
    y = F.softmax(torch.relu(x @ w1) @ w2, -1)
    (y * y).sum().backward()
    close(expected["w1"], w1.grad)
    close(expected["w2"], w2.grad)


# --- explain and errors ----------------------------------------------------------------------------


def test_explain_shows_the_decision():
    mesh = fd.simulated_mesh(4, "x")
    a = fd.distribute_tensor(torch.ones(8, 8), mesh, fd.P("x"))
    b = fd.distribute_tensor(torch.ones(8, 8), mesh, fd.P(None, "x"))
    report = fd.explain(torch.add, a, b)
    assert report.output.placements in ((S(0),), (S(1),)) and report.total_bytes > 0
    text = str(report)
    assert "add" in text and "all_to_all" in text and "output" in text


def test_a_users_rule_for_a_custom_op():
    @torch.library.custom_op("fd_test::rowwise_cumsum", mutates_args=())
    def rowwise_cumsum(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=-1)

    @rowwise_cumsum.register_fake
    def _(x):
        return torch.empty_like(x)

    @fd.register_sharding(rowwise_cumsum)
    def _(x):
        return [(S(0), [S(0)]), (R, [R])]

    mesh = fd.simulated_mesh(3, "x")
    x = values((7, 5), 1)
    out = rowwise_cumsum(fd.distribute_tensor(x, mesh, fd.P(None, "x")))  # uneven rows, after a move
    assert out.placements == (S(0),)
    close(out.full_tensor(), torch.cumsum(x, -1))


def test_errors_of_mixed_and_unsupported_inputs():
    mesh = fd.simulated_mesh(2, "x")
    d = fd.distribute_tensor(torch.ones(4, 4), mesh, fd.P("x"))
    check(
        fd.InputTypeError,
        TypeError,
        lambda: d + torch.ones(4, 4),
        "torch.add",
        "plain torch.Tensor",
        "fd.P()",
    )
    with fd.strict_ops():
        check(
            fd.FunctionalDTensorError,
            Exception,
            lambda: torch.fft.fft(d),
            "fft",
            "strict",
            "fd.local_map",
            "fd.register_sharding",
        )
    other = fd.distribute_tensor(torch.ones(4, 4), fd.simulated_mesh(2, "y"), fd.P())
    check(fd.MeshError, ValueError, lambda: d + other, "one mesh")
    check(
        fd.ShapeError,
        ValueError,
        lambda: d @ fd.distribute_tensor(torch.ones(3, 2), mesh, fd.P()),
        "torch.matmul",
    )
    check(fd.InputTypeError, TypeError, lambda: d.to("cuda"), "mesh's devices")
    check(fd.InputTypeError, TypeError, lambda: d[torch.tensor([0, 1])], "basic indexing")


@pytest.mark.parametrize("logits_spec", [fd.P(), fd.P("dp"), fd.P(None, "tp"), fd.P("dp", "tp")])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_with_class_sharded_logits(logits_spec, reduction):
    """Loss parallel: with the class dim sharded, no device gathers the logits (the bytes moved
    are the per-row maxima and sums, far below the logits' size)."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x, target = values((6, 40), 1), torch.tensor([1, 39, 3, 0, -100, 5])
    leaf, logits = spread(x, fd.Layout.from_spec(mesh, logits_spec), True)
    targets = fd.distribute_tensor(target, mesh, fd.P("dp") if logits_spec and logits_spec[0] else fd.P())
    with fd.CommDebugMode() as comm:
        loss = F.cross_entropy(logits, targets, reduction=reduction)
    close(loss.full_tensor(), F.cross_entropy(x, target, reduction=reduction))
    assert sum(e.nbytes for e in comm.events) < x.numel() * x.element_size() / 4
    loss.full_tensor().sum().backward()
    (expected,) = torch.autograd.grad(
        F.cross_entropy(x.requires_grad_(), target, reduction=reduction).sum(), x
    )
    close(leaf.grad, expected)


@given(data=st.data(), b=st.integers(1, 3), i=st.integers(1, 5), j=st.integers(1, 5), k=st.integers(1, 5))
def test_einsum(data, b, i, j, k):
    la, lb = data.draw(layouts_for([(b, i, j), (b, j, k)]))
    lb = fd.Layout(la.mesh, lb.placements, lb.shard_order)
    x, y = values((b, i, j), 1), values((b, j, k), 2)
    tx, dx = spread(x, la, True)
    ty, dy = spread(y, lb, True)
    for equation in ("bij,bjk->bik", "bij,bjk->kb", "bij,bjk->"):
        out = torch.einsum(equation, dx, dy)
        close(out.full_tensor(), torch.einsum(equation, x, y))
    torch.einsum("bij,bjk->ik", dx, dy).full_tensor().sum().backward()
    gx, gy = torch.autograd.grad(
        torch.einsum("bij,bjk->ik", x.requires_grad_(), y.requires_grad_()).sum(), (x, y)
    )
    close(tx.grad, gx)
    close(ty.grad, gy)


def test_an_elementwise_op_is_decided_once_for_every_value_of_a_number():
    """``x * lr`` with a new ``lr`` each step reuses its decision (numbers key it by type); a
    reduction's dim keys its decision by value."""
    mesh = fd.simulated_mesh(4, "x")
    x = values((8, 4), 1)
    d = fd.distribute_tensor(x, mesh, fd.P("x"))
    before = len(_global_ops._DECISIONS)
    for step in range(5):
        close((d * (0.5 + step)).full_tensor(), x * (0.5 + step))
        close(torch.add(d, step).full_tensor(), x + step)
    assert len(_global_ops._DECISIONS) - before == 2
    assert (fd.distribute_tensor(torch.arange(4), mesh, fd.P("x")) * 2.5).dtype == torch.float32
    assert d.sum(0).placements != d.sum(1).placements  # decided per dim


def test_basic_indexing_is_decided_once_per_index_on_the_flat_path(monkeypatch):
    """``x[:, 0]``, ``x[..., :2]``: an index of ints, slices of ints, None and ``...`` keys its
    decision as it is (slices described: unhashable before Python 3.12), so a warm call runs
    without flattening a pytree; each index its own decision."""
    mesh = fd.simulated_mesh((2, 2), ("a", "b"))
    x = values((4, 6, 8), 1)
    d = fd.distribute_tensor(x, mesh, fd.P("a"))
    indices = [
        (slice(None), 0),
        (slice(None), 1),
        (Ellipsis, slice(None, 2)),
        (Ellipsis, slice(None, 3)),
        (None, slice(None), slice(1, 5, 2)),
    ]
    before = len(_global_ops._DECISIONS)
    for index in indices:
        close(d[index].full_tensor(), x[index])
    assert len(_global_ops._DECISIONS) - before == len(indices)

    def refused(*args, **kwargs):
        raise AssertionError("a warm index call flattened its arguments as a pytree")

    monkeypatch.setattr(_global_ops, "_dispatch_tree", refused)
    for index in indices:
        close(d[index].full_tensor(), x[index])
    assert d[:, 0].placements == (S(0), R)


def test_redistribute_takes_torchs_form():
    mesh = fd.simulated_mesh(2, "x")
    d = fd.distribute_tensor(values((4, 4), 1), mesh, fd.P("x"))
    assert d.redistribute(mesh, [R]).placements == (R,)
    assert d.redistribute(device_mesh=mesh, placements=[S(1)]).placements == (S(1),)
    other = fd.simulated_mesh(2, "y")
    check(fd.MeshError, ValueError, lambda: d.redistribute(other, [R]), "redistribute(device_mesh)")


def job_ops(mesh):
    """The catalogue of op calls: every device's output shard."""
    x, w, idx = values((8, 6), 1), values((6, 8), 2), torch.tensor([[0, 5], [7, 2], [3, 3], [1, 6]])
    return {name: list(value.local_shards()) for name, value in op_catalogue(mesh, x, w, idx).items()}


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_the_op_catalogue_is_the_same_on_both_backends(backend, mesh):
    results = backend.run(job_ops, mesh.shape, mesh.names)
    expected = job_ops(mesh.simulated())
    for name, shards in expected.items():
        got = per_device(results, name)
        assert len(got) == len(shards), name
        for a, b in zip(got, shards):
            close(a, b)


def compiled_program(x, w1, w2, mesh):
    """Global ops written as torch functions and methods (Dynamo traces them; it refuses
    Python operators on a non-tensor value that defines ``__torch_function__``)."""
    names = mesh.axis_names
    X = fd.distribute_tensor(x, mesh, fd.P(names[0]))
    h = torch.matmul(X, fd.distribute_tensor(w1, mesh, fd.P(None, names[-1]))).relu()
    y = F.softmax(F.linear(h, fd.distribute_tensor(w2.t(), mesh, fd.P(None, names[-1]))), dim=-1)
    # composites (linear, norm) and a method defined in Python taking a size (unflatten)
    return torch.add(torch.mul(y.square().sum(), h.norm()), h.unflatten(1, (2, 4)).mean()).full_tensor()


def job_compiled(mesh):
    x, w1, w2 = values((8, 6), 1), values((6, 8), 2).requires_grad_(), values((8, 4), 3).requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_program, backend="aot_eager", fullgraph=True)
    out = compiled(x, w1, w2, mesh)
    grads = torch.autograd.grad(out, (w1, w2))
    eager = compiled_program(x, w1, w2, mesh)
    eager_grads = torch.autograd.grad(eager, (w1, w2))
    return {"out": out.detach(), "eager": eager.detach(), "grads": grads, "eager_grads": eager_grads}


@pytest.mark.meshes((2,), (2, 2), slow=("gloo-4", "simulated/2x2"))
def test_a_program_of_global_ops_compiles_with_fullgraph(backend, mesh):
    for result in backend.run(job_compiled, mesh.shape, mesh.names, timeout=240):
        close(result["out"], result["eager"])
        for got, expected in zip(result["grads"], result["eager_grads"]):
            close(got, expected)


def job_func_grad(mesh):
    """First and second derivatives by torch.func of a function of global values."""
    names = mesh.axis_names
    x = values((8, 6), 1)

    def loss(w):
        X = fd.distribute_tensor(x, mesh, fd.P(names[0]))
        W = fd.distribute_tensor(w, mesh, fd.P(None, names[-1]))
        return F.softmax(torch.matmul(X, W).relu(), -1).square().sum().full_tensor()

    w = values((6, 4), 2)
    return torch.func.grad(loss)(w), torch.func.grad(lambda v: torch.func.grad(loss)(v).sin().sum())(w)


@pytest.mark.meshes((2,), (2, 2))
def test_torch_func_grad_of_global_ops_to_second_order(backend, mesh):
    x, w = values((8, 6), 1), values((6, 4), 2)

    def loss(v):
        return F.softmax(torch.matmul(x, v).relu(), -1).square().sum()

    first = torch.func.grad(loss)(w)
    second = torch.func.grad(lambda v: torch.func.grad(loss)(v).sin().sum())(w)
    for got_first, got_second in backend.run(job_func_grad, mesh.shape, mesh.names):
        close(got_first, first)
        close(got_second, second)


@given(data=st.data(), op=st.sampled_from(["matmul", "add", "sum"]))
def test_the_collectives_that_run_are_the_planned_ones(data, op):
    """Every collective a global op runs is one of the steps its decision planned (fd.explain)."""
    (la, lb) = data.draw(layouts_for([(6, 4), (4, 6) if op == "matmul" else (6, 4)]))
    lb = fd.Layout(la.mesh, lb.placements, lb.shard_order)
    a = fd.distribute_tensor(values((6, 4), 1), la.mesh, la)
    b = fd.distribute_tensor(values((4, 6) if op == "matmul" else (6, 4), 2), la.mesh, lb)
    func, args = {"matmul": (torch.matmul, (a, b)), "add": (torch.add, (a, b)), "sum": (torch.sum, (a,))}[op]
    report = fd.explain(func, *args)
    with fd.CommDebugMode() as comm:
        func(*args)
    shapes = [tuple(t.shape) for t in args]
    planned = [  # the steps that move bytes (a regather of a replicated value slices locally)
        s.collective
        for steps, shape in zip(report.steps, shapes)
        for s in steps
        if s.collective and step_bytes(s, shape, 4) > 0
    ]
    assert sorted(e.op for e in comm.events) == sorted(
        op for c in planned for op in (["all_reduce", "all_gather"] if c == "all_reduce+all_gather" else [c])
    ) or len(comm.events) == len(planned)


def job_drawn(mesh, spec_a, spec_b):
    a = fd.distribute_tensor(values((8, 4), 1), mesh, spec_a)
    b = fd.distribute_tensor(values((4, 8), 2), mesh, spec_b)
    c = torch.matmul(a, b)
    d = torch.add(c, a.sum(1, keepdim=True)).amax(0)
    return {"c": list(c.local_shards()), "d": list(d.local_shards())}


@st.composite
def two_specs(draw, mesh_shape):
    mesh = fd.simulated_mesh(mesh_shape, ("x", "y")[: len(mesh_shape)])
    return draw(fds.specs(mesh, 2)), draw(fds.specs(mesh, 2))


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_drawn_layouts_give_the_simulated_shards_on_gloo(backend, mesh):
    if backend.is_simulated:
        pytest.skip("the simulated backend is the reference here")

    @settings(max_examples=8)
    @given(specs=two_specs(mesh.shape))
    def check_case(specs):
        results = backend.run(job_drawn, mesh.shape, mesh.names, *specs)
        expected = job_drawn(mesh.simulated(), *specs)
        for name in ("c", "d"):
            for got, want in zip(per_device(results, name), expected[name]):
                close(got, want)

    check_case()


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    heads=st.sampled_from([1, 2, 3, 4, 6]),
    head_dim=st.integers(1, 3),
    rows=st.integers(1, 5),
)
def test_views_that_split_or_merge_a_sharded_dim(data, heads, head_dim, rows):
    """(rows, heads * head_dim) <-> (rows, heads, head_dim): a shard of the merged dim stays on
    the heads dim, with no communication, where the devices along it divide the heads;
    otherwise the view is still right (its input redistributed)."""
    layout = data.draw(layouts_for([(rows, heads * head_dim)]))[0]
    x = values((rows, heads * head_dim))
    t, d = spread(x, layout, True)
    with fd.CommDebugMode() as comm:
        split = d.view(rows, heads, head_dim)
    close(split.full_tensor(), x.view(rows, heads, head_dim))
    devices = math.prod(n for n, p in zip(layout.mesh.shape, layout.placements) if p == fd.Shard(1))
    if devices > 1 and heads % devices == 0 and not layout.has_partial:
        assert comm.get_total_counts() == 0
        assert [p == fd.Shard(1) for p in split.placements] == [p == fd.Shard(1) for p in layout.placements]
    merged = split.reshape(rows, heads * head_dim)
    close(merged.full_tensor(), x)
    merged.full_tensor().sin().sum().backward()
    close(t.grad, x.cos())


def test_an_op_keeps_the_split_order_of_its_input():
    """A value sharded P(("tp", "dp")) (tp major, the layout FSDP gives a column-parallel
    weight): an elementwise op, a product with a replicated value and a view keep that order,
    with no communication; an op of two values in different orders pairs their blocks."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x, y = values((8, 4), 1), values((8, 4), 2)
    a = fd.distribute_tensor(x, mesh, fd.P(("tp", "dp")))
    with fd.CommDebugMode() as comm:
        outs = [a * 2.0, torch.tanh(a), a.view(8, 2, 2), a @ fd.distribute_tensor(y.T, mesh, fd.P())]
    assert comm.get_total_counts() == 0
    assert all(o.spec.__getitem__(0) == ("tp", "dp") for o in outs)
    b = fd.distribute_tensor(y, mesh, fd.P(("dp", "tp")))
    close((a + b).full_tensor(), x + y)
    close((b * a).full_tensor(), y * x)
    close(torch.einsum("ij,ij->i", a, b).full_tensor(), (x * y).sum(1))


def test_ops_along_a_dim_of_a_zero_d_value_and_split_checks():
    """Regression (fuzz): softmax/cumsum/max along dim 0 or -1 of a 0-d value (as torch allows)
    divided by zero; split of a 0-d value and chunk(0) raised ZeroDivisionError, not the
    library's error."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = torch.tensor(1.5, dtype=torch.float64)
    d = fd.distribute_tensor(x, mesh, fd.P())
    for program in (
        lambda v: F.softmax(v, 0),
        lambda v: torch.log_softmax(v, dim=-1),
        lambda v: torch.cumsum(v, -1),
    ):
        close(program(d).full_tensor(), program(x))
    values_, indices = torch.max(d, 0)
    close(values_.full_tensor(), x)
    assert torch.equal(indices.full_tensor(), torch.max(x, 0).indices)
    check(fd.ShapeError, ValueError, lambda: torch.split(d, 1, 0), "torch.split", "1-dimensional")
    row = fd.distribute_tensor(torch.arange(10.0), mesh, fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: torch.chunk(row, 0), "torch.chunk")
    for got, want in zip(torch.chunk(row, 4), torch.chunk(torch.arange(10.0), 4), strict=True):
        close(got.full_tensor(), want)


def test_matmul_of_two_dtypes_transposes_of_a_zero_d_value_and_mT():
    """Regression (fuzz): a matmul of float32 by float16 ran (meta kernels do not check dtypes)
    or failed in torch; transpose/t of a 0-d value divided by zero; ``x.mT`` was missing."""
    mesh = fd.simulated_mesh(2, "x")
    a = fd.distribute_tensor(torch.ones(2, 3), mesh, fd.P())
    b = fd.distribute_tensor(torch.ones(3, 2, dtype=torch.float16), mesh, fd.P())
    check(fd.InputTypeError, TypeError, lambda: a @ b, "torch.matmul", "float16")
    scalar = fd.distribute_tensor(torch.tensor(2.0), mesh, fd.P())
    for program in (lambda v: v.transpose(0, -1), lambda v: v.t(), lambda v: v.T):
        close(program(scalar).full_tensor(), torch.tensor(2.0))
    x = values((4, 3), 1)
    d = fd.distribute_tensor(x, mesh, fd.P("x"))
    assert d.mT.placements == (S(1),)
    close(d.mT.full_tensor(), x.mT)
    check(fd.ShapeError, ValueError, lambda: scalar.mT, "torch.transpose")


def test_an_op_that_fails_on_the_shards_is_the_librarys_error():
    """Regression (fuzz): abs of a bool value (meta kernels do not check the dtype), and an
    integer remainder by zero, raised torch's own errors from the shards."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    flags = fd.distribute_tensor(torch.tensor([True, False, True]), mesh, fd.P("x"))
    check(fd.InputTypeError, TypeError, lambda: torch.abs(flags), "torch.abs", "Bool", "Fix:")
    check(fd.InputTypeError, TypeError, lambda: flags.abs(), "torch.abs")
    ints = fd.distribute_tensor(torch.tensor([2, 3]), mesh, fd.P())
    with pytest.raises(fd.InputTypeError) as info:
        torch.remainder(ints, fd.distribute_tensor(torch.tensor([0, 1]), mesh, fd.P("y")))
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's error, chained


@pytest.mark.parametrize(
    "program",
    [
        lambda v: v - 0.25,
        lambda v: v + 1,
        lambda v: 1 - v,
        lambda v: v + torch.tensor(1.0, dtype=torch.float64),
        lambda v: torch.sub(v, other=1.0),
        lambda v: 2 / v,
        lambda v: torch.div(2, v),
    ],
)
def test_a_constant_does_not_pass_through_partial_sums(program):
    """Regression (fuzz): ``x + c`` and ``c / x`` with x Partial(sum) kept the Partial layout,
    so every device's part took the constant (a silent wrong answer: ``c`` counted once per
    device). Where the op is linear (``x * c``, ``x / c``, ``x + y``) the layout stays Partial."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = values((3, 4), 1)
    p = fd.distribute_tensor(x, mesh, [fd.Partial("sum"), S(1)])
    out = program(p)
    assert not out.sharding.has_partial
    close(out.full_tensor(), program(x))
    for linear in (lambda v: v * 2, lambda v: v / 2, lambda v: v + v, lambda v: torch.add(v, v, alpha=2)):
        assert linear(p).placements == p.placements
        close(linear(p).full_tensor(), linear(x))


def test_norm_of_an_integer_value_is_refused_as_torch_does():
    """Regression (fuzz): the norm of an int64 value returned a number where torch refuses."""
    mesh = fd.simulated_mesh(2, "x")
    d = fd.distribute_tensor(torch.arange(4), mesh, fd.P("x"))
    check(fd.ShapeError, ValueError, lambda: d.norm(), "torch.norm", "torch.int64")
    x = values((4, 3), 1)
    close(torch.norm(fd.distribute_tensor(x, mesh, fd.P("x")), dim=0).full_tensor(), torch.norm(x, dim=0))


@pytest.mark.parametrize("kind", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_an_empty_dim_list_reduces_every_dim(kind, keepdim):
    """Regression (fuzz): ``x.sum(dim=())`` reduces every dim in torch; on a sharded value it
    reduced none (a wrong value and shape), or failed in a reshape on the shards."""
    mesh = fd.simulated_mesh(4, "x")
    x = values((2, 3), 1)
    for spec in (fd.P("x"), fd.P(), fd.P(None, "x")):
        d = fd.distribute_tensor(x, mesh, spec)
        for dim in ((), []):
            out = getattr(torch, kind)(d, dim=dim, keepdim=keepdim)
            close(out.full_tensor(), getattr(torch, kind)(x, dim=dim, keepdim=keepdim))
    empty = fd.distribute_tensor(torch.zeros(0, dtype=torch.float64), mesh, fd.P("x"))
    close(torch.sum(empty, dim=()).full_tensor(), torch.zeros((), dtype=torch.float64))


def test_type_promotion_of_a_zero_d_value_with_a_dimensioned_one():
    """Regression (fuzz): a 0-d int64 value with an int32 vector gave int64 (on the simulated
    backend a 0-d value's stacked storage has a dim, and torch promoted it as dimensioned);
    torch gives int32, and float16 for a 0-d float64 with a float16 vector."""
    mesh = fd.simulated_mesh(2, "x")
    pairs = [
        (torch.tensor(3), torch.tensor([1, 2], dtype=torch.int32)),
        (torch.tensor(1.5, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float16)),
    ]
    for a, b in pairs:
        da, db = fd.distribute_tensor(a, mesh, fd.P()), fd.distribute_tensor(b, mesh, fd.P("x"))
        for program in (lambda x, y: x * 2 + y - x * y, torch.maximum, lambda x, y: x > y):
            out = program(da, db)
            assert out.dtype == program(a, b).dtype
            assert torch.equal(out.full_tensor(), program(a, b))


def test_an_integer_division_by_an_uneven_value_does_not_divide_its_padding():
    """Regression (fuzz): remainder, fmod and floor division by an integer value sharded
    unevenly (2 elements over 64 devices) failed with torch's ZeroDivisionError: the padding of
    the uneven shards holds zeros."""
    mesh = fd.simulated_mesh(64, "x")
    x, y = torch.tensor([5, 7]), torch.tensor([2, 3])
    dx, dy = fd.distribute_tensor(x, mesh, fd.P()), fd.distribute_tensor(y, mesh, fd.P("x"))
    programs = [
        torch.remainder,
        torch.fmod,
        lambda a, b: torch.div(a, b, rounding_mode="floor"),
        lambda a, b: a % (torch.abs(b) + 1),
    ]
    for program in programs:
        assert torch.equal(program(dx, dy).full_tensor(), program(x, y))
    assert torch.equal(torch.remainder(dx, dy + 0).full_tensor(), torch.remainder(x, y))


def test_cat_of_zero_d_values_is_refused_as_torch_does():
    """Regression (fuzz): torch.cat of 0-d values divided by zero in the library, where torch
    says a zero-dimensional tensor cannot be concatenated; stacking them works."""
    mesh = fd.simulated_mesh(2, "x")
    a, b = (fd.distribute_tensor(torch.tensor(v), mesh, fd.P()) for v in (1.0, 2.0))
    check(fd.ShapeError, ValueError, lambda: torch.cat([a, b]), "torch.cat", "()")
    close(torch.stack([a, b]).full_tensor(), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("shape", [(), (4,)])
def test_amax_of_complex_values_is_refused_as_torch_does(shape):
    """Regression (fuzz): amax of a 0-d complex value returned it, where torch refuses (complex
    values have no order); the meta kernel does not check the dtype."""
    mesh = fd.simulated_mesh(2, "x")
    d = fd.distribute_tensor(torch.ones(shape, dtype=torch.complex64), mesh, fd.P())
    check(fd.InputTypeError, TypeError, lambda: torch.amax(d), "torch.amax", "complex64")
    check(fd.InputTypeError, TypeError, lambda: d.amin(), "torch.amin")
    close(d.sum().full_tensor(), torch.ones(shape, dtype=torch.complex64).sum())


@pytest.mark.parametrize("table_spec", [fd.P(), fd.P("x"), fd.P(None, "x")])
def test_an_embedding_index_outside_the_table_is_the_librarys_error(table_spec):
    """Regression (fuzz): with the table's rows sharded, an index outside the table read as a
    row of zeros (each shard looks up its own rows only), where torch refuses it; an empty
    table likewise. The message names the indices outside, not the others."""
    mesh = fd.simulated_mesh(2, "x")
    indices = fd.distribute_tensor(torch.tensor([0, 5]), mesh, fd.P())
    table = fd.distribute_tensor(values((4, 3), 1), mesh, table_spec)
    check(
        fd.InputTypeError,
        TypeError,
        lambda: F.embedding(indices, table),
        "torch.embedding",
        "got indices [5]",
    )
    empty = fd.distribute_tensor(torch.zeros(0, 3, dtype=torch.float64), mesh, table_spec)
    zero = fd.distribute_tensor(torch.tensor([0]), mesh, fd.P())
    check(fd.InputTypeError, TypeError, lambda: F.embedding(zero, empty), "torch.embedding", "0 rows")


def test_cross_entropy_takes_floating_logits_and_int64_targets_as_torch():
    """Regression (fuzz): cross_entropy of int64 logits returned a loss, where torch's kernel
    refuses them."""
    mesh = fd.simulated_mesh(2, "x")
    target = fd.distribute_tensor(torch.tensor([0, 1]), mesh, fd.P())
    logits = fd.distribute_tensor(torch.tensor([[1, 2], [3, 4]]), mesh, fd.P("x"))
    check(fd.InputTypeError, TypeError, lambda: F.cross_entropy(logits, target), "F.cross_entropy", "int64")
    narrow = fd.distribute_tensor(torch.tensor([0, 1], dtype=torch.int32), mesh, fd.P())
    check(fd.InputTypeError, TypeError, lambda: F.cross_entropy(logits.double(), narrow), "torch.int32")
    close(
        F.cross_entropy(logits.double(), target).full_tensor(),
        F.cross_entropy(torch.tensor([[1.0, 2], [3, 4]], dtype=torch.float64), torch.tensor([0, 1])),
    )


@pytest.mark.parametrize("kind", ["amax", "amin", "max", "min"])
def test_a_max_of_an_uneven_bool_value(kind):
    """Regression (fuzz): amax/amin of a bool value sharded unevenly (or with empty shards)
    failed in torch.iinfo(torch.bool), finding the identity for the padding."""
    mesh = fd.simulated_mesh(4, "x")
    for x in (torch.tensor([False, True]), torch.tensor([True, True, False]), torch.tensor([False] * 5)):
        d = fd.distribute_tensor(x, mesh, fd.P("x"))
        assert torch.equal(getattr(torch, kind)(d).full_tensor(), getattr(torch, kind)(x))
        assert torch.equal(
            getattr(torch, "amax" if "max" in kind else "amin")(d, 0).full_tensor(),
            x.any() if "max" in kind else x.all(),
        )


def two_orders(fn, tensors, layouts, seed=3):
    """``fn`` of fd.DTensors of ``layouts`` against ``fn`` of ``tensors``: values, gradients
    and second derivatives (the gradient of the gradients' product with drawn tensors)."""
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]
    inputs = [fd.distribute_tensor(t, lay.mesh, lay) for t, lay in zip(leaves, layouts)]
    refs = [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]
    got, expected = fn(*inputs).full_tensor(), fn(*refs)
    close(got, expected)
    floating = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    cotangent = values(expected.shape, seed)
    firsts = [
        torch.autograd.grad((out * cotangent).sum(), [ts[i] for i in floating], create_graph=True)
        for out, ts in ((got, leaves), (expected, refs))
    ]
    for g, e in zip(*firsts):
        close(g, e)
    directions = [values(tensors[i].shape, seed + 1 + i) for i in floating]
    seconds = [
        torch.autograd.grad(
            sum((g * v).sum() for g, v in zip(grads, directions)),
            [ts[i] for i in floating],
            allow_unused=True,
        )
        for grads, ts in zip(firsts, (leaves, refs))
    ]
    for g, e, i in zip(*seconds, floating):
        zero = torch.zeros_like(tensors[i])
        close(zero if g is None else g, zero if e is None else e)


@given(data=st.data(), dim=st.integers(0, 1))
def test_gather(data, dim):
    """``torch.gather`` on every layout: the input sharded on the gathered dim (each device
    gathers from its own block, a Partial sum), uneven blocks, dims split by two axes in either
    order, a Partial input; values and derivatives of two orders."""
    x = values((5, 7), 1)
    index = torch.randint(x.shape[dim], (5, 3) if dim else (4, 7), generator=torch.Generator().manual_seed(2))
    lx, li = data.draw(layouts_for([x.shape, index.shape], allow_partial=True))
    li = fd.Layout(lx.mesh, [R if isinstance(p, fd.Partial) else p for p in li.placements], li.shard_order)
    if any(p == fd.Partial("avg") for p in lx.placements):
        lx = fd.Layout(lx.mesh, [fd.Partial() if isinstance(p, fd.Partial) else p for p in lx.placements])
    two_orders(lambda v, i: torch.gather(v, dim, i) * v.sum(), [x, index], [lx, li])


@pytest.mark.parametrize("logits_spec", [fd.P(None, "tp"), fd.P("dp", "tp"), fd.P(None, ("tp", "dp"))])
def test_cross_entropy_second_derivatives(logits_spec):
    """The class-sharded loss (the target's logit gathered from its block) against one device,
    to the second derivative, with an ignored target and uneven class blocks."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x, target = values((6, 11), 1), torch.tensor([1, 10, 3, 0, -100, 5])
    layouts = [fd.Layout.from_spec(mesh, logits_spec), fd.Layout.from_spec(mesh, fd.P())]
    two_orders(lambda v, t: F.cross_entropy(v, t) * v.square().mean(), [x, target], layouts)


def test_cross_entropy_of_a_target_outside_the_classes_is_the_librarys_error():
    """Regression: a target outside the classes read a log-probability of 0 (a one-hot pick of
    no class), a silent wrong loss, where torch refuses it."""
    mesh = fd.simulated_mesh(2, "x")
    logits = fd.distribute_tensor(values((3, 4), 1), mesh, fd.P(None, "x"))
    target = fd.distribute_tensor(torch.tensor([0, 4, 1]), mesh, fd.P())
    refused = "cross_entropy(target)", "[4]"
    check(fd.InputTypeError, TypeError, lambda: F.cross_entropy(logits, target), *refused)
    ignored = fd.distribute_tensor(torch.tensor([0, 7, 1]), mesh, fd.P())
    close(
        F.cross_entropy(logits, ignored, ignore_index=7).full_tensor(),
        F.cross_entropy(values((3, 4), 1), torch.tensor([0, 7, 1]), ignore_index=7),
    )


@pytest.mark.parametrize("threshold", [0, 1 << 40], ids=["per-device kernels", "batched"])
def test_layer_norm_on_stacked_devices(threshold, monkeypatch):
    """Both forms of a stacked layer norm (the fused op once per device; normalized at once,
    the affine weights applied after): values and derivatives of two orders, with weights
    replicated and sharded like a row of the input."""
    from functional_dtensor._simulated import batched

    monkeypatch.setattr(batched, "PER_DEVICE_KERNEL", threshold)
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x, w, b = values((4, 3, 8), 1), values((8,), 2), values((8,), 3)
    layouts = [fd.Layout.from_spec(mesh, spec) for spec in (fd.P("dp"), fd.P(), fd.P())]
    two_orders(lambda v, weight, bias: F.layer_norm(v, (8,), weight, bias).square(), [x, w, b], layouts)
    two_orders(lambda v, weight: F.rms_norm(v, (8,), weight).square(), [x, w], layouts[:2])


def test_a_linear_weights_gradient_is_row_major_on_stacked_devices():
    """``x @ w.t()`` (a linear layer): a weight of large blocks keeps its memory order in its
    gradient, as torch's mm gives it (an optimizer reads a transposed one several times slower);
    values and derivatives of two orders, for weights of small blocks (a plain product) too."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    layouts = [fd.Layout.from_spec(mesh, fd.P("dp")), fd.Layout.from_spec(mesh, fd.P("tp"))]
    for x, w in [(values((4, 5, 6), 1), values((8, 6), 2)), (values((2, 3, 64), 3), values((128, 64), 4))]:
        two_orders(lambda v, weight: F.linear(v, weight).square(), [x, w], layouts)
    weight = fd.distribute_tensor(w.clone().requires_grad_(), mesh, layouts[1])  # blocks of 64 x 64
    (grad,) = torch.autograd.grad(F.linear(fd.distribute_tensor(x, mesh, layouts[0]), weight).sum(), [weight])
    assert grad.local_shards()[0].is_contiguous() and grad.sharding == weight.sharding


def test_a_matmul_torch_refuses_is_refused_with_a_contraction_of_one():
    """Regression (fuzz): a bool matmul with a contraction of length one ran as a broadcast
    product, where torch's kernel refuses bool matrices."""
    mesh = fd.simulated_mesh(2, "x")
    a = fd.distribute_tensor(torch.ones(4, 1, dtype=torch.bool), mesh, fd.P("x"))
    b = fd.distribute_tensor(torch.ones(1, 3, dtype=torch.bool), mesh, fd.P())
    check(fd.InputTypeError, TypeError, lambda: a @ b, "matmul", "Bool")


def test_a_bool_einsum_torch_refuses_is_refused_on_every_layout():
    """Regression (the slow tier's fuzz): a bool einsum contracting a dim of length two, split
    over 64 devices, ran on blocks of one row or none, where torch's kernel contracts bool only
    over dims of length one (one device refuses): a value where torch raises. A sum of one
    operand's own label, and a contraction of length one, are computed as torch computes them."""
    mesh = fd.simulated_mesh(4, "x")
    a = fd.distribute_tensor(torch.ones(1, 2, dtype=torch.bool), mesh, fd.P())
    b = fd.distribute_tensor(torch.ones(2, 1, dtype=torch.bool), mesh, fd.P("x"))
    check(fd.InputTypeError, TypeError, lambda: torch.einsum("ij,jk->ik", a, b), "einsum", "bool", "'j': 2")
    assert torch.equal(torch.einsum("ij,k->ik", a, b[:, 0]).full_tensor(), torch.full((1, 2), 2))
    one = fd.distribute_tensor(torch.ones(1, 1, dtype=torch.bool), mesh, fd.P())
    assert torch.equal(torch.einsum("ij,jk->ik", one, one).full_tensor(), torch.ones(1, 1, dtype=torch.bool))


@pytest.mark.parametrize(
    "op", [torch.div, torch.atan2, lambda a, b: torch.pow(b.abs(), a)], ids=["div", "atan2", "pow"]
)
def test_a_broadcast_operand_takes_no_gradient_from_padding(op):
    """Regression (fuzz): with uneven blocks, ``c / y`` gave ``c`` a NaN gradient: the padding of
    ``y`` holds 0, where the derivative is infinite, and the zeroed cotangent times it (0 / 0)
    was summed into the gradient of ``c``, replicated on the device that holds no block."""
    mesh = fd.simulated_mesh(3, "x")
    c, y = values((1,), 1), values((2,), 2)
    layouts = [fd.Layout.from_spec(mesh, fd.P()), fd.Layout.from_spec(mesh, fd.P("x"))]
    two_orders(op, [c, y], layouts)
    two_orders(lambda a, b: op(a, b.unsqueeze(0)).sum(0), [values((4, 1), 3), y], [layouts[1], layouts[0]])


@torch.library.custom_op("fd_tests::softmax_rows", mutates_args=())
def _softmax_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x, dim)


@_softmax_rows.register_fake
def _(x, dim):
    return torch.empty_like(x)


@fd.register_sharding(_softmax_rows)
def _softmax_rows_sharding(x, dim):
    """torch's own strategy style (its docs' example): ``x.ndim``, a list of output placements."""
    softmax_dim = dim if dim >= 0 else dim + x.ndim
    acceptable = [([fd.Replicate()], [fd.Replicate(), None])]
    for sharding_dim in range(x.ndim):
        if sharding_dim != softmax_dim:
            acceptable.append(([fd.Shard(sharding_dim)], [fd.Shard(sharding_dim), None]))
    return acceptable


def test_register_sharding_takes_torchs_strategy_style():
    mesh = fd.simulated_mesh(4, "x")
    t = torch.randn(8, 6)
    y = _softmax_rows(fd.distribute_tensor(t, mesh, fd.P("x")), -1)
    assert y.placements == (fd.Shard(0),)
    assert_close(y.full_tensor(), torch.softmax(in_float64(t), -1), torch.softmax(t, -1))
