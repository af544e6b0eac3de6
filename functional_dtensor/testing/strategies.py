"""Hypothesis strategies for property tests of sharded programs.

Every strategy checks its arguments when it is called, not when it is first drawn from, and
raises :class:`hypothesis.errors.InvalidArgument` with a message that ends with the fix. Sizes
are kept small by default (mesh axes up to 64 devices in all, tensor sides up to 12, at most
2048 elements), so that hundreds of examples run in seconds on the simulated backend. Where an
argument is a mesh, a :class:`~functional_dtensor.DeviceMesh` or a strategy of meshes is
accepted.

>>> import math, torch, functional_dtensor as fd
>>> from hypothesis import given, settings
>>> from functional_dtensor.testing import strategies as fds
>>> @settings(max_examples=20, deadline=None)
... @given(fds.sharded_cases(allow_partial=True))
... def test_round_trip(case):
...     x = torch.arange(math.prod(case.global_shape)).reshape(case.global_shape)
...     y = fd.distribute_tensor(x, case.mesh, case.layout)
...     assert torch.equal(y.full_tensor(), x)
>>> test_round_trip()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from .._errors import explain
from .._layout import Layout
from .._mesh import DeviceMesh, simulated_mesh
from .._placements import PARTIAL_OPS, Partial, Placement, Replicate, Shard
from .._sharding import ShardTable, shard_table
from .._spec import P

__all__ = [
    "AXIS_NAMES",
    "ShardedCase",
    "dtypes",
    "global_shapes",
    "layouts",
    "meshes",
    "placements",
    "sharded_cases",
    "specs",
]

#: The axis names :func:`meshes` draws from when none are given (in a drawn order, so that
#: tests do not come to rely on names being sorted).
AXIS_NAMES: tuple[str, ...] = ("x", "y", "z", "dp", "tp", "pp", "cp", "ep")

_API = "fd.testing.strategies"


class ShardedCase(NamedTuple):
    """A drawn test case: a global value of ``global_shape`` and ``dtype`` laid out by
    ``layout`` on ``mesh``."""

    mesh: DeviceMesh
    layout: Layout
    global_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.layout.placements

    @property
    def spec(self) -> P:
        """The partition spec of the layout (an error for layouts with Partial axes)."""
        return self.layout.spec

    @property
    def table(self) -> ShardTable:
        """Every device's local shape and global offset (see ``shard_table``)."""
        return shard_table(self.layout, self.global_shape)


# ---------------------------------------------------------------------------------------------
# Argument checks: eager, with messages in the library's style.


def _fail(where: str, what: str, *, expected: str, got: str, fix: str):
    raise InvalidArgument(explain(f"{_API}.{where}", what, expected=expected, got=got, fix=fix))


def _check_int(value, where: str, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(where, "an integer is needed", expected="an int", got=repr(value), fix="pass an int")
    if value < low or (high is not None and value > high):
        bound = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
        _fail(where, "out of range", expected=bound, got=repr(value), fix=f"pass {bound}")
    return value


def _check_interval(low: int, high: int, where: str) -> None:
    if low > high:
        _fail(
            where,
            "the lower bound exceeds the upper bound",
            expected="min <= max",
            got=f"{low} > {high}",
            fix="swap the bounds, or widen the upper one",
        )


def _check_bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        _fail(where, "a flag is needed", expected="True or False", got=repr(value), fix="pass a bool")
    return value


def _check_mesh(mesh, where: str) -> DeviceMesh | SearchStrategy:
    if not isinstance(mesh, (DeviceMesh, SearchStrategy)):
        _fail(
            where,
            "a mesh is needed",
            expected="an fd.DeviceMesh or a strategy of meshes (e.g. meshes())",
            got=type(mesh).__name__,
            fix="build one with fd.simulated_mesh(...) or pass fd.testing.strategies.meshes()",
        )
    return mesh


def _check_ops(ops, where: str) -> tuple[str, ...]:
    if isinstance(ops, str) or not isinstance(ops, Sequence):
        _fail(
            where,
            "a sequence of reductions is needed",
            expected=repr(PARTIAL_OPS),
            got=repr(ops),
            fix="pass e.g. ('sum', 'max')",
        )
    ops = tuple(ops)
    unknown = [op for op in ops if op not in PARTIAL_OPS]
    if not ops or unknown:
        _fail(
            where,
            "unknown or missing Partial reductions",
            expected=f"a non-empty subset of {PARTIAL_OPS!r}",
            got=repr(ops),
            fix="name supported reductions only",
        )
    return ops


def _draw_mesh(draw, mesh) -> DeviceMesh:
    return draw(mesh) if isinstance(mesh, SearchStrategy) else mesh


# ---------------------------------------------------------------------------------------------
# Meshes.


def meshes(
    min_dims: int | None = None,
    max_dims: int | None = None,
    max_devices: int = 64,
    axis_names: Sequence[str] | None = None,
    *,
    max_side: int | None = None,
) -> SearchStrategy[DeviceMesh]:
    """Simulated meshes of ``min_dims`` to ``max_dims`` axes and at most ``max_devices`` devices.

    Every axis has at least one device (size-1 axes are drawn too) and at most ``max_side``.
    Without ``axis_names``, the names are drawn from :data:`AXIS_NAMES` in a drawn order, and
    meshes have 1 to 3 axes; with ``axis_names``, the mesh takes the first ``ndim`` of them and
    ``min_dims``/``max_dims`` default to their number.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20, deadline=None)
    ... @given(meshes(axis_names=("dp", "tp"), max_devices=8))
    ... def test(mesh):
    ...     assert mesh.axis_names == ("dp", "tp") and mesh.size <= 8
    >>> test()
    """
    if axis_names is not None:
        if isinstance(axis_names, str) or not isinstance(axis_names, Sequence):
            _fail(
                "meshes(axis_names)",
                "a sequence of names is needed",
                expected="e.g. ('dp', 'tp')",
                got=repr(axis_names),
                fix="pass a tuple of axis names",
            )
        names = tuple(axis_names)
        if (
            not names
            or not all(isinstance(n, str) and n.isidentifier() for n in names)
            or len(set(names)) != len(names)
        ):
            _fail(
                "meshes(axis_names)",
                "axis names must be distinct identifiers",
                expected="a non-empty tuple of distinct identifiers",
                got=repr(axis_names),
                fix="pass e.g. ('dp', 'tp')",
            )
        pool_size = len(names)
        min_dims = pool_size if min_dims is None else min_dims
        max_dims = pool_size if max_dims is None else max_dims
    else:
        names = None
        pool_size = len(AXIS_NAMES)
        min_dims = 1 if min_dims is None else min_dims
        max_dims = 3 if max_dims is None else max_dims
    _check_int(min_dims, "meshes(min_dims)", low=1)
    _check_int(max_dims, "meshes(max_dims)", low=1)
    _check_interval(min_dims, max_dims, "meshes(min_dims, max_dims)")
    if max_dims > pool_size:
        _fail(
            "meshes(max_dims)",
            "not enough axis names",
            expected=f"at most {pool_size} axes (one name each)",
            got=str(max_dims),
            fix="pass more axis_names, or lower max_dims",
        )
    _check_int(max_devices, "meshes(max_devices)", low=1)
    max_side = max_devices if max_side is None else _check_int(max_side, "meshes(max_side)", low=1)
    return _meshes(min_dims, max_dims, max_devices, max_side, names)


@st.composite
def _meshes(draw, min_dims, max_dims, max_devices, max_side, names) -> DeviceMesh:
    ndim = draw(st.sampled_from(range(min_dims, max_dims + 1)))
    shape, budget = [], max_devices
    for _ in range(ndim):
        cap = min(max_side, budget)
        # mostly the small sizes of real meshes, sometimes anything up to the cap
        size = draw(st.integers(1, min(4, cap)) | st.integers(1, cap))
        shape.append(size)
        budget //= size
    axis_names = names[:ndim] if names is not None else draw(st.permutations(AXIS_NAMES))[:ndim]
    return simulated_mesh(tuple(shape), tuple(axis_names))


# ---------------------------------------------------------------------------------------------
# Placements, specs, layouts.


def placements(
    mesh: DeviceMesh | SearchStrategy[DeviceMesh],
    ndim: int,
    *,
    allow_partial: bool = False,
    partial_ops: Sequence[str] = PARTIAL_OPS,
    negative_dims: bool = False,
) -> SearchStrategy[tuple[Placement, ...]]:
    """One placement per axis of ``mesh`` for an ``ndim``-d tensor.

    Each axis is ``Replicate()``, ``Shard(d)`` for a dim ``d`` of the tensor (several axes may
    shard the same dim), or with ``allow_partial`` a ``Partial(op)`` with ``op`` in
    ``partial_ops``. With ``negative_dims``, Shard dims may count from the end (``Shard(-1)``).

    >>> import functional_dtensor as fd
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20, deadline=None)
    ... @given(placements(fd.simulated_mesh((2, 2), ("x", "y")), 3, allow_partial=True))
    ... def test(placements):
    ...     assert len(placements) == 2 and all(0 <= p.dim < 3 for p in placements if p.is_shard())
    >>> test()
    """
    mesh = _check_mesh(mesh, "placements(mesh)")
    ndim = _check_int(ndim, "placements(ndim)", low=0)
    _check_bool(allow_partial, "placements(allow_partial)")
    ops = _check_ops(partial_ops, "placements(partial_ops)")
    _check_bool(negative_dims, "placements(negative_dims)")
    return _placements(mesh, ndim, allow_partial, ops, negative_dims)


@st.composite
def _placements(draw, mesh, ndim, allow_partial, ops, negative_dims) -> tuple[Placement, ...]:
    mesh = _draw_mesh(draw, mesh)
    # Shard weighs double: sharded axes are the interesting ones. Shrinks towards Replicate.
    kinds = ["replicate"] + ["shard", "shard"] * bool(ndim) + ["partial"] * allow_partial
    low = -ndim if negative_dims else 0
    out: list[Placement] = []
    for _ in range(mesh.ndim):
        kind = draw(st.sampled_from(kinds))
        if kind == "replicate":
            out.append(Replicate())
        elif kind == "shard":
            out.append(Shard(draw(st.integers(low, ndim - 1))))
        else:
            out.append(Partial(draw(st.sampled_from(ops))))
    return tuple(out)


def specs(mesh: DeviceMesh | SearchStrategy[DeviceMesh], ndim: int) -> SearchStrategy[P]:
    """Partition specs valid for an ``ndim``-d tensor on ``mesh``.

    Each mesh axis splits at most one dim; a dim split by several axes lists them in any order
    (major first, as in JAX). Specs may be shorter than ``ndim`` (trailing dims unsplit).

    >>> import functional_dtensor as fd
    >>> from hypothesis import given, settings
    >>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    >>> @settings(max_examples=20, deadline=None)
    ... @given(specs(mesh, 2))
    ... def test(spec):
    ...     layout = fd.Layout.from_spec(mesh, spec)  # raises unless the spec is valid
    ...     assert len(spec) <= 2 and fd.Layout.from_spec(mesh, layout.spec) == layout
    >>> test()
    """
    mesh = _check_mesh(mesh, "specs(mesh)")
    ndim = _check_int(ndim, "specs(ndim)", low=0)
    return _specs(mesh, ndim)


@st.composite
def _specs(draw, mesh, ndim) -> P:
    mesh = _draw_mesh(draw, mesh)
    entries: list[tuple[str, ...]] = [() for _ in range(ndim)]
    for name in mesh.axis_names:
        dim = draw(st.integers(-1, ndim - 1))  # -1: the axis splits no dim
        if dim >= 0:
            entries[dim] += (name,)
    entries = [draw(st.permutations(e)) if len(e) > 1 else e for e in entries]  # mesh order first
    used = max((d + 1 for d, e in enumerate(entries) if e), default=0)
    length = draw(st.integers(used, ndim))
    return P(*entries[:length])


def layouts(
    mesh: DeviceMesh | SearchStrategy[DeviceMesh],
    ndim: int,
    *,
    allow_partial: bool = False,
    partial_ops: Sequence[str] = PARTIAL_OPS,
) -> SearchStrategy[Layout]:
    """Layouts on ``mesh`` for an ``ndim``-d tensor (non-negative Shard dims; the axes that
    split one dim in any order); with ``allow_partial``, some axes may be ``Partial``.

    >>> import functional_dtensor as fd
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20, deadline=None)
    ... @given(layouts(meshes(max_devices=8), 2))
    ... def test(layout):
    ...     assert fd.Layout.from_spec(layout.mesh, layout.spec) == layout
    >>> test()
    """
    mesh = _check_mesh(mesh, "layouts(mesh)")
    ndim = _check_int(ndim, "layouts(ndim)", low=0)
    _check_bool(allow_partial, "layouts(allow_partial)")
    ops = _check_ops(partial_ops, "layouts(partial_ops)")
    return _layouts(mesh, ndim, allow_partial, ops)


@st.composite
def _layouts(draw, mesh, ndim, allow_partial, ops) -> Layout:
    mesh = _draw_mesh(draw, mesh)
    placements = draw(_placements(mesh, ndim, allow_partial, ops, False))
    order = []
    for dim in range(ndim):
        axes = tuple(a for a, p in enumerate(placements) if p.is_shard(dim))
        if len(axes) > 1:
            order.append((dim, tuple(draw(st.permutations(axes)))))  # shrinks to mesh order
    return Layout(mesh, placements, tuple(order))


# ---------------------------------------------------------------------------------------------
# Shapes and dtypes.


def global_shapes(
    min_dims: int = 0,
    max_dims: int = 4,
    *,
    min_side: int = 0,
    max_side: int = 12,
    max_elements: int = 2048,
) -> SearchStrategy[tuple[int, ...]]:
    """Global tensor shapes of ``min_dims`` to ``max_dims`` dims, each side in
    ``[min_side, max_side]``, at most ``max_elements`` elements in all.

    Sides of 0 (empty tensors) and sides that do not divide by the mesh are drawn too: that is
    where uneven ``torch.chunk`` sharding leaves trailing devices short or empty.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20, deadline=None)
    ... @given(global_shapes(max_dims=3, max_side=5))
    ... def test(shape):
    ...     assert len(shape) <= 3 and all(0 <= s <= 5 for s in shape)
    >>> test()
    """
    _check_shape_args("global_shapes", min_dims, max_dims, min_side, max_side, max_elements)
    return _global_shapes(min_dims, max_dims, min_side, max_side, max_elements)


def _check_shape_args(api: str, min_dims, max_dims, min_side, max_side, max_elements) -> None:
    _check_int(min_dims, f"{api}(min_dims)", low=0)
    _check_int(max_dims, f"{api}(max_dims)", low=0)
    _check_interval(min_dims, max_dims, f"{api}(min_dims, max_dims)")
    _check_int(min_side, f"{api}(min_side)", low=0)
    _check_int(max_side, f"{api}(max_side)", low=0)
    _check_interval(min_side, max_side, f"{api}(min_side, max_side)")
    _check_int(max_elements, f"{api}(max_elements)", low=1)
    _check_budget(min_side, max_dims, max_elements, f"{api}(max_elements)")


def _check_budget(min_side: int, max_dims: int, max_elements: int, where: str) -> None:
    if min_side**max_dims > max_elements:
        _fail(
            where,
            "a shape of max_dims sides of min_side has too many elements",
            expected=f"max_elements >= min_side ** max_dims = {min_side**max_dims}",
            got=str(max_elements),
            fix="raise max_elements, or lower min_side or max_dims",
        )


@st.composite
def _global_shapes(draw, min_dims, max_dims, min_side, max_side, max_elements) -> tuple[int, ...]:
    ndim = draw(st.sampled_from(range(min_dims, max_dims + 1)))
    shape, budget = [], max_elements
    for dim in range(ndim):
        # keep room for the remaining dims at their minimum size
        room = budget // max(1, min_side ** (ndim - dim - 1))
        side = draw(st.integers(min_side, max(min_side, min(max_side, room))))
        shape.append(side)
        budget //= max(1, side)
    return tuple(shape)


_FLOATING = (torch.float32, torch.float64)
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_INTEGRAL = (torch.int64, torch.int32)


def dtypes(
    *, floating: bool = True, integral: bool = True, low_precision: bool = False
) -> SearchStrategy[torch.dtype]:
    """Tensor dtypes: float32 and float64 (``floating``), int64 and int32 (``integral``),
    bfloat16 and float16 (``low_precision``).

    >>> import torch
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20, deadline=None)
    ... @given(dtypes(integral=False))
    ... def test(dtype):
    ...     assert dtype.is_floating_point
    >>> test()
    """
    chosen: tuple[torch.dtype, ...] = ()
    if _check_bool(floating, "dtypes(floating)"):
        chosen += _FLOATING
    if _check_bool(integral, "dtypes(integral)"):
        chosen += _INTEGRAL
    if _check_bool(low_precision, "dtypes(low_precision)"):
        chosen += _LOW_PRECISION
    if not chosen:
        _fail(
            "dtypes",
            "no dtype family enabled",
            expected="at least one of floating, integral, low_precision",
            got="all False",
            fix="enable a family",
        )
    return st.sampled_from(chosen)


# ---------------------------------------------------------------------------------------------
# The bundle.


def sharded_cases(
    *,
    mesh: DeviceMesh | SearchStrategy[DeviceMesh] | None = None,
    min_dims: int = 0,
    max_dims: int = 4,
    min_side: int = 0,
    max_side: int = 12,
    max_elements: int = 2048,
    dtype: torch.dtype | SearchStrategy[torch.dtype] | None = None,
    allow_partial: bool = False,
    partial_ops: Sequence[str] = PARTIAL_OPS,
    even: bool = False,
) -> SearchStrategy[ShardedCase]:
    """Whole cases ``ShardedCase(mesh, layout, global_shape, dtype)``.

    ``mesh`` defaults to :func:`meshes` (1 to 3 axes, up to 64 devices) and ``dtype`` to
    :func:`dtypes`. Shapes follow :func:`global_shapes`; layouts follow :func:`layouts`. With
    ``even``, every sharded dim divides evenly over the axes that split it (what
    ``fd.shard_map`` requires); the element budget is then kept where the divisibility allows.

    >>> import functional_dtensor as fd
    >>> from hypothesis import given, settings
    >>> @settings(max_examples=20, deadline=None)
    ... @given(sharded_cases(even=True))
    ... def test(case):
    ...     assert case.table.is_even
    >>> test()
    """
    mesh = meshes() if mesh is None else _check_mesh(mesh, "sharded_cases(mesh)")
    _check_shape_args("sharded_cases", min_dims, max_dims, min_side, max_side, max_elements)
    if dtype is None:
        dtype = dtypes()
    elif isinstance(dtype, torch.dtype):
        dtype = st.just(dtype)
    elif not isinstance(dtype, SearchStrategy):
        _fail(
            "sharded_cases(dtype)",
            "a dtype is needed",
            expected="a torch.dtype or a strategy of them",
            got=repr(dtype),
            fix="pass e.g. torch.float32 or dtypes()",
        )
    _check_bool(allow_partial, "sharded_cases(allow_partial)")
    ops = _check_ops(partial_ops, "sharded_cases(partial_ops)")
    _check_bool(even, "sharded_cases(even)")
    shape_args = (min_dims, max_dims, min_side, max_side, max_elements)
    return _sharded_cases(mesh, shape_args, dtype, allow_partial, ops, even)


@st.composite
def _sharded_cases(draw, mesh, shape_args, dtype, allow_partial, ops, even) -> ShardedCase:
    mesh = _draw_mesh(draw, mesh)
    min_dims, max_dims, min_side, max_side, max_elements = shape_args
    if not even:
        shape = draw(_global_shapes(*shape_args))
        layout = draw(_layouts(mesh, len(shape), allow_partial, ops))
    else:
        ndim = draw(st.sampled_from(range(min_dims, max_dims + 1)))
        layout = draw(_layouts(mesh, ndim, allow_partial, ops))
        shape, budget = [], max_elements
        for dim in range(ndim):
            parts = math.prod(mesh.shape[a] for a in layout.sharding_axes(dim))
            low = -(-min_side // parts)
            high = max(low, min(max_side, budget) // parts)
            side = parts * draw(st.integers(low, high))
            shape.append(side)
            budget //= max(1, side)
        shape = tuple(shape)
    return ShardedCase(mesh, layout, tuple(shape), draw(dtype))
