"""Tensor-parallel MLP, forward + backward, on a simulated mesh.

    python bench/simulated_mlp.py [--quick] [--threads 1] [--steady-malloc]

The MLP is ``y = relu(x @ w1) @ w2`` with x ``(64, 512)``, w1 ``(512, 2048)`` split on its
columns (ColwiseParallel) and w2 ``(2048, 512)`` split on its rows (RowwiseParallel), a psum at
the end; the step is forward, then backward of a fixed cotangent into x, w1 and w2.

Variants, interleaved in one loop:

* ``unsharded``: the same math on one device, plain torch: the target's denominator.
* ``stacked torch, n``: the per-device math written by hand on stacked shards, batched as
  functorch's vmap batches it (``x`` against a batch of column blocks, a batched matmul, a
  sum for the psum).
* ``folded torch, n``: the same, with ``x @ w1`` as one matmul on the whole weight viewed per
  device (what fd's batching rule for a replicated activation times column blocks does). The
  floor of a simulation that batches the devices: fd above it is library overhead.
* ``fd.shard_map, n``: the library, ``check_rep`` on (the default) and off, on the global
  tensors (the gradients come back as global tensors).
* ``LocalTensor DTensor, 8``: torch's own simulation, ``parallelize_module`` with
  ``ColwiseParallel``/``RowwiseParallel`` on ``LocalTensorMode`` over a fake process group.

``--steady-malloc`` fixes glibc malloc's thresholds first (``_timing.steady_malloc``): with the
defaults the fd step page-faults several hundred times per step, the unsharded one half as often.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist
from _checks import checked, in_float64
from _timing import interleaved, median_ms, print_table, steady_malloc, verdict
from torch import nn

import functional_dtensor as fd

BATCH, DIM, HIDDEN = 64, 512, 2048
TARGETS = {8: 1.2, 64: 1.5}  # fd / unsharded


def make_inputs():
    torch.manual_seed(0)
    x = torch.randn(BATCH, DIM, requires_grad=True)
    w1 = (torch.randn(DIM, HIDDEN) / DIM**0.5).requires_grad_()
    w2 = (torch.randn(HIDDEN, DIM) / HIDDEN**0.5).requires_grad_()
    dy = torch.randn(BATCH, DIM)
    return x, w1, w2, dy


def clear(*leaves):
    for t in leaves:
        t.grad = None


def unsharded_step(x, w1, w2, dy):
    def step():
        clear(x, w1, w2)
        y = torch.relu(x @ w1) @ w2
        y.backward(dy)
        return y

    return step


def stacked_step(n, x, w1, w2, dy):
    """Every device's shard stacked on a leading dim, computed by hand."""

    def step():
        clear(x, w1, w2)
        w1_cols = w1.view(DIM, n, HIDDEN // n).permute(1, 0, 2)  # (n, dim, hidden/n)
        w2_rows = w2.view(n, HIDDEN // n, DIM)  # (n, hidden/n, dim)
        y = (torch.relu(x @ w1_cols) @ w2_rows).sum(0)  # the psum
        y.backward(dy)
        return y

    return step


def folded_step(n, x, w1, w2, dy):
    """As ``stacked_step``, with the column-parallel matmul done once on the whole weight."""

    def step():
        clear(x, w1, w2)
        h = (x @ w1).view(BATCH, n, HIDDEN // n).transpose(0, 1)  # (n, batch, hidden/n), a view
        w2_rows = w2.view(n, HIDDEN // n, DIM)
        y = (torch.relu(h) @ w2_rows).sum(0)
        y.backward(dy)
        return y

    return step


def fd_step(n, x, w1, w2, dy, check_rep):
    mesh = fd.simulated_mesh(n, "tp")

    @fd.shard_map(
        mesh=mesh,
        in_specs=(fd.P(), fd.P(None, "tp"), fd.P("tp", None)),
        out_specs=fd.P(),
        check_rep=check_rep,
    )
    def mlp(x, w1_cols, w2_rows):
        return fd.psum(torch.relu(x @ w1_cols) @ w2_rows, "tp")

    def step():
        clear(x, w1, w2)
        y = mlp(x, w1, w2).full_tensor()
        y.backward(dy)
        return y

    return step


def local_tensor_step(world, x, w1, w2, dy):
    """DTensor tensor parallelism on torch's LocalTensor simulation of ``world`` ranks."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    model = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, DIM, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w1.T)
        model[2].weight.copy_(w2.T)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with LocalTensorMode(world):
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x_lt = x.detach().clone().requires_grad_()

    def step():
        with LocalTensorMode(world):
            model.zero_grad(set_to_none=True)
            x_lt.grad = None
            y = model(x_lt)
            y.backward(dy)
            return y.wait() if hasattr(y, "wait") else y

    def results():
        """Rank 0's output and the global gradients (x, w1, w2)."""
        y = step()
        with LocalTensorMode(world):
            g1 = model[0].weight.grad.full_tensor()
            g2 = model[2].weight.grad.full_tensor()
        rank0 = lambda t: t._local_tensors[0] if hasattr(t, "_local_tensors") else t  # noqa: E731
        return rank0(y), rank0(x_lt.grad), rank0(g1).T, rank0(g2).T

    return step, results


def check(name, got, want):
    """``got`` (y, dx, dw1, dw2) against ``want``: (the unsharded step in float64, in float32)."""
    checked(f"{name} against the unsharded step", dict(zip(("y", "dx", "dw1", "dw2"), got)), *want)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1; above 1, read the wall columns)",
    )
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument(
        "--steady-malloc", action="store_true", help="fix glibc malloc's thresholds first (no page faults)"
    )
    args = parser.parse_args()
    if args.steady_malloc:
        steady_malloc()
    torch.set_num_threads(args.threads)
    reps = args.reps or (5 if args.quick else 100)
    warnings.filterwarnings("ignore")

    x, w1, w2, dy = make_inputs()
    grads = lambda step: (step().detach(), x.grad, w1.grad, w2.grad)  # noqa: E731
    unsharded = unsharded_step(x, w1, w2, dy)
    x64, w1_64, w2_64, dy64 = in_float64((x, w1, w2, dy))
    y64 = unsharded_step(x64, w1_64, w2_64, dy64)().detach()
    labels = ("y", "dx", "dw1", "dw2")
    reference = (
        dict(zip(labels, (y64, x64.grad, w1_64.grad, w2_64.grad))),
        dict(zip(labels, grads(unsharded))),
    )
    steps = {"unsharded": unsharded}
    devices = {}  # fd variant -> its number of devices
    for n in (8, 64):
        steps[f"stacked torch, {n}"] = stacked_step(n, x, w1, w2, dy)
        steps[f"folded torch, {n}"] = folded_step(n, x, w1, w2, dy)
        for check_rep in (True, False):
            name = f"fd.shard_map, {n}" + ("" if check_rep else ", check_rep=False")
            steps[name] = fd_step(n, x, w1, w2, dy, check_rep=check_rep)
            devices[name] = n
    for name, step in steps.items():
        check(name, grads(step), reference)
    lt_step, lt_results = local_tensor_step(8, x, w1, w2, dy)
    check("LocalTensor", lt_results(), reference)
    steps["LocalTensor DTensor, 8"] = lt_step

    times = interleaved(steps, reps=reps, warmup=2)
    cpu = {name: median_ms(t.cpu) for name, t in times.items()}
    wall = {name: median_ms(t.wall) for name, t in times.items()}
    rows = []
    for name in steps:
        n = devices.get(name)
        ratio = cpu[name] / cpu["unsharded"]
        rows.append(
            [
                name,
                f"{cpu[name]:.1f}",
                f"{wall[name]:.1f}",
                f"{ratio:.2f}",
                f"{wall[name] / wall['unsharded']:.2f}",
                f"{cpu[name] / cpu[f'folded torch, {n}']:.2f}" if n else "",
                verdict(ratio, TARGETS[n]) if n else "",
            ]
        )
    lt, fd8 = "LocalTensor DTensor, 8", "fd.shard_map, 8"
    print_table(
        f"TP MLP fwd+bwd (batch {BATCH}, dim {DIM}, hidden {HIDDEN}): medians of {reps} interleaved "
        f"reps, {torch.get_num_threads()} thread(s)",
        ["variant", "cpu ms", "wall ms", "/ unsharded", "/ unsharded (wall)", "/ folded", "target"],
        rows,
        caption=f"LocalTensor / fd.shard_map at 8 devices: {cpu[lt] / cpu[fd8]:.1f}x (cpu), "
        f"{wall[lt] / wall[fd8]:.1f}x (wall)",
    )


if __name__ == "__main__":
    main()
