"""Checkpoints: saved from one mesh and layout, loaded onto another, bit-exact, on both backends;
full-state files; a failed save leaves the previous checkpoint; damaged checkpoints and ``like``
trees that do not fit are clear errors.

Jobs that run on gloo ranks write into a directory shared by every rank, passed as an argument;
the values are built from the same global tensor in every process, so the test compares what
came back with that tensor.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from backends import Backend
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor import checkpoint as ckpt
from functional_dtensor.testing import strategies as fst

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


def original(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Distinct values (as far as the dtype allows), the same in every process."""
    n = math.prod(shape)
    values = (torch.arange(n, dtype=torch.int64) * 7 + seed) % 251 - 125
    if dtype == torch.bool:
        return (values % 3 == 0).reshape(shape)
    if dtype.is_floating_point:
        return (values.to(torch.float64) / 8).to(dtype).reshape(shape)  # exact in bfloat16 too
    return values.to(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` (torch.equal on floats would call -0.0 and 0.0 equal)."""
    return (
        t.clone(memory_format=torch.contiguous_format).view(torch.uint8)
        if t.dtype != torch.bool and t.numel() and t.dim()
        else t
    )


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def meta_like(x: fd.DTensor, mesh: fd.DeviceMesh, placements) -> fd.DTensor:
    return fd.zeros(tuple(x.shape), dtype=x.dtype, mesh=mesh, placements=placements, device="meta")


# ---------------------------------------------------------------------------------------------
# The simulated backend: any layout saved, any layout loaded.

CASES = fst.sharded_cases(
    mesh=fst.meshes(max_devices=8),
    max_dims=3,
    max_side=9,
    max_elements=256,
    dtype=st.sampled_from(DTYPES),
    allow_partial=True,
    partial_ops=("sum",),
)


@settings(max_examples=40)
@given(case=CASES, target=st.data())
def test_any_layout_saves_and_loads_onto_any_mesh_and_layout_bit_exact(tmp_path, case, target):
    """Saved from a drawn layout (uneven, strided, Partial), loaded onto a drawn mesh and
    layout: the same global value, and every shard what the target layout gives each device
    (a Partial(sum) target: the value on the first device of the axis, zeros elsewhere)."""
    tensor = original(case.global_shape, case.dtype)
    if case.dtype == torch.bool and case.layout.has_partial:
        tensor = tensor.to(torch.int64)  # a Partial sum of bools is not a bool
    x = fd.distribute_tensor(tensor, case.mesh, case.layout)
    truth = x.full_tensor()  # a float split into Partial parts may round
    ckpt.save(tmp_path / "ckpt", {"x": x})  # each example replaces the previous checkpoint
    partial = tensor.dtype != torch.bool  # a Partial bool value reduces to another dtype
    ops = ("sum", "max", "min")  # the mean of equal values may round: avg loads as exact as it reduces
    layout = target.draw(
        fst.layouts(fst.meshes(max_devices=8), len(case.global_shape), allow_partial=partial, partial_ops=ops)
    )
    loaded = ckpt.load(tmp_path / "ckpt", {"x": meta_like(x, layout.mesh, layout)})["x"]
    assert loaded.sharding == layout and loaded.shape == x.shape
    assert same(loaded.full_tensor(), truth)
    plain = fd.Layout(
        layout.mesh, [fd.Replicate() if p.is_partial() else p for p in layout.placements], layout.shard_order
    )
    expected = fd.distribute_tensor(truth, layout.mesh, plain).local_shards()
    sums = [p.is_partial() and p.op == "sum" for p in layout.placements]
    for device, (got, want) in enumerate(zip(loaded.local_shards(), expected)):
        first = all(c == 0 or not s for c, s in zip(layout.mesh.coordinate(device), sums))
        zero = torch.full_like(want, -0.0 if want.is_floating_point() else 0)
        assert same(got, want if first else zero), device


@settings(max_examples=15)
@given(
    case=fst.sharded_cases(mesh=fst.meshes(max_devices=8), max_elements=128, dtype=st.sampled_from(DTYPES))
)
def test_a_value_loads_back_onto_its_own_layout_shard_for_shard(tmp_path, case):
    x = fd.distribute_tensor(original(case.global_shape, case.dtype), case.mesh, case.layout)
    ckpt.save(tmp_path / "ckpt", [x])
    (loaded,) = ckpt.load(tmp_path / "ckpt", [x])
    assert loaded is not x and loaded.sharding == x.sharding
    assert all(same(a, b) for a, b in zip(loaded.local_shards(), x.local_shards()))


def test_a_training_state_round_trips_and_like_is_not_changed(tmp_path):
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    w = fd.distribute_tensor(original((5, 3)), mesh, fd.P("tp", "dp"))  # uneven on both dims
    state = {
        "params": {
            "w": w,
            "b": fd.distribute_tensor(original((7,), torch.bfloat16), mesh, fd.P(("dp", "tp"))),
        },
        "optim": [
            {"m": fd.zeros(5, 3, mesh=mesh, placements=fd.P("dp")), "count": torch.tensor(4)},
            (1.5, None),
        ],
        "step": 3,
        "name": "run-7",
        "flag": True,
    }
    ckpt.save(tmp_path / "ckpt", state)
    big = fd.simulated_mesh(8, "x")
    like = {
        "params": {
            "w": meta_like(w, big, fd.P(None, "x")),
            "b": fd.zeros(7, dtype=torch.bfloat16, mesh=big, placements=fd.P("x")),
        },
        "optim": [{"m": torch.ones(5, 3), "count": torch.tensor(0)}, (0.0, 0)],
        "step": 0,
        "name": "",
        "flag": False,
    }
    loaded = ckpt.load(tmp_path / "ckpt", like)
    assert same(loaded["params"]["w"].full_tensor(), original((5, 3)))
    assert loaded["params"]["w"].sharding == fd.Layout.from_spec(big, fd.P(None, "x"))
    assert same(loaded["params"]["b"].full_tensor(), original((7,), torch.bfloat16))
    assert same(loaded["optim"][0]["m"], torch.zeros(5, 3)) and same(
        loaded["optim"][0]["count"], torch.tensor(4)
    )
    assert loaded["optim"][1] == (1.5, None) and isinstance(loaded["optim"][1], tuple)
    assert (loaded["step"], loaded["name"], loaded["flag"]) == (3, "run-7", True)
    assert same(like["optim"][0]["m"], torch.ones(5, 3)) and same(
        like["params"]["b"].full_tensor(), torch.zeros(7, dtype=torch.bfloat16)
    )


def test_the_format_is_dcp_and_replicas_are_written_once(tmp_path):
    """A plain torch.distributed.checkpoint load reads the checkpoint; a value replicated over
    4 devices is stored once."""
    import torch.distributed.checkpoint as dcp

    mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
    x = fd.distribute_tensor(original((6, 5)), mesh, fd.P("dp"))
    ckpt.save(tmp_path / "ckpt", {"x": x})
    metadata = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata()
    chunks = metadata.state_dict_metadata["x"].chunks
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0, 0), (3, 5)), ((3, 0), (3, 5))]
    plain = {"x": torch.empty(6, 5)}
    with pytest.warns(UserWarning):
        dcp.load(plain, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert same(plain["x"], original((6, 5)))


# ---------------------------------------------------------------------------------------------
# Real gloo ranks: save on one backend or mesh, load on another.


def job_save(mesh, path: str, shape, spec, dtypes) -> None:
    state = {str(d): fd.distribute_tensor(original(shape, d), mesh, spec) for d in dtypes}
    state["plain"] = original((3,), torch.int64)
    state["step"] = 11
    ckpt.save(path, state)


def job_load(mesh, path: str, shape, spec, dtypes) -> dict:
    like = {str(d): fd.zeros(shape, dtype=d, mesh=mesh, placements=spec, device="meta") for d in dtypes}
    like["plain"] = torch.zeros(3, dtype=torch.int64)
    like["step"] = 0
    loaded = ckpt.load(path, like)
    out = {
        k: (v.full_tensor(), v.local_shards(), str(v.sharding))
        for k, v in loaded.items()
        if isinstance(v, fd.DTensor)
    }
    return out | {"plain": loaded["plain"], "step": loaded["step"]}


def check_loaded(answers, mesh_shape, shape, spec, dtypes) -> None:
    mesh = fd.simulated_mesh(mesh_shape, ("x", "y")[: len(mesh_shape)])
    for d in dtypes:
        expected = fd.distribute_tensor(original(shape, d), mesh, spec).local_shards()
        shards = [s for answer in answers for s in answer[str(d)][1]]
        assert len(shards) == len(expected) and all(same(a, b) for a, b in zip(shards, expected)), d
        assert all(same(answer[str(d)][0], original(shape, d)) for answer in answers), d
    assert all(same(a["plain"], original((3,), torch.int64)) and a["step"] == 11 for a in answers)


@pytest.mark.distributed
def test_saved_on_4_ranks_loads_on_2_ranks_in_another_layout(gloo, tmp_path):
    path, shape = str(tmp_path / "ckpt"), (7, 5)  # uneven over 4 and over 2
    Backend("gloo-4", gloo).run(job_save, (4,), ("x",), path, shape, fd.P("x", None), DTYPES)
    answers = Backend("gloo-2", gloo).run(job_load, (2,), ("x",), path, shape, fd.P(None, "x"), DTYPES)
    check_loaded(answers, (2,), shape, fd.P(None, "x"), DTYPES)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
        ckpt.MANIFEST,
    ]


@pytest.mark.distributed
def test_simulated_and_gloo_checkpoints_load_on_each_other(gloo, tmp_path):
    shape = (6, 5)
    # simulated (2, 2) -> gloo 4 ranks on a (2, 2) mesh of another layout
    simulated = Backend("simulated")
    simulated.run(job_save, (2, 2), ("x", "y"), str(tmp_path / "a"), shape, fd.P(("y", "x")), DTYPES)
    answers = Backend("gloo-4", gloo).run(
        job_load, (2, 2), ("x", "y"), str(tmp_path / "a"), shape, fd.P("y", "x"), DTYPES
    )
    check_loaded(answers, (2, 2), shape, fd.P("y", "x"), DTYPES)
    # gloo 2 ranks, replicated on a (2,) mesh -> simulated mesh of 8
    Backend("gloo-2", gloo).run(job_save, (2,), ("x",), str(tmp_path / "b"), shape, fd.P(), DTYPES)
    files = sorted(p.name for p in (tmp_path / "b").iterdir() if p.suffix == ".distcp")
    assert len(files) == 2  # a file per rank; the replicated value in one of them
    answers = simulated.run(job_load, (8,), ("x",), str(tmp_path / "b"), shape, fd.P(None, "x"), DTYPES)
    check_loaded(answers, (8,), shape, fd.P(None, "x"), DTYPES)


def job_save_full(mesh, path: str) -> None:
    x = fd.distribute_tensor(original((5, 3)), mesh, fd.P("x"))
    ckpt.save_full(path, {"model": {"w": x, "b": original((3,), torch.bfloat16)}, "step": 2})


def job_load_full(mesh, path: str):
    like = {
        "model": {
            "w": fd.zeros(5, 3, mesh=mesh, placements=fd.P(None, "x")),
            "b": torch.zeros(3, dtype=torch.bfloat16),
        },
        "step": 0,
    }
    loaded = ckpt.load_full(path, like)
    return loaded["model"]["w"].local_shards(), loaded["model"]["b"], loaded["step"]


@pytest.mark.distributed
def test_full_state_file_on_gloo_ranks(gloo, tmp_path):
    path = str(tmp_path / "full.pt")
    Backend("gloo-4", gloo).run(job_save_full, (4,), ("x",), path)
    plain = torch.load(path, weights_only=True)
    assert set(plain) == {"model.w", "model.b", "step"} and same(plain["model.w"], original((5, 3)))
    answers = Backend("gloo-2", gloo).run(job_load_full, (2,), ("x",), path)
    expected = fd.distribute_tensor(
        original((5, 3)), fd.simulated_mesh(2, "x"), fd.P(None, "x")
    ).local_shards()
    assert all(same(a, b) for a, b in zip([s for a in answers for s in a[0]], expected))
    assert all(same(a[1], original((3,), torch.bfloat16)) and a[2] == 2 for a in answers)


def job_save_failing_on_rank(mesh, path: str, rank: int, scale: float) -> str | None:
    """Save; on ``rank``, writing the data fails. The error each rank raised, if any."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    original_write = dcp.FileSystemWriter.write_data

    def write_data(self, *args, **kwargs):
        if dist.get_rank() == rank:
            raise OSError(f"disk full on rank {rank}")
        return original_write(self, *args, **kwargs)

    dcp.FileSystemWriter.write_data = write_data
    try:
        ckpt.save(path, {"w": fd.distribute_tensor(original((9, 2)) * scale, mesh, fd.P("x"))})
    except fd.CheckpointError as error:
        return str(error)
    finally:
        dcp.FileSystemWriter.write_data = original_write
    return None


def job_load_or_error(mesh, path: str) -> torch.Tensor | str:
    try:
        like = {"w": fd.zeros(9, 2, mesh=mesh, placements=fd.P(None, "x"), device="meta")}
        return ckpt.load(path, like)["w"].full_tensor()
    except fd.CheckpointError as error:
        return str(error)


@pytest.mark.distributed
def test_on_gloo_ranks_a_failed_save_keeps_the_previous_and_damage_is_seen_by_every_rank(gloo, tmp_path):
    path, two = str(tmp_path / "ckpt"), Backend("gloo-2", gloo)
    assert two.run(job_save_failing_on_rank, (2,), ("x",), path, -1, 1.0) == [None, None]
    errors = two.run(job_save_failing_on_rank, (2,), ("x",), path, 1, 2.0)
    assert all("failed on rank 1" in e and "disk full on rank 1" in e for e in errors), errors
    assert all(same(w, original((9, 2))) for w in two.run(job_load_or_error, (2,), ("x",), path))
    message = damage(tmp_path / "ckpt", "flipped")
    answers = two.run(job_load_or_error, (2,), ("x",), path)
    assert all(isinstance(a, str) and re.search(message, a) for a in answers), answers


# ---------------------------------------------------------------------------------------------
# Full-state files on the simulated backend.


def test_full_state_file_is_a_plain_state_dict(tmp_path):
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    w = fd.distribute_tensor(original((5, 4)), mesh, fd.P("tp", "dp"))
    p = fd.distribute_tensor(original((4,)), mesh, [fd.Partial(), fd.Replicate()])
    ckpt.save_full(tmp_path / "full.pt", {"layer": {"weight": w, "bias": p}, "step": 5})
    plain = torch.load(tmp_path / "full.pt", weights_only=True)
    assert list(plain) == ["layer.bias", "layer.weight", "step"]
    assert same(plain["layer.weight"], original((5, 4))) and same(plain["layer.bias"], original((4,)))
    assert ckpt.load_full(tmp_path / "full.pt").keys() == plain.keys()
    module = torch.nn.Linear(5, 4)  # the weight is (4, 5): a module state dict, loaded as is
    ckpt.save_full(tmp_path / "module.pt", {k: v for k, v in module.state_dict().items()})
    torch.nn.Linear(5, 4).load_state_dict(torch.load(tmp_path / "module.pt", weights_only=True))
    like = {
        "layer": {
            "weight": fd.zeros(5, 4, mesh=fd.simulated_mesh(8, "x"), placements=fd.P("x")),
            "bias": torch.zeros(4),
        },
        "step": 0,
    }
    loaded = ckpt.load_full(tmp_path / "full.pt", like)
    assert loaded["layer"]["weight"].sharding == like["layer"]["weight"].sharding
    assert same(loaded["layer"]["weight"].full_tensor(), original((5, 4))) and loaded["step"] == 5
    like["layer"]["bias"] = torch.zeros(5)
    with pytest.raises(fd.CheckpointError, match=r"like\['layer'\]\['bias'\].*shape"):
        ckpt.load_full(tmp_path / "full.pt", like)
    (tmp_path / "broken.pt").write_bytes((tmp_path / "full.pt").read_bytes()[:100])
    with pytest.raises(fd.CheckpointError, match="broken.pt"):
        ckpt.load_full(tmp_path / "broken.pt")


# ---------------------------------------------------------------------------------------------
# Atomicity, damage, and like trees that do not fit.


def small_state(scale: float = 1.0) -> dict:
    mesh = fd.simulated_mesh(4, "x")
    return {"w": fd.distribute_tensor(original((9, 2)) * scale, mesh, fd.P("x")), "step": int(scale)}


def small_like() -> dict:
    return {"w": fd.zeros(9, 2, mesh=fd.simulated_mesh(2, "x"), placements=fd.P()), "step": 0}


def loads_as(path, scale: float) -> bool:
    loaded = ckpt.load(path, small_like())
    return same(loaded["w"].full_tensor(), original((9, 2)) * scale) and loaded["step"] == int(scale)


@pytest.mark.parametrize("where", ["writing data", "writing metadata", "the manifest"])
def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, where):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    ckpt.save(path, small_state(1.0))

    def fail(*args, **kwargs):
        raise OSError("disk full")

    target = {
        "writing data": (dcp.FileSystemWriter, "write_data"),
        "writing metadata": (dcp.FileSystemWriter, "finish"),
        "the manifest": (ckpt, "write_json"),
    }[where]
    monkeypatch.setattr(*target, fail)
    with pytest.raises((fd.CheckpointError, OSError), match="disk full"):
        ckpt.save(path, small_state(2.0))
    monkeypatch.undo()
    assert loads_as(path, 1.0)
    ckpt.save(path, small_state(3.0))  # a later save cleans up and replaces it
    assert loads_as(path, 3.0) and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_leaf_that_cannot_be_saved_fails_before_anything_is_written(tmp_path):
    path = tmp_path / "ckpt"
    ckpt.save(path, small_state(1.0))
    mesh = fd.simulated_mesh(2, "x")
    bad = [object(), fd.zeros(4, mesh=mesh, placements=fd.P("x"), device="meta")]
    for leaf, match in zip(bad, ["object", "meta"]):
        with pytest.raises(fd.InputTypeError, match=rf"fd.checkpoint.save\(state\['bad'\]\).*{match}"):
            ckpt.save(path, small_state(2.0) | {"bad": leaf})
    assert loads_as(path, 1.0)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(fd.CheckpointError, match="not a checkpoint"):
        ckpt.save(tmp_path / "notes.txt", small_state())


def damage(path, how: str) -> str:
    """Damage the checkpoint at ``path``; what the error must say."""
    data = sorted(path.glob("*.distcp"))[-1]
    if how == "truncated":
        data.write_bytes(data.read_bytes()[:-7])
        return rf"{data.name} is truncated"
    if how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        return rf"{data.name} is corrupted"
    if how == "no metadata":
        (path / ".metadata").unlink()
        return r"\.metadata is missing"
    if how == "no index":  # neither fd's manifest nor DCP's metadata
        (path / ckpt.MANIFEST).unlink()
        (path / ".metadata").unlink()
        return r"no manifest \(fd_checkpoint.json\) and no DCP metadata \(.metadata\)"
    if how == "no manifest, flipped data":  # read as DCP's directory: its archives' CRC-32s checked
        (path / ckpt.MANIFEST).unlink()
        raw = bytearray(data.read_bytes())
        at = raw.find(original((9, 2))[7:9].numpy().tobytes())  # the last device's block
        assert at > 0
        raw[at + 5] ^= 0x01
        data.write_bytes(bytes(raw))
        return rf"{data.name} is corrupted at bytes .*Bad CRC-32"
    if how == "edited manifest":
        text = (path / ckpt.MANIFEST).read_text()
        (path / ckpt.MANIFEST).write_text(text.replace('"step"', '"steps"', 1))
        return "manifest .* is not readable: .*SHA-256 differs"
    if how == "bad manifest":
        (path / ckpt.MANIFEST).write_text("{")
        return "manifest .* is not readable"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "flipped",
        "no metadata",
        "no index",
        "no manifest, flipped data",
        "edited manifest",
        "bad manifest",
    ],
)
def test_a_damaged_checkpoint_is_a_clear_error_naming_the_file(tmp_path, how):
    path = tmp_path / "ckpt"
    ckpt.save(path, small_state())
    message = damage(path, how)
    with pytest.raises(fd.CheckpointError, match=message) as error:
        ckpt.load(path, small_like())
    assert "fd.checkpoint.load" in str(error.value) and "Fix:" in str(error.value)


def test_a_missing_checkpoint_and_an_interrupted_replacement(tmp_path):
    with pytest.raises(fd.CheckpointError, match="no checkpoint at this path"):
        ckpt.load(tmp_path / "nothing", small_like())
    ckpt.save(tmp_path / "ckpt", small_state())
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.previous")  # a crash between the two renames
    with pytest.raises(fd.CheckpointError, match=r"interrupted.*\.ckpt\.previous"):
        ckpt.load(tmp_path / "ckpt", small_like())
    assert loads_as(tmp_path / ".ckpt.previous", 1.0)


LIKE_MISMATCHES = [
    (
        "shape",
        lambda like: like | {"w": fd.zeros(9, 3, mesh=fd.simulated_mesh(2, "x"), placements=fd.P())},
        r"like\['w'\]\): the shape differs: expected shape \(9, 2\), got \(9, 3\)",
    ),
    (
        "dtype",
        lambda like: (
            like | {"w": fd.zeros(9, 2, dtype=torch.int64, mesh=fd.simulated_mesh(2, "x"), placements=fd.P())}
        ),
        r"like\['w'\]\): the dtype differs: expected torch.float32, got torch.int64",
    ),
    ("extra leaf", lambda like: like | {"v": 1}, r"like\['v'\]\): the checkpoint has no such leaf"),
    (
        "another path",
        lambda like: {"w": {"inner": like["w"]}, "step": 0},
        r"like\['w'\]\['inner'\]\): the checkpoint has no such leaf",
    ),
    (
        "kind",
        lambda like: like | {"step": torch.zeros(())},
        r"like\['step'\]\): a tensor where the checkpoint has a Python value",
    ),
]


@pytest.mark.parametrize(("name", "change", "message"), LIKE_MISMATCHES, ids=[m[0] for m in LIKE_MISMATCHES])
def test_a_like_that_does_not_fit_names_the_path_expected_and_got(tmp_path, name, change, message):
    ckpt.save(tmp_path / "ckpt", small_state())
    with pytest.raises(fd.CheckpointError, match=message):
        ckpt.load(tmp_path / "ckpt", change(small_like()))


def test_containers_must_match(tmp_path):
    ckpt.save(tmp_path / "ckpt", {"pair": (1, 2)})
    with pytest.raises(
        fd.CheckpointError, match=r"the containers differ: expected .*\(\*, \*\).*got .*\[\*, \*\]"
    ):
        ckpt.load(tmp_path / "ckpt", {"pair": [0, 0]})
    assert ckpt.load(tmp_path / "ckpt", {"pair": (0, 0)}) == {"pair": (1, 2)}


def test_edge_states_a_single_value_nothing_empty_tensors(tmp_path):
    x = fd.distribute_tensor(original((5,)), fd.simulated_mesh(2, "x"), fd.P("x"))
    ckpt.save(tmp_path / "one", x)
    assert same(ckpt.load(tmp_path / "one", x).full_tensor(), original((5,)))
    ckpt.save(tmp_path / "none", {})
    assert ckpt.load(tmp_path / "none", {}) == {}
    empty = fd.zeros(0, 3, mesh=fd.simulated_mesh(4, "x"), placements=fd.P("x"))
    ckpt.save(tmp_path / "empty", {"e": empty, "t": torch.ones(0, 2)})
    like = {
        "e": fd.zeros(0, 3, mesh=fd.simulated_mesh(2, "x"), placements=fd.P(None, "x")),
        "t": torch.ones(0, 2),
    }
    loaded = ckpt.load(tmp_path / "empty", like)
    assert loaded["e"].shape == (0, 3) and loaded["t"].shape == (0, 2)


def test_paths_that_join_to_the_same_key_are_refused(tmp_path):
    with pytest.raises(
        fd.CheckpointError, match=r"same checkpoint key 'a.b'.*state\['a'\]\['b'\] and state\['a.b'\]"
    ):
        ckpt.save(tmp_path / "ckpt", {"a.b": 1, "a": {"b": 2}})
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------------------------------
# Loading a part of a checkpoint, and directories torch.distributed.checkpoint wrote.


def test_a_like_naming_some_saved_leaves_loads_those(tmp_path):
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    w = fd.distribute_tensor(original((5, 3)), mesh, fd.P("tp", "dp"))
    state = {
        "params": {"w": w, "b": fd.distribute_tensor(original((7,), torch.bfloat16), mesh, fd.P("dp"))},
        "optim": [
            {"m": fd.zeros(5, 3, mesh=mesh, placements=fd.P("dp")), "count": torch.tensor(4)},
            (1.5, None),
        ],
        "step": 3,
    }
    ckpt.save(tmp_path / "ckpt", state)
    big = fd.simulated_mesh(8, "x")
    part = ckpt.load(tmp_path / "ckpt", {"params": {"w": meta_like(w, big, fd.P(None, "x"))}, "step": 0})
    assert list(part) == ["params", "step"] and list(part["params"]) == ["w"] and part["step"] == 3
    assert part["params"]["w"].sharding == fd.Layout.from_spec(big, fd.P(None, "x"))
    assert same(part["params"]["w"].full_tensor(), original((5, 3)))
    inner = ckpt.load(tmp_path / "ckpt", {"optim": [{"count": torch.tensor(0)}]})
    assert same(inner["optim"][0]["count"], torch.tensor(4))
    # a leaf whose key is a saved one's, at another path
    ckpt.save(tmp_path / "dotted", {"a.b": 1, "c": 2})
    with pytest.raises(fd.CheckpointError, match=r"like\['a'\]\['b'\]\): the checkpoint keeps this leaf at"):
        ckpt.load(tmp_path / "dotted", {"a": {"b": 0}})
    assert ckpt.load(tmp_path / "dotted", {"c": 0}) == {"c": 2}


#: the values torch writes, by key; how each loads back: (shape, dtype, the like's spec)
TORCH_VALUES = {
    "w": ((7, 5), torch.float32, lambda names: fd.P(None, names[-1])),
    "b": ((6,), torch.bfloat16, lambda names: fd.P(names[-1])),
    "e": ((5, 3), torch.int64, lambda names: fd.P(names[0])),
}


def job_torch_save(mesh, path: str) -> None:
    """torch.distributed.checkpoint.save of a nested state: on gloo ranks the torch DTensors of
    fd values (fd.to_torch, each rank its shard), on the simulated mesh (which torch's DCP
    cannot save from one process) their global tensors; a plain tensor and Python values."""
    import torch.distributed.checkpoint as dcp

    names = mesh.axis_names
    specs = {"w": fd.P(names[0]), "b": fd.P(tuple(reversed(names))), "e": fd.P()}  # b: strided on 2-d
    values = {
        k: fd.distribute_tensor(original(s, d), mesh, specs[k]) for k, (s, d, _) in TORCH_VALUES.items()
    }
    distributed = mesh.backend != "simulated"
    model = {k: fd.to_torch(v) if distributed else v.full_tensor() for k, v in values.items()}
    state = {"model": model, "plain": original((3,)), "step": 9, "betas": (0.9, 0.99)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs in one process
        dcp.save(state, checkpoint_id=path, no_dist=not distributed)


def job_load_torch(mesh, path: str) -> dict:
    names = mesh.axis_names
    model = {
        k: fd.zeros(s, dtype=d, mesh=mesh, placements=spec(names), device="meta")
        for k, (s, d, spec) in TORCH_VALUES.items()
    }
    like = {"model": model, "plain": torch.zeros(3), "step": 0, "betas": None}  # betas: saved whole
    loaded = ckpt.load(path, like)
    part = ckpt.load(path, {"model": {"b": fd.zeros(6, dtype=torch.bfloat16, mesh=mesh, placements=fd.P())}})
    return {
        "model": {
            k: (v.full_tensor(), v.local_shards(), str(v.sharding)) for k, v in loaded["model"].items()
        },
        "rest": (loaded["plain"], loaded["step"], loaded["betas"]),
        "part": {k: {n: v.full_tensor() for n, v in m.items()} for k, m in part.items()},
    }


def job_save_and_load_a_part(mesh, path: str) -> list[torch.Tensor]:
    names = mesh.axis_names
    w = fd.distribute_tensor(original((7, 5)), mesh, fd.P(names[0]))
    ckpt.save(path, {"values": {"w": w, "v": w * 2}, "step": 9})
    part = ckpt.load(path, {"values": {"w": meta_like(w, mesh, fd.P(None, names[-1]))}})
    assert list(part) == ["values"] and list(part["values"]) == ["w"]
    return part["values"]["w"].local_shards()


def check_torch_loaded(answers, mesh_shape, names) -> None:
    mesh = fd.simulated_mesh(mesh_shape, names)
    for key, (shape, dtype, spec) in TORCH_VALUES.items():
        expected = fd.distribute_tensor(original(shape, dtype), mesh, spec(names)).local_shards()
        shards = [s for answer in answers for s in answer["model"][key][1]]
        assert len(shards) == len(expected) and all(same(a, b) for a, b in zip(shards, expected)), key
        assert all(same(a["model"][key][0], original(shape, dtype)) for a in answers), key
        assert all(a["model"][key][2] == str(fd.Layout.from_spec(mesh, spec(names))) for a in answers)
    for answer in answers:
        plain, step, betas = answer["rest"]
        assert same(plain, original((3,))) and step == 9 and betas == (0.9, 0.99)
        assert list(answer["part"]) == ["model"] and list(answer["part"]["model"]) == ["b"]
        assert same(answer["part"]["model"]["b"], original((6,), torch.bfloat16))


@pytest.mark.meshes((4,), (2, 2))
def test_a_directory_torch_wrote_loads_resharded_and_in_part(backend, mesh, tmp_path):
    """A directory torch.distributed.checkpoint.save wrote (no manifest) loads like fd's own:
    onto other layouts, in part, bit-exact; written on gloo ranks from torch DTensors, it loads
    on a simulated mesh too. A part of fd's own checkpoint loads on either backend."""
    path = str(tmp_path / "torch")
    backend.run(job_torch_save, mesh.shape, mesh.names, path)
    assert not (tmp_path / "torch" / ckpt.MANIFEST).exists()
    check_torch_loaded(backend.run(job_load_torch, mesh.shape, mesh.names, path), mesh.shape, mesh.names)
    if not backend.is_simulated:
        check_torch_loaded(Backend("simulated").run(job_load_torch, (8,), ("x",), path), (8,), ("x",))
    answers = backend.run(job_save_and_load_a_part, mesh.shape, mesh.names, str(tmp_path / "fd"))
    expected = fd.distribute_tensor(original((7, 5)), mesh.simulated(), fd.P(None, mesh.names[-1]))
    shards = [s for answer in answers for s in answer]
    assert len(shards) == mesh.size and all(same(a, b) for a, b in zip(shards, expected.local_shards()))


def torch_checkpoint(path) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    w = original((64, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs in one process
        dcp.save({"w": w, "step": 3, "pair": (1, 2)}, checkpoint_id=path, no_dist=True)
    return w


def torch_like() -> dict:
    return {
        "w": fd.zeros(64, 8, mesh=fd.simulated_mesh(2, "x"), placements=fd.P("x"), device="meta"),
        "step": 0,
    }


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing", "bad metadata"])
def test_a_damaged_directory_torch_wrote_is_a_clear_error_never_wrong_values(tmp_path, how):
    """DCP keeps no checksums; each of its items is a torch.save archive whose entries carry a
    CRC-32: a changed byte of a tensor is found by it, a short or missing file by DCP's sizes."""
    path = tmp_path / "ckpt"
    w = torch_checkpoint(path)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if how == "flipped":
        at = raw.find(w.numpy().tobytes())
        assert at > 0
        raw[at + 1000] ^= 0x01
        data.write_bytes(bytes(raw))
        message = r"__0_0.distcp is corrupted at bytes .*Bad CRC-32"
    elif how == "truncated":
        data.write_bytes(bytes(raw[:-3]))
        message = r"__0_0.distcp is truncated: \d+ bytes, DCP's metadata records"
    elif how == "missing":
        data.unlink()
        message = r"__0_0.distcp is missing"
    else:
        (path / ".metadata").write_bytes(b"\x80\x04not a pickle")
        message = r"DCP's metadata .*\.metadata is not readable"
    with pytest.raises(fd.CheckpointError, match=message) as error:
        ckpt.load(path, torch_like())
    assert "Fix:" in str(error.value)


def test_a_directory_torch_wrote_names_its_keys_and_whole_values(tmp_path):
    path = tmp_path / "ckpt"
    w = torch_checkpoint(path)
    loaded = ckpt.load(path, torch_like() | {"pair": None})
    assert same(loaded["w"].full_tensor(), w) and loaded["step"] == 3 and loaded["pair"] == (1, 2)
    with pytest.raises(
        fd.CheckpointError, match=r"like\['pair'\]\[0\]\): the checkpoint holds state\['pair'\] whole"
    ):
        ckpt.load(path, {"pair": (0, 0)})
    with pytest.raises(
        fd.CheckpointError, match=r"like\['v'\]\): the checkpoint has no such leaf.*state\['w'\]"
    ):
        ckpt.load(path, {"v": 0})
    with pytest.raises(fd.CheckpointError, match=r"like\['w'\]\): the shape differs"):
        ckpt.load(path, {"w": torch.zeros(8, 64)})
    with pytest.raises(fd.CheckpointError, match="not a checkpoint"):  # fd never writes over it
        ckpt.save(path, {"w": 1})
