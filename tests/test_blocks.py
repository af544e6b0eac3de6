"""The value rules and block grids both backends share (``_blocks``): reductions and partitions
for every op and dtype against a plain loop over Python numbers, and block grids against the
plain-loop oracle of :mod:`backends` (nested ``torch.chunk``, the axes of a dim in any order)."""

from __future__ import annotations

import functools

import pytest
import torch
from backends import block, coordinates
from common import assert_close
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor import _blocks as blocks
from functional_dtensor.testing import strategies as fds

OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float64, torch.float32, torch.int64, torch.int32)


def values(shape, dtype, seed: int) -> torch.Tensor:
    """Signed values, odd and even, so that rounding and max/min show."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(-9, 10, shape, generator=generator, dtype=dtype)


def loop_reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of equally shaped tensors, element by element on Python numbers (an
    integer average rounds down, as ``//`` does)."""
    columns = list(zip(*[p.reshape(-1).tolist() for p in parts], strict=True))
    rule = {
        "sum": sum,
        "max": max,
        "min": min,
        "avg": lambda c: sum(c) / len(c) if isinstance(c[0], float) else sum(c) // len(c),
    }[op]
    flat = [rule(c) for c in columns]
    return torch.tensor(flat, dtype=parts[0].dtype).reshape(parts[0].shape)


def assert_equal_values(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    if got.is_floating_point():
        assert_close(got, want)
    else:
        assert torch.equal(got, want), (got, want)


# ---------------------------------------------------------------------------------------------
# reduce, average, partition


@given(
    op=st.sampled_from(OPS),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    keepdim=st.booleans(),
    data=st.data(),
)
def test_reduce_matches_a_loop_and_keeps_the_dtype(op, dtype, shape, keepdim, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    x = values(shape, dtype, data.draw(st.integers(0, 1000)))
    got = blocks.reduce(x, op, dim, keepdim=keepdim)
    want = loop_reduce(list(x.unbind(dim)), op)
    assert_equal_values(got, want.unsqueeze(dim) if keepdim else want)


def test_integer_average_rounds_down():
    x = torch.tensor([[-3, 3, 5], [0, 0, 0]])
    assert blocks.reduce(x, "avg", 0).tolist() == [-2, 1, 2]
    assert blocks.reduce(x.int(), "avg", 0).dtype == torch.int32
    assert blocks.average(torch.tensor([-3, 3]), 2).tolist() == [-2, 1]
    assert blocks.average(torch.tensor([-3.0, 3.0]), 2).tolist() == [-1.5, 1.5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_partition_parts_reduce_back_to_the_value(op, dtype, size):
    x = values((3, 2), dtype, seed=size)
    parts = [blocks.partition(x, op, size, first=i == 0) for i in range(size)]
    assert all(p.dtype == dtype and p.shape == x.shape for p in parts)
    assert_equal_values(loop_reduce(parts, op), x)
    if op == "sum" and size > 1 and not dtype.is_floating_point:  # the first device holds it all
        assert torch.equal(parts[0], x) and all(not p.any() for p in parts[1:])
    if op == "sum" and size > 1 and dtype.is_floating_point:  # divided evenly
        assert all(torch.equal(p, parts[0]) for p in parts)
    # the same parts with `first` as a bool tensor over a leading device dim
    first = torch.arange(size).view(size, 1, 1) == 0
    stacked = blocks.partition(x.expand(size, 3, 2), op, size, first)
    assert torch.equal(stacked, torch.stack(parts))


# ---------------------------------------------------------------------------------------------
# Block grids: split, assemble, padding


@st.composite
def grid_cases(draw, allow_partial: bool = False):
    """A simulated mesh (1-3 axes, up to 12 devices), a layout whose sharded dims list their axes
    in any order, a global shape (uneven and empty ones too), a dtype and a value."""
    mesh = draw(fds.meshes(max_devices=12, axis_names=("x", "y", "z"), min_dims=1))
    shape = draw(fds.global_shapes(max_dims=3, max_side=7, max_elements=200))
    layout = draw(fds.layouts(mesh, len(shape), allow_partial=allow_partial))
    dtype = draw(st.sampled_from(DTYPES))
    return mesh, layout, shape, values(shape, dtype, draw(st.integers(0, 1000)))


def spec_of(layout: fd.Layout) -> fd.P:
    """The partition spec of a layout's Shard axes (its Partial axes replicate the blocks)."""
    names = layout.mesh.axis_names
    ndim = max((p.dim + 1 for p in layout.placements if p.is_shard()), default=0)
    return fd.P(*[tuple(names[a] for a in layout.sharding_axes(d)) for d in range(ndim)])


def oracle_blocks(value, layout):
    mesh = layout.mesh
    spec = spec_of(layout)
    return [block(value, mesh.shape, mesh.axis_names, spec, c) for c in coordinates(mesh.shape)]


@given(grid_cases())
def test_split_holds_every_devices_block_padded_with_zeros(case):
    mesh, layout, shape, value = case
    want = oracle_blocks(value, layout)
    padded = tuple(max((w.shape[d] for w in want), default=0) for d in range(len(shape)))
    grid = blocks.split(value, layout)
    assert tuple(grid.shape) == (*mesh.shape, *padded) and grid.dtype == value.dtype
    for c, w in zip(coordinates(mesh.shape), want, strict=True):
        got = grid[c]
        assert torch.equal(blocks.unpad(got, tuple(w.shape)), w), c
        assert torch.equal(blocks.pad(w, padded), got), c  # the padding is zeros


@given(grid_cases(allow_partial=True))
def test_partial_axes_split_into_parts_that_reduce_back(case):
    mesh, layout, shape, value = case
    grid = blocks.split(value, layout)
    want = oracle_blocks(value, layout)
    padded = tuple(grid.shape[mesh.ndim :])
    # a plain loop: each device's block is the reduction of its Partial groups' parts, axis by
    # axis in mesh order
    reduced = {c: grid[c] for c in coordinates(mesh.shape)}
    for axis, placement in enumerate(layout.placements):
        if placement.is_partial():
            reduced = {
                c: loop_reduce(
                    [reduced[c[:axis] + (i,) + c[axis + 1 :]] for i in range(mesh.shape[axis])], placement.op
                )
                for c in reduced
                if c[axis] == 0
            }
    for c, part in reduced.items():
        w = want[coordinates(mesh.shape).index(c)]
        assert_equal_values(blocks.unpad(part, tuple(w.shape)), w)
    # and the library's own reduction of the grid agrees (Partial axes kept, of size 1)
    library = blocks.reduce_partial(grid, layout)
    assert (
        tuple(library.shape)
        == tuple(1 if p.is_partial() else n for n, p in zip(mesh.shape, layout.placements, strict=True))
        + padded
    )
    for c, part in reduced.items():
        assert_equal_values(library[c], part)


@given(grid_cases())
def test_assemble_puts_the_blocks_back_together(case):
    mesh, layout, shape, value = case
    grid = blocks.split(value, layout)
    for axis, placement in enumerate(layout.placements):
        if not placement.is_shard():
            grid = grid.narrow(axis, 0, 1)  # one block per distinct shard
    assert torch.equal(blocks.assemble(grid, layout, shape), value)


@given(grid_cases())
def test_valid_mask_and_distinct_shards(case):
    mesh, layout, shape, value = case
    want = oracle_blocks(value, layout)
    mask = blocks.valid_mask(layout, shape, "cpu")
    padded = tuple(mask.shape[1:])
    for k, w in enumerate(want):
        expected = blocks.pad(torch.ones(w.shape, dtype=torch.bool), padded)
        assert torch.equal(mask[k], expected), k
    sizes, padded_again = blocks.distinct_shards(layout, shape)
    assert padded_again == padded
    assert sizes == tuple(
        n if p.is_shard() else 1 for n, p in zip(mesh.shape, layout.placements, strict=True)
    )
    # devices that differ only off the Shard axes hold the same block
    for k, c in enumerate(coordinates(mesh.shape)):
        first = tuple(i if p.is_shard() else 0 for i, p in zip(c, layout.placements, strict=True))
        assert torch.equal(want[k], want[coordinates(mesh.shape).index(first)])


def test_split_of_a_dim_over_axes_out_of_mesh_order():
    """P(('y', 'x')) on a 2 x 3 mesh: device (x, y) holds block y * 2 + x of dim 0."""
    mesh = fd.simulated_mesh((2, 3), ("x", "y"))
    grid = blocks.split(torch.arange(12).reshape(6, 2), fd.Layout.from_spec(mesh, fd.P(("y", "x"))))
    assert grid[:, :, 0, 0].tolist() == [[0, 4, 8], [2, 6, 10]]
    assert grid[1, 2].tolist() == [[10, 11]]
    uneven = blocks.split(torch.arange(5), fd.Layout.from_spec(mesh, fd.P(("y", "x"))))
    # 5 over 6 blocks: 1 1 1 1 1 0; device (x, y) holds block y * 2 + x, padded with a zero
    assert uneven.tolist() == [[[0], [2], [4]], [[1], [3], [0]]]


def test_loop_reduce_is_a_plain_reduction():
    """The oracle itself, on numbers worked by hand."""
    parts = [torch.tensor([1, -3]), torch.tensor([2, 0])]
    assert loop_reduce(parts, "sum").tolist() == [3, -3]
    assert loop_reduce(parts, "avg").tolist() == [1, -2]
    assert loop_reduce(parts, "max").tolist() == [2, 0]
    assert loop_reduce(parts, "min").tolist() == [1, -3]
    assert functools.reduce(torch.add, parts).tolist() == [3, -3]


@given(
    st.lists(st.integers(-120, 12), max_size=12),
    st.integers(0, 10),
    st.sampled_from([None, -100, 3]),
    st.sampled_from([torch.int64, torch.int32, torch.int16]),
)
def test_indices_outside_a_dim_are_found_as_a_loop_over_them_finds_them(indices, size, ignored, dtype):
    """``outside``: some index outside ``[0, size)`` and not the ignored one, against a loop over
    Python numbers; ``outside_mask`` marks exactly those."""
    tensor = torch.tensor(indices, dtype=dtype)
    bad = [not 0 <= i < size and i != ignored for i in indices]
    assert blocks.outside(tensor, size, ignored) == any(bad)
    assert blocks.outside_mask(tensor, size, ignored).tolist() == bad
