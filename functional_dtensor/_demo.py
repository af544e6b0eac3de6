"""The demo behind ``python -m functional_dtensor``: layouts on an 8-device simulated mesh."""

from __future__ import annotations

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import functional_dtensor as fd

# Layouts as P specs or as placements: even, uneven (5 columns over 4 devices), nested (rows
# over dp then tp), replicated, and partial sums (which have no P spec).
EXAMPLES = (
    fd.P("dp"),
    fd.P("dp", "tp"),
    fd.P(("dp", "tp")),
    fd.P(),
    (fd.Partial("sum"), fd.Shard(1)),
)


def mesh_table(mesh: fd.DeviceMesh) -> Table:
    """The device ids of a 2-d mesh, laid out as a grid."""
    rows, cols = mesh.axis_names
    table = Table(title=escape(str(mesh)), box=box.SIMPLE_HEAD)
    table.add_column("")
    for c in range(mesh.shape[1]):
        table.add_column(f"{cols}={c}", justify="center")
    for r in range(mesh.shape[0]):
        ids = (str(mesh.device_ids[mesh.flat_index((r, c))]) for c in range(mesh.shape[1]))
        table.add_row(f"{rows}={r}", *ids)
    return table


def layouts_table(x: torch.Tensor, mesh: fd.DeviceMesh) -> tuple[Table, bool]:
    """For each example: its P spec, its placements in short form and every device's local
    shape; and whether ``full_tensor()`` gave ``x`` back for all of them."""
    shape = "×".join(map(str, x.shape))
    table = Table(title=f"a {shape} tensor, local shape per device", box=box.SIMPLE_HEAD)
    table.add_column("P spec")
    table.add_column("layout")
    for device in range(mesh.size):
        table.add_column(f"d{device}", justify="center")
    all_equal = True
    for target in EXAMPLES:
        value = fd.distribute_tensor(x, mesh, target)
        spec = "-" if value.layout.has_partial else str(value.spec)
        shapes = ("×".join(map(str, s.shape)) for s in value.local_shards())
        table.add_row(escape(spec), escape(str(value.layout)), *shapes)
        all_equal &= torch.allclose(value.full_tensor(), x)
    return table, all_equal


def main() -> None:
    console = Console()
    mesh = fd.simulated_mesh((2, 4), ("dp", "tp"))
    console.print(mesh_table(mesh))
    x = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    table, all_equal = layouts_table(x, mesh)
    console.print(table)
    console.print(
        "Uneven splits follow torch.chunk: 5 columns over 4 devices give 2, 2, 1, 0.\n"
        "Nested axes split the block the previous axis left: 6 rows over dp give 3 + 3,\n"
        "then each 3 over tp gives 1, 1, 1, 0."
    )
    mark = "[green]ok[/green]" if all_equal else "[red]FAILED[/red]"
    console.print(f"round trip distribute_tensor -> full_tensor on {mesh.size} devices: {mark}")
    if not all_equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
