"""torch's OpInfo database on ``fd.DTensor``, as torch's ``test_dtensor_ops.py`` sweeps its
DTensor: each op's float32 samples, every tensor distributed (Shard(0) and Replicate on a mesh
of 4, Shard(0), Shard(1) on 2 x 2, op_db's uneven sizes), against plain torch on values and
gradients (``tests/opinfo_sweep.py``). The default run checks a fixed slice of op_db that works;
the slow tier sweeps all of it: no op may give a wrong answer, and at least :data:`OK_FLOOR`
ops must work (``python bench/opinfo_sweep.py`` prints the whole table and the errors to fix).
"""

from __future__ import annotations

import functools

import opinfo_sweep as sweep
import pytest

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
    "mm", "bmm", "addmm", "einsum", "nn.functional.scaled_dot_product_attention",
    # views, shapes, indexing
    "transpose", "permute", "reshape", "view", "flatten", "unsqueeze", "squeeze", "cat", "stack",
    "split", "chunk", "gather", "nn.functional.embedding",
    # the ops a new user reaches for first: by rules, torch's pointwise tags or replicated
    "masked_fill", "argmax", "var", "std", "topk", "sort", "tril", "triu", "nn.functional.pad",
    "index_select", "all", "any", "nn.functional.nll_loss", "logsumexp", "flip", "roll", "repeat",
    "nn.functional.normalize", "linalg.vector_norm", "new_zeros", "view_as", "expand_as",
    "floor_divide", "median",
]  # fmt: skip

#: samples per op in the default run (all layouts each)
SLICE_SAMPLES = 3

#: ops of op_db that are "ok" on fd.DTensor, measured with
#: ``python bench/opinfo_sweep.py --fd-only --samples 4`` (585 of 702, torch 2.13.0+cpu): the
#: slow sweep fails if fewer work (raise it as ops are fixed)
OK_FLOOR = 585


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
    "add", "mul", "sum", "amax", "mm", "softmax", "reshape", "flatten", "cat", "gather",
    "nn.functional.embedding", "median", "sort", "var", "nn.functional.pad", "tril",
]  # fmt: skip


def job_gloo_slice(mesh, names: list[str]) -> dict:
    import functional_dtensor as fd

    meshes = {"x4": mesh, "2x2": fd.init_device_mesh("cpu", (2, 2), ("a", "b"))}
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


@pytest.mark.slow
def test_no_op_of_op_db_gives_a_wrong_answer():
    results = [sweep.sweep_op(op, [fd_side()], samples=4, timeout=60)["fd"] for op in sweep.op_db()]
    wrong = [f"{r.op}: {r.message} (at {r.where})" for r in results if r.status == "wrong"]
    assert not wrong, "silent wrong answers:\n" + "\n".join(wrong)
    ok = sum(r.status == "ok" for r in results)
    assert ok >= OK_FLOOR, f"{ok} ops of op_db work on fd.DTensor, fewer than the floor {OK_FLOOR}"
