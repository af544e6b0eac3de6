"""Eager dispatch overhead of global torch ops on ``fd.DTensor``: ``a + b``, ``torch.mm``, ``a.sum()``,
``a[:, 1:5]``.

    python bench/global_ops.py [--quick] [--profile]                         # simulated mesh of 8
    torchrun --standalone --nproc-per-node 2 bench/global_ops.py [--quick]   # gloo ranks

One 8 x 8 float32 global value per input, laid out so that no op communicates:

* ``add``: ``a + b``, both split on their rows (``fd.P("x")``, ``[Shard(0)]``): the result
  is split on its rows;
* ``mm``: ``torch.mm(a, b)``, a split on its columns (``fd.P(None, "x")``, ``[Shard(1)]``), b on
  its rows (``fd.P("x")``, ``[Shard(0)]``): each device multiplies its blocks, the result is
  ``Partial("sum")``;
* ``sum``: ``a.sum()``, a split on its rows: the result is ``Partial("sum")``;
* ``index``: ``a[:, 1:5]``, a split on its rows: each device slices its block's columns, the
  result is split on its rows.

Without torchrun, on a simulated mesh of 8 devices: ``fd`` (``fd.simulated_mesh(8, "x")``),
torch's DTensor on ``LocalTensor`` (torch's simulation, under ``LocalTensorMode(8)`` over a
``"fake"`` process group, as in ``tiny_op.py``), plain torch on the 8 x 8 tensor, and the op fd
runs on its stacked storage (the 8 devices' blocks stacked on a leading dim: one torch call).
Under torchrun (gloo, one thread per rank): ``fd`` (``fd.init_device_mesh``), torch's DTensor
(``torch.distributed.tensor.distribute_tensor`` with the same placements), plain torch on the
8 x 8 tensor and on this rank's local blocks; rank 0 prints.

Before timing, every variant's result is checked against plain torch (``full_tensor()``, the
tests' comparison: a float64 reference, within a few times plain torch's own float32 error;
``_checks.py``), and fd's ops are checked to run no collective (``fd.CommDebugMode``).
A timed sample is ``n`` back-to-back calls of one op (n = 200, 10 for DTensor on LocalTensor);
samples of all variants are interleaved in a shuffled order. Per-op times are medians of CPU
time (there is no communication, so it is the work of this process), wall-clock beside them.
Overhead = per-op time minus plain torch's on the 8 x 8 tensor. Target: fd's <= 5 us per op.
``--profile`` runs cProfile over 10k ``a + b`` calls on fd's simulated mesh and prints the top
functions by their own time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import warnings

import torch
import torch.distributed as dist
from _checks import checked, in_float64
from _timing import interleaved, median_ms, print_table, verdict

import functional_dtensor as fd

N = 8  # global shape N x N
TARGET_US = 5.0
OPS = ("add", "mm", "sum", "index")
CALLS = 200  # calls per timed sample
SLOW_CALLS = 10  # for DTensor on LocalTensor (hundreds of us per op)


def values():
    torch.manual_seed(0)
    return torch.randn(N, N), torch.randn(N, N)


def plain_ops(t, u):
    """op -> a zero-argument call on plain tensors; ``t`` and ``u`` as the global a and b."""
    return {
        "add": lambda: t + u,
        "mm": lambda: torch.mm(t, u),
        "sum": lambda: t.sum(),
        "index": lambda: t[:, 1:5],
    }


def fd_ops(mesh, t, u):
    a_rows, b_rows = fd.distribute_tensor(t, mesh, fd.P("x")), fd.distribute_tensor(u, mesh, fd.P("x"))
    a_cols = fd.distribute_tensor(t, mesh, fd.P(None, "x"))
    return {
        "add": lambda: a_rows + b_rows,
        "mm": lambda: torch.mm(a_cols, b_rows),
        "sum": lambda: a_rows.sum(),
        "index": lambda: a_rows[:, 1:5],
    }


def dtensor_ops(mesh, t, u):
    from torch.distributed.tensor import Shard, distribute_tensor

    a_rows, b_rows = distribute_tensor(t, mesh, [Shard(0)]), distribute_tensor(u, mesh, [Shard(0)])
    a_cols = distribute_tensor(t, mesh, [Shard(1)])
    return {
        "add": lambda: a_rows + b_rows,
        "mm": lambda: torch.mm(a_cols, b_rows),
        "sum": lambda: a_rows.sum(),
        "index": lambda: a_rows[:, 1:5],
    }


def stacked_ops(mesh, t, u):
    """The torch call fd makes on its stacked storage (the simulated backend): the floor."""
    from functional_dtensor._dtensor import storage_of

    a_rows, b_rows = (storage_of(fd.distribute_tensor(v, mesh, fd.P("x"))) for v in (t, u))
    a_cols = storage_of(fd.distribute_tensor(t, mesh, fd.P(None, "x")))
    return {
        "add": lambda: a_rows + b_rows,  # (8, 1, 8) + (8, 1, 8)
        "mm": lambda: a_cols * b_rows,  # (8, 8, 1) @ (8, 1, 8): a contraction of length one
        "sum": lambda: torch.sum(a_rows, dim=[-2, -1]),  # (8, 1, 8) -> (8,)
        "index": lambda: a_rows[:, :, 1:5],  # (8, 1, 8) -> (8, 1, 4)
    }


def repeat(op, n, mode=None):
    def run():
        if mode is None:
            for _ in range(n):
                op()
        else:
            with mode():
                for _ in range(n):
                    op()

    return run


def check(name, ops, want, full=lambda x: x.full_tensor(), mode=None):
    """Each op's result against ``want``: op -> (the float64 reference, plain torch's float32)."""
    for op, call in ops.items():
        if mode is None:
            got = full(call())
        else:
            with mode():
                got = full(call())
        if isinstance(got, torch.Tensor) and type(got) is not torch.Tensor:  # a LocalTensor of equal shards
            got = got._local_tensors[0]
        checked(f"{name}: {op} against plain torch", got, *want[op])


def check_no_comm(ops):
    with fd.CommDebugMode() as comm:
        for call in ops.values():
            call()
    if comm.get_total_counts() != 0:
        raise SystemExit(f"fd ran collectives in the timed ops: {comm.get_comm_counts()}")


def report(title, variants, times, calls, fd_names, caption):
    """``variants``: the variant names, the first one the denominator (plain torch, 8 x 8)."""
    cpu = {key: median_ms(t.cpu) * 1e3 / calls[key] for key, t in times.items()}  # us per op
    wall = {key: median_ms(t.wall) * 1e3 / calls[key] for key, t in times.items()}
    base = variants[0]
    rows = []
    for op in OPS:
        for name in variants:
            us, overhead = cpu[(name, op)], cpu[(name, op)] - cpu[(base, op)]
            rows.append(
                [
                    f"{op}: {name}",
                    f"{us:.1f}",
                    f"{wall[(name, op)]:.1f}",
                    f"{overhead:.1f}" if name != base else "",
                    f"{us / cpu[(base, op)]:.1f}" if name != base else "1.0",
                    verdict(overhead, TARGET_US) if name in fd_names else "",
                ]
            )
        rows.append([""] * 6)
    print_table(
        title,
        ["op: variant", "us / op", "us / op (wall)", "overhead us / op", "x plain", "target"],
        rows[:-1],
        caption=caption,
    )


def simulated(args, reps):
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = 8
    t, u = values()
    plain = plain_ops(t, u)
    plain64 = plain_ops(*in_float64((t, u)))
    want = {op: (plain64[op](), call()) for op, call in plain.items()}
    mesh = fd.simulated_mesh(world, "x")
    ours = fd_ops(mesh, t, u)
    check("fd", ours, want)
    check_no_comm(ours)
    stacked = stacked_ops(mesh, t, u)
    if args.profile:
        profile(ours["add"])
        return

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    mode = lambda: LocalTensorMode(world)  # noqa: E731
    with mode():
        theirs = dtensor_ops(torch_mesh, t, u)
    check("DTensor on LocalTensor", theirs, want, mode=mode)

    variants = {
        "plain torch, 8x8": (plain, CALLS, None),
        "fd, simulated 8": (ours, CALLS, None),
        "DTensor on LocalTensor, 8": (theirs, SLOW_CALLS, mode),
        "fd's op on stacked storage": (stacked, CALLS, None),
    }
    steps, calls = {}, {}
    for name, (ops, n, m) in variants.items():
        for op, call in ops.items():
            steps[(name, op)], calls[(name, op)] = repeat(call, n, m), n
    times = interleaved(steps, reps=reps, warmup=2)
    report(
        f"global 8x8 float32 ops, simulated mesh of {world}: medians of {reps} interleaved samples "
        f"of {CALLS} calls ({SLOW_CALLS} for LocalTensor), 1 thread",
        list(variants),
        times,
        calls,
        {"fd, simulated 8"},
        "us / op: CPU time; overhead: minus plain torch on the 8x8 tensor. "
        "fd's results checked against plain torch; fd ran no collective (fd.CommDebugMode).",
    )


def gloo(args, reps):
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ["WORLD_SIZE"])
    mesh = fd.init_device_mesh("cpu", (world,), ("x",))
    rank = dist.get_rank()
    torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    t, u = values()
    plain = plain_ops(t, u)
    plain64 = plain_ops(*in_float64((t, u)))
    want = {op: (plain64[op](), call()) for op, call in plain.items()}
    rows = slice(rank * N // world, (rank + 1) * N // world)
    t_rows, u_rows, t_cols = t[rows].contiguous(), u[rows].contiguous(), t[:, rows].contiguous()
    local = {
        "add": lambda: t_rows + u_rows,  # (8/k, 8) + (8/k, 8)
        "mm": lambda: torch.mm(t_cols, u_rows),  # (8, 8/k) @ (8/k, 8)
        "sum": lambda: t_rows.sum(),
        "index": lambda: t_rows[:, 1:5],
    }
    ours = fd_ops(mesh, t, u)
    theirs = dtensor_ops(torch_mesh, t, u)
    check("fd", ours, want)
    check_no_comm(ours)
    check("DTensor", theirs, want)

    variants = {
        "plain torch, 8x8": plain,
        f"fd, gloo {world}": ours,
        f"DTensor, gloo {world}": theirs,
        "plain torch, local blocks": local,
    }
    steps, calls = {}, {}
    for name, ops in variants.items():
        for op, call in ops.items():
            steps[(name, op)], calls[(name, op)] = repeat(call, CALLS), CALLS
    times = interleaved(steps, reps=reps, warmup=2)
    if rank == 0:
        report(
            f"global 8x8 float32 ops on {world} gloo ranks: medians of {reps} interleaved samples of "
            f"{CALLS} calls, rank 0, 1 thread per rank",
            list(variants),
            times,
            calls,
            {f"fd, gloo {world}"},
            "us / op: rank 0's CPU time; overhead: minus plain torch on the 8x8 tensor. fd's and "
            "DTensor's results checked against plain torch; fd ran no collective (fd.CommDebugMode).",
        )
    dist.barrier()
    dist.destroy_process_group()


def profile(call, n=10_000):
    for _ in range(100):
        call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"cProfile of {n} fd `a + b` calls (8x8, simulated mesh of 8), by own time:")
    stats.sort_stats("tottime").print_stats(12)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile 10k fd `a + b` calls (simulated)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    reps = args.reps or (5 if args.quick else 50)
    if "WORLD_SIZE" in os.environ:
        gloo(args, reps)
    else:
        simulated(args, reps)


if __name__ == "__main__":
    main()
