"""A fuzz suite: drawn programs on drawn layouts, shapes and dtypes, against single-device torch.

Every drawn program (a redistribute, a global op, a ``shard_map`` program of the catalogue, or a
few of them in sequence) either gives the single-device reference (values, dtype, shape, and the
gradient for floating dtypes) or raises one of the library's own errors
(:class:`fd.FunctionalDTensorError`). Anything else -- a raw torch error, an ``assert``, an
``IndexError``, a wrong value -- fails the test. The draws reach 0-size dims, uneven shards,
1-device and 64-device meshes, Partial layouts, non-contiguous and strided inputs, broadcasting,
and float16, bfloat16, float64, integers, bool and complex values.

Each fuzz test runs twice: a short derandomized slice in the default run, and its ``_long``
twin (:data:`LONG_EXAMPLES` derandomized examples) in the slow tier (``python -m pytest -m slow``,
which CI runs too). The ``fuzz`` profile draws fresh random examples, over 10,000 in all::

    FD_PROFILE=fuzz python -m pytest tests/test_fuzz.py -m "not distributed" --hypothesis-show-statistics

A small slice also runs on gloo ranks (the ``backend`` fixture), against the simulated backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from backends import per_device
from catalogue import cases, mapped
from common import assert_close, held_at_any_size, with_long_run
from hypothesis import event, given, settings
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor._dtensor import held_of
from functional_dtensor._sharding import shard_table
from functional_dtensor.testing import strategies as fds

LIBRARY_ERROR = fd.FunctionalDTensorError
LONG_EXAMPLES = 1500  # each fuzz test's examples in the slow tier


def fuzz(**strategies):
    """The fuzz tests' ``@given``: a short slice in the default run, :data:`LONG_EXAMPLES` in the
    slow tier (the ``_long`` twin)."""
    return with_long_run(LONG_EXAMPLES, **strategies)


LOW = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float64)
EXACT = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool)
ALL_DTYPES = (*FLOATS, *LOW, *EXACT, torch.complex64)
# --- values ------------------------------------------------------------------------------------


def value_of(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small values of ``dtype``: exact in every floating dtype (quarters in [-2, 2]) for low
    precision, normal samples for float32/64/complex, small integers, random bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in LOW:
        return (torch.randint(-8, 9, shape, generator=g) / 4).to(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if seed % 3 == 0:  # large values too, where sums of a narrow dtype wrap
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**20)), min(info.max, 2**20)
        return torch.randint(low, high + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    low = 0 if dtype == torch.uint8 else -4
    return torch.randint(low, 5, shape, generator=g).to(dtype)


FORMS = ("contiguous", "transposed", "strided", "offset", "expanded")


def in_form(x: torch.Tensor, form: str, seed: int) -> torch.Tensor:
    """A tensor equal to ``x`` (or, for ``expanded``, a broadcast of part of it: the reference
    is the returned tensor) with other strides: the last two dims transposed in memory, every
    other element of a larger buffer, a storage offset, or stride 0 along a dim."""
    if form == "transposed" and x.dim() >= 2:
        return x.mT.contiguous().mT
    if form == "strided" and x.dim() >= 1:
        buffer = torch.zeros((*x.shape[:-1], 2 * x.shape[-1] + 1), dtype=x.dtype)
        buffer[..., 1::2] = x
        return buffer[..., 1::2]
    if form == "offset":
        buffer = torch.zeros(x.numel() + 3, dtype=x.dtype)
        buffer[3:] = x.reshape(-1)
        return buffer[3:].view(x.shape)
    if form == "expanded" and x.dim() >= 1:
        dim = seed % x.dim()
        return x.narrow(dim, 0, min(1, x.shape[dim])).expand(x.shape) if x.shape[dim] else x
    return x


# --- comparing ---------------------------------------------------------------------------------


def assert_matches(got, want: torch.Tensor, what: str, scale: float = 1.0, inputs=()) -> None:
    """``got`` (an fd.DTensor or a tensor) is ``want``: shape, dtype and values (exact for
    integers and bool; for floating and complex values within the tolerance of the loosest of
    their dtype and the ``inputs``' dtypes -- a float16 input split into Partial(sum) parts
    rounds in float16 before a promotion -- widened for sums of up to ``scale`` terms: see
    ``common.assert_close``)."""
    full = got.full_tensor() if isinstance(got, fd.DTensor) else got
    assert isinstance(full, torch.Tensor), f"{what}: got {type(full).__name__}"
    assert full.shape == want.shape, f"{what}: shape {tuple(full.shape)} vs {tuple(want.shape)}"
    assert full.dtype == want.dtype, f"{what}: dtype {full.dtype} vs {want.dtype}"
    if isinstance(got, fd.DTensor):
        assert got.shape == want.shape and got.dtype == want.dtype, what
    if want.dtype == torch.complex32:  # few CPU kernels take it: compared as complex64
        full, want = full.to(torch.complex64), want.to(torch.complex64)
    assert_close(full, want, terms=scale, dtypes=tuple(inputs), msg=what)


class Outcome(NamedTuple):
    value: object
    error: BaseException | None


def attempt(call: Callable) -> Outcome:
    """The result of ``call()``, or the library's error it raised (any other error propagates:
    a failure of the fuzz)."""
    try:
        value = call()
    except LIBRARY_ERROR as error:
        assert str(error), "a library error without a message"
        event(f"library error: {type(error).__name__}")
        return Outcome(None, error)
    event("a value, compared")
    return Outcome(value, None)


def reference(call: Callable) -> Outcome:
    """Single-device torch: its result, or the error torch raises."""
    try:
        return Outcome(call(), None)
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as error:
        return Outcome(None, error)


# --- drawing meshes, layouts, dtypes ---------------------------------------------------------------

FIXED_MESHES = [(1,), (1, 1), (64,), (8, 8), (4, 4, 4), (2, 1, 32), (3, 5)]


@st.composite
def meshes(draw, max_devices: int = 64) -> fd.DeviceMesh:
    """Meshes of 1 to 3 axes: mostly small ones, often a 1-device or 64-device one."""
    fixed = [s for s in FIXED_MESHES if math.prod(s) <= max_devices]
    choice = draw(st.integers(0, 3))
    if choice == 0:
        shape = draw(st.sampled_from(fixed))
        names = draw(st.permutations(fds.AXIS_NAMES))[: len(shape)]
        return fd.simulated_mesh(shape, tuple(names))
    return draw(fds.meshes(max_devices=min(max_devices, 8 if choice < 3 else 64)))


def layout_on(mesh, ndim, partial: bool = True):
    return fds.layouts(mesh, ndim, allow_partial=partial)


def shapes(min_dims=0, max_dims=4, max_side=9, max_elements=256):
    return fds.global_shapes(min_dims, max_dims, max_side=max_side, max_elements=max_elements)


dtypes = st.sampled_from(ALL_DTYPES)


def differentiable(dtype) -> bool:
    return dtype in FLOATS


# --- (a) redistribute ------------------------------------------------------------------------------


@fuzz(
    mesh=meshes(),
    shape=shapes(),
    dtype=dtypes,
    form=st.sampled_from(FORMS),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_fuzz_redistribute(mesh, shape, dtype, form, seed, data):
    """distribute_tensor of a strided input, redistribute to a drawn layout, full_tensor: the
    input's value (and dtype), the blocks of the target's shard table; the input is copied (a
    later change to it does not show); the gradient comes back whole."""
    source = data.draw(layout_on(mesh, len(shape)), "source")
    target = data.draw(layout_on(mesh, len(shape)), "target")
    x = in_form(value_of(shape, dtype, seed), form, seed)
    want = x.clone()
    leaf = x.detach().requires_grad_() if differentiable(dtype) else x

    def run():
        d = fd.distribute_tensor(leaf, mesh, source)
        return d, fd.redistribute(d, target) if data.draw(st.booleans()) else d.redistribute(mesh, target)

    outcome = attempt(run)
    if outcome.error is not None:  # only a Partial reduction the dtype lacks is refused
        undefined = {"max", "min"} if dtype.is_complex else {"avg"} if dtype == torch.bool else set()
        ops = {p.op for p in (*source.placements, *target.placements) if p.is_partial()}
        assert isinstance(outcome.error, fd.LayoutError) and ops & undefined, repr(outcome.error)
        return
    d, y = outcome.value
    n = mesh.size
    assert y.sharding == target, f"{y.sharding} vs {target}"
    assert_matches(d, want, f"distribute {source}", scale=n)
    assert_matches(y, want, f"{source} -> {target}", scale=n)
    table = fd.testing.strategies.ShardedCase(mesh, target, tuple(shape), dtype).table
    assert [tuple(s.shape) for s in y.local_shards()] == [tuple(s) for s in table.local_shapes]
    if form in ("contiguous", "offset", "strided"):  # the input is copied, never aliased
        with torch.no_grad():
            x.add_(1) if dtype != torch.bool else x.logical_not_()
        assert_matches(y, want, "after a change to the input", scale=n)
    if differentiable(dtype):
        cotangent = value_of(shape, dtype, seed + 1)
        (grad,) = torch.autograd.grad((y.full_tensor() * cotangent).sum(), leaf)
        assert_matches(grad, cotangent, f"gradient of {source} -> {target}", scale=n)


# --- (b) global ops ------------------------------------------------------------------------------


class Op(NamedTuple):
    name: str
    arity: int  # fd.DTensor operands
    call: Callable  # (*operands, params) -> value
    params: Callable = lambda draw, shapes: ()  # drawn Python arguments
    shapes: str = "same"  # the operands' shapes: same, broadcast, matmul
    smooth: bool = True  # gradients compare where the op is differentiable almost everywhere


def _gather(x, y, p):
    size = x.shape[p[0]] if x.ndim else 1
    return torch.gather(x, p[0], torch.remainder(y.long(), max(size, 1)))


def _dim(draw, shapes):
    ndim = len(shapes[0])
    return draw(st.integers(-ndim, ndim - 1)) if ndim else 0


def _dims(draw, shapes):
    ndim = len(shapes[0])
    dims = draw(st.none() | st.lists(st.integers(0, max(0, ndim - 1)), max_size=ndim, unique=True))
    return (None if dims is None or not ndim else tuple(dims), draw(st.booleans()))


def _reduce(fn):
    def call(x, p):
        dims, keepdim = p
        return fn(x) if dims is None else fn(x, dim=dims, keepdim=keepdim)

    return call


def _index(draw, shapes):
    items = []
    for n in shapes[0]:
        kind = draw(st.sampled_from(["all", "int", "slice", "none"]))
        if kind == "int" and n:
            items.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            start = draw(st.none() | st.integers(-n - 1, n + 1))
            stop = draw(st.none() | st.integers(-n - 1, n + 1))
            items.append(slice(start, stop, draw(st.none() | st.integers(1, 3))))
        elif kind == "none":
            items += [None, slice(None)]
        else:
            items.append(slice(None))
    if items and draw(st.booleans()):
        items = [Ellipsis, *items[draw(st.integers(0, len(items))) :]]
    return (tuple(items),)


def _reshape(draw, shapes):
    shape = shapes[0]
    numel = math.prod(shape)
    if numel == 0 or len(shape) == 0:
        return ((-1,),)
    # a drawn factorization of numel
    out, rest = [], numel
    while rest > 1 and len(out) < 3:
        divisors = [d for d in range(2, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divisors))
        out.append(d)
        rest //= d
    out = [*out, rest] if rest > 1 or not out else out
    if draw(st.booleans()):
        out[draw(st.integers(0, len(out) - 1))] = -1
    return (tuple(out),)


def _permutation(draw, shapes):
    return (tuple(draw(st.permutations(range(len(shapes[0]))))),)


def _two_dims(draw, shapes):
    ndim = max(1, len(shapes[0]))
    return (draw(st.integers(-ndim, ndim - 1)), draw(st.integers(-ndim, ndim - 1)))


def _dim_keep(draw, shapes):
    return (_dim(draw, shapes) if draw(st.booleans()) else None, draw(st.booleans()))


def _equation(shapes) -> str:
    """A batched matmul's einsum equation, every dim labelled (fd.DTensor takes no '...')."""
    a, b = shapes
    batch = "abcd"[: len(a) - 2]
    return f"{batch}ij,{batch[len(batch) - (len(b) - 2) :]}jk->{batch}ik"


def _split(draw, shapes):
    return (draw(st.integers(1, 4)), _dim(draw, shapes))


def _unary(name: str):
    f = getattr(torch, name)
    return lambda x, p: f(x)


OPS = [
    # elementwise, unary
    *[
        Op(name, 1, _unary(name), smooth=smooth)
        for name, smooth in [
            ("neg", True),
            ("abs", False),
            ("exp", True),
            ("sin", True),
            ("tanh", True),
            ("sigmoid", True),
            ("relu", False),
            ("square", True),
            ("floor", False),
            ("round", False),
            ("sign", False),
            ("logical_not", False),
            ("isnan", False),
            ("erf", True),
        ]
    ],
    Op("sqrt(abs)", 1, lambda x, p: torch.sqrt(torch.abs(x) + 1)),
    Op("clamp", 1, lambda x, p: torch.clamp(x, -0.5, 0.5), smooth=False),
    Op("gelu", 1, lambda x, p: F.gelu(x)),
    Op("softplus", 1, lambda x, p: F.softplus(x)),
    Op("leaky_relu", 1, lambda x, p: F.leaky_relu(x, 0.1), smooth=False),
    # x / 0 of a Partial(sum) value keeps the layout (linear), and its parts' 0 / 0 are nan: a
    # known limit of Partial layouts with non-finite values (as in torch's DTensor); log is
    # not linear, so the parts are summed first
    Op("nan_to_num", 1, lambda x, p: torch.nan_to_num(torch.log(x))),
    Op("scalar ops", 1, lambda x, p: (2 - x) * 3 + x / 2 - x**2),
    Op("int scalar", 1, lambda x, p: x * 2 + 1),
    Op("compare", 1, lambda x, p: (x > 0) & (x <= 1)),
    Op("to float64", 1, lambda x, p: x.to(torch.float64)),
    Op("float", 1, lambda x, p: x.float()),
    Op("bool", 1, lambda x, p: x.bool(), smooth=False),
    Op("int", 1, lambda x, p: x.int(), smooth=False),
    Op("clone", 1, lambda x, p: x.clone().contiguous().detach()),
    # elementwise, binary, broadcast
    *[
        Op(name, 2, lambda x, y, p, f=f: f(x, y), shapes="broadcast", smooth=smooth)
        for name, f, smooth in [
            ("add", torch.add, True),
            ("sub", torch.sub, True),
            ("mul", torch.mul, True),
            # a divisor of zero under a Partial(sum) numerator reads nan where a part is zero
            # (0 / 0): the documented non-finite limit of Partial layouts (concepts/global_ops)
            ("div", lambda x, y: torch.div(x, torch.where(y == 0, 1, y)), True),
            ("maximum", torch.maximum, False),
            ("minimum", torch.minimum, False),
            ("eq", torch.eq, False),
            ("lt", torch.lt, False),
            ("logical_and", torch.logical_and, False),
            ("logical_xor", torch.logical_xor, False),
            ("atan2", torch.atan2, True),
            ("operators", lambda x, y: x * 2 + y - x * y, True),
            ("pow", lambda x, y: torch.pow(torch.abs(x) + 1, torch.abs(y)), True),
            ("remainder", lambda x, y: torch.remainder(x, torch.abs(y) + 1), False),
            ("where", lambda x, y: torch.where(x > y, x, y), False),
        ]
    ],
    # reductions
    *[
        Op(name, 1, _reduce(getattr(torch, name)), _dims, smooth=name in ("sum", "mean"))
        for name in ("sum", "mean", "amax", "amin")
    ],
    Op(
        "prod",
        1,
        lambda x, p: torch.prod(x) if p[0] is None else torch.prod(x, p[0], p[1]),
        _dim_keep,
        smooth=False,
    ),
    Op("max", 1, lambda x, p: torch.max(x), smooth=False),
    Op("max along", 1, lambda x, p: tuple(torch.max(x, p[0], p[1])), lambda draw, s: (_dim(draw, s), True)),
    Op("norm", 1, lambda x, p: torch.norm(x)),
    Op("std (no rule)", 1, lambda x, p: torch.std(x)),
    # matmul family
    Op("matmul", 2, lambda x, y, p: torch.matmul(x, y), shapes="matmul"),
    Op("einsum", 2, lambda x, y, p: torch.einsum(p[0], x, y), lambda draw, s: (_equation(s),), "matmul"),
    Op("linear", 2, lambda x, y, p: F.linear(x, y.mT), shapes="matmul"),
    # views
    Op("reshape", 1, lambda x, p: x.reshape(p[0]), _reshape),
    Op("view", 1, lambda x, p: x.view(p[0]), _reshape),
    Op("flatten", 1, lambda x, p: x.flatten()),
    Op("permute", 1, lambda x, p: x.permute(*p[0]), _permutation),
    Op("transpose", 1, lambda x, p: x.transpose(p[0], p[1]), _two_dims),
    Op("unsqueeze", 1, lambda x, p: x.unsqueeze(p[0]), lambda draw, s: (draw(st.integers(0, len(s[0]))),)),
    Op("index", 1, lambda x, p: x[p[0]], _index),
    Op("expand", 1, lambda x, p: x.unsqueeze(0).expand(3, *x.shape)),
    Op("split", 1, lambda x, p: tuple(torch.split(x, p[0], p[1])), _split),
    Op("chunk", 1, lambda x, p: tuple(torch.chunk(x, p[0], p[1])), _split),
    # along a dim
    Op("softmax", 1, lambda x, p: F.softmax(x, p[0]), lambda draw, s: (_dim(draw, s),)),
    Op("log_softmax", 1, lambda x, p: torch.log_softmax(x, dim=p[0]), lambda draw, s: (_dim(draw, s),)),
    Op("cumsum", 1, lambda x, p: torch.cumsum(x, p[0]), lambda draw, s: (_dim(draw, s),)),
    Op("layer_norm", 1, lambda x, p: F.layer_norm(x, x.shape[-1:])),
    Op("squeeze", 1, lambda x, p: x.squeeze()),
    Op("lerp", 2, lambda x, y, p: torch.lerp(x, y, 0.25), shapes="broadcast"),
    Op("clamp by a tensor", 2, lambda x, y, p: torch.clamp(x, min=y), shapes="broadcast", smooth=False),
    Op("embedding", 2, lambda x, y, p: F.embedding(torch.remainder(x.long(), 7), y), shapes="lookup"),
    Op(
        "gather",
        2,
        _gather,
        lambda draw, s: (_dim(draw, s),),
        shapes="gather",
    ),
    Op(
        "cross_entropy",
        2,
        lambda x, y, p: F.cross_entropy(x, torch.remainder(y.long(), x.shape[-1])),
        shapes="classes",
    ),
    # joining
    Op("cat", 2, lambda x, y, p: torch.cat([x, y], p[0]), lambda draw, s: (_dim(draw, s),)),
    Op(
        "stack",
        2,
        lambda x, y, p: torch.stack([x, y], p[0]),
        lambda draw, s: (draw(st.integers(0, len(s[0]))),),
    ),
]
OPS_BY_NAME = {op.name: op for op in OPS}


@st.composite
def operand_shapes(draw, op: Op):
    if op.shapes == "same":
        shape = draw(shapes(max_dims=3 if op.arity == 1 else 2))
        return [shape] * op.arity
    if op.shapes == "broadcast":
        shape = draw(shapes(max_dims=3))
        drop = draw(st.integers(0, len(shape)))
        other = tuple(1 if draw(st.booleans()) else n for n in shape[drop:])
        return [shape, other] if draw(st.booleans()) else [other, shape]
    if op.shapes == "lookup":  # indices (any shape), a table (rows, features)
        return [draw(shapes(max_dims=2)), (draw(st.integers(0, 7)), draw(st.integers(0, 4)))]
    if op.shapes == "gather":  # an input, and an index no larger on any dim
        shape = draw(shapes(max_dims=3))
        return [shape, tuple(draw(st.integers(0, n)) for n in shape)]
    if op.shapes == "classes":  # logits (rows, classes), targets (rows,)
        rows = draw(st.integers(0, 6))
        return [(rows, draw(st.integers(1, 7))), (rows,)]
    m, k, n = (draw(st.integers(0, 5)) for _ in range(3))
    batch = draw(st.sampled_from([(), (2,), (3, 1)]))
    return [(*batch, m, k), (*batch[len(batch) // 2 :], k, n)]


def _flatten_outputs(value):
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _scale(shapes_) -> float:
    return float(max([math.prod(s) for s in shapes_] + [1]))


def run_op(op: Op, mesh, layouts, xs, params, grad: bool, what: str, held: bool = False) -> None:
    """``op`` on fd.DTensors of ``layouts`` against ``op`` on ``xs``: values, and the gradient
    for floating dtypes where asked. ``held``: inputs replicated over an axis are made by an
    all-reduce into it, so that a simulated mesh holds them once (see test_held_once.py)."""
    leaves = [x.detach().requires_grad_() if grad else x for x in xs]
    try:
        inputs = [(_held if held else fd.distribute_tensor)(t, mesh, lay) for t, lay in zip(leaves, layouts)]
    except fd.LayoutError:  # a Partial reduction the dtype lacks (test_fuzz_redistribute)
        return
    # the reference of values: the op on the inputs' global values as the library holds them (a
    # float Partial(sum) input is held as parts x / n, whose sum rounds), contiguous (a value has
    # no strides: x.view works on any input)
    want = reference(lambda: op.call(*[d.full_tensor().detach().contiguous() for d in inputs], params))
    got = attempt(lambda: op.call(*inputs, params))
    if got.error is not None:
        cause = got.error.__cause__
        if cause is not None and not isinstance(cause, LIBRARY_ERROR):  # torch failed on the shards
            assert want.error is not None, f"{what}: fails on the shards ({cause!r}), not on one device"
        if want.error is None:
            event(f"refused where torch computes: {op.name}, {type(got.error).__name__}")
        return
    assert want.error is None, f"{what}: torch raises {want.error!r}, the library returns a value"
    outs, wants = _flatten_outputs(got.value), _flatten_outputs(want.value)
    assert len(outs) == len(wants), what
    for i, (o, w) in enumerate(zip(outs, wants)):
        assert isinstance(o, fd.DTensor), f"{what}: output {i} is {type(o).__name__}"
        scale = _scale([x.shape for x in xs])
        assert_matches(o, w.detach(), f"{what}: output {i}", scale, [x.dtype for x in xs])
    if not grad:
        return
    floating = [(o, w) for o, w in zip(outs, wants) if w.dtype.is_floating_point and w.requires_grad]
    if not floating:
        return
    cotangents = [value_of(w.shape, w.dtype, 7 + i) for i, (_, w) in enumerate(floating)]
    wants = _flatten_outputs(op.call(*[t.contiguous() for t in leaves], params))  # differentiable
    floating = [(o, w) for (o, _), w in zip(floating, [w for w in wants if w.dtype.is_floating_point])]
    got_grads = torch.autograd.grad(
        sum((o.full_tensor() * c).sum() for (o, _), c in zip(floating, cotangents)), leaves, allow_unused=True
    )
    want_grads = torch.autograd.grad(
        sum((w * c).sum() for (_, w), c in zip(floating, cotangents)), leaves, allow_unused=True
    )
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        g = torch.zeros_like(xs[i]) if g is None else g
        w = torch.zeros_like(xs[i]) if w is None else w
        assert_matches(g, w, f"{what}: gradient of input {i}", scale=_scale([x.shape for x in xs]))


@fuzz(
    op=st.sampled_from(OPS),
    mesh=meshes(max_devices=64),
    dtypes_=st.tuples(dtypes, dtypes),
    seed=st.integers(0, 2**16),
    forms=st.tuples(st.sampled_from(FORMS), st.sampled_from(FORMS)),
    data=st.data(),
)
def test_fuzz_global_ops(op, mesh, dtypes_, seed, forms, data):
    """One torch op on fd.DTensor inputs of drawn layouts (Partial too), shapes (broadcast ones
    too), dtypes (mixed: type promotion) and strides."""
    operand_shapes_ = data.draw(operand_shapes(op), "shapes")
    if data.draw(st.booleans()):  # mostly one dtype for all operands
        dtypes_ = (dtypes_[0], dtypes_[0])
    layouts = [data.draw(layout_on(mesh, len(s)), f"layout {i}") for i, s in enumerate(operand_shapes_)]
    params = op.params(data.draw, operand_shapes_) if op.params is not None else ()
    xs = [
        in_form(value_of(s, dt, seed + i), form, seed)
        for i, (s, dt, form) in enumerate(zip(operand_shapes_, dtypes_, forms))
    ]
    grad = op.smooth and all(differentiable(x.dtype) for x in xs) and data.draw(st.booleans(), "grad")
    what = f"{op.name}{tuple(params)} on {[str(lay) for lay in layouts]} {operand_shapes_} {dtypes_}"
    run_op(op, mesh, layouts, xs, params, grad, what)


def _held(t: torch.Tensor, mesh, layout: fd.Layout) -> fd.DTensor:
    """``t`` in ``layout``, made by summing parts over its first Replicate axis of more than
    one device (held once there on a simulated mesh, for floating dtypes)."""
    axes = [a for a, (p, n) in enumerate(zip(layout.placements, mesh.shape)) if p.is_replicate() and n > 1]
    if not axes:
        return fd.distribute_tensor(t, mesh, layout)
    parts = list(layout.placements)
    parts[axes[0]] = fd.Partial()
    value = fd.distribute_tensor(t, mesh, fd.Layout(mesh, tuple(parts), layout.shard_order)).redistribute(
        layout
    )
    event(f"held once: {held_of(value) is not None}")
    return value


@fuzz(
    op=st.sampled_from(OPS),
    mesh=meshes(max_devices=16),
    dtype=dtypes,
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_fuzz_global_ops_on_held_values(op, mesh, dtype, seed, data):
    """The ops of :func:`test_fuzz_global_ops` on values held once (on a simulated mesh: made
    by an all-reduce into a Replicate axis), values and gradients."""
    operand_shapes_ = data.draw(operand_shapes(op), "shapes")
    layouts = [data.draw(layout_on(mesh, len(s)), f"layout {i}") for i, s in enumerate(operand_shapes_)]
    params = op.params(data.draw, operand_shapes_) if op.params is not None else ()
    xs = [value_of(s, dtype, seed + i) for i, s in enumerate(operand_shapes_)]
    grad = op.smooth and differentiable(dtype) and data.draw(st.booleans(), "grad")
    what = f"{op.name}{tuple(params)} on held {[str(lay) for lay in layouts]} {operand_shapes_} {dtype}"
    with held_at_any_size():
        run_op(op, mesh, layouts, xs, params, grad, what, held=True)


def _second_derivatives(outs, leaves, cotangents, directions):
    """The gradient of ``sum(out**2 * c)`` over ``leaves`` and the gradient of its product with
    ``directions`` (zeros where a leaf has none)."""
    loss = sum((out.square() * c).sum() for out, c in zip(outs, cotangents))
    firsts = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    firsts = [torch.zeros_like(x) if g is None else g for g, x in zip(firsts, leaves)]
    varying = [(g * d).sum() for g, d in zip(firsts, directions) if g.requires_grad]
    seconds = (
        torch.autograd.grad(sum(varying), leaves, allow_unused=True) if varying else [None] * len(leaves)
    )
    return [g.detach() for g in firsts], [
        torch.zeros_like(x) if h is None else h for h, x in zip(seconds, leaves)
    ]


@fuzz(
    op=st.sampled_from([op for op in OPS if op.smooth]),
    mesh=meshes(max_devices=16),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_fuzz_second_derivatives(op, mesh, seed, data):
    """One smooth torch op on float64 fd.DTensor inputs of drawn layouts (Partial too): first
    and second derivatives against the op on one device."""
    operand_shapes_ = data.draw(operand_shapes(op), "shapes")
    layouts = [data.draw(layout_on(mesh, len(s)), f"layout {i}") for i, s in enumerate(operand_shapes_)]
    params = op.params(data.draw, operand_shapes_) if op.params is not None else ()
    xs = [value_of(s, torch.float64, seed + i) for i, s in enumerate(operand_shapes_)]
    leaves, refs = [x.clone().requires_grad_() for x in xs], [x.clone().requires_grad_() for x in xs]
    want = reference(lambda: op.call(*refs, params))
    got = attempt(
        lambda: op.call(*[fd.distribute_tensor(t, mesh, lay) for t, lay in zip(leaves, layouts)], params)
    )
    if want.error is not None or got.error is not None:  # the values' test compares the errors
        return
    pairs = [
        (o.full_tensor(), w)
        for o, w in zip(_flatten_outputs(got.value), _flatten_outputs(want.value))
        if w.dtype.is_floating_point and w.requires_grad
    ]
    if not pairs:
        return
    cotangents = [value_of(w.shape, torch.float64, seed + 7 + i) for i, (_, w) in enumerate(pairs)]
    directions = [value_of(x.shape, torch.float64, seed + 11 + i) for i, x in enumerate(xs)]
    want_grads = reference(lambda: _second_derivatives([w for _, w in pairs], refs, cotangents, directions))
    if want_grads.error is not None:  # torch's own derivatives fail (an empty embedding's second)
        return
    want_grads = want_grads.value
    got_grads = _second_derivatives([o for o, _ in pairs], leaves, cotangents, directions)
    what = f"{op.name}{tuple(params)} on {[str(lay) for lay in layouts]} {operand_shapes_}"
    for order, (gs, ws) in enumerate(zip(got_grads, want_grads), 1):
        for i, (g, w) in enumerate(zip(gs, ws)):
            assert_matches(g, w, f"{what}: derivative {order} of input {i}", scale=_scale(operand_shapes_))


# --- (c) the catalogue's shard_map programs, drawn specs -------------------------------------------


@st.composite
def mesh_and_axes(draw):
    mesh = draw(meshes(max_devices=64))
    axes = tuple(draw(st.permutations(mesh.axis_names))[: draw(st.integers(1, mesh.ndim))])
    return mesh, axes


CATALOGUE_NAMES = [c.name for c in cases(fd.simulated_mesh(2, "x"), ("x",))]
SHARD_MAP_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@fuzz(
    mesh_axes=mesh_and_axes(),
    name=st.sampled_from(CATALOGUE_NAMES),
    m=st.integers(0, 3),
    dtype=st.sampled_from(SHARD_MAP_DTYPES),
    form=st.sampled_from(FORMS[:4]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_catalogue(mesh_axes, name, m, dtype, form, seed):
    """A catalogue program over drawn mesh axes (any order, up to 64 devices), local sizes
    (0 too), dtypes and strided inputs: the reference's value and, for float32/64, gradients."""
    mesh, axes = mesh_axes
    case = next(c for c in cases(mesh, axes, m) if c.name == name)
    xs = [in_form(value_of(s, dtype, seed + i), form, seed) for i, s in enumerate(case.shapes)]
    grad = dtype in FLOATS and case.smooth
    leaves = [x.detach().requires_grad_() if grad else x for x in xs]
    got = attempt(lambda: mapped(case, mesh)(*leaves))
    assert got.error is None, f"a valid program refused: {got.error!r}"
    want = case.reference(*[t.contiguous() for t in leaves])
    what = f"{name} over {axes} of {mesh.shape}, m={m}, {dtype}"
    scale = float(mesh.axis_size(axes) * max([math.prod(s) for s in case.shapes] + [1]))
    assert_matches(got.value, want.detach(), what, scale=scale)
    if grad:
        cotangent = value_of(want.shape, dtype, seed + 9)
        got_grads = torch.autograd.grad(
            (got.value.full_tensor() * cotangent).sum(), leaves, allow_unused=True
        )
        want_grads = torch.autograd.grad((want * cotangent).sum(), leaves, allow_unused=True)
        for i, (g, w) in enumerate(zip(got_grads, want_grads)):
            g = torch.zeros_like(xs[i]) if g is None else g
            w = torch.zeros_like(xs[i]) if w is None else w
            assert_matches(g, w, f"{what}: gradient of input {i}", scale=scale)


@fuzz(
    case=fds.sharded_cases(mesh=meshes(max_devices=64), max_dims=3, max_elements=256, dtype=dtypes),
    spec_case=st.data(),
    seed=st.integers(0, 2**16),
)
def test_fuzz_shard_map_specs(case, spec_case, seed):
    """An elementwise per-device program with a drawn spec (in and out): the reference where
    the shape divides, the library's SpecError where it does not."""
    spec = spec_case.draw(fds.specs(case.mesh, len(case.global_shape)), "spec")
    x = value_of(case.global_shape, case.dtype, seed)

    def f(v):
        return v * 2 + v if v.dtype != torch.bool else v | v

    got = attempt(lambda: fd.shard_map(f, mesh=case.mesh, in_specs=(spec,), out_specs=spec)(x))
    if got.error is not None:  # only where a dim does not divide over its axes
        assert not shard_table(fd.Layout.from_spec(case.mesh, spec), case.global_shape).is_even, got.error
        return
    assert got.value.sharding == fd.Layout.from_spec(case.mesh, spec).normalized(x.dim())
    assert_matches(got.value, f(x), f"shard_map with {spec} on {case.mesh.shape}", scale=4)


# --- (d) short programs of several steps -------------------------------------------------------------

# a layout recipe: per mesh axis ("R", 0), ("S", k) for Shard(k % ndim), or ("P", op)
recipe_entries = st.one_of(
    st.just(("R", 0)),
    st.tuples(st.just("S"), st.integers(0, 3)),
    st.tuples(st.just("P"), st.sampled_from(["sum", "avg", "max", "min"])),
)


def from_recipe(mesh, recipe, ndim: int) -> fd.Layout:
    placements = []
    for kind, arg in recipe[: mesh.ndim]:
        if kind == "S" and ndim:
            placements.append(fd.Shard(arg % ndim))
        elif kind == "P":
            placements.append(fd.Partial(arg))
        else:
            placements.append(fd.Replicate())
    return fd.Layout(mesh, tuple(placements))


def recipes():
    return st.lists(recipe_entries, min_size=3, max_size=3)


steps = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(["sin", "tanh", "relu", "neg", "square"])),
    st.tuples(st.just("affine"), st.none()),
    st.tuples(st.just("add"), st.tuples(recipes(), st.integers(0, 99))),
    st.tuples(st.just("mul"), st.tuples(recipes(), st.integers(0, 99))),
    st.tuples(st.just("redistribute"), recipes()),
    st.tuples(st.sampled_from(["sum", "amax", "softmax", "cat"]), st.integers(0, 3)),
    st.tuples(st.sampled_from(["transpose", "gram", "flatten and back", "slice", "double"]), st.none()),
)


def interpret(program, x, mesh=None):
    """Run ``program`` on ``x``: an fd.DTensor on ``mesh``, or (``mesh`` None) a plain tensor,
    the reference, for which a redistribute is the identity."""

    def spread(t, recipe):
        return t if mesh is None else fd.distribute_tensor(t, mesh, from_recipe(mesh, recipe, t.dim()))

    for name, arg in program:
        ndim = x.dim()
        if name == "unary":
            x = getattr(torch, arg)(x)
        elif name == "affine":
            x = x * 1.5 - 0.25
        elif name in ("add", "mul"):
            recipe, seed = arg
            other = spread(value_of(tuple(x.shape), x.dtype, seed), recipe)
            x = x + other if name == "add" else x * other
        elif name == "redistribute":
            x = x if mesh is None else fd.redistribute(x, from_recipe(mesh, arg, ndim))
        elif name == "sum":
            x = x.sum(arg % ndim, keepdim=True) if ndim else x.sum()
        elif name == "amax" and ndim:
            x = x.amax(arg % ndim, keepdim=True)
        elif name == "softmax":
            x = torch.softmax(x, arg % max(ndim, 1))
        elif name == "cat" and ndim:
            x = torch.cat([x, x * 2], arg % ndim)
        elif name == "transpose" and ndim >= 2:
            x = x.transpose(0, -1)
        elif name == "gram" and ndim >= 2:
            x = x @ x.mT
        elif name == "flatten and back":
            x = x.reshape(-1).reshape(tuple(x.shape))
        elif name == "slice" and ndim and x.shape[0] > 1:
            x = x[1:]
        elif name == "double":
            x = x.double()
    return x


@fuzz(
    mesh=meshes(max_devices=64),
    shape=shapes(max_dims=3, max_side=6, max_elements=96),
    dtype=st.sampled_from((torch.float64, torch.float64, torch.float32, torch.bfloat16, torch.int64)),
    recipe=recipes(),
    program=st.lists(steps, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_fuzz_programs(mesh, shape, dtype, recipe, program, seed):
    """A few global ops and redistributes in sequence: the plain program's value, and its first
    and second derivatives for float64 inputs."""
    x = value_of(shape, dtype, seed)
    grad = dtype == torch.float64
    leaf = x.detach().requires_grad_() if grad else x
    layout = from_recipe(mesh, recipe, x.dim())
    what = f"{program} from {layout} {shape} {dtype}"
    given_ = attempt(lambda: fd.distribute_tensor(leaf, mesh, layout))
    if given_.error is not None:  # a Partial reduction the dtype lacks
        event(f"refused input: {type(given_.error).__name__}")
        return
    # the reference runs on the global value as the library holds it (a float Partial(sum) is
    # held as parts x / n, whose sum rounds)
    held = given_.value.full_tensor().detach()
    held = held.requires_grad_() if grad else held
    want = reference(lambda: interpret(program, held))
    got = attempt(lambda: interpret(program, given_.value, mesh))
    if got.error is not None:
        cause = got.error.__cause__
        if cause is not None and not isinstance(cause, LIBRARY_ERROR):
            assert want.error is not None, f"{what}: fails on the shards ({cause!r}), not on one device"
        if want.error is None:
            event(f"refused where torch computes: {type(got.error).__name__}")
        return
    assert want.error is None, f"{what}: torch raises {want.error!r}, the library returns a value"
    scale = float(max(1, math.prod(shape)) ** 2)
    assert_matches(got.value, want.value.detach(), what, scale=scale)
    if grad and want.value.requires_grad:
        cotangent = value_of(want.value.shape, want.value.dtype, seed + 3)
        direction = value_of(shape, dtype, seed + 4)
        firsts, seconds = [], []
        for out, wrt in ((got.value.full_tensor(), leaf), (want.value, held)):
            # the square makes the first derivative depend on x for a linear program too
            (g,) = torch.autograd.grad(
                (out.square() * cotangent).sum(), wrt, create_graph=True, allow_unused=True
            )
            g = torch.zeros_like(x) if g is None else g
            (h,) = (
                torch.autograd.grad((g * direction).sum(), wrt, allow_unused=True)
                if g.requires_grad
                else (None,)
            )
            firsts.append(g.detach())
            seconds.append(torch.zeros_like(x) if h is None else h)
        assert_matches(firsts[0], firsts[1], f"{what}: gradient", scale=scale)
        assert_matches(seconds[0], seconds[1], f"{what}: second derivative", scale=scale)


# --- a slice on gloo ranks ---------------------------------------------------------------------------


def job_program(mesh, program, shape, dtype_name: str, recipe, seed: int) -> dict:
    """A drawn program on ``mesh`` (either backend): the output's shards and global value, or
    the library error's type."""
    x = value_of(shape, getattr(torch, dtype_name), seed)
    try:
        out = interpret(program, fd.distribute_tensor(x, mesh, from_recipe(mesh, recipe, x.dim())), mesh)
    except LIBRARY_ERROR as error:
        return {"error": type(error).__name__}
    return {"error": None, "shards": list(out.local_shards()), "full": out.full_tensor()}


@pytest.mark.meshes((2,), (2, 2))
def test_fuzz_programs_on_gloo(backend, mesh):
    """A few drawn programs on gloo ranks: the simulated backend's shards, global value, or
    error."""
    if backend.is_simulated:
        pytest.skip("the simulated backend is the reference here")

    @settings(max_examples=4, deadline=None)
    @given(
        shape=shapes(min_dims=1, max_dims=3, max_side=6, max_elements=96),
        dtype=st.sampled_from(("float64", "float32", "int64")),
        recipe=recipes(),
        program=st.lists(steps, min_size=1, max_size=3),
        seed=st.integers(0, 2**16),
    )
    def check_program(shape, dtype, recipe, program, seed):
        args = (program, shape, dtype, recipe, seed)
        expected = job_program(mesh.simulated(), *args)
        results = backend.run(job_program, mesh.shape, mesh.names, *args)
        for result in results:
            assert result["error"] == expected["error"], (program, result["error"], expected["error"])
        if expected["error"] is None:
            for got, want in zip(per_device(results, "shards"), expected["shards"], strict=True):
                assert_matches(got, want, f"{program}: a shard", scale=float(math.prod(shape)) ** 2)
            for result in results:
                assert_matches(
                    result["full"], expected["full"], f"{program}", scale=float(math.prod(shape)) ** 2
                )

    check_program()
