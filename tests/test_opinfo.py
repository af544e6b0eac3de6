"""torch's OpInfo database on ``fd.DTensor``, as torch's ``test_dtensor_ops.py`` sweeps its
DTensor: each op's float32 samples, every tensor distributed (Shard(0) and Replicate on a mesh
of 4, Shard(0), Shard(1) on 2 x 2, op_db's uneven sizes), against plain torch on values and
gradients (``tests/opinfo_sweep.py``). The default run checks a fixed slice of op_db that works;
the slow tier sweeps all of it: no op may give a wrong answer, and at least :data:`OK_FLOOR`
ops must work (``python bench/opinfo_sweep.py`` prints the whole table and the errors to fix).
"""

from __future__ import annotations

import functools
import os

import opinfo_sweep as sweep
import pytest
from common import with_long_run
from hypothesis import settings
from hypothesis import strategies as st

import functional_dtensor as fd

#: op_db entries (``name`` or ``name.variant``) that run on fd.DTensor under every layout
SLICE = [
    # elementwise
    "add", "sub", "mul", "div.no_rounding_mode", "atan2", "maximum", "pow", "lerp", "where",
    "clamp", "abs", "exp", "log", "sin", "tanh", "sigmoid", "rsqrt", "eq", "float",
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.softplus",
    # reductions and scans
    "sum", "mean", "amax", "prod", "cumsum", "max.reduction_no_dim", "softmax", "log_softmax",
    "masked.sum",
    # matrix products
    "mm", "bmm", "addmm", "einsum", "nn.functional.linear", "nn.functional.layer_norm",
    # views, shapes, indexing
    "transpose", "permute", "reshape", "view", "flatten", "unsqueeze", "squeeze", "cat", "stack",
    "split", "chunk", "gather", "nn.functional.embedding",
    # the ops a new user reaches for first: by rules, torch's pointwise tags or replicated
    "masked_fill", "argmax", "var", "std", "topk", "sort", "tril", "triu", "nn.functional.pad.constant",
    "index_select", "all", "any", "nn.functional.nll_loss", "logsumexp", "flip", "roll", "repeat",
    "nn.functional.normalize", "linalg.vector_norm", "new_zeros", "view_as", "expand_as",
    "floor_divide", "median",
]  # fmt: skip

#: samples per op in the default run (all layouts each)
SLICE_SAMPLES = 3

#: ops of op_db that are "ok" on fd.DTensor, measured with
#: ``python bench/opinfo_sweep.py --fd-only --samples 4`` (608 of 702, torch 2.13.0+cpu; the
#: others draw random numbers (27), have no float32 CPU sample (52) or are in REFUSED): the
#: slow sweep fails if fewer work (raise it as ops are fixed)
OK_FLOOR = 608


sweep.op_db()  # imported here, at collection: torch's test utilities register hypothesis profiles


@functools.cache
def fd_side() -> sweep.FdDTensor:
    return sweep.FdDTensor()


def op_named(name: str):
    (op,) = [op for op in sweep.find_ops([name]) if sweep.op_id(op) == name]
    return op


@pytest.mark.parametrize("name", SLICE)
def test_op_matches_plain_torch(name):
    result = sweep.sweep_op(op_named(name), [fd_side()], samples=SLICE_SAMPLES)["fd"]
    assert result.status == "ok", f"{name} is {result.status}: {result.message}\n  at {result.where}"
    assert result.cases >= len(sweep.LAYOUTS), f"{name}: only {result.cases} cases ran"


#: ops run on real gloo ranks too: rules of each family, and ops without a rule (replicated)
GLOO_SLICE = [
    "add", "mul", "sum", "amax", "mm", "nn.functional.linear", "softmax", "reshape", "flatten", "cat",
    "gather", "nn.functional.embedding", "median", "sort", "var", "nn.functional.pad.constant", "tril",
]  # fmt: skip


def job_gloo_slice(mesh, names: list[str]) -> dict:
    import functional_dtensor as fd

    if mesh.backend == "simulated":
        square = fd.simulated_mesh((2, 2), ("a", "b"))
    else:
        square = fd.init_device_mesh("cpu", (2, 2), ("a", "b"))
    meshes = {"x4": mesh, "2x2": square}
    side = sweep.FdDTensor(meshes)
    results = {name: sweep.sweep_op(op_named(name), [side], samples=2)["fd"] for name in names}
    return {name: (r.status, r.message, r.where, r.cases) for name, r in results.items()}


@pytest.mark.meshes((4,))
def test_a_slice_matches_plain_torch_on_both_backends(backend, mesh):
    """The same samples and layouts on the simulated mesh and on 4 gloo ranks (each rank
    compares its own reading of every output with plain torch)."""
    for results in backend.run(job_gloo_slice, mesh.shape, mesh.names, GLOO_SLICE, timeout=300):
        for name, (status, message, where, cases) in results.items():
            assert status == "ok", f"{name} is {status}: {message}\n  at {where}"
            assert cases >= len(sweep.LAYOUTS), f"{name}: only {cases} cases ran"


#: every op of op_db that does not run on fd.DTensor, reviewed, with the reason (the slow sweep
#: fails on an op not listed here, and on one listed that now works)
REFUSED = {
    # torch's OpInfos call these as unbound torch.Tensor methods (torch.Tensor.item(x)), which
    # only take torch.Tensor instances; x.item(), x + y, x[...] work on fd.DTensor
    "__getitem__": "called as torch.Tensor.__getitem__(x, ...): fd.DTensor is not a torch.Tensor",
    "__radd__": "called as torch.Tensor.__radd__(x, ...): fd.DTensor is not a torch.Tensor",
    "__rmul__": "called as torch.Tensor.__rmul__(x, ...): fd.DTensor is not a torch.Tensor",
    "cdouble": "called as torch.Tensor.cdouble(x): fd.DTensor is not a torch.Tensor",
    "cfloat": "called as torch.Tensor.cfloat(x): fd.DTensor is not a torch.Tensor",
    "item": "called as torch.Tensor.item(x): fd.DTensor is not a torch.Tensor",
    # torch's code builds a plain tensor of the global shape and mixes it in (refused outside
    # fd.implicit_replication, as torch's DTensor refuses it)
    "masked.std": "torch.masked builds a plain tensor and divides the value by it",
    "masked.var": "torch.masked builds a plain tensor and divides the value by it",
    # draws from torch's global generator: each device would draw its own numbers
    "nn.functional.fractional_max_pool2d": "draws its pooling regions from torch's global generator",
    "nn.functional.fractional_max_pool3d": "draws its pooling regions from torch's global generator",
    "nn.functional.multi_head_attention_forward": "draws its dropout from torch's global generator",
    "nn.functional.scaled_dot_product_attention": "its samples with dropout_p > 0 (the dropout draws from "
    "torch's global generator; the others work, in SLICE)",
    # an fd.DTensor holds dense tensors
    "sparse.mm.reduce": "a sparse input",
    "sparse.sampled_addmm": "a sparse input",
    "to_sparse": "a sparse output",
}


@pytest.mark.slow
def test_every_op_of_op_db_works_or_is_a_reviewed_refusal():
    results = [sweep.sweep_op(op, [fd_side()], samples=4, timeout=60)["fd"] for op in sweep.op_db()]
    wrong = [f"{r.op}: {r.message} (at {r.where})" for r in results if r.status == "wrong"]
    assert not wrong, "silent wrong answers:\n" + "\n".join(wrong)
    failing = {r.op: r.message for r in results if r.status in ("refused", "raw error")}
    unreviewed = {op: message for op, message in failing.items() if op not in REFUSED}
    assert not unreviewed, f"ops that fail without a reviewed reason: {unreviewed}"
    fixed = sorted(set(REFUSED) - set(failing))
    assert not fixed, f"ops that work now: remove them from REFUSED: {fixed}"
    ok = sum(r.status == "ok" for r in results)
    assert ok >= OK_FLOOR, f"{ok} ops of op_db work on fd.DTensor, fewer than the floor {OK_FLOOR}"


@functools.cache
def fuzzed_ops() -> tuple:
    """The ops of op_db the fuzz draws from: all but random ones, in-place variants (an
    fd.DTensor is immutable) and reviewed refusals."""
    return tuple(
        op
        for op in sweep.op_db()
        if not sweep.is_random(op) and not sweep.is_inplace(op) and sweep.op_id(op) not in REFUSED
    )


#: the meshes the fuzz draws (simulated): a line of 1 to 5 devices, or a square or rectangle
FUZZ_MESHES = {
    "1": fd.simulated_mesh(1, "x"),
    "2": fd.simulated_mesh(2, "x"),
    "3": fd.simulated_mesh(3, "x"),
    "5": fd.simulated_mesh(5, "x"),
    "2x2": fd.simulated_mesh((2, 2), ("a", "b")),
    "2x3": fd.simulated_mesh((2, 3), ("a", "b")),
}


@with_long_run(1000, data=st.data(), default_examples=40)
def test_fuzz_op_db(data):
    """An op drawn from the whole of op_db (not the library's own list), one of its samples,
    a drawn mesh and, per tensor, drawn placements per mesh axis (Shard of any dim, uneven
    sizes included, or Replicate): torch's values and gradients."""
    ops = fuzzed_ops()
    op = ops[data.draw(st.integers(0, len(ops) - 1), label="op")]
    samples = sweep.samples_of(op, 3)
    if not samples:
        return
    sample = samples[data.draw(st.integers(0, len(samples) - 1), label="sample")]
    mesh = data.draw(st.sampled_from(sorted(FUZZ_MESHES)), label="mesh")
    axes = FUZZ_MESHES[mesh].ndim

    def placements_for(ndim: int) -> tuple:
        kinds = ["R", *(f"S{d}" for d in range(ndim))]
        return tuple(data.draw(st.sampled_from(kinds)) for _ in range(axes))

    side = sweep.FdDTensor({mesh: FUZZ_MESHES[mesh]})
    sweep.check_case(side, op, sample, mesh, placements_for)


def test_importing_op_db_keeps_the_tests_hypothesis_profile():
    """torch's test utilities register a profile named "dev" and load one of their own when
    op_db is imported: the tests after this module must still draw as conftest.py says."""
    sweep.op_db()
    assert settings.get_profile("dev").max_examples == 100  # ours (torch's draws 10)
    assert settings._current_profile == (os.environ.get("FD_PROFILE") or "ci")
