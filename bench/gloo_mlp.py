"""Tensor-parallel MLP, forward + backward, on real gloo ranks (CPU).

    torchrun --standalone --nproc-per-node 2 bench/gloo_mlp.py [--quick]

The MLP of ``simulated_mlp.py`` (x ``(64, 512)``, w1 ``(512, 2048)`` split on its columns,
w2 ``(2048, 512)`` split on its rows, ``y = relu(x @ w1) @ w2`` summed over the ranks), the
step being forward, then backward of a fixed cotangent into x and the local weight shards.
Variants, interleaved in one loop; a sample is ``--calls`` (default 5) back-to-back steps, as a
training loop runs them, with a barrier before each sample:

* ``hand-written``: ``torch.distributed._functional_collectives`` as Megatron does: x goes
  through identity-forward / all_reduce-backward, the row-parallel output through
  all_reduce-forward / identity-backward. The denominator of the ratios.
* ``fd.shard_map``: the library on ``fd.init_device_mesh("cpu", (world,), ("tp",))``, the
  weights as ``fd.from_local`` DTensors over this rank's shards (``check_rep`` on and off).
* ``DTensor TP``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``.
* ``local compute only``: the hand-written step without its two all_reduces (no
  communication): what the collectives and the libraries add on top of the math.

All variants share the weight storage: ``nn.Linear`` weights (out, in), so every variant's
matmuls are the same BLAS calls (``w1 = linear1.weight.T``). Medians are rank 0's wall-clock
times (the slowest rank's median beside them), and rank 0's CPU time per step, which counts
gloo's own threads but not time spent waiting for a core or for the other rank.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _checks import checked, in_float64
from _timing import interleaved, median_ms, print_table, verdict
from torch import nn

import functional_dtensor as fd

BATCH, DIM, HIDDEN = 64, 512, 2048
TARGET = 1.03  # fd / hand-written


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(t, "sum", dist.group.WORLD).wait()


class CopyToTP(torch.autograd.Function):
    """Identity forward; all_reduce backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g)


class ReduceFromTP(torch.autograd.Function):
    """All_reduce forward; identity backward (the output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, y):
        return all_reduce(y)

    @staticmethod
    def backward(ctx, g):
        return g


class Shards(NamedTuple):
    """The global values (the same on every rank) and this rank's weight shards, stored as
    ``nn.Linear`` weights (out, in) that require grad."""

    x: torch.Tensor  # (batch, dim), requires grad
    w1: torch.Tensor  # (dim, hidden), global
    w2: torch.Tensor  # (hidden, dim), global
    dy: torch.Tensor  # (batch, dim): the cotangent of y
    lin1: torch.Tensor  # (hidden/world, dim) = w1[:, cols].T
    lin2: torch.Tensor  # (dim, hidden/world) = w2[cols, :].T

    def clear(self):
        self.x.grad = self.lin1.grad = self.lin2.grad = None


def make_shards(rank: int, world: int) -> Shards:
    torch.manual_seed(0)
    x = torch.randn(BATCH, DIM, requires_grad=True)
    w1 = torch.randn(DIM, HIDDEN) / DIM**0.5
    w2 = torch.randn(HIDDEN, DIM) / HIDDEN**0.5
    dy = torch.randn(BATCH, DIM)
    cols = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
    lin1 = w1[:, cols].T.contiguous().requires_grad_()
    lin2 = w2[cols, :].T.contiguous().requires_grad_()
    return Shards(x, w1, w2, dy, lin1, lin2)


def hand_written_step(s: Shards, communicate: bool = True):
    def step():
        s.clear()
        x = CopyToTP.apply(s.x) if communicate else s.x
        y_partial = torch.relu(x @ s.lin1.T) @ s.lin2.T
        y = ReduceFromTP.apply(y_partial) if communicate else y_partial
        y.backward(s.dy)
        return y, s.x.grad, s.lin1.grad, s.lin2.grad

    return step


def fd_step(s: Shards, mesh: fd.DeviceMesh, check_rep: bool):
    @fd.shard_map(
        mesh=mesh,
        in_specs=(fd.P(), fd.P(None, "tp"), fd.P("tp", None)),
        out_specs=fd.P(),
        check_rep=check_rep,
    )
    def mlp(x, w1_cols, w2_rows):
        return fd.psum(torch.relu(x @ w1_cols) @ w2_rows, "tp")

    # the parameters, built once: DTensors over this rank's shards (views of the leaves)
    w1 = fd.from_local(s.lin1.T, mesh, fd.P(None, "tp"))
    w2 = fd.from_local(s.lin2.T, mesh, fd.P("tp", None))

    def step():
        s.clear()
        y = mlp(s.x, w1, w2).to_local()
        y.backward(s.dy)
        return y, s.x.grad, s.lin1.grad, s.lin2.grad

    return step


def dtensor_step(s: Shards, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, DIM, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(s.w1.T)
        model[2].weight.copy_(s.w2.T)
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def step():
        model.zero_grad(set_to_none=True)
        s.x.grad = None
        y = model(s.x)
        if isinstance(y, funcol.AsyncCollectiveTensor):
            y.trigger_wait()  # the forward all_reduce, which the backward does not wait for
        y.backward(s.dy)
        return y, s.x.grad, model[0].weight.grad.to_local(), model[2].weight.grad.to_local()

    return step


def check(name: str, got, want, rank: int, want_in_dtype=None):
    """This rank's (y, dx, dw1, dw2) of a variant against the hand-written step's: the same
    local products and the same all-reduce, equal to float32's tolerance."""
    labels = ("y", "dx", "dw1", "dw2")
    low = None if want_in_dtype is None else dict(zip(labels, want_in_dtype))
    checked(f"rank {rank}: {name}", dict(zip(labels, got)), dict(zip(labels, want)), low)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--calls", type=int, default=5, help="back-to-back steps per timed sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    reps = args.reps or (5 if args.quick else 100)

    mesh = fd.init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), ("tp",))
    rank, world = dist.get_rank(), dist.get_world_size()
    s = make_shards(rank, world)
    hand = "hand-written funcol"
    steps = {
        hand: hand_written_step(s),
        "fd.shard_map": fd_step(s, mesh, check_rep=True),
        "fd.shard_map, check_rep=False": fd_step(s, mesh, check_rep=False),
        "DTensor TP": dtensor_step(s, world),
        "local compute only": hand_written_step(s, communicate=False),
    }
    snapshot = lambda step: [t.detach().clone() for t in step()]  # noqa: E731
    reference = snapshot(steps[hand])
    x64, w1_64, w2_64 = in_float64((s.x, s.w1, s.w2))
    y_unsharded = torch.relu(s.x @ s.w1) @ s.w2
    check(hand, reference[:1], [torch.relu(x64 @ w1_64) @ w2_64], rank, [y_unsharded])
    for name in ("fd.shard_map", "fd.shard_map, check_rep=False", "DTensor TP"):
        check(name, snapshot(steps[name]), reference, rank)

    times = interleaved(steps, reps=reps, warmup=3, before_each=dist.barrier, calls=args.calls)
    wall = {name: median_ms(t.wall) for name, t in times.items()}
    cpu = {name: median_ms(t.cpu) for name, t in times.items()}
    slowest = torch.tensor(list(wall.values()))  # each variant's median on the slowest rank
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    if rank == 0:
        rows = [
            [
                name,
                f"{wall[name]:.2f}",
                f"{worst:.2f}",
                f"{wall[name] / wall[hand]:.3f}",
                f"{cpu[name]:.2f}",
                f"{cpu[name] / cpu[hand]:.3f}",
                verdict(wall[name] / wall[hand], TARGET) if name == "fd.shard_map" else "",
            ]
            for name, worst in zip(steps, slowest.tolist(), strict=True)
        ]
        print_table(
            f"TP MLP fwd+bwd on {world} gloo ranks (batch {BATCH}, dim {DIM}, hidden {HIDDEN}): "
            f"medians of {reps} interleaved samples of {args.calls} steps, 1 thread per rank",
            [
                "variant",
                "rank 0 ms",
                "slowest rank ms",
                "/ hand-written",
                "rank 0 cpu ms",
                "/ hand (cpu)",
                "target",
            ],
            rows,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
