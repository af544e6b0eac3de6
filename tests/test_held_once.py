"""Values replicated over some mesh axes are held once on the simulated mesh: an all-reduce or
an all-gather into a Replicate axis writes each distinct result once, and the global ops on
such values run once per distinct block, not once per device. Values, gradients (first and
second order) and communication equal one device's and the distributed backend's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backends import events
from common import assert_close, compiled_graphs, held_at_any_size
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor._dtensor import held_of, storage_of
from functional_dtensor._simulated import storage

#: the library's own threshold (the tests below hold values of any size)
HELD_MIN_ELEMENTS = storage.HELD_MIN_ELEMENTS

S, R = fd.Shard, fd.Replicate()


@pytest.fixture(autouse=True)
def _small_values_held():
    with held_at_any_size():
        yield


def values(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def on_mesh(x, w1, w2, gain, mesh):
    """The block's inputs laid out as a model's: ``x`` split over the leading axes and
    replicated over the last, the weights split over the last (column, then row blocks)."""
    batch = [S(0)] * (mesh.ndim - 1)
    return [
        fd.distribute_tensor(x, mesh, [*batch, R]),
        fd.distribute_tensor(w1, mesh, [*[R] * len(batch), S(1)]),
        fd.distribute_tensor(w2, mesh, [*[R] * len(batch), S(0)]),
        fd.distribute_tensor(gain, mesh, [R] * mesh.ndim),
    ]


def block(x, w1, w2, gain, mesh=None, seen=None):
    """A tensor-parallel residual block and a gathered head (on one device where ``mesh`` is
    None)."""
    rows = None if mesh is None else [S(0)] * (mesh.ndim - 1)
    h = torch.matmul(torch.relu(torch.matmul(x, w1)), w2)  # Partial over the last axis on a mesh
    if mesh is not None:
        h = h.redistribute(placements=[*rows, R])  # one all-reduce: held once
    y = F.layer_norm(x + h, (x.shape[-1],), gain)
    z = torch.tanh(y) * y + 1
    head = torch.matmul(y, w1)  # split over tp (torch.matmul: Dynamo traces no ``@`` of objects)
    if mesh is not None:
        seen += [held_of(v) is not None for v in (h, y, z)]
        head = head.redistribute(placements=[*rows, R])  # one all-gather: held once
        seen.append(held_of(head) is not None)
    return (z * z).sum() + (F.log_softmax(head, -1) * head).sum()


def gradients(loss, inputs):
    first = torch.autograd.grad(loss, inputs, create_graph=True)
    second = torch.autograd.grad(sum([(g * g).sum() for g in first]), inputs)
    return first, second


def leaves(batch=4, d=6, hidden=8):
    return [
        values((batch, d), 1).requires_grad_(),
        values((d, hidden), 2).requires_grad_(),
        values((hidden, d), 3).requires_grad_(),
        (values((d,), 4) + 2).requires_grad_(),
    ]


def assert_each_equals(results: list, expected: dict) -> None:
    """Every process's loss, gradients and collectives equal the simulated mesh's."""
    for result in results:
        assert_close(result["loss"], expected["loss"])
        assert_close(result["first"], expected["first"])
        assert_close(result["second"], expected["second"])
        assert result["comm"] == expected["comm"]


def held_program(mesh):
    inputs, seen = leaves(), []
    laid_out = on_mesh(*inputs, mesh)
    with fd.CommDebugMode() as comm:
        loss = block(*laid_out, mesh=mesh, seen=seen).full_tensor()
    first, second = gradients(loss, inputs)
    return {"loss": loss, "first": first, "second": second, "comm": events(comm), "seen": seen}


@pytest.mark.parametrize("shape", [(2, 2), (4,), (2, 3)], ids=str)
def test_held_values_and_gradients_equal_one_device(shape):
    mesh = fd.simulated_mesh(shape, ("dp", "tp")[-len(shape) :])
    inputs = leaves(batch=4 if len(shape) == 1 else 2 * shape[0], d=6, hidden=4 * shape[-1])
    seen = []
    loss = block(*on_mesh(*inputs, mesh), mesh=mesh, seen=seen).full_tensor()
    assert seen == [True] * 4  # the all-reduce, the ops after it and the all-gather: held once
    got = gradients(loss, inputs)
    want_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    want_loss = block(*want_inputs)
    want = gradients(want_loss, want_inputs)
    assert_close(loss, want_loss)
    assert_close(got, want)


@pytest.mark.meshes((2, 2), (4,))
def test_held_program_is_the_same_on_both_backends(backend, mesh):
    """The distributed backend holds one block per rank anyway: the same values, gradients
    and collectives as the simulated mesh's held values."""
    results = backend.run(held_program, mesh.shape, mesh.names)
    expected = held_program(mesh.simulated())
    if backend.is_simulated:
        assert all(expected["seen"])
    assert_each_equals(results, expected)


def test_a_held_value_reads_as_every_devices_block():
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x = values((4, 6), 5)
    parts = fd.distribute_tensor(x, mesh, [S(0), fd.Partial()])
    held = parts.redistribute(placements=[S(0), R])
    assert held_of(held) is not None
    whole = fd.distribute_tensor(x, mesh, [S(0), R])  # (the parts sum to x)
    assert torch.equal(storage_of(held), storage_of(whole))
    assert torch.equal(held.to_local(device=3), whole.to_local(device=3))
    assert held.dtype == torch.float64 and not held.requires_grad
    assert torch.equal(held.full_tensor(), x)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(2,), (4,), (2, 2), (3, 2), (2, 2, 2)]),
    ops=st.lists(
        st.sampled_from(["sin", "exp", "square", "add", "mul", "softmax", "sum"]), min_size=1, max_size=5
    ),
    seed=st.integers(0, 2**16),
)
def test_chains_of_ops_on_held_values_equal_one_device(shape, ops, seed):
    """Random chains of global ops on a value held once along the mesh's last axis (split
    over the others), against one device, with first- and second-order gradients."""
    names = ("a", "b", "c")[: len(shape)]
    mesh = fd.simulated_mesh(shape, names)
    rows = 2 * (shape[0] if len(shape) > 1 else 1)
    x = values((rows, 4), seed).requires_grad_()
    other = values((4,), seed + 1).requires_grad_()

    def program(x, other, on_mesh):
        if on_mesh:
            split = [S(0)] * (len(shape) - 1)
            x = fd.distribute_tensor(x, mesh, [*split, fd.Partial()]).redistribute(placements=[*split, R])
            other = fd.distribute_tensor(other, mesh, [R] * len(shape))
        for op in ops:
            if op == "sum":
                x = x.sum(-1, keepdim=True) * x
            elif op == "softmax":
                x = F.softmax(x, -1)
            elif op in ("add", "mul"):
                x = getattr(torch, op)(x, other)
            else:
                x = getattr(torch, op)(x)
        if on_mesh:
            assert held_of(x) is not None
            return (x * x * other).sum().full_tensor()
        return (x * x * other).sum()

    got = gradients(program(x, other, True), [x, other])
    want_x, want_other = (t.detach().clone().requires_grad_() for t in (x, other))
    want = gradients(program(want_x, want_other, False), [want_x, want_other])
    assert_close(got, want)


def _held_over_tp(x, mesh, spec_dp):
    """``x`` laid out by ``spec_dp`` over ``dp`` and held once over ``tp`` (reduced into it)."""
    parts = fd.distribute_tensor(x, mesh, [spec_dp, fd.Partial()])
    held = parts.redistribute(placements=[spec_dp, R])
    assert held_of(held) is not None
    return held


@pytest.mark.parametrize("lookup", ["gather", "embedding"])
@pytest.mark.parametrize("split", [False, True], ids=["along a whole dim", "along a split dim"])
def test_lookups_on_held_values_equal_one_device(lookup, split):
    """A lookup on values held once over ``tp``: along a whole dim every held block looks up
    alike, one batched op for all (no per-block loop: no stack of blocks in its graph); along a
    dim split over ``dp`` each device's indices are offset by its block's start, block by
    block. Values and first and second derivatives against one device."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x = values((6, 8), 1).requires_grad_()
    if lookup == "gather":
        dim = 0 if split else 1
        index = torch.randint(x.shape[dim], (6, 3), generator=torch.Generator().manual_seed(2))
        spec_x, spec_index = S(0), S(0) if not split else R

        def program(x, index):
            return torch.gather(x, dim, index)
    else:  # the table: x; along its split rows, or rows whole (columns split)
        index = torch.tensor([[0, 5, 3], [2, 2, 4]])
        spec_x, spec_index = (S(0), R) if split else (S(1), R)

        def program(x, index):
            return F.embedding(index, x)

    def first_and_second(out_of, x):
        out = out_of(x)
        weights = values(out.shape, 3)
        (first,) = torch.autograd.grad((out.sin() * weights).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(first.square().sum(), x)
        return out.detach(), first.detach(), second

    def sharded(x):
        held = _held_over_tp(x, mesh, spec_x)
        out = program(held, fd.distribute_tensor(index, mesh, [spec_index, R]))
        if not split:
            assert held_of(out) is not None and "Stack" not in type(held_of(out).grad_fn).__name__
        return out.full_tensor()

    want = first_and_second(lambda x: program(x, index), x)
    assert_close(first_and_second(sharded, x), want)


class _Head(torch.nn.Module):
    """An embedding and a vocabulary head gathered over ``tp`` (transformers' ``lm_head``
    plan), a norm on the gathered logits and a loss: the gathered value is varied over ``tp``
    (its gradient reduce-scattered once), and the ops after it run on it held once."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 6)
        self.head = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, tokens):
        logits = self.norm(self.head(self.embed(tokens)))
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten() % 8) + (logits.tanh() * logits).mean()


_HEAD_PLAN = {"embed": "embedding_rowwise", "head": "colwise_gather_output"}


def sharded_head(mesh, unit):
    """The head's model, its tokens, the model sharded with data parallelism of ``unit`` and
    the tokens laid out over "dp"."""
    torch.manual_seed(0)
    model = _Head().double()
    tokens = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(1))
    plan = {**_HEAD_PLAN, "": fd.ReplicateParallel("dp") if unit == "replicate" else fd.FullyShard("dp")}
    return (
        model,
        tokens,
        fd.parallelize_module(model, mesh, plan),
        fd.distribute_tensor(tokens, mesh, fd.P("dp")),
    )


def head_program(mesh, unit):
    model, tokens, sharded, laid_out = sharded_head(mesh, unit)
    params = list(sharded.params.values())
    with fd.CommDebugMode() as comm:
        loss = sharded.apply(sharded.params, laid_out)
        first, second = gradients(loss.full_tensor(), params)
    return {
        "loss": loss.full_tensor(),
        "first": [g.full_tensor() for g in first],
        "second": [g.full_tensor() for g in second],
        "comm": events(comm),
        "one device": (model, tokens),
    }


@pytest.mark.parametrize("unit", ["replicate", "fully_shard"])
def test_a_gathered_head_under_data_parallelism_equals_one_device(unit):
    got = head_program(fd.simulated_mesh((2, 2), ("dp", "tp")), unit)
    model, tokens = got["one device"]
    loss = model(tokens)
    first, second = gradients(loss, list(model.parameters()))
    assert_close(got["loss"], loss)
    assert_close(got["first"], list(first))
    assert_close(got["second"], list(second))


@pytest.mark.parametrize("unit", ["replicate", pytest.param("fully_shard", marks=pytest.mark.slow)])
def test_a_compiled_gathered_head_is_one_product_of_the_held_input(unit):
    """Compiled (fullgraph), the gathered head is computed at once as it is eagerly: one product
    of the held blocks (one per "dp" row) writes the gathered logits, not one per device of its
    columns. The loss, the gradients and the collectives counted equal the eager program's."""
    _, _, sharded, laid_out = sharded_head(fd.simulated_mesh((2, 2), ("dp", "tp")), unit)
    params = list(sharded.params.values())
    found = {}
    for run in ("eager", "compiled"):
        with fd.CommDebugMode() as comm:
            if run == "eager":
                loss = sharded.apply(sharded.params, laid_out).full_tensor()
            else:
                loss, graphs = compiled_graphs(sharded.apply, (sharded.params, laid_out))
            grads = torch.autograd.grad(loss, params)
        found[run] = (loss, [g.full_tensor() for g in grads], events(comm))
    assert_close(found["compiled"][:2], found["eager"][:2])
    assert found["compiled"][2] == found["eager"][2]
    products = [
        n
        for n in graphs["forward"].graph.nodes
        if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)
    ]
    assert [tuple(n.meta["val"].shape) for n in products] == [(2, 2 * 3, 8)]


class _SubclassedLinear(torch.nn.Linear):
    """An ``nn.Linear`` of a subclass: its forward is its own, so a gathering style leaves the
    product and its all-gather apart."""


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("unit", ["replicate", "fully_shard", "none"])
@pytest.mark.parametrize("shape", [(2, 2), (4,), (3, 2)], ids=str)
def test_a_gathered_linear_is_one_product_of_the_held_input(monkeypatch, shape, unit, bias):
    """A column-parallel ``nn.Linear`` whose output the style gathers (transformers'
    ``lm_head``), on an input held once over the axis: computed gathered at once, with no
    all-gather's copy forward and no cut of the cotangent backward. The same loss, first and
    second derivatives and recorded communication as the product and the all-gather apart (a
    subclass's forward), and one device's values."""
    from functional_dtensor._backend import Backend

    if unit != "none" and len(shape) == 1:
        pytest.skip("data parallelism needs a data axis")
    names = ("dp", "tp")[-len(shape) :]
    mesh = fd.simulated_mesh(shape, names)
    copies = []

    def spied(name):
        move = getattr(Backend, name)

        def spy(*args, **kwargs):
            if kwargs.get("counted", True):  # (not a fully-sharded unit's gather: counted as its bucket)
                copies.append(name)
            return move(*args, **kwargs)

        return spy

    for name in ("all_gather_held", "slice_held"):  # the held all-gather's moves, both ways
        monkeypatch.setattr(Backend, name, spied(name))

    def run(linear_type):
        torch.manual_seed(0)
        width = 2 * shape[-1]  # a column-parallel and a row-parallel layer: its output held once
        layers = [torch.nn.Linear(6, width), torch.nn.Linear(width, 6), torch.nn.LayerNorm(6)]
        model = torch.nn.Sequential(*layers, linear_type(6, 4 * shape[-1], bias=bias)).double()
        x = values((2 * shape[0], 3, 6), 1)
        plan = {"0": "colwise", "1": "rowwise", "3": "colwise_gather_output"}
        if unit != "none":
            plan[""] = fd.ReplicateParallel("dp") if unit == "replicate" else fd.FullyShard("dp")
        sharded = fd.parallelize_module(model, mesh, plan)
        params = list(sharded.params.values())
        copies.clear()
        with fd.CommDebugMode() as comm:
            y = sharded.apply(sharded.params, fd.distribute_tensor(x, mesh, fd.P(*names[:-1])))
            loss = (y.sin() * y).sum().full_tensor()
            first, second = gradients(loss, params)
        plain = model(x)
        want = gradients((plain.sin() * plain).sum(), list(model.parameters()))
        return {
            "loss": loss,
            "first": [g.full_tensor() for g in first],
            "second": [g.full_tensor() for g in second],
            "comm": events(comm),
            "copies": list(copies),
            "one device": (plain, want),
        }

    fused, apart = run(torch.nn.Linear), run(_SubclassedLinear)
    assert fused["copies"] == [] and {"all_gather_held", "slice_held"} <= set(apart["copies"])
    plain, (first, second) = fused.pop("one device")
    apart.pop("one device"), fused.pop("copies"), apart.pop("copies")
    assert_each_equals([fused], apart)
    assert_close(fused["loss"], (plain.sin() * plain).sum())
    assert_close(fused["first"], list(first))
    assert_close(fused["second"], list(second))


def _head_job(mesh):
    out = head_program(mesh, "replicate")
    del out["one device"]
    return out


@pytest.mark.meshes((2, 2))
def test_a_gathered_head_is_the_same_on_both_backends(backend, mesh):
    results = backend.run(_head_job, (2, 2), ("dp", "tp"))
    assert_each_equals(results, _head_job(fd.simulated_mesh((2, 2), ("dp", "tp"))))


@pytest.mark.parametrize("shape", [(2, 2), pytest.param((4,), marks=pytest.mark.slow)], ids=str)
def test_a_compiled_program_holds_its_values_once(shape):
    """Compiled (fullgraph), the program holds its values once as it does eagerly: its layer
    norm runs on one block per distinct shard in the graph, not on every device's. The loss,
    the gradients and the collectives counted equal the eager program's."""
    mesh = fd.simulated_mesh(shape, ("dp", "tp")[-len(shape) :])
    inputs = leaves(batch=4 if len(shape) == 1 else 2 * shape[0], d=6, hidden=4 * shape[-1])
    found = {}
    for run in ("eager", "compiled"):
        seen = []
        program = lambda *a, seen=seen: block(*a, mesh=mesh, seen=seen)  # noqa: E731
        with fd.CommDebugMode() as comm:
            if run == "eager":
                loss = program(*on_mesh(*inputs, mesh)).full_tensor()
            else:
                loss, graphs = compiled_graphs(program, on_mesh(*inputs, mesh))
            grads = torch.autograd.grad(loss, inputs)
        assert seen == [True] * 4, (run, seen)
        found[run] = (loss, grads, events(comm))
    assert_close(found["compiled"][:2], found["eager"][:2])
    assert found["compiled"][2] == found["eager"][2]
    norms = [n for n in graphs["forward"].graph.nodes if n.target == torch.ops.aten.native_layer_norm.default]
    distinct = mesh.size // mesh.shape[-1]  # the rows of the batch: the value is replicated over "tp"
    assert [n.args[0].meta["val"].shape[0] for n in norms] == [distinct]


def test_a_compiled_function_takes_a_held_value():
    """A value held once, made eagerly, is an input like any other to a compiled function."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    x = values((4, 6), 7).requires_grad_()
    held = fd.distribute_tensor(x, mesh, [S(0), fd.Partial()]).redistribute(placements=[S(0), R])
    assert held_of(held) is not None
    compiled = torch.compile(lambda v: (v.sin() * v).sum(), fullgraph=True)
    loss = compiled(held).full_tensor()
    (grad,) = torch.autograd.grad(loss, [x])
    want = x.detach().clone().requires_grad_()
    want_loss = (want.sin() * want).sum()
    assert_close(loss, want_loss)
    assert_close(grad, torch.autograd.grad(want_loss, [want])[0])


def test_only_large_blocks_are_held():
    """Holding a value once costs Python (its own autograd nodes, a copy where it meets
    stacked storage): a small block stays stacked, a large one is held."""
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    fixture, storage.HELD_MIN_ELEMENTS = storage.HELD_MIN_ELEMENTS, HELD_MIN_ELEMENTS
    try:
        for rows, held in ((8, False), (2 * 128, True)):
            parts = fd.distribute_tensor(torch.ones(rows, 128), mesh, [S(0), fd.Partial()])
            assert (held_of(parts.redistribute(placements=[S(0), R])) is not None) is held, rows
    finally:
        storage.HELD_MIN_ELEMENTS = fixture
