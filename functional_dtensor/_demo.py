"""The demo behind ``python -m functional_dtensor``: a tour of the library on a mesh of 8
simulated devices (``--backend distributed`` under ``torchrun``: the same on real processes).

1. the mesh, and who holds which block of a value in two layouts (one uneven);
2. a tensor-parallel MLP step written with ``shard_map``, checked against one device, and the
   communication it cost;
3. a global op, ``a @ b`` of two sharded values, and the rule that ran it;
4. a redistribute's plan, with the bytes each device receives.
"""

from __future__ import annotations

import argparse
import os

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.rule import Rule
from rich.table import Table

import functional_dtensor as fd


def mesh_table(mesh: fd.DeviceMesh) -> Table:
    """The device ids of a 2-d mesh, laid out as a grid."""
    rows, cols = mesh.axis_names
    table = Table(title=escape(str(mesh)), box=box.SIMPLE_HEAD)
    table.add_column("")
    for c in range(mesh.shape[1]):
        table.add_column(f"{cols}={c}", justify="center")
    for r in range(mesh.shape[0]):
        ids = (str(mesh.flat_index((r, c))) for c in range(mesh.shape[1]))
        table.add_row(f"{rows}={r}", *ids)
    return table


def layouts(console: Console, mesh: fd.DeviceMesh) -> bool:
    x = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
    grid = fd.distribute_tensor(x, mesh, fd.P("dp", "tp"))
    console.print(
        fd.sharding_picture(grid, header='an 8 x 8 value as P("dp", "tp"): rows over dp, columns over tp')
    )
    v = torch.arange(5.0)
    uneven = fd.distribute_tensor(v, mesh, fd.P("tp"))
    console.print(
        fd.sharding_picture(uneven, header='5 elements as P("tp"): torch.chunk blocks, replicas over dp')
    )
    return torch.equal(grid.full_tensor(), x) and torch.equal(uneven.full_tensor(), v)


def mlp_step(console: Console, mesh: fd.DeviceMesh) -> bool:
    """relu(x @ w1) @ w2 with the batch over dp and the hidden dim over tp (Megatron's split),
    forward and backward, against one device."""
    torch.manual_seed(0)
    # float64: the check is of the sharding, the comparison far above any rounding on any CPU
    x, w1, w2 = (
        torch.randn(*shape, dtype=torch.float64) / s
        for shape, s in [((16, 32), 1), ((32, 64), 6), ((64, 32), 8)]
    )

    @fd.shard_map(
        mesh=mesh,
        in_specs=(fd.P("dp"), fd.P(None, "tp"), fd.P("tp")),
        out_specs=fd.P("dp"),
    )
    def mlp(x_rows, w1_cols, w2_rows):
        hidden = torch.relu(x_rows @ w1_cols)  # each device: its rows, its slice of the hidden dim
        return fd.psum(hidden @ w2_rows, "tp")  # the partial products summed over tp

    w1d, w2d = (t.clone().requires_grad_() for t in (w1, w2))
    with fd.CommDebugMode() as comm:
        y = mlp(x, w1d, w2d)
        loss = y.full_tensor().square().mean()
        g1, g2 = torch.autograd.grad(loss, (w1d, w2d))
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    expected = (torch.relu(x @ a) @ b).square().mean()
    e1, e2 = torch.autograd.grad(expected, (a, b))
    same = torch.allclose(loss, expected) and torch.allclose(g1, e1) and torch.allclose(g2, e2)
    console.print(
        f"loss {loss.item():.6f}, on one device {expected.item():.6f}; "
        f"gradients equal: {'yes' if same else 'NO'}"
    )
    console.print(comm.table())
    console.print(
        "forward: one psum over tp sums the partial products. backward: the weights,\n"
        "replicated over dp, get their gradients summed over dp."
    )
    return same


def global_matmul(console: Console, mesh: fd.DeviceMesh) -> bool:
    torch.manual_seed(1)
    a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    ad = fd.distribute_tensor(a, mesh, fd.P(None, "tp"))  # a's columns over tp
    bd = fd.distribute_tensor(b, mesh, fd.P("tp"))  # b's rows over tp
    console.print(escape(str(fd.explain(torch.matmul, ad, bd))))
    out = ad @ bd
    console.print(f"a @ b is {out.sharding} (a sum still to take over tp); its value equals one device's:")
    same = torch.allclose(out.full_tensor(), a @ b)
    console.print(f"  {'yes' if same else 'NO'}")
    return same


def plan(console: Console, mesh: fd.DeviceMesh) -> bool:
    x = fd.distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, fd.P(("dp", "tp")))
    target = fd.P(None, ("dp", "tp"))  # rows over every device -> columns over every device
    console.print(fd.explain_redistribute(x, target, show=False).table())
    return torch.equal(fd.redistribute(x, target).full_tensor(), x.full_tensor())


def _ranks_mesh() -> fd.DeviceMesh:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % 2:
        raise SystemExit(
            "run it on an even number of ranks: torchrun --nproc-per-node 4 -m functional_dtensor ..."
        )
    return fd.init_device_mesh("cpu", (2, world // 2), ("dp", "tp"))


#: the mesh of each backend: 8 simulated devices, or the ranks torchrun started
MESHES = {"simulated": lambda: fd.simulated_mesh((2, 4), ("dp", "tp")), "distributed": _ranks_mesh}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m functional_dtensor", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=tuple(MESHES), default="simulated")
    args = parser.parse_args(argv)
    mesh = MESHES[args.backend]()
    quiet = int(os.environ.get("RANK", "0")) != 0  # on torchrun's ranks, rank 0 prints
    console = Console(width=80, quiet=quiet)
    sections = (
        ("1. a mesh, and who holds what", layouts),
        ("2. a tensor-parallel MLP step with shard_map", mlp_step),
        ("3. a global op: a @ b of sharded values", global_matmul),
        ("4. a redistribute, planned", plan),
    )
    console.print(mesh_table(mesh))
    ok = True
    for title, section in sections:
        console.print(Rule(title))
        with console.status(f"{title}..."):
            ok &= section(console, mesh)
    console.print(Rule())
    console.print("all checks against one device: " + ("[green]ok[/green]" if ok else "[red]FAILED[/red]"))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
