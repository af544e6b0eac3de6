"""Helpers shared by several test files (and the benchmarks' checks): float comparisons with
tolerances derived from the dtype and the computation, the library's error contract, drawn
layout pairs that split evenly, and a catalogue of global op calls."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

__all__ = [
    "ERROR_FACTOR",
    "assert_close",
    "check",
    "compiled_graphs",
    "even_pairs",
    "in_float64",
    "op_catalogue",
    "with_long_run",
]

#: How many times the error of plain torch's own low-precision computation a result may have.
#: Two orders of the same roundings (a sum over shards, then across devices, against one
#: device's sum) err by about as much; the factor leaves room for the spread of the largest of
#: a tensor's errors. It is fixed: a comparison that needs more has found something to explain.
ERROR_FACTOR = 4

#: torch.testing.assert_close's default (rtol, atol) per dtype (its documented table): what
#: "equal" means for a dtype's own rounding, the floor of every tolerance below
DTYPE_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
}
_WIDE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64}
_WIDE.update({torch.complex32: torch.complex128, torch.complex64: torch.complex128})


def assert_close(
    got,
    want,
    want_in_dtype=None,
    *,
    terms: float = 1,
    dtypes: tuple[torch.dtype, ...] = (),
    msg: str | Callable[[str], str] | None = None,
) -> None:
    """Each tensor of the pytree ``got`` equals the one of ``want`` (the same structure), the
    way torch's OpInfo tests decide it: within the tolerance of ``got``'s dtype
    (:data:`DTYPE_TOLERANCES`), widened where the computation amplifies rounding to
    :data:`ERROR_FACTOR` times the error of plain torch's own computation in that dtype.

    ``want`` is the reference, best computed in float64 (:func:`in_float64`); ``want_in_dtype``,
    if given, is the same computation by plain torch in ``got``'s dtype, and its distance from
    ``want`` is that error. A low-precision ``got`` is compared with a float64 ``want`` in float64
    (its dtype checked against ``want_in_dtype``'s, if given); otherwise dtypes must match, as in
    ``torch.testing.assert_close``. Integer and bool tensors compare exactly; NaNs match NaNs.

    Where plain torch has no such computation to measure (a value summed from parts across
    devices), ``terms`` says how many rounded values a result sums at most, in another order than
    the reference's: the absolute tolerance widens to the bound of such a sum's rounding, ``terms``
    times the dtype's relative tolerance at the scale of the values (at least 1: inputs of unit
    scale). ``dtypes`` adds the dtypes a result was computed through (a float16 input promoted
    to float32 rounded in float16 first): the loosest tolerance of them all applies.
    """
    say = msg if callable(msg) else (lambda m: f"{msg}: {m}" if msg else m)
    got_leaves, got_tree = optree.tree_flatten(got)
    want_leaves, want_tree = optree.tree_flatten(want)
    if got_tree != want_tree:
        raise AssertionError(say(f"structures differ: got {got_tree}, want {want_tree}"))
    low_leaves = [None] * len(got_leaves)
    if want_in_dtype is not None:
        low_leaves, low_tree = optree.tree_flatten(want_in_dtype)
        if low_tree != want_tree:
            raise AssertionError(say(f"structures differ: want_in_dtype {low_tree}, want {want_tree}"))
    for path, g, w, low in zip(optree.tree_paths(got), got_leaves, want_leaves, low_leaves):
        where = "".join(f"[{k!r}]" for k in path)
        leaf_say = (lambda m, where=where: say(f"{where}: {m}")) if where else say
        _assert_leaf_close(torch.as_tensor(g), torch.as_tensor(w), low, terms, dtypes, leaf_say)


def _assert_leaf_close(got, want, low, terms: float, dtypes, say: Callable[[str], str]) -> None:
    if not (got.is_floating_point() or got.is_complex()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=say)
        return
    if low is not None:
        low = torch.as_tensor(low)
        if got.dtype != low.dtype:
            raise AssertionError(say(f"dtype {got.dtype}, where plain torch gives {low.dtype}"))
    if want.dtype != _WIDE.get(got.dtype) and got.dtype != want.dtype:
        raise AssertionError(say(f"dtype {got.dtype}, want {want.dtype}"))
    rtol, atol = (max(t) for t in zip(*(DTYPE_TOLERANCES.get(d, (0.0, 0.0)) for d in (got.dtype, *dtypes))))
    if terms > 1 and want.numel():
        scale = max(1.0, want.abs().nan_to_num(0.0, 0.0, 0.0).max().item())
        atol = max(atol, terms * rtol * scale)
    if low is not None and want.numel():
        error = (low.to(want.dtype) - want).abs().nan_to_num(0.0, 0.0, 0.0).max().item()
        atol = max(atol, ERROR_FACTOR * error)
    torch.testing.assert_close(got.to(want.dtype), want, rtol=rtol, atol=atol, equal_nan=True, msg=say)


def train_sharded(params: dict, batches, loss_of: Callable) -> list[dict]:
    """AdamW steps (``fd.Optimizer``, lr 1e-2) of a sharded model, one per batch: per step the
    loss ``loss_of(params, batch)``, the parameters it was taken at and its gradients, as
    global values (a model test compares them with one device's)."""
    opt = fd.Optimizer(torch.optim.AdamW, params, lr=1e-2)
    steps = []
    for batch in batches:
        loss = loss_of(params, batch)
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        steps.append(
            {
                "loss": loss.full_tensor().detach(),
                "params": {n: p.full_tensor().detach() for n, p in params.items()},
                "grads": {n: g.full_tensor() for n, g in grads.items()},
            }
        )
        params = opt.step(params, grads)
    return steps


def in_float64(tree):
    """``tree`` with every float (complex) tensor and module converted to float64 (complex128):
    the arguments of a float64 reference. Modules are copied, tensors keep ``requires_grad``."""

    def wide(leaf):
        if isinstance(leaf, torch.nn.Module):
            return copy.deepcopy(leaf).double()
        if isinstance(leaf, torch.Tensor) and leaf.dtype in _WIDE:
            return leaf.detach().to(_WIDE[leaf.dtype]).requires_grad_(leaf.requires_grad)
        return leaf

    return optree.tree_map(wide, tree, is_leaf=lambda x: isinstance(x, torch.nn.Module))


def with_long_run(examples: int, *strategies, default_examples: int | None = None, **named_strategies):
    """``@given(*strategies, **named_strategies)`` for the default run (``default_examples``, or
    the profile's), and a twin of the same test drawn ``examples`` times, ``<name>_long``, in the
    slow tier (``python -m pytest -m slow``), put beside it in its module. Marks applied below
    this decorator (parametrize, filterwarnings) reach both."""

    def decorate(body):
        twin = settings(max_examples=examples)(given(*strategies, **named_strategies)(body))
        body.__globals__[f"{body.__name__}_long"] = pytest.mark.slow(twin)
        test = given(*strategies, **named_strategies)(body)
        return test if default_examples is None else settings(max_examples=default_examples)(test)

    return decorate


def check(error, builtin, call, *fragments):
    """``call()`` raises ``error``, a library error that is also ``builtin``, whose message says
    what was expected, what it got and the fix, and holds every fragment."""
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, builtin) and isinstance(info.value, fd.FunctionalDTensorError)
    message = str(info.value)
    assert "Fix:" in message and "expected" in message and "got" in message
    for fragment in fragments:
        assert fragment in message, message


@st.composite
def even_pairs(draw):
    """Meshes up to 8 devices, 1-3 dims of sizes multiple of the mesh size: every layout splits
    evenly, so the planner (not the fallback) runs. Any order of a dim's axes, Partial axes."""
    mesh = draw(fds.meshes(max_devices=8))
    ndim = draw(st.integers(1, 3))
    shape = tuple(mesh.size * draw(st.integers(1, 2)) for _ in range(ndim))
    source = draw(fds.layouts(mesh, ndim, allow_partial=True))
    target = draw(fds.layouts(mesh, ndim, allow_partial=True))
    return mesh, shape, source, target


def op_catalogue(mesh, x, w, idx) -> dict:
    """Op calls on several layouts over the mesh's first and last axes (``x`` (8, 6), ``w``
    (6, 8), ``idx`` (4, 2) indices below 8): ``"op layout-number" -> value``."""
    names = mesh.axis_names
    out = {}
    for n, spec in enumerate([fd.P(), fd.P(names[0]), fd.P(None, names[-1]), fd.P(names)]):
        d = fd.distribute_tensor(x, mesh, spec)
        e = fd.distribute_tensor(w, mesh, fd.P(*reversed(tuple(spec))) if len(spec) else fd.P())
        table = fd.distribute_tensor(x, mesh, fd.P(names[-1]))
        cases = {
            "add": d + d.sum(0),
            "matmul": d @ e,
            "mean": d.mean(),
            "amax": d.amax(1),
            "softmax": torch.softmax(d, -1),
            "view": d.t().reshape(3, 16),
            "index": d[1:5, ::2],
            "cat": torch.cat([d, d * 2], 1),
            "where": torch.where(d > 0, d, -d),
            "einsum": torch.einsum("ij,jk->ik", d, e),
            "embedding": F.embedding(fd.distribute_tensor(idx, mesh, fd.P(names[0])), table),
            "gather": torch.gather(d, 0, fd.distribute_tensor(idx, mesh, fd.P(names[0]))),
            "gather rows": torch.gather(d, 1, fd.distribute_tensor(idx % 6, mesh, fd.P())),
            "cross_entropy": F.cross_entropy(d, fd.distribute_tensor(idx[:, 0].repeat(2) % 6, mesh, fd.P())),
        }
        out.update({f"{name} {n}": value for name, value in cases.items()})
    return out


def compiled_graphs(f, args, **aot_options):
    """``f``'s output compiled (fullgraph), and the forward and backward graphs AOT autograd
    made of it (``aot_options``: its partitioner and decompositions, where not the defaults)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    torch._dynamo.reset()
    graphs = {}

    def capture(gm, example_inputs):
        def keep(name):
            def compiler(graph, inputs):
                graphs[name] = graph
                return make_boxed_func(graph)

            return compiler

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"), **aot_options
        )

    out = torch.compile(lambda *a: f(*a).full_tensor(), fullgraph=True, backend=capture)(*args)
    return out, graphs


@contextlib.contextmanager
def held_at_any_size():
    """Values of any size held once on a simulated mesh (see ``Backend.holds``: small ones
    are not, where the Python of holding them outweighs the work saved)."""
    from functional_dtensor._simulated import storage

    before = storage.HELD_MIN_ELEMENTS
    storage.HELD_MIN_ELEMENTS = 0
    try:
        yield
    finally:
        storage.HELD_MIN_ELEMENTS = before
