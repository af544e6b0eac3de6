"""``visualize_sharding``: who holds which block of a global value, drawn; HTML reprs for notebooks.

1-d and 2-d values are drawn as a grid of blocks, each labelled with the flat indices of the
devices that hold it (``0,4`` for replicas, ``P(sum) 0+2`` for partial values that add up to
the block), sized roughly as the blocks are (``torch.chunk``'s uneven splits, empty shards
listed below the grid). Values of any other rank get a table: per device, its coordinate, the
global index ranges it holds, its local shape and bytes. Everything is worked out from the
layout and the global shape alone (``shard_table``), so it needs no communication; on
``torch.distributed`` only rank 0 prints.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> x = fd.distribute_tensor(torch.arange(10.0), mesh, fd.P("x"))
>>> fd.visualize_sharding(x, use_rich=False)
(10,) as S(0) on [x=4]
+--------------+--------------+--------------+------+
|     0:3      |     3:6      |     6:9      | 9:10 |
+--------------+--------------+--------------+------+
|      0       |      1       |      2       |  3   |
+--------------+--------------+--------------+------+

This module also installs ``_repr_html_`` on ``fd.DeviceMesh``, ``fd.Layout``, ``fd.DTensor``
and ``fd.PlanReport`` (a small self-contained HTML string each, exported by rich).
"""

from __future__ import annotations

import html
import io
from dataclasses import dataclass

import torch

from ._dtensor import DTensor
from ._errors import InputTypeError, LayoutError, ShapeError, explain
from ._explain import PlanReport
from ._layout import Layout
from ._mesh import DeviceMesh
from ._placements import Partial, Replicate, Shard
from ._public import public
from ._sharding import shard_table

__all__ = ["visualize_sharding", "sharding_picture", "ShardingPicture", "install"]

#: light backgrounds, black text: one per distinct block, in turn
PALETTE = (
    "#a6cee3",
    "#b2df8a",
    "#fb9a99",
    "#fdbf6f",
    "#cab2d6",
    "#ffff99",
    "#8dd3c7",
    "#bebada",
    "#80b1d3",
    "#fccde5",
    "#d9d9d9",
    "#ccebc5",
    "#ffed6f",
    "#e5c494",
    "#b3cde3",
    "#decbe4",
)
#: the most blocks along one dim drawn as a grid; more get the table
MAX_GRID_BLOCKS = 16
HTML_FORMAT = (
    "<pre style=\"font-family: Menlo, 'DejaVu Sans Mono', Consolas, 'Courier New', monospace; "
    'line-height: 1.2; margin: 0">{code}</pre>'
)


@public
@dataclass(frozen=True)
class ShardingPicture:
    """Who holds which block of a global value of ``shape`` laid out as ``layout``: a rich
    renderable (``rich.print(picture)``), plain text (``str(picture)``) and HTML in notebooks.
    Built by :func:`sharding_picture`."""

    layout: Layout
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    header: str | None = None

    @property
    def is_grid(self) -> bool:
        """Whether the picture is a grid of blocks (1-d and 2-d values), not a table."""
        if len(self.shape) not in (1, 2) or 0 in self.shape:
            return False
        return all(
            len(_intervals(self.layout, self.shape, d)) <= MAX_GRID_BLOCKS for d in range(len(self.shape))
        )

    @property
    def title(self) -> str:
        if self.header is not None:
            return self.header
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.layout.mesh.axis_names, self.layout.mesh.shape))
        return f"{tuple(self.shape)} as {self.layout} on [{axes}]"

    def renderable(self, *, ascii: bool = False):
        """The rich renderable: a grid of blocks, or the per-device table."""
        from rich import box

        style = box.ASCII2 if ascii else box.SQUARE
        if self.is_grid:
            return _grid(self, style)
        return _summary(self, style)

    def __rich__(self):
        return self.renderable()

    def text(self, *, ascii: bool = False, width: int = 80) -> str:
        """Plain text, no colours (``ascii=True``: no box-drawing characters either)."""
        return _render_text(self.renderable(ascii=ascii), width)

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return _html(self.renderable())


def sharding_picture(
    x: DTensor | Layout,
    shape=None,
    *,
    header: str | None = None,
    dtype: torch.dtype | None = None,
) -> ShardingPicture:
    """The picture :func:`visualize_sharding` prints, as an object: a rich renderable, plain
    text with ``str()``, HTML in a notebook. ``x`` is an ``fd.DTensor``, or an ``fd.Layout``
    with the global ``shape`` (and ``dtype``, for the bytes; float32 by default).

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    >>> print(fd.sharding_picture(fd.Layout(mesh, [fd.Shard(0), fd.Replicate()]), (4, 4)))
    (4, 4) as S(0)R on [x=2, y=2]
    ┌─────┬────────────────────────┐
    │     │          0:4           │
    ├─────┼────────────────────────┤
    │ 0:2 │                        │
    │     │          0,1           │
    │     │                        │
    ├─────┼────────────────────────┤
    │ 2:4 │                        │
    │     │          2,3           │
    │     │                        │
    └─────┴────────────────────────┘
    """
    where = "fd.sharding_picture"
    if header is not None and not isinstance(header, str):
        raise InputTypeError(
            explain(
                f"{where}(header)",
                "the header is a line of text",
                expected="a str or None",
                got=type(header).__name__,
                fix="pass header='...' or leave it out",
            )
        )
    if isinstance(x, DTensor):
        if shape is not None:
            raise InputTypeError(
                explain(
                    f"{where}(shape)",
                    "a value has its own shape",
                    expected="shape=None with an fd.DTensor",
                    got=repr(shape),
                    fix="leave shape out, or pass x.sharding with the shape you want drawn",
                )
            )
        layout, shape, dtype = x.sharding, tuple(x.shape), dtype or x.dtype
    elif isinstance(x, Layout):
        if shape is None:
            raise InputTypeError(
                explain(
                    f"{where}(shape)",
                    "a layout alone has no size",
                    expected="the global shape of the value",
                    got="None",
                    fix="pass shape=(rows, cols, ...), or pass the DTensor itself",
                )
            )
        layout, shape = x, _checked_shape(shape, where)
    else:
        raise InputTypeError(
            explain(
                f"{where}(x)",
                "a value or a layout is needed",
                expected="an fd.DTensor, or an fd.Layout with shape=",
                got=type(x).__name__,
                fix="pass the DTensor, or fd.Layout(mesh, placements) and its global shape",
            )
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InputTypeError(
            explain(
                f"{where}(dtype)",
                "the dtype sets the bytes per element",
                expected="a torch.dtype such as torch.float32",
                got=repr(dtype),
                fix="pass dtype=torch.float32 (or leave it out)",
            )
        )
    layout = layout.normalized(len(shape), where=where)
    return ShardingPicture(layout, shape, dtype or torch.float32, header)


def visualize_sharding(
    x: DTensor | Layout,
    shape=None,
    *,
    use_rich: bool = True,
    header: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Print which devices hold which block of ``x`` (an ``fd.DTensor``, or an ``fd.Layout``
    with the global ``shape``), as torch's and JAX's ``visualize_sharding`` do: a grid of
    blocks for 1-d and 2-d values, a per-device table for any other rank. ``use_rich=False``
    prints plain ASCII (no colours, no box-drawing characters). On ``torch.distributed`` only
    rank 0 prints: every block is worked out from the layout, without communication. For the
    picture as an object (HTML in notebooks), see :func:`sharding_picture`.

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(2, "x")
    >>> x = fd.distribute_tensor(torch.ones(4, 2, 2), mesh, fd.P(None, "x"))
    >>> fd.visualize_sharding(x, use_rich=False)
    (4, 2, 2) as S(1) on [x=2]
    +--------+------+-------------+-------------+-------+
    | device | x    | holds       | local shape | bytes |
    +--------+------+-------------+-------------+-------+
    | 0      | (0,) | [:, 0:1, :] | (4, 1, 2)   | 32 B  |
    | 1      | (1,) | [:, 1:2, :] | (4, 1, 2)   | 32 B  |
    +--------+------+-------------+-------------+-------+
    """
    picture = sharding_picture(x, shape, header=header, dtype=dtype)
    if not _is_lead_process():
        return
    if use_rich:
        from rich.console import Console

        Console().print(picture)
    else:
        print(picture.text(ascii=True))


# --- the grid -------------------------------------------------------------------------------


def _grid(picture: ShardingPicture, box_style):
    from rich.align import Align
    from rich.style import Style
    from rich.table import Table
    from rich.text import Text

    layout, shape = picture.layout, picture.shape
    table = shard_table(layout, shape)
    two_d = len(shape) == 2
    rows = _intervals(layout, shape, 0) if two_d else [None]  # a 1-d value is one row
    cols = _intervals(layout, shape, len(shape) - 1)
    cells: dict[tuple, list[int]] = {}  # (row range, column range) -> the devices holding it
    empty = []
    for device, (local, offset) in enumerate(zip(table.local_shapes, table.offsets)):
        if 0 in local:
            empty.append(device)
            continue
        spans = [(o, o + n) for o, n in zip(offset, local)]
        cells.setdefault((spans[0] if two_d else None, spans[-1]), []).append(device)
    labels = {key: _label(layout, devices) for key, devices in cells.items()}
    colors = {key: PALETTE[i % len(PALETTE)] for i, key in enumerate(cells)}  # in device order

    def narrowest(col) -> int:
        texts = [f"{col[0]}:{col[1]}"] + [labels[r, col] for r in rows if (r, col) in labels]
        return max(len(t) for t in texts) + 2

    widths = _proportional(
        [b - a for a, b in cols], [narrowest(c) for c in cols], total=max(24, min(72, 12 * len(cols)))
    )
    heights = [1]
    if two_d:
        heights = _proportional([b - a for a, b in rows], [1] * len(rows), total=min(3 * len(rows), 12))
    out = Table(box=box_style, show_lines=True, padding=0, pad_edge=False)
    if two_d:
        out.add_column("", no_wrap=True)
    for (a, b), width in zip(cols, widths):
        out.add_column(f"{a}:{b}", justify="center", width=width, no_wrap=True)
    for r, height in zip(rows, heights):
        row = [f" {r[0]}:{r[1]} "] if two_d else []
        for c in cols:
            style = Style(color="black", bgcolor=colors[r, c]) if (r, c) in colors else Style()
            label = Text(labels.get((r, c), ""))
            row.append(Align(label, "center", vertical="middle", height=height, style=style))
        out.add_row(*row)
    return _titled(picture.title, out, _notes(layout, empty))


def _intervals(layout: Layout, shape: tuple[int, ...], dim: int) -> list[tuple[int, int]]:
    """The distinct non-empty ``(start, stop)`` ranges of dim ``dim`` that devices hold."""
    table = shard_table(layout, shape)
    spans = {(o[dim], o[dim] + s[dim]) for s, o in zip(table.local_shapes, table.offsets) if 0 not in s}
    return sorted(spans)


def _proportional(extents: list[int], minimums: list[int], *, total: int) -> list[int]:
    """Sizes roughly proportional to ``extents``, adding up to about ``total``, each at least
    its minimum."""
    whole = sum(extents) or 1
    return [max(low, round(total * e / whole)) for e, low in zip(extents, minimums)]


def _label(layout: Layout, devices: list[int]) -> str:
    """The devices that hold one block: ``0,4`` (replicas), ``P(sum) 0+2`` (partial values
    that reduce to the block; replicas of one part joined by commas)."""
    partial = [a for a, p in enumerate(layout.placements) if isinstance(p, Partial)]
    if not partial:
        return _devices(devices)
    mesh = layout.mesh
    parts: dict[tuple[int, ...], list[int]] = {}
    for device in devices:
        coordinate = mesh.coordinate(device)
        parts.setdefault(tuple(coordinate[a] for a in partial), []).append(device)
    ops = "".join(dict.fromkeys(str(layout.placements[a]) for a in partial))
    return f"{ops} " + "+".join(_devices(p) for p in parts.values())


def _devices(devices: list[int]) -> str:
    """Flat device indices, runs of three or more written ``first-last``: ``0,4``, ``0-3``."""
    out, run = [], [devices[0]]
    for d in devices[1:]:
        if d == run[-1] + 1:
            run.append(d)
        else:
            out.append(run)
            run = [d]
    out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in out)


def _notes(layout: Layout, empty: list[int], *, grid: bool = True) -> str:
    lines = []
    partial = [a for a, p in enumerate(layout.placements) if isinstance(p, Partial)]
    if partial:
        names = ", ".join(layout.mesh.axis_names[a] for a in partial)
        ops = "/".join(dict.fromkeys(layout.placements[a].op for a in partial))
        what = f"P({ops}) a+b" if grid else "part"
        lines.append(f"{what}: partial values over {names}; their {ops} is the block")
    if empty:
        lines.append(f"empty shards (no elements): {_devices(empty)}")
    return "\n".join(lines)


# --- the table, for any rank ------------------------------------------------------------------


def _summary(picture: ShardingPicture, box_style):
    from rich.style import Style
    from rich.table import Table

    layout, shape = picture.layout, picture.shape
    mesh = layout.mesh
    table = shard_table(layout, shape)
    itemsize = torch.empty((), dtype=picture.dtype).element_size()
    partial = [a for a, p in enumerate(layout.placements) if isinstance(p, Partial)]
    out = Table(box=box_style)
    for column in ("device", ", ".join(mesh.axis_names), "holds", "local shape", "bytes"):
        out.add_column(column)
    if partial:
        out.add_column("part")
    colors: dict[tuple, str] = {}
    for device, (local, offset) in enumerate(zip(table.local_shapes, table.offsets)):
        spans = []
        for d, (n, o) in enumerate(zip(local, offset)):
            spans.append(f"{o}:{o + n}" if layout.sharding_axes(d) else ":")
        key = (local, offset)
        color = colors.setdefault(key, PALETTE[len(colors) % len(PALETTE)])
        numel = 1
        for n in local:
            numel *= n
        coordinate = mesh.coordinate(device)
        row = [
            str(device),
            str(coordinate),
            f"[{', '.join(spans)}]",
            str(tuple(local)),
            _nbytes(numel * itemsize),
        ]
        if partial:
            row.append(" ".join(f"{mesh.axis_names[a]}={coordinate[a]}" for a in partial))
        out.add_row(*row, style=Style(color="black", bgcolor=color) if 0 not in local else None)
    empty = [d for d, local in enumerate(table.local_shapes) if 0 in local]
    return _titled(picture.title, out, _notes(layout, empty, grid=False))


def _titled(title: str, table, notes: str):
    """The title, the table, and below it the notes (partial values, empty shards), if any."""
    from rich.console import Group
    from rich.text import Text

    return Group(Text(title), table, *([Text(notes)] if notes else []))


# --- output -----------------------------------------------------------------------------------


def _nbytes(n: int) -> str:
    """Bytes as ``explain_redistribute`` prints them: ``48 B``, ``1.50 KiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _is_lead_process() -> bool:
    """Whether this process prints: rank 0 of ``torch.distributed``, or the only process."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _render_text(renderable, width: int) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, color_system=None, record=True, legacy_windows=False)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().rstrip("\n").split("\n"))


def _html(renderable, width: int = 100) -> str:
    """``renderable`` as a small self-contained HTML fragment (inline styles)."""
    from rich.console import Console

    console = Console(
        file=io.StringIO(), width=width, record=True, color_system="truecolor", force_terminal=True
    )
    console.print(renderable)
    return console.export_html(inline_styles=True, code_format=HTML_FORMAT)


def _checked_shape(shape, where: str) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        out = tuple(int(s) for s in shape)
        ok = all(isinstance(s, int) or hasattr(s, "__index__") for s in shape)
    except TypeError:
        ok = False
    if not ok or any(s < 0 for s in out):
        raise ShapeError(
            explain(
                f"{where}(shape)",
                "a global shape is a tuple of sizes",
                expected="non-negative ints such as (8, 8)",
                got=repr(shape),
                fix="pass the global shape of the value the layout lays out",
            )
        )
    return out


# --- HTML reprs, installed on the lower classes ------------------------------------------------


def _mesh_grid(mesh: DeviceMesh, cell=None, colors=None):
    """The mesh as a table: rows the coordinates of every axis but the last, columns the last
    axis; each cell the device's flat index (and ``cell(device)``, where given)."""
    from rich.console import Group
    from rich.style import Style
    from rich.table import Table
    from rich.text import Text

    *outer, last = mesh.axis_names
    table = Table(show_lines=True)
    if outer:
        table.add_column(", ".join(outer))
    for j in range(mesh.shape[-1]):
        table.add_column(f"{last}={j}", justify="center")
    for start in range(0, mesh.size, mesh.shape[-1]):
        coordinate = mesh.coordinate(start)
        row = [Text(", ".join(f"{n}={c}" for n, c in zip(outer, coordinate)))] if outer else []
        cells = []
        for device in range(start, start + mesh.shape[-1]):
            text = (
                str(device)
                if mesh.device_ids[device] == device
                else f"{device} (id {mesh.device_ids[device]})"
            )
            if cell is not None:
                text += "\n" + cell(device)
            style = Style(color="black", bgcolor=colors(device)) if colors else None
            cells.append(Text(text, style=style or ""))
        table.add_row(*row, *cells)
    return Group(Text(str(mesh)), table)


def _mesh_html(self: DeviceMesh) -> str:
    return _html(_mesh_grid(self))


def _layout_renderable(layout: Layout):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    mesh = layout.mesh
    axes = Table(show_header=True)
    for column in ("axis", "size", "placement", "meaning"):
        axes.add_column(column)
    for a, (name, size, p) in enumerate(zip(mesh.axis_names, mesh.shape, layout.placements)):
        if isinstance(p, Shard):
            order = layout.sharding_axes(p.dim)
            meaning = f"splits dim {p.dim}"
            if len(order) > 1:
                meaning += f" ({order.index(a) + 1} of {len(order)}, major first)"
        elif isinstance(p, Replicate):
            meaning = "replicas"
        else:
            meaning = f"partial values ({p.op})"
        axes.add_row(name, str(size), str(p), meaning)
    dims = sorted({p.dim for p in layout.placements if isinstance(p, Shard)})

    def block(device: int) -> str:
        coordinate = mesh.coordinate(device)
        parts = []
        for d in dims:
            index = 0
            for a in layout.sharding_axes(d):
                index = index * mesh.shape[a] + coordinate[a]
            parts.append(f"dim {d}: {index}")
        return ", ".join(parts) or "whole"

    blocks: dict[str, str] = {}

    def color(device: int) -> str:
        return blocks.setdefault(block(device), PALETTE[len(blocks) % len(PALETTE)])

    try:
        spec = f", spec {layout.spec!r}"
    except LayoutError:
        spec = ""
    return Group(Text(f"Layout {layout}{spec}"), axes, _mesh_grid(mesh, block, color))


def _layout_html(self: Layout) -> str:
    return _html(_layout_renderable(self))


def _dtensor_html(self: DTensor) -> str:
    head = html.escape(
        f"DTensor shape {tuple(self.shape)}, {self.dtype}, layout {self.sharding} on {self.device_mesh}"
    )
    picture = ShardingPicture(self.sharding.normalized(self.ndim), tuple(self.shape), self.dtype)
    return f"<div><b>{head}</b></div>" + _html(picture.renderable())


def _plan_html(self: PlanReport) -> str:
    return _html(self.table())


def install() -> None:
    """Give the records, values and plan reports their notebook pictures."""
    DeviceMesh._repr_html_ = _mesh_html
    Layout._repr_html_ = _layout_html
    DTensor._repr_html_ = _dtensor_html
    PlanReport._repr_html_ = _plan_html


install()
