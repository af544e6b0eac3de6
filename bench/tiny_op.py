"""Per-op overhead of a tiny elementwise op inside ``fd.shard_map``, at 8, 64 and 1,024 devices.

    python bench/tiny_op.py [--quick]

The per-device function applies ``x = x + 1`` N times to a 4-element local tensor. The
per-op time is ``(time(N ops) - time(0 ops)) / N``, so the fixed cost of a ``shard_map`` call
(reported apart) cancels; the overhead per op is that minus the plain-torch per-op time of the
same add on one 4-element tensor. The same is done for a tiny ``fd.psum`` (a collective on the
4-element local tensor), and for torch's LocalTensor simulation (plain LocalTensor, and DTensor
on LocalTensor) at 8 ranks. Two floors show what the simulation's approach costs before any
work of fd's own: the add under functorch's vmap primitives alone, and under them with an empty
Python torch-function mode (fd's replication tracker is one). Target: fd's overhead per add
<= 2 us, flat in the device count.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from _timing import interleaved, median_ms, print_table, verdict
from torch.overrides import TorchFunctionMode

import functional_dtensor as fd

LOCAL = 4  # elements per device
TARGET_US = 2.0


def adds(n_ops):
    def body(x):
        for _ in range(n_ops):
            x = x + 1
        return x

    return body


def psums(n_ops):
    def body(x):
        y = x
        for _ in range(n_ops):
            y = fd.psum(x, "x")
        return y

    return body


def plain(body, x):
    return lambda: body(x)


def mapped(body, n_devices, check_rep):
    mesh = fd.simulated_mesh(n_devices, "x")
    f = fd.shard_map(body, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"), check_rep=check_rep)
    x = fd.distribute_tensor(torch.zeros(n_devices * LOCAL), mesh, fd.P("x"))
    return lambda: f(x)


class _EmptyMode(TorchFunctionMode):
    """A torch-function mode that runs every op as it is: the dispatch a Python mode costs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def vmap_floor(body, n_devices, with_mode: bool):
    """The body on stacked ``(n, LOCAL)`` values under functorch's vmap primitives alone (no
    pytrees, no checks), optionally under an empty Python torch-function mode: what any
    simulation by a device vmap with a Python mode pays per op, before any work of its own."""
    from torch._C._functorch import (
        _add_batch_dim,
        _remove_batch_dim,
        _vmap_decrement_nesting,
        _vmap_increment_nesting,
    )

    x, mode = torch.zeros(n_devices, LOCAL), _EmptyMode()

    def run():
        level = _vmap_increment_nesting(n_devices, "different")
        try:
            local = _add_batch_dim(x, 0, level)
            if with_mode:
                with mode:
                    out = body(local)
            else:
                out = body(local)
            return _remove_batch_dim(out, level, n_devices, 0)
        finally:
            _vmap_decrement_nesting()

    return run


def local_tensor(body, world, dtensor: bool):
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    if not dtensor:
        x = LocalTensor({r: torch.zeros(LOCAL) for r in range(world)})
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
        with LocalTensorMode(world):
            x = distribute_tensor(torch.zeros(world * LOCAL), mesh, [Shard(0)])

    def run():
        with LocalTensorMode(world):
            return body(x)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument("--ops", type=int, default=200, help="adds per call (default 200)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    reps = 5 if args.quick else 60
    n_ops, n_psums = args.ops, args.ops // 4

    # variant name -> a function making its step from a per-device body
    variants = {"plain torch, 1 tensor": lambda body: plain(body, torch.zeros(LOCAL))}
    variants["floor: vmap primitives, 8"] = lambda body: vmap_floor(body, 8, with_mode=False)
    variants["floor: vmap + empty mode, 8"] = lambda body: vmap_floor(body, 8, with_mode=True)
    for n in (8, 64, 1024):
        for check_rep in (True, False):
            name = f"fd.shard_map, {n}" + ("" if check_rep else ", check_rep=False")
            variants[name] = lambda body, n=n, c=check_rep: mapped(body, n, c)
    variants["LocalTensor, 8"] = lambda body: local_tensor(body, 8, dtensor=False)
    variants["DTensor on LocalTensor, 8"] = lambda body: local_tensor(body, 8, dtensor=True)

    steps = {}
    for name, make in variants.items():
        steps[(name, "add", 0)] = make(adds(0))
        steps[(name, "add", n_ops)] = make(adds(n_ops))
        if name.startswith("fd"):
            steps[(name, "psum", 0)] = make(psums(0))
            steps[(name, "psum", n_psums)] = make(psums(n_psums))
    check = mapped(adds(3), 8, True)().full_tensor()
    assert torch.equal(check, torch.full((8 * LOCAL,), 3.0)), check

    times = interleaved(steps, reps=reps, warmup=2)
    cpu = {key: median_ms(t.cpu) * 1e3 for key, t in times.items()}  # us
    wall = {key: median_ms(t.wall) * 1e3 for key, t in times.items()}

    def per_op(clock, name, op, count):
        return (clock[(name, op, count)] - clock[(name, op, 0)]) / count

    plain_us = per_op(cpu, "plain torch, 1 tensor", "add", n_ops)
    rows = []
    for name in variants:
        add_us = per_op(cpu, name, "add", n_ops)
        overhead = add_us - plain_us
        is_fd = name.startswith("fd")
        rows.append(
            [
                name,
                f"{add_us:.1f}",
                f"{per_op(wall, name, 'add', n_ops):.1f}",
                f"{overhead:.1f}" if name != "plain torch, 1 tensor" else "",
                f"{cpu[(name, 'add', 0)]:.0f}",
                f"{per_op(cpu, name, 'psum', n_psums):.0f}" if is_fd else "",
                verdict(overhead, TARGET_US) if is_fd else "",
            ]
        )
    print_table(
        f"tiny op inside shard_map ({LOCAL} elements per device): medians of {reps} interleaved reps, "
        f"{n_ops} adds / {n_psums} psums per call, 1 thread",
        [
            "variant",
            "us / add",
            "us / add (wall)",
            "overhead us / add",
            "us / call, 0 ops",
            "us / psum",
            "target",
        ],
        rows,
        caption="us / add and us / psum: (T(N ops) - T(0 ops)) / N in CPU time; overhead: minus plain torch.",
    )


if __name__ == "__main__":
    main()
