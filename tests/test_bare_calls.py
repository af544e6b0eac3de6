"""Warm calls of a ``shard_map`` on a simulated mesh of one axis run bare: no torch-function
mode between the function's ops, the device vmap's batching recording which values vary (see
``shard_map``). They must answer as the first call does, which runs under the replication
tracker, and as one device does: values, gradients of the first and second order, forward
mode, communication counts, errors, and the caller's memory.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from backends import events
from catalogue import cases, check_rep_as, compare, derivatives, global_inputs, mapped, pick
from common import assert_close, with_long_run
from hypothesis import strategies as st

import functional_dtensor as fd

P = fd.P
CASE_NAMES = [c.name for c in cases(fd.simulated_mesh(2, "x"), ("x",))]
#: the catalogue's cases with a product: the backend's own batching rule runs it, under a mode
WITH_PRODUCTS = {"local matmul", "tensor-parallel matmul + psum", "mlp"}
DRAWN, DRAWN_LONG = 15, 80


def mode_on() -> bool:
    return bool(torch.overrides._get_current_function_mode_stack())


def recording(f, seen: list):
    """``f``, noting on each call whether a torch-function mode is on."""

    def body(*args):
        seen.append(mode_on())
        return f(*args)

    return body


def test_warm_calls_on_one_axis_run_no_mode():
    x, w = torch.arange(8.0).reshape(4, 2), torch.ones(2, 2)
    seen: list = []
    f = fd.shard_map(
        recording(lambda v: v * 2, seen), mesh=fd.simulated_mesh(4, "x"), in_specs=P("x"), out_specs=P("x")
    )
    for _ in range(3):
        f(x)
    assert seen == [True, False, False]
    # a product keeps the mode: the backend's rule runs it as one kernel
    seen.clear()
    g = fd.shard_map(
        recording(lambda v, m: v @ m, seen),
        mesh=fd.simulated_mesh(4, "x"),
        in_specs=(P("x"), P()),
        out_specs=P("x"),
    )
    for _ in range(3):
        g(x, w)
    assert seen == [True, True, True]
    # two axes: a value may vary over one and not the other, which the tracker records
    seen.clear()
    h = fd.shard_map(
        recording(lambda v: v * 2, seen),
        mesh=fd.simulated_mesh((2, 2), ("x", "y")),
        in_specs=P("x"),
        out_specs=P("x"),
    )
    for _ in range(3):
        h(x)
    assert seen == [True, True, True]


@with_long_run(
    DRAWN_LONG,
    st.integers(1, 8),
    st.sampled_from(CASE_NAMES),
    st.booleans(),
    st.integers(0, 99),
    default_examples=DRAWN,
)
@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr Node")  # torch.func.linearize's
@pytest.mark.parametrize("mode", ("values", "hvp", "jvp", "jvp of grad"))
def test_warm_calls_match_the_first_and_one_device(mode, n, name, check_rep, seed):
    mesh = fd.simulated_mesh(n, "x")
    seen: list = []
    case = check_rep_as(pick(mesh, ("x",), name), check_rep)
    case = dataclasses.replace(case, f=recording(case.f, seen))
    f = mapped(case, mesh)
    xs, vs = global_inputs(case, seed=seed), global_inputs(case, seed=seed + 100)
    what = f"{mode} of {name} on {n} devices, check_rep={case.check_rep}"
    if mode == "values":
        runs = [_value_and_gradient(f, xs) for _ in range(2)]
        want = _value_and_gradient(case.reference, xs)
        for got in runs:
            compare(got["results"], want["results"], what)
        assert runs[1]["forward"] == runs[0]["forward"] and runs[1]["backward"] == runs[0]["backward"], what
    else:
        f(*xs)  # the first call, under the mode
        compare(derivatives(mode, f, xs, vs), derivatives(mode, case.reference, xs, vs), what)
    assert seen[0], what  # the first call runs under the mode
    # warm calls run bare, but for a product (where a replicated value also meets per-device
    # ones: its gradient sums the devices' parts, which the tracker marks), or under torch.func
    bare = mode in ("values", "hvp") and name not in WITH_PRODUCTS
    assert all(on != bare for on in seen[1:]), (what, seen)


def _value_and_gradient(f, xs):
    """The global value of ``f`` at ``xs``, the gradients of ``sum(sin(y) * y)``, and the
    collectives of the forward and the backward."""
    inputs = [x.detach().requires_grad_() for x in xs]
    with fd.CommDebugMode() as forward:
        out = f(*inputs)
    with fd.CommDebugMode() as backward:
        full = out.full_tensor() if isinstance(out, fd.DTensor) else out
        grads = torch.autograd.grad((torch.sin(full) * full).sum(), inputs, allow_unused=True)
    grads = [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads, strict=True)]
    return {"results": [full.detach(), *grads], "forward": events(forward), "backward": events(backward)}


def test_a_warm_call_that_breaks_its_out_spec_is_refused():
    """The first call returns a replicated value; a warm one (bare) returns a varying one
    under the same spec ``P()``: refused as the tracker refuses it."""
    mesh = fd.simulated_mesh(4, "x")
    f = fd.shard_map(
        lambda x, reduce: fd.psum(x, "x") if reduce else x * 2,
        mesh=mesh,
        in_specs=(P("x"), None),
        out_specs=P(),
    )
    x = torch.arange(8.0)
    assert_close(f(x, True).full_tensor(), x.reshape(4, 2).sum(0))
    for _ in range(2):
        with pytest.raises(fd.SpecError, match=r"claims the output is replicated over \('x',\)"):
            f(x, False)


def test_random_values_in_a_warm_call_vary_over_the_devices():
    mesh = fd.simulated_mesh(4, "x")
    f = fd.shard_map(
        lambda x, draw: x + torch.rand(x.shape) if draw else fd.psum(x, "x"),
        mesh=mesh,
        in_specs=(P(), None),
        out_specs=P(),
    )
    x = torch.zeros(3)
    f(x, False)
    with pytest.raises(fd.SpecError, match="replicated"):
        f(x, True)
    g = fd.shard_map(lambda x: x + torch.rand(x.shape), mesh=mesh, in_specs=P(), out_specs=P("x"))
    for _ in range(2):
        blocks = g(x).full_tensor().reshape(4, 3)
        assert all(not torch.equal(blocks[0], blocks[d]) for d in range(1, 4))


def test_a_product_first_met_in_a_warm_call_runs_by_vmap_and_sums_the_replicated_gradient():
    """A product the first call did not make runs bare, by functorch's own rule; the gradient
    of the replicated weight is the sum of the devices' parts, as on one device."""
    mesh = fd.simulated_mesh(4, "x")
    f = fd.shard_map(
        lambda x, w, multiply: x @ w if multiply else x[:, :2] * 1,
        mesh=mesh,
        in_specs=(P("x"), P(), None),
        out_specs=P("x"),
    )
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    f(x, w, False)
    for _ in range(2):
        y = f(x, w, True).full_tensor()
        assert_close(y, x @ w)
        got = torch.autograd.grad((torch.sin(y) * y).sum(), (x, w), create_graph=True)
        want = torch.autograd.grad((torch.sin(x @ w) * (x @ w)).sum(), (x, w), create_graph=True)
        for a, b in zip(got, want, strict=True):
            assert_close(a, b)
        # second order: the gradient of the weight's gradient's sum
        assert_close(torch.autograd.grad(got[1].sum(), x)[0], torch.autograd.grad(want[1].sum(), x)[0])


def test_a_numpy_backed_input_is_copied_in_a_warm_call_and_never_written():
    numpy = pytest.importorskip("numpy")
    mesh = fd.simulated_mesh(2, "x")
    f = fd.shard_map(
        lambda x, write: x.add_(1) if write else x * 1, mesh=mesh, in_specs=(P("x"), None), out_specs=P("x")
    )
    x = torch.from_numpy(numpy.arange(4.0))
    assert_close(f(x, False).full_tensor(), torch.arange(4.0, dtype=torch.float64))
    with pytest.raises(fd.ImmutableError, match=r"args\[0\]"):
        f(x, True)
    assert torch.equal(x, torch.arange(4.0, dtype=torch.float64))


def test_a_transform_inside_a_warm_unchecked_call():
    mesh = fd.simulated_mesh(4, "x")
    g = fd.shard_map(
        lambda v: torch.func.grad(lambda t: fd.psum(t.sum(), "x"))(v),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_rep=False,
    )
    for _ in range(2):  # unchecked, psum transposes to psum: every device's copy counts
        assert_close(g(torch.randn(8)).full_tensor(), torch.full((8,), 4.0))


def test_dropout_by_key_in_a_warm_call_draws_what_the_first_drew():
    mesh = fd.simulated_mesh(4, "x")
    key = fd.random.key(0)
    f = fd.shard_map(lambda x: fd.random.dropout(key, x, 0.5), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = torch.ones(64)
    first, warm = f(x).full_tensor(), f(x).full_tensor()
    assert torch.equal(first, warm)
    blocks = first.reshape(4, 16)
    assert not all(torch.equal(blocks[0], blocks[d]) for d in range(1, 4))  # each device its own mask


#: every row of the check_rep table (docs/concepts/shard_map.md) on a one-axis mesh of 4
RING = [(i, (i + 1) % 4) for i in range(4)]
TABLE = {
    "torch op": lambda v: torch.sin(v) * 2,
    "psum": lambda v: fd.psum(v, "x"),
    "pmean": lambda v: fd.pmean(v, "x"),
    "pmax": lambda v: fd.pmax(v, "x"),
    "all_gather": lambda v: fd.all_gather(v, "x"),
    "all_gather tiled": lambda v: fd.all_gather(v, "x", axis=0, tiled=True),
    "psum_scatter": lambda v: fd.psum_scatter(fd.all_gather(v, "x", axis=0, tiled=True), "x", tiled=True),
    "all_to_all": lambda v: fd.all_to_all(v.reshape(4, 1), "x", 0, 1, tiled=True),
    "ppermute": lambda v: fd.ppermute(v, "x", RING),
    "axis_index": lambda v: v * 0 + fd.axis_index("x"),
    "fd.random draw": lambda v: v + fd.random.normal(fd.random.key(1), v.shape),
    "fd.random dropout": lambda v: fd.random.dropout(fd.random.key(1), v, 0.5),
    "torch.rand": lambda v: fd.psum(v, "x") + torch.rand(()),
    "pvary": lambda v: fd.pvary(fd.psum(v, "x"), "x"),
}


@pytest.mark.parametrize("out_spec", [P(), P("x")], ids=["P()", "P(x)"])
@pytest.mark.parametrize("name", list(TABLE))
def test_each_rule_of_the_table_answers_in_a_warm_call_as_in_the_first(name, out_spec):
    """The value, or the refusal of an out spec that claims replication, of a warm call (bare:
    its first call took another branch) against a first call's (the tracker's)."""
    mesh = fd.simulated_mesh(4, "x")
    op = TABLE[name]
    first = fd.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=out_spec)
    warm = fd.shard_map(
        lambda v, take: op(v) if take else fd.pmax(v, "x"),
        mesh=mesh,
        in_specs=(P("x"), None),
        out_specs=out_spec,
    )
    x = torch.arange(16.0)
    warm(x, False)
    answers = []
    for call in (lambda: first(x), lambda: warm(x, True)):
        try:
            torch.manual_seed(0)
            answers.append(call().full_tensor())
        except fd.SpecError as error:
            answers.append(str(error))
    if isinstance(answers[0], str):
        assert answers[1] == answers[0]
    else:
        assert_close(answers[1], answers[0])
