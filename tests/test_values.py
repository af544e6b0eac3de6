"""Values you can trust, on both backends: an ``fd.DTensor`` shares no memory a caller can still
change, nothing the library runs changes a caller's tensor, and values save and load bit-exact.

Each job runs on the simulated mesh and on gloo ranks (see :mod:`backends`); the test compares
what came back with the global tensor the job started from, cut by the plain ``torch.chunk``
oracle of :mod:`backends`.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from backends import Backend, block, coordinates, local_devices, local_of, per_device
from common import assert_close

import functional_dtensor as fd

S, R, Pa = fd.Shard, fd.Replicate(), fd.Partial


def original(shape, dtype=torch.float64) -> torch.Tensor:
    """Distinct values, the same in every process."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 - 1).to(dtype)


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    address = a.untyped_storage().data_ptr()
    return address != 0 and address == b.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# distribute_tensor and from_local copy what they would share; copy=False opts out.

SPECS = [fd.P("x"), fd.P(), fd.P(None, "x"), fd.P(("x",))]


def job_distribute_then_modify_the_source(mesh, shape, specs) -> list[dict]:
    """Each spec: distribute a tensor, then change the tensor in place; the value's shards, and
    whether ``copy=False`` shares memory with the tensor."""
    out = []
    for spec in specs:
        tensor = original(shape)
        x = fd.distribute_tensor(tensor, mesh, spec)
        # every rank's own tensor (src_data_rank=None): received data could not share its memory
        shared = fd.distribute_tensor(tensor, mesh, spec, copy=False, src_data_rank=None)
        aliased = any(shares_memory(s, tensor) for s in shared.local_shards())
        tensor.mul_(-7).add_(3)
        out.append({"shards": list(x.local_shards()), "full": x.full_tensor(), "aliased": aliased})
    return out


@pytest.mark.meshes((2,), (4,))
def test_distribute_tensor_owns_its_memory(backend, mesh):
    """Every layout: changing the source afterwards leaves the value as it was. The opt-out
    ``copy=False`` shares memory where the layout allows views (an even split of rows; a
    replicated value, held once or as this rank's whole tensor)."""
    shape = (2 * mesh.size, 3)
    results = backend.run(job_distribute_then_modify_the_source, mesh.shape, mesh.names, shape, SPECS)
    value = original(shape)
    for k, spec in enumerate(SPECS):
        answers = [r[k] for r in results]
        shards = per_device(answers, "shards")
        for coordinate, got in zip(coordinates(mesh.shape), shards):
            want = block(value, mesh.shape, mesh.names, spec, coordinate)
            assert torch.equal(got, want), (spec, coordinate)
        assert all(torch.equal(a["full"], value) for a in answers), spec
        if spec != fd.P(None, "x"):  # stacked column blocks are a copy on the simulated backend
            assert all(a["aliased"] for a in answers), f"{spec}: copy=False copied"


def job_uneven_and_partial_values_do_not_alias(mesh) -> list[torch.Tensor]:
    tensor = original((5, 3))
    values = [fd.distribute_tensor(tensor, mesh, p) for p in ((S(0),), (Pa("sum"),), (Pa("max"),))]
    tensor.zero_()
    return [v.full_tensor() for v in values]


@pytest.mark.meshes((2,), (4,))
def test_uneven_and_partial_layouts_do_not_alias_either(backend, mesh):
    for answer in backend.run(job_uneven_and_partial_values_do_not_alias, mesh.shape, mesh.names):
        for full in answer:
            assert_close(full, original((5, 3)))


def job_from_local_then_modify(mesh) -> dict:
    """from_local of every device's shard and of one shard every device holds; then the local
    tensors change in place. The gradient reaches the local tensors through the copy."""
    shards = [original((2, 3)) + d for d in range(mesh.size)]
    local = local_of(mesh, shards)
    leaves = [t.clone().requires_grad_() for t in local] if isinstance(local, list) else local.clone()
    if not isinstance(leaves, list):
        leaves.requires_grad_()
    sharded = fd.from_local(leaves, mesh, fd.P("x"))
    same = original((2, 3)).requires_grad_()
    replicated = fd.from_local(same, mesh, fd.P())
    shared = fd.from_local(same.detach(), mesh, fd.P(), copy=False)
    aliased = shares_memory(shared.local_shards()[0], same)
    (sharded.full_tensor().sum() + replicated.full_tensor().sum()).backward()
    grads = [t.grad for t in (leaves if isinstance(leaves, list) else [leaves])]
    with torch.no_grad():
        for t in leaves if isinstance(leaves, list) else [leaves]:
            t.zero_()
        same.zero_()
    return {
        "sharded": list(sharded.local_shards()),
        "replicated": list(replicated.local_shards()),
        "aliased": aliased,
        "grads": grads,
        "same_grad": same.grad,
    }


@pytest.mark.meshes((2,), (4,))
def test_from_local_owns_its_memory(backend, mesh):
    results = backend.run(job_from_local_then_modify, mesh.shape, mesh.names)
    shards = per_device(results, "sharded")
    assert all(torch.equal(s, original((2, 3)) + d) for d, s in enumerate(shards))
    assert all(torch.equal(s, original((2, 3))) for s in per_device(results, "replicated"))
    assert all(r["aliased"] for r in results), "copy=False copied"
    assert all(torch.equal(g, torch.ones(2, 3, dtype=torch.float64)) for g in per_device(results, "grads"))
    assert all(r["same_grad"] is not None for r in results)  # through the copy


# ---------------------------------------------------------------------------------------------
# Inside shard_map, inputs are values: an in-place op on one is an error before it runs.

WRITES = {
    "method": lambda x: x.mul_(2),
    "operator": lambda x: x.__iadd__(1),
    "augmented": None,  # x += 1, below
    "view": lambda x: x[0].add_(1),
    "setitem": lambda x: x.__setitem__(0, 5.0),
    "out": lambda x: torch.add(x, 1, out=x),
    "inplace_kwarg": lambda x: torch.nn.functional.relu(x, inplace=True),
    "init": lambda x: torch.nn.init.zeros_(x),
}


def _write(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "augmented":
        x += 1
    else:
        WRITES[name](x)
    return x


def job_in_place_on_inputs(mesh, check_rep: bool) -> list[dict]:
    """Every write, into a tensor argument and into a DTensor argument, sharded and replicated,
    on a first call and on a warm one (after a call that wrote nothing: on a simulated mesh of
    one axis it runs bare, see ``shard_map``); whether it raised ``ImmutableError`` and what
    the caller holds afterwards."""
    out = []
    for name in WRITES:
        for spec in (fd.P("x"), fd.P()):
            for as_dtensor in (False, True):
                for warm in (False, True):
                    tensor = original((2 * mesh.size, 3))
                    argument = fd.distribute_tensor(tensor, mesh, spec) if as_dtensor else tensor
                    f = fd.shard_map(
                        lambda x, write, name=name: _write(name, x) if write else x * 1,
                        mesh=mesh,
                        in_specs=(spec, None),
                        out_specs=spec,
                        check_rep=check_rep,
                    )
                    if warm:
                        f(argument, False)
                    try:
                        f(argument, True)
                        error = None
                    except fd.ImmutableError as e:
                        error = str(e)
                    held = argument.full_tensor() if as_dtensor else tensor
                    out.append({"case": (name, str(spec), as_dtensor, warm), "error": error, "held": held})
    return out


@pytest.mark.meshes((2,), (4,))
@pytest.mark.parametrize("check_rep", [True, False], ids=["check_rep", "unchecked"])
def test_in_place_op_on_an_input_is_an_error_and_changes_nothing(backend, mesh, check_rep):
    for answer in backend.run(job_in_place_on_inputs, mesh.shape, mesh.names, check_rep):
        for got in answer:
            assert got["error"] is not None, f"{got['case']}: no error"
            assert "fd.shard_map(" in got["error"] and "args[0]" in got["error"], got["error"]
            assert "clone" in got["error"], got["error"]
            assert torch.equal(got["held"], original((2 * mesh.size, 3))), f"{got['case']}: modified"


def job_in_place_on_own_values(mesh, check_rep: bool) -> torch.Tensor:
    """In-place ops on the function's own tensors are fine (and a clone of an input is its own)."""

    def f(x, w):
        y = x * 2
        y.add_(1)
        z = w.clone()
        z.mul_(3)
        y += z.sum()
        return y

    f = fd.shard_map(f, mesh=mesh, in_specs=(fd.P("x"), fd.P()), out_specs=fd.P("x"), check_rep=check_rep)
    return f(original((2 * mesh.size, 3)), torch.ones(2)).full_tensor()


@pytest.mark.meshes((2,), (4,))
@pytest.mark.parametrize("check_rep", [True, False], ids=["check_rep", "unchecked"])
def test_in_place_ops_on_the_functions_own_values_run(backend, mesh, check_rep):
    expected = original((2 * mesh.size, 3)) * 2 + 1 + 6
    for full in backend.run(job_in_place_on_own_values, mesh.shape, mesh.names, check_rep):
        assert torch.equal(full, expected)


def job_outputs_returned_inputs(mesh, check_rep: bool) -> list[torch.Tensor]:
    """A function that returns its tensor inputs (and views of them) as they are; then the
    caller changes its tensors in place. The outputs of a first call and of a warm one."""

    def f(rows, whole):
        return rows, whole, rows[:, :1], whole.view(-1)

    specs = (fd.P("x"), fd.P())
    f = fd.shard_map(f, mesh=mesh, in_specs=specs, out_specs=(*specs, fd.P("x"), fd.P()), check_rep=check_rep)
    rows, whole = original((2 * mesh.size, 3)), original((2, 2))
    outputs = [*f(rows, whole), *f(rows, whole)]
    rows.add_(100)
    whole.add_(100)
    return [y.full_tensor() for y in outputs]


@pytest.mark.meshes((2,), (4,))
@pytest.mark.parametrize("check_rep", [True, False], ids=["check_rep", "unchecked"])
def test_outputs_share_no_memory_with_the_callers_tensors(backend, mesh, check_rep):
    rows, whole = original((2 * mesh.size, 3)), original((2, 2))
    for got in backend.run(job_outputs_returned_inputs, mesh.shape, mesh.names, check_rep):
        for call in (got[:4], got[4:]):
            assert torch.equal(call[0], rows) and torch.equal(call[1], whole)
            assert torch.equal(call[2], rows[:, :1]) and torch.equal(call[3], whole.view(-1))


def test_two_threads_calling_one_shard_map_each_guard_their_own_inputs():
    """A warm call keeps its input guard per thread: another thread's call, begun and ended
    while one call runs, leaves that call's inputs guarded."""
    import threading

    mesh = fd.simulated_mesh(2, "x")
    started, other_done = threading.Event(), threading.Event()

    def body(x, write):
        if bool(write.all()):  # (the same on every device: a plain Python flag in the data)
            started.set()
            other_done.wait(10)
            x.add_(1)
        return x * 2

    f = fd.shard_map(body, mesh=mesh, in_specs=(fd.P("x"), None), out_specs=fd.P("x"))
    x = torch.arange(4.0)
    f(x, torch.tensor(False))  # warm: the guard exists
    caught = []

    def writer():
        try:
            f(x, torch.tensor(True))
        except fd.ImmutableError as error:
            caught.append(error)

    thread = threading.Thread(target=writer)
    thread.start()
    assert started.wait(10)
    other = threading.Thread(target=lambda: f(x, torch.tensor(False)))
    other.start()
    other.join(10)
    other_done.set()
    thread.join(10)
    assert len(caught) == 1 and "in place" in str(caught[0])
    assert torch.equal(x, torch.arange(4.0))


def test_dtensor_has_no_in_place_methods():
    x = fd.distribute_tensor(torch.arange(4.0), fd.simulated_mesh(2, "x"), fd.P("x"))
    for name, form in (("add_", "x.add("), ("mul_", "x.mul("), ("clamp_", "x.clamp(")):
        with pytest.raises(fd.ImmutableError, match="no in-place methods") as info:
            getattr(x, name)
        assert form in str(info.value) and name in str(info.value)
        assert isinstance(info.value, AttributeError) and not hasattr(x, name)
    with pytest.raises(fd.ImmutableError, match="build a new value instead"):
        x.requires_grad_()  # requires_grad is no method: no out-of-place form to name
    with pytest.raises(fd.ImmutableError, match="immutable"):
        x[0] = 1.0
    with pytest.raises(fd.ImmutableError, match="immutable"):
        x.shape = (2, 2)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        x.nonsense  # noqa: B018
    assert torch.equal(x.full_tensor(), torch.arange(4.0))
    assert copy.copy(x) is x  # immutable, as a tuple


# ---------------------------------------------------------------------------------------------
# Saving and loading: pickle, deepcopy, torch.save / torch.load (weights_only too).

VALUES = [
    ((6, 3), fd.P("x"), torch.float64),
    ((5, 3), fd.P("x"), torch.float32),  # uneven
    ((4,), fd.P(), torch.bfloat16),  # replicated: held once on the simulated backend
    ((3, 2), (Pa("sum"),), torch.float64),
    ((3, 2), (Pa("max"),), torch.int64),
    ((2, 4), fd.P(None, "x"), torch.int32),
]


def _through(way: str, obj):
    if way == "pickle":
        return pickle.loads(pickle.dumps(obj))
    if way == "deepcopy":
        return copy.deepcopy(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=way == "torch.load(weights_only=True)")


WAYS = ["pickle", "deepcopy", "torch.load", "torch.load(weights_only=True)"]


def job_round_trip_values(mesh, way: str) -> list[dict]:
    out = []
    for k, (shape, placements, dtype) in enumerate(VALUES):
        tensor = original(shape, dtype)
        x = fd.distribute_tensor(tensor.requires_grad_(k == 0), mesh, placements)  # k == 0: in a graph
        records = {"mesh": mesh, "layout": x.sharding, "placements": x.placements, "spec": fd.P("x", None)}
        loaded = _through(way, {"value": x, **records})
        y = loaded["value"]
        out.append(
            {
                "records": all(loaded[key] == value for key, value in records.items()),
                "same": all(
                    getattr(y, a) == getattr(x, a) for a in ("shape", "dtype", "layout", "requires_grad")
                ),
                "bits": all(
                    a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(x.local_shards(), y.local_shards())
                ),
                "full": torch.equal(y.full_tensor(), x.full_tensor()),
            }
        )
    return out


@pytest.mark.meshes((2,), (4,))
@pytest.mark.parametrize("way", WAYS)
def test_values_and_records_save_and_load_bit_exact(backend, mesh, way):
    for answer in backend.run(job_round_trip_values, mesh.shape, mesh.names, way):
        for (_, placements, dtype), got in zip(VALUES, answer):
            assert got == {"records": True, "same": True, "bits": True, "full": True}, (placements, dtype)


def job_save(mesh, directory: str) -> torch.Tensor:
    """Each process saves its value to its own file."""
    x = fd.distribute_tensor(original((2 * mesh.size, 3)), mesh, fd.P("x"))
    index = local_devices(mesh)[0] if mesh.backend == "distributed" else "all"
    torch.save({"step": 3, "w": x}, f"{directory}/values-{index}.pt")
    return x.local_shards()


def job_load(mesh, directory: str, file_of_rank) -> list | str:
    """Each process loads ``file_of_rank(device)``'s file; the shards or the error."""
    index = local_devices(mesh)[0] if mesh.backend == "distributed" else "all"
    name = index if index == "all" else file_of_rank[index]
    try:
        loaded = torch.load(f"{directory}/values-{name}.pt", weights_only=True)
    except fd.FunctionalDTensorError as e:
        return f"{type(e).__name__}: {e}"
    return loaded["w"].local_shards() + (loaded["w"].full_tensor(),)


@pytest.mark.meshes((2,), (4,))
def test_each_process_saves_its_shards_and_loads_them_back(backend, mesh, tmp_path):
    saved = per_device(backend.run(job_save, mesh.shape, mesh.names, str(tmp_path)))
    own = list(range(mesh.size))
    loaded = backend.run(job_load, mesh.shape, mesh.names, str(tmp_path), own)
    assert all(not isinstance(answer, str) for answer in loaded), loaded
    shards = per_device([answer[:-1] for answer in loaded])
    assert len(shards) == mesh.size and all(torch.equal(a, b) for a, b in zip(shards, saved))
    assert all(torch.equal(answer[-1], original((2 * mesh.size, 3))) for answer in loaded)


@pytest.mark.distributed
def test_a_distributed_value_loads_only_where_it_was_saved(gloo, tmp_path):
    """Another world size, another rank's file, or no process group: clear errors pointing to
    resharding through the global value or torch.distributed.checkpoint."""
    two, four = Backend("gloo-2", gloo), Backend("gloo-4", gloo)
    two.run(job_save, (2,), ("x",), str(tmp_path))
    for answer in four.run(job_load, (4,), ("x",), str(tmp_path), [0, 1, 0, 1]):
        assert answer.startswith("MeshError") and "2-rank world" in answer and "4 ranks" in answer, answer
        assert "torch.distributed.checkpoint" in answer and "full_tensor()" in answer, answer
    for answer in two.run(job_load, (2,), ("x",), str(tmp_path), [1, 0]):
        assert answer.startswith("MeshError") and "the file this rank" in answer, answer
    with pytest.raises(fd.MeshError, match="no process group"):
        torch.load(tmp_path / "values-0.pt", weights_only=True)


def test_a_value_that_cannot_be_saved_raises_when_saving():
    """A value that exists only inside a torch.func transform is refused when saved, not when
    the file is read."""
    mesh = fd.simulated_mesh(2, "x")
    errors = []

    def f(t):
        x = fd.distribute_tensor(t, mesh, fd.P("x"))
        for save in (lambda: torch.save(x, io.BytesIO()), lambda: pickle.dumps(x)):
            with pytest.raises(fd.InputTypeError, match="outside the transform") as info:
                save()
            errors.append(info.value)
        return x.full_tensor().sum()

    torch.func.grad(f)(torch.randn(4))
    assert len(errors) == 2 and all(isinstance(e, TypeError) for e in errors)
