"""``fd.visualize_sharding`` and ``fd.sharding_picture``: the exact pictures of small cases (1-d
even and uneven, 2-d on a 2 x 2 mesh, replicas, partial values, empty shards, a 3-d table), the
HTML reprs of meshes, layouts, values and plan reports, bad inputs, and on gloo ranks: only
rank 0 prints, the same picture as on the simulated backend."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
from rich.console import Console

import functional_dtensor as fd

R, S, Pa = fd.Replicate(), fd.Shard, fd.Partial
LINE = fd.simulated_mesh(4, "x")
GRID = fd.simulated_mesh((2, 2), ("x", "y"))


def render(picture) -> str:
    """The picture on a fixed-width console without colours, trailing spaces stripped."""
    console = Console(record=True, width=80, color_system=None, file=io.StringIO())
    console.print(picture)
    return "\n".join(line.rstrip() for line in console.export_text().rstrip("\n").split("\n"))


def picture(layout_or_value, shape=None, **kwargs) -> str:
    return render(fd.sharding_picture(layout_or_value, shape, **kwargs))


ONE_D_EVEN = """\
(8,) as S(0) on [x=4]
┌────────────┬────────────┬────────────┬────────────┐
│    0:2     │    2:4     │    4:6     │    6:8     │
├────────────┼────────────┼────────────┼────────────┤
│     0      │     1      │     2      │     3      │
└────────────┴────────────┴────────────┴────────────┘"""

ONE_D_UNEVEN = """\
(5,) as S(0) on [x=4]
┌──────────────┬──────────────┬───────┐
│     0:2      │     2:4      │  4:5  │
├──────────────┼──────────────┼───────┤
│      0       │      1       │   2   │
└──────────────┴──────────────┴───────┘
empty shards (no elements): 3"""

TWO_D_SS = """\
(4, 4) as S(0)S(1) on [x=2, y=2]
┌─────┬────────────┬────────────┐
│     │    0:2     │    2:4     │
├─────┼────────────┼────────────┤
│ 0:2 │            │            │
│     │     0      │     1      │
│     │            │            │
├─────┼────────────┼────────────┤
│ 2:4 │            │            │
│     │     2      │     3      │
│     │            │            │
└─────┴────────────┴────────────┘"""

TWO_D_SR = """\
(4, 6) as S(1)R on [x=2, y=2]
┌─────┬────────────┬────────────┐
│     │    0:3     │    3:6     │
├─────┼────────────┼────────────┤
│ 0:4 │            │            │
│     │    0,1     │    2,3     │
│     │            │            │
└─────┴────────────┴────────────┘"""

REPLICATED = """\
(4, 4) as RR on [x=2, y=2]
┌─────┬────────────────────────┐
│     │          0:4           │
├─────┼────────────────────────┤
│ 0:4 │                        │
│     │          0-3           │
│     │                        │
└─────┴────────────────────────┘"""

PARTIAL = """\
(4, 4) as P(sum)S(0) on [x=2, y=2]
┌─────┬────────────────────────┐
│     │          0:4           │
├─────┼────────────────────────┤
│ 0:2 │                        │
│     │       P(sum) 0+2       │
│     │                        │
├─────┼────────────────────────┤
│ 2:4 │                        │
│     │       P(sum) 1+3       │
│     │                        │
└─────┴────────────────────────┘
P(sum) a+b: partial values over x; their sum is the block"""

THREE_D = """\
(4, 2, 3) as S(0)S(2) on [x=2, y=2]
┌────────┬────────┬───────────────┬─────────────┬───────┐
│ device │ x, y   │ holds         │ local shape │ bytes │
├────────┼────────┼───────────────┼─────────────┼───────┤
│ 0      │ (0, 0) │ [0:2, :, 0:2] │ (2, 2, 2)   │ 32 B  │
│ 1      │ (0, 1) │ [0:2, :, 2:3] │ (2, 2, 1)   │ 16 B  │
│ 2      │ (1, 0) │ [2:4, :, 0:2] │ (2, 2, 2)   │ 32 B  │
│ 3      │ (1, 1) │ [2:4, :, 2:3] │ (2, 2, 1)   │ 16 B  │
└────────┴────────┴───────────────┴─────────────┴───────┘"""

EMPTY_ROW = """\
(3, 4) as S(0) on [x=4]
┌─────┬────────────────────────┐
│     │          0:4           │
├─────┼────────────────────────┤
│ 0:1 │                        │
│     │           0            │
│     │                        │
├─────┼────────────────────────┤
│ 1:2 │                        │
│     │           1            │
│     │                        │
├─────┼────────────────────────┤
│ 2:3 │                        │
│     │           2            │
│     │                        │
└─────┴────────────────────────┘
empty shards (no elements): 3"""


@pytest.mark.parametrize(
    ("layout", "shape", "expected"),
    [
        (fd.Layout(LINE, [S(0)]), (8,), ONE_D_EVEN),
        (fd.Layout(LINE, [S(0)]), (5,), ONE_D_UNEVEN),  # torch.chunk: 2, 2, 1, 0
        (fd.Layout(GRID, [S(0), S(1)]), (4, 4), TWO_D_SS),
        (fd.Layout(GRID, [S(1), R]), (4, 6), TWO_D_SR),
        (fd.Layout(GRID, [R, R]), (4, 4), REPLICATED),
        (fd.Layout(GRID, [Pa(), S(0)]), (4, 4), PARTIAL),
        (fd.Layout(GRID, [S(0), S(2)]), (4, 2, 3), THREE_D),
        (fd.Layout(LINE, [S(0)]), (3, 4), EMPTY_ROW),  # 1, 1, 1, 0 rows
    ],
    ids=["1d-even", "1d-uneven", "2d-SS", "2d-SR", "replicated", "partial", "3d", "empty-shard"],
)
def test_pictures_of_small_cases(layout, shape, expected):
    assert picture(layout, shape) == expected


def test_a_negative_shard_dim_counts_from_the_end():
    assert picture(fd.Layout(LINE, [S(-1)]), (5,)) == ONE_D_UNEVEN


def test_a_value_draws_as_its_layout_and_shape():
    x = fd.distribute_tensor(torch.arange(5.0), LINE, fd.P("x"))
    assert picture(x) == ONE_D_UNEVEN
    assert str(fd.sharding_picture(x)) == ONE_D_UNEVEN


def test_blocks_follow_the_order_of_the_axes_that_split_a_dim():
    """``P(("y", "x"))``: ``y`` major, so block 1 is on device (1, 0), flat index 2."""
    text = picture(fd.Layout.from_spec(GRID, fd.P(("y", "x"))), (8,))
    assert text.splitlines()[4] == "│     0      │     2      │     1      │     3      │"


def test_every_rank_gets_a_table():
    scalar = picture(fd.Layout(GRID, [Pa("max"), R]), ())
    assert "│ 3      │ (1, 1) │ []    │ ()          │ 4 B   │ x=1  │" in scalar
    assert scalar.endswith("part: partial values over x; their max is the block")
    four_d = picture(fd.Layout(LINE, [S(3)]), (2, 2, 2, 6), dtype=torch.float64)
    assert "│ 2      │ (2,) │ [:, :, :, 4:6] │ (2, 2, 2, 2) │ 128 B │" in four_d
    assert "│ 3      │ (3,) │ [:, :, :, 6:6] │ (2, 2, 2, 0) │ 0 B   │" in four_d  # 6 over 4: 2, 2, 2, 0
    assert four_d.endswith("empty shards (no elements): 3")


def test_a_grid_too_fine_to_draw_becomes_a_table():
    mesh = fd.simulated_mesh(32, "x")
    text = picture(fd.Layout(mesh, [S(0)]), (64,))
    assert text.splitlines()[2].split() == [
        "│",
        "device",
        "│",
        "x",
        "│",
        "holds",
        "│",
        "local",
        "shape",
        "│",
        "bytes",
        "│",
    ]
    assert "│ 31     │ (31,) │ [62:64] │ (2,)        │ 8 B   │" in text


def test_many_replicas_are_written_as_runs():
    mesh = fd.simulated_mesh((2, 4), ("x", "y"))
    text = picture(fd.Layout(mesh, [S(0), R]), (4, 4))
    assert "0-3" in text and "4-7" in text
    text = picture(fd.Layout(mesh, [R, S(0)]), (4, 4))
    assert "0,4" in text and "3,7" in text


def test_header_replaces_the_title():
    text = picture(fd.Layout(LINE, [S(0)]), (8,), header="activations")
    assert text.splitlines()[0] == "activations"


def test_visualize_sharding_prints(capsys):
    x = fd.distribute_tensor(torch.zeros(4, 4), GRID, fd.P("x", "y"))
    assert fd.visualize_sharding(x) is None
    out = capsys.readouterr().out
    assert "(4, 4) as S(0)S(1) on [x=2, y=2]" in out and "│ 2:4 │" in out
    fd.visualize_sharding(x, use_rich=False)
    plain = capsys.readouterr().out
    assert plain.isascii() and "| 2:4 |" in plain and "\x1b" not in plain


def test_html_reprs():
    mesh_html = GRID._repr_html_()
    assert mesh_html.startswith("<pre") and "y=1" in mesh_html and "x=0" in mesh_html
    layout_html = fd.Layout(GRID, [S(0), Pa()])._repr_html_()
    assert "splits dim 0" in layout_html and "partial values (sum)" in layout_html
    x = fd.distribute_tensor(torch.zeros(4, 4), GRID, [Pa(), S(0)])
    value_html = x._repr_html_()
    assert "DTensor shape (4, 4), torch.float32" in value_html and "P(sum) 0+2" in value_html
    assert len(set(re.findall(r"background-color: ?(#[0-9a-f]{6})", value_html))) == 2  # one per block
    split = fd.distribute_tensor(torch.zeros(4, 4), GRID, fd.P("x", "y"))._repr_html_()
    assert len(set(re.findall(r"background-color: ?(#[0-9a-f]{6})", split))) == 4
    assert "<html" not in value_html  # a fragment, not a page
    report = fd.explain_redistribute(x, fd.P(), show=False)
    assert "all_reduce" in report._repr_html_() or "all_gather" in report._repr_html_()
    assert repr(report) == f"<PlanReport {report.summary}>"
    assert fd.sharding_picture(x)._repr_html_().startswith("<pre")


def test_bad_inputs():
    layout = fd.Layout(LINE, [S(0)])
    x = fd.distribute_tensor(torch.zeros(8), LINE, fd.P("x"))
    with pytest.raises(fd.InputTypeError, match=r"fd.sharding_picture\(x\).*got Tensor"):
        fd.visualize_sharding(torch.zeros(8))
    with pytest.raises(fd.InputTypeError, match=r"fd.sharding_picture\(shape\): a layout alone"):
        fd.visualize_sharding(layout)
    with pytest.raises(fd.InputTypeError, match="a value has its own shape"):
        fd.visualize_sharding(x, (8,))
    with pytest.raises(fd.ShapeError, match=r"got \(8, -1\)"):
        fd.visualize_sharding(layout, (8, -1))
    with pytest.raises(fd.LayoutError, match="out of range for a 1-d tensor"):
        fd.visualize_sharding(fd.Layout(LINE, [S(1)]), (8,))
    with pytest.raises(fd.InputTypeError, match=r"\(header\)"):
        fd.visualize_sharding(x, header=3)
    with pytest.raises(fd.InputTypeError, match=r"\(dtype\)"):
        fd.visualize_sharding(layout, (8,), dtype="float32")


def job_visualize(mesh, n: int) -> dict:
    x = fd.distribute_tensor(torch.arange(float(n)), mesh, fd.P("x"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fd.visualize_sharding(x, use_rich=False)
    return {"printed": out.getvalue(), "html": x._repr_html_()}


@pytest.mark.meshes((2,))
def test_only_rank_0_prints(backend, mesh):
    results = backend.run(job_visualize, mesh.shape, ("x",), 3)
    expected = "\n".join(
        [
            "(3,) as S(0) on [x=2]",
            "+----------------+--------+",
            "|      0:2       |  2:3   |",
            "+----------------+--------+",
            "|       0        |   1    |",
            "+----------------+--------+",
            "",
        ]
    )
    assert results[0]["printed"] == expected
    assert all(r["printed"] == "" for r in results[1:])
    assert len(results) == (1 if backend.is_simulated else 2)
    assert all("0:2" in r["html"] for r in results)  # every rank draws the whole value
