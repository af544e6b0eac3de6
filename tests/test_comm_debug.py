"""``fd.CommDebugMode``: wire bytes as ``explain_redistribute`` counts them, each collective's
byte formula, module paths by qualified name, forward and backward apart, compiled functions,
the dict and JSON forms, the table at 80 columns, and the DEBUG log of each collective."""

from __future__ import annotations

import json
import logging
from fractions import Fraction

import pytest
import torch
from backends import Mesh
from common import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

R, S = fd.Replicate(), fd.Shard


# --- wire bytes: the same as explain_redistribute -----------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_redistribute_wire_bytes_equal_explain_redistribute(data):
    case = data.draw(
        fds.sharded_cases(mesh=fds.meshes(max_devices=8), dtype=torch.float32, allow_partial=True)
    )
    target = data.draw(fds.layouts(case.mesh, len(case.global_shape), allow_partial=True))
    report = fd.explain_redistribute(case.layout, target, case.global_shape, dtype=case.dtype, show=False)
    x = fd.distribute_tensor(torch.ones(case.global_shape), case.mesh, case.layout)
    with fd.CommDebugMode() as comm:
        fd.redistribute(x, target)
    regathers = [s for s in report.steps if type(s).__name__ == "Regather"]
    partial_axes = [p for s in regathers for p in s.source.placements if isinstance(p, fd.Partial)]
    if len(partial_axes) <= 1:  # a regather reduces each Partial axis in turn: the plan as one group
        assert comm.get_total_wire_bytes() == report.total_bytes
    if not regathers:  # one collective per step, the same bytes
        collectives = [(s.collective, b) for s, b in zip(report.steps, report.step_bytes) if s.collective]
        assert [(e.op, e.wire_bytes) for e in comm.events] == collectives


# --- each collective's bytes, by hand -----------------------------------------------------------


MESH = fd.simulated_mesh(4, "x")  # k = 4 devices
ALL = fd.P("x")


@pytest.mark.parametrize(
    "op, f, b, wire",  # b: bytes per device, 2 or 4 float32
    [
        ("all_reduce", lambda v: fd.psum(v, "x"), 8, Fraction(2 * 3 * 8, 4)),  # 2 (k-1)/k b
        ("all_gather", lambda v: fd.all_gather(v, "x", tiled=True), 8, Fraction(3 * 8)),  # (k-1) b
        ("reduce_scatter", lambda v: fd.psum_scatter(v, "x", tiled=True), 16, Fraction(3 * 16, 4)),
        ("all_to_all", lambda v: fd.all_to_all(v, "x", 0, 0, tiled=True), 16, Fraction(3 * 16, 4)),
        ("ppermute", lambda v: fd.ppermute(v, "x", [(i, (i + 1) % 4) for i in range(4)]), 8, Fraction(8)),
    ],
)
def test_each_collectives_bytes(op, f, b, wire):
    out = {"all_reduce": fd.P(), "all_gather": fd.P()}.get(op, ALL)
    g = fd.shard_map(f, mesh=MESH, in_specs=ALL, out_specs=out, check_rep=False)
    with fd.CommDebugMode() as comm:
        g(torch.arange(b, dtype=torch.float32))  # b / 4 float32 per device: b bytes
    (event,) = comm.events
    assert (event.op, event.axes, event.group_size) == (op, ("x",), 4)
    assert (event.nbytes, event.wire_bytes) == (b, wire)
    assert comm.get_total_wire_bytes() == wire and comm.get_total_bytes() == b
    assert comm.get_wire_bytes_by_op() == {op: wire} and comm.get_bytes_by_op() == {op: b}
    assert comm.get_comm_counts_by_axis() == {("x",): {op: 1}}


def test_an_all_reduce_over_two_axes_counts_their_group():
    mesh = fd.simulated_mesh((2, 3), ("x", "y"))
    g = fd.shard_map(lambda v: fd.psum(v, ("x", "y")), mesh=mesh, in_specs=fd.P(("x", "y")), out_specs=fd.P())
    with fd.CommDebugMode() as comm:
        g(torch.ones(12))  # 2 float32 per device, 6 devices: 2 * 5/6 * 8 bytes
    assert [(e.group_size, e.wire_bytes) for e in comm.events] == [(6, Fraction(40, 3))]
    assert comm.to_dict()["totals"]["wire_bytes"] == pytest.approx(40 / 3)


def distribute_job(mesh) -> dict:
    """A tensor laid out on the mesh inside a ``CommDebugMode``: its events and its table."""
    with fd.CommDebugMode() as comm:
        fd.distribute_tensor(torch.ones(4, 6), mesh, fd.P("x"))
    console = Console(width=80, record=True)
    console.print(comm.table())
    events = [(e.op, e.axes, e.group_size, e.nbytes, e.wire_bytes) for e in comm.events]
    return {
        "events": events,
        "wire": comm.get_total_wire_bytes(),
        "table": "broadcast" in console.export_text(),
    }


@pytest.mark.meshes(Mesh((2, 2), ("x", "y")))
def test_distribute_tensor_on_ranks_counts_its_broadcasts(backend, mesh):
    """On ranks, ``fd.distribute_tensor`` broadcasts the source rank's tensor over each axis:
    each device receives its 96 bytes per axis, counted and tabulated; in one process nothing
    moves."""
    for got in backend.run(distribute_job, mesh.shape, mesh.names, timeout=120):
        if backend.world_size is None:
            assert got == {"events": [], "wire": 0, "table": False}
        else:
            broadcasts = [("broadcast", (axis,), 2, 96, Fraction(96)) for axis in ("x", "y")]
            assert got == {"events": broadcasts, "wire": Fraction(192), "table": True}


def partial_loss_job(mesh) -> dict:
    """Gradients of a loss that is a Partial sum over both axes, by ``torch.autograd.grad`` (of
    the laid-out weight) and by ``.backward()`` (into the plain tensor laid out): the
    collectives each runs, and the gradients."""
    x = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(4, 6)
    found = {}
    for how in ("grad", "backward"):
        w = torch.linspace(0.5, 2, 6, dtype=torch.float64).requires_grad_()
        w_d = fd.distribute_tensor(w, mesh, fd.P("y"))
        loss = (fd.distribute_tensor(x, mesh, fd.P("x", "y")) * w_d).sum()
        with fd.CommDebugMode() as comm:
            if how == "grad":
                (g,) = torch.autograd.grad(loss, [w_d])
            else:
                loss.backward()
                g = w.grad
        events = [(e.op, e.axes, e.phase) for e in comm.events]
        found[how] = {"events": events, "grad": g.full_tensor() if how == "grad" else g}
    found["placements"] = loss.placements
    return found


@pytest.mark.meshes(Mesh((2, 2), ("x", "y")))
def test_a_backward_from_a_partial_loss_gathers_nothing(backend, mesh):
    """Autograd starts from a one-element value's storage with the storage of a global 1 as its
    cotangent: a Partial loss's value is not gathered (an all-reduce per axis on ranks) for
    ``torch.autograd.grad`` or ``.backward()``; every collective is the backward's (the
    weight's gradient summed over the rows' axis, and its global value assembled for the plain
    tensor). The gradients are one device's."""
    x = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(4, 6)
    for got in backend.run(partial_loss_job, mesh.shape, mesh.names, timeout=120):
        assert got["placements"] == (fd.Partial(), fd.Partial())
        assert got["grad"]["events"] == [("all_reduce", ("x",), "backward")]
        for how in ("grad", "backward"):
            assert all([phase == "backward" for *_, phase in got[how]["events"]]), got[how]["events"]
            assert_close(got[how]["grad"], x.sum(0), msg=lambda m, how=how: f"{how}: {m}")


# --- module paths, phases -----------------------------------------------------------------------


class RowParallel(torch.nn.Module):
    """``x @ w`` with the contraction split over ``x``: one all-reduce forward."""

    def __init__(self, mesh):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8, 8))
        specs = (fd.P(None, "x"), fd.P("x"))
        self.f = fd.shard_map(lambda x, w: fd.psum(x @ w, "x"), mesh=mesh, in_specs=specs, out_specs=fd.P())

    def forward(self, x):
        return self.f(x, self.w).full_tensor()


class Two(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.first, self.second = RowParallel(mesh), RowParallel(mesh)

    def forward(self, x):
        return self.second(self.first(x))


def test_two_children_of_one_class_have_their_own_paths():
    model = Two(MESH)
    with fd.CommDebugMode() as comm:
        model(torch.ones(2, 8)).sum().backward()
    assert comm.get_comm_counts_by_module() == {
        "first": {"forward": {"all_reduce": 1}},
        "second": {"forward": {"all_reduce": 1}},
    }


def mlp_job(mesh) -> dict:
    """A 2-layer MLP, column- then row-parallel over ``tp`` and fully sharded over ``dp``: its
    collectives by module and phase, a training step's."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    plan = {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel(), "": fd.FullyShard("dp")}
    params, apply = fd.parallelize_module(mlp, mesh, plan)
    x = fd.distribute_tensor(torch.randn(4, 8), mesh, fd.P("dp"))
    with fd.CommDebugMode() as comm:
        loss = apply(params, x).full_tensor().square().sum()
        torch.autograd.grad(loss, list(params.values()))
    return {"by_module": comm.get_comm_counts_by_module(), "totals": comm.to_dict()["totals"]}


@pytest.mark.meshes(Mesh((2, 2), ("dp", "tp")), Mesh((2, 1), ("dp", "tp")))
def test_forward_and_backward_per_module_of_a_parallelized_mlp(backend, mesh):
    results = backend.run(mlp_job, mesh.shape, mesh.names, timeout=300)
    expected = mlp_job(fd.simulated_mesh(mesh.shape, mesh.names))
    by_module = expected["by_module"]
    # forward: the parameters gathered over dp in the root (FSDP: the four in one all-gather);
    # over tp, the partial output of the row-parallel layer summed in its own module
    assert by_module["Sequential"]["forward"] == {"all_gather": 1}
    if mesh.shape == (2, 2):
        assert by_module["2"]["forward"] == {"all_reduce": 1}
    # backward: the gradients of the 4 gathered parameters reduced back over dp in one
    # reduce-scatter, under the module whose backward runs then (paths relative to the root:
    # "0", never "Sequential.0")
    backward = {m: phases["backward"] for m, phases in by_module.items() if "backward" in phases}
    assert set(backward) <= {"Sequential", "0", "2"} and "0" in backward
    assert sum(n for ops in backward.values() for n in ops.values()) == 1
    for got in results:
        assert got == expected


# --- compiled functions -------------------------------------------------------------------------


def test_a_compiled_function_counts_when_its_graph_runs():
    torch._dynamo.reset()
    f = fd.shard_map(lambda v: fd.psum(v.sin(), "x"), mesh=MESH, in_specs=ALL, out_specs=fd.P())
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.arange(8.0, requires_grad=True)
    for _ in range(2):
        with fd.CommDebugMode() as comm:
            compiled(x).sum().backward()
        assert [(e.op, e.phase, e.wire_bytes) for e in comm.events] == [("all_reduce", "forward", 12)]


# --- dict, JSON, table, log ---------------------------------------------------------------------


def test_dict_and_json_forms():
    model = Two(MESH)
    with fd.CommDebugMode() as comm:
        model(torch.ones(2, 8))
    data = comm.to_dict()
    assert data["totals"] == {"count": 2, "input_bytes": 64 * 2, "wire_bytes": 96 * 2}
    assert data["events"][0] == {
        "op": "all_reduce",
        "axes": ["x"],
        "group_size": 4,
        "input_bytes": 64,  # 2 x 8 float32 per device
        "wire_bytes": 96,  # 2 (k-1)/k of it
        "module": "first",
        "phase": "forward",
    }
    assert [row["module"] for row in data["rows"]] == ["first", "second"]
    assert json.loads(comm.to_json()) == data


def test_the_table_fits_80_columns():
    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder_layers = torch.nn.ModuleList([Two(MESH)])

        def forward(self, x):
            return self.encoder_layers[0](x)

    with fd.CommDebugMode() as comm:
        Deep()(torch.ones(2, 8))
    console = Console(record=True, width=80, color_system=None)
    console.print(comm.table())
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "module" in line)
    assert header.split() == ["module", "phase", "op", "axes", "count", "input", "B", "wire", "B"]
    # the long path breaks after a dot, not inside a name
    assert "encoder_layers.0." in text and "first" in text and "encoder_layers.0.first" not in text
    total = next(line for line in lines if line.strip().startswith("total"))
    assert total.split() == ["total", "2", "128", "192"]
    assert text.count("all_reduce") == 2 and "fwd" in text


def test_each_collective_is_logged_at_debug(caplog):
    f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=MESH, in_specs=ALL, out_specs=fd.P())
    with caplog.at_level(logging.DEBUG, logger="functional_dtensor.collectives"):
        f(torch.ones(8))
    (message,) = [r.getMessage() for r in caplog.records if r.name == "functional_dtensor.collectives"]
    assert message.startswith("all_reduce over x (4 devices): 8 bytes in, 12 bytes on the wire")
    caplog.clear()
    f(torch.ones(8))  # off: nothing logged
    assert not [r for r in caplog.records if r.name == "functional_dtensor.collectives"]
