"""``torch.compile`` of ``shard_map``'d functions on both backends: compiled values, gradients
and ``CommDebugMode`` counts equal the eager ones and a single-device computation, with no
graph break under ``fullgraph=True`` and no warning from the library's caches.

Compiling is slow on small machines: few cases, small shapes, ``aot_eager`` (inductor once,
marked slow).
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch
from backends import events
from catalogue import global_inputs, mapped, pick, reference
from common import assert_close, compiled_graphs

import functional_dtensor as fd


def job_compiled(
    mesh, axes, name: str, check_rep: bool, fullgraph: bool, compiler: str = "aot_eager"
) -> dict:
    """One catalogue case, eager and compiled: the global output, the gradients of the global
    inputs for a fixed cotangent, the collectives of forward and backward (compiled: called
    once outside any CommDebugMode, then twice inside, the second call running the graph
    without tracing it), and the warnings compiling gave. A compile
    error is returned, not raised: every process fails alike while tracing, before any
    collective runs."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    case = pick(mesh, axes, name, check_rep)
    f = mapped(case, mesh)

    def step(*args):
        return f(*args).full_tensor()

    def run(fn) -> dict:
        inputs = [t.requires_grad_() for t in global_inputs(case)]
        with fd.CommDebugMode() as comm:
            out = fn(*inputs)
            cotangent = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
            grads = torch.autograd.grad(out, inputs, cotangent, allow_unused=True)
        return {
            "full": out.detach(),
            "grads": [None if g is None else g.detach() for g in grads],
            "comm": events(comm),
        }

    eager = run(step)
    compiled = torch.compile(step, fullgraph=fullgraph, backend=compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            traced_unrecorded = compiled(*[t.requires_grad_() for t in global_inputs(case)])
            traced_unrecorded.sum().backward()  # a graph traced with no recorder: it records nothing
            first = run(compiled)  # a recorder: a variant of the graph that records
            second = run(compiled)
        except Exception:
            return {"error": traceback.format_exc()}
    return {
        "eager": eager,
        "first": first,
        "second": second,
        "warnings": [str(w.message) for w in caught],
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
    }


def close(got, want, what: str) -> None:
    assert_close(got, want, msg=lambda m: f"{what}: {m}")


def check(results: list[dict], mesh, axes, name: str, check_rep: bool) -> None:
    want = reference(pick(mesh.simulated(), axes, name, check_rep))
    for rank, got in enumerate(results):
        assert "error" not in got, f"process {rank}: torch.compile failed:\n{got['error']}"
        cache_warnings = [w for w in got["warnings"] if "lru_cache" in w or "incorrectness" in w]
        assert cache_warnings == [], f"process {rank}: {cache_warnings}"
        assert got["graph_breaks"] == 0, f"process {rank}"
        assert_close(got["eager"]["full"], want["full"])
        for call in ("first", "second"):
            close(got[call]["full"], want["full"], f"process {rank}, {call} call: forward")
            for i, (g, w) in enumerate(zip(got[call]["grads"], want["grads"], strict=True)):
                g = torch.zeros_like(w) if g is None else g
                close(g, w, f"process {rank}, {call} call: gradient of input {i}")
            # counted when the graph runs: the same collectives as eager, on every call
            assert got[call]["comm"] == got["eager"]["comm"], f"process {rank}, {call} call"
        assert got["eager"]["comm"], "the case communicates"


SLOW = pytest.mark.slow
CASES = [  # the first two in the default run, each compile of the others in the slow tier
    ("mlp", True, True),
    pytest.param("all_gather then psum_scatter", True, True, marks=SLOW),
    pytest.param("mlp", False, True, marks=SLOW),
    pytest.param("mlp", True, False, marks=SLOW),
    pytest.param("pmax", False, True, marks=SLOW),
]


@pytest.mark.meshes((2,))
@pytest.mark.parametrize("name, check_rep, fullgraph", CASES)
def test_compiled_equals_eager_and_counts_its_collectives(backend, mesh, name, check_rep, fullgraph):
    axes = mesh.names
    results = backend.run(job_compiled, mesh.shape, mesh.names, axes, name, check_rep, fullgraph, timeout=300)
    check(results, mesh, axes, name, check_rep)


@pytest.mark.slow
@pytest.mark.meshes((2, 2))
def test_compiled_over_axes_out_of_mesh_order(backend, mesh):
    """Two mesh axes, named against the mesh's order."""
    if not backend.is_simulated:
        pytest.skip("gloo on 4 ranks: tests/test_distributed_runtime.py compiles this case")
    results = backend.run(job_compiled, mesh.shape, mesh.names, ("y", "x"), "ppermute ring", True, True)
    check(results, mesh, ("y", "x"), "ppermute ring", True)


@pytest.mark.slow
@pytest.mark.meshes((2,))
def test_compiled_with_inductor(backend, mesh):
    results = backend.run(
        job_compiled, mesh.shape, mesh.names, ("x",), "mlp", True, True, "inductor", timeout=500
    )
    check(results, mesh, ("x",), "mlp", True)


def job_dtensors_in_and_out(mesh) -> dict:
    """A compiled function of an fd.DTensor that returns an fd.DTensor, eager and compiled: the
    output's shards and placements, and the gradient of the source tensor."""
    torch._dynamo.reset()
    f = fd.shard_map(
        lambda v: torch.sin(v) * fd.psum(v.sum(), "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x")
    )

    def run(fn) -> dict:
        source = torch.arange(8.0, requires_grad=True)
        out = fn(fd.distribute_tensor(source, mesh, fd.P("x")))
        (grad,) = torch.autograd.grad(out.full_tensor().sum(), source)
        return {
            "shards": [s.detach() for s in out.local_shards()],
            "placements": out.placements,
            "grad": grad,
        }

    return {"eager": run(f), "compiled": run(torch.compile(f, fullgraph=True, backend="aot_eager"))}


@pytest.mark.meshes((2,))
def test_compiled_function_of_dtensors(backend, mesh):
    source = torch.arange(8.0, requires_grad=True)
    want = torch.sin(source) * source.sum()
    (want_grad,) = torch.autograd.grad(want.sum(), source)
    for got in backend.run(job_dtensors_in_and_out, mesh.shape, mesh.names):
        for run in ("eager", "compiled"):
            assert got[run]["placements"] == (fd.Shard(0),)
            close(got[run]["grad"], want_grad, f"{run} gradient")
        for g, w in zip(got["compiled"]["shards"], got["eager"]["shards"], strict=True):
            close(g, w, "compiled shard")


def job_shapes(mesh) -> dict:
    """A compiled function called on three sizes of the sharded dim (the third call compiles
    a graph with a dynamic size): outputs, and bytes counted per call, eager and compiled."""
    torch._dynamo.reset()
    f = fd.shard_map(
        lambda x: fd.all_gather(torch.sin(x), "x", axis=0, tiled=True),
        mesh=mesh,
        in_specs=fd.P("x"),
        out_specs=fd.P(),
        check_rep=False,
    )

    def step(x):
        return f(x).full_tensor()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    found: dict = {"eager": [], "compiled": []}
    for rows in (4, 8, 12):
        x = torch.arange(rows * 3.0).reshape(rows, 3)
        for run, fn in (("eager", step), ("compiled", compiled)):
            with fd.CommDebugMode() as comm:
                out = fn(x)
            found[run].append((out, events(comm)))
    return found


@pytest.mark.meshes((2,), slow=("gloo-2",))  # the counting is the library's, the same on both
def test_compiled_with_changing_shapes_counts_the_bytes_of_each_call(backend, mesh):
    for got in backend.run(job_shapes, mesh.shape, mesh.names, timeout=300):
        for rows, (compiled, eager) in zip((4, 8, 12), zip(got["compiled"], got["eager"], strict=True)):
            close(compiled[0], torch.sin(torch.arange(rows * 3.0).reshape(rows, 3)), f"{rows} rows")
            assert compiled[1] == eager[1] == [("all_gather", ("x",), rows // 2 * 3 * 4)]


def job_redistribute(mesh, source, target) -> dict:
    """fd.redistribute of a distributed tensor, eager and compiled: the global value, the
    gradient of the source and the collectives of forward and backward."""
    torch._dynamo.reset()

    def step(t):
        return fd.redistribute(fd.distribute_tensor(t, mesh, source), target).full_tensor()

    def run(fn) -> dict:
        t = torch.arange(16.0).reshape(4, 4).requires_grad_()
        with fd.CommDebugMode() as comm:
            out = fn(t)
            (grad,) = torch.autograd.grad((out * out).sum(), t)
        return {"full": out.detach(), "grad": grad, "comm": events(comm)}

    return {"eager": run(step), "compiled": run(torch.compile(step, fullgraph=True, backend="aot_eager"))}


@pytest.mark.meshes((2,))
@pytest.mark.parametrize(
    "source, target",
    [(fd.P("x"), fd.P(None, "x")), ((fd.Partial("sum"),), fd.P("x"))],
    ids=["all_to_all", "reduce_scatter"],
)
def test_compiled_redistribute(backend, mesh, source, target):
    for got in backend.run(job_redistribute, mesh.shape, mesh.names, source, target, timeout=300):
        want = torch.arange(16.0).reshape(4, 4)
        for run in ("eager", "compiled"):
            close(got[run]["full"], want, f"{run} forward")
            close(got[run]["grad"], 2 * want, f"{run} gradient")
        assert got["compiled"]["comm"] == got["eager"]["comm"] != []


class _RowParallel(torch.nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8, 3))
        self.f = fd.shard_map(
            lambda x, w: fd.psum(x @ w, "x"),
            mesh=mesh,
            in_specs=(fd.P(None, "x"), fd.P("x")),
            out_specs=fd.P(),
        )

    def forward(self, x):
        return self.f(x, self.w).full_tensor()


class _Model(torch.nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.layer = _RowParallel(mesh)

    def forward(self, x):
        return self.layer(x) * 2


def job_counts_by_module(mesh) -> dict:
    """CommDebugMode's counts by module of a model, eager and compiled (twice)."""
    torch._dynamo.reset()
    model = _Model(mesh)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    found = {}
    for run, fn in (("eager", model), ("compiled", compiled), ("again", compiled)):
        with fd.CommDebugMode() as comm:
            fn(torch.ones(2, 8)).sum().backward()
        found[run] = comm.get_comm_counts_by_module()
    return found


# torch warns that global module hooks (CommDebugMode's) also see the compiled wrapper; they skip it
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
@pytest.mark.meshes((2,), slow=("gloo-2",))
def test_compiled_collectives_are_counted_under_the_module_around_the_graph(backend, mesh):
    """Modules traced into the graph run no hooks: a compiled model's collectives are counted
    under the compiled module itself, never under the compiler's wrappers."""
    for got in backend.run(job_counts_by_module, mesh.shape, mesh.names, timeout=300):
        assert got["eager"] == {"layer": {"forward": {"all_reduce": 1}}}
        assert got["compiled"] == got["again"] == {"_Model": {"forward": {"all_reduce": 1}}}


# --- what the simulated backend does not compile --------------------------------------------------


def _grad_inside(x):
    return torch.func.grad(lambda v: fd.psum((v * v).sum(), "x"))(x)


# Dynamo warns that it cannot trace the functorch query that leads to the refusal
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")
def test_a_transform_inside_the_per_device_function_is_refused_under_fullgraph():
    """On a simulated mesh a collective under a torch.func transform inside the per-device
    function runs by vmap rules that Dynamo cannot trace: fullgraph names the library's reason;
    the default mode runs that function eagerly, with the eager answer."""
    torch._dynamo.reset()
    mesh = fd.simulated_mesh(2, "x")
    f = fd.shard_map(_grad_inside, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"), check_rep=False)

    def step(x):
        return f(x).full_tensor()

    x = torch.arange(4.0)
    eager = step(x)
    with pytest.raises(Exception, match="torch.func transform inside the per-device function"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    assert_close(torch.compile(step, backend="aot_eager")(x), eager)


# --- what the simulated backend compiles into ----------------------------------------------------


def _mlp(check_rep: bool):
    """The Megatron MLP on 4 simulated devices, its global inputs (float64), and its output on
    one device."""
    f = fd.shard_map(
        lambda x, w1, w2: fd.psum(torch.relu(x @ w1) @ w2, "tp"),
        mesh=fd.simulated_mesh(4, "tp"),
        in_specs=(fd.P(), fd.P(None, "tp"), fd.P("tp", None)),
        out_specs=fd.P(),
        check_rep=check_rep,
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64, generator=g)
    w1, w2 = (torch.randn(s, dtype=torch.float64, generator=g).requires_grad_() for s in ((8, 16), (16, 8)))
    return f, (x, w1, w2), torch.relu(x @ w1) @ w2


@pytest.mark.parametrize("check_rep", [True, False])
def test_compiled_replicated_times_column_blocks_is_one_matmul(check_rep):
    """On a simulated mesh, a replicated activation times the column blocks of a weight compiles,
    as it runs eagerly, into one matmul with the whole weight (not a batched matmul against
    copies of the activation); values and gradients equal one device's."""
    f, (x, w1, w2), want = _mlp(check_rep)
    out, graphs = compiled_graphs(f, (x, w1, w2))
    assert_close(out, want)
    for got, expected in zip(
        torch.autograd.grad(out.sum(), (w1, w2)), torch.autograd.grad(want.sum(), (w1, w2))
    ):
        assert_close(got, expected)
    products = [
        (str(n.target), tuple(n.meta["val"].shape))
        for n in graphs["forward"].graph.nodes
        if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
    ]
    assert ("aten.mm.default", (3, 16)) in products, products  # the whole hidden width at once
    assert ("aten.bmm.default", (4, 3, 4)) not in products, products  # x against copies of it


@pytest.mark.parametrize("check_rep", [True, False])
def test_compiled_mlp_saves_its_activation_not_a_mask(check_rep):
    """Under inductor's partitioner and decompositions, the compiled MLP's forward saves
    ``relu``'s output for the backward, as the unsharded program's does, and no ``bool`` mask of
    it (the row-parallel matmul consumes the activation itself, not a view of it); gradients
    equal one device's."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    f, (x, w1, w2), want = _mlp(check_rep)
    out, graphs = compiled_graphs(
        f,
        (x, w1, w2),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    for got, expected in zip(
        torch.autograd.grad(out.sum(), (w1, w2)), torch.autograd.grad(want.sum(), (w1, w2))
    ):
        assert_close(got, expected)
    (returned,) = [n for n in graphs["forward"].graph.nodes if n.op == "output"]
    saved = [v.meta["val"] for v in returned.args[0] if isinstance(v, torch.fx.Node)]
    assert not [v for v in saved if v.dtype == torch.bool], [(v.dtype, tuple(v.shape)) for v in saved]
    relu = [n for n in graphs["forward"].graph.nodes if n.target == torch.ops.aten.relu.default]
    assert relu and all(n in returned.args[0] for n in relu), returned.args[0]


def test_a_compiled_backward_sums_large_data_parallel_gradients_where_they_lie():
    """On a simulated mesh, a data-parallel model's gradients of 16,384 elements or more per
    device are each summed over "dp" where they lie, compiled as eagerly: the compiled backward
    concatenates none of them (it concatenated every gradient into one bucket, copying them all
    twice: 190 ms of a 1.6 s transformer step). Gradients and the collectives counted equal the
    eager ones."""
    torch._dynamo.reset()
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    plan = {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel(), "": fd.ReplicateParallel("dp")}
    sharded = fd.parallelize_module(model.double(), mesh, plan)
    params = sharded.params
    x = fd.distribute_tensor(
        torch.linspace(-1, 1, 8 * 128, dtype=torch.float64).reshape(8, 128), mesh, fd.P("dp")
    )

    def loss_of(params, x):
        return sharded.apply(params, x).square().mean()

    found = {}
    out, graphs = compiled_graphs(loss_of, (params, x))
    torch.autograd.grad(out, list(params.values()))  # (the backward is compiled when it first runs)
    compiled = torch.compile(lambda *a: loss_of(*a).full_tensor(), fullgraph=True, backend="aot_eager")
    for run, fn in (("eager", lambda *a: loss_of(*a).full_tensor()), ("compiled", compiled)):
        with fd.CommDebugMode() as comm:
            grads = torch.autograd.grad(fn(params, x), list(params.values()))
        found[run] = ([g.full_tensor() for g in grads], comm.get_comm_counts())
    assert_close(found["compiled"][0], found["eager"][0])
    assert found["compiled"][1] == found["eager"][1]
    large = 4 * (1 << 14)
    cats = [n for n in graphs["backward"].graph.nodes if n.target == torch.ops.aten.cat.default]
    assert not [n for n in cats if n.meta["val"].numel() >= large], [tuple(n.meta["val"].shape) for n in cats]
