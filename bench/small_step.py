"""Small training steps on the simulated mesh against the same step on one device: where the
kernels are tiny and the Python around them is the cost.

    python bench/small_step.py [--quick] [--reps N] [--profile] [--host] [--steady-malloc]

Two steps, each on ``fd.simulated_mesh((2, 2), ("dp", "tp"))`` in one process, one torch thread,
beside the same step on one device in plain torch (``torch.optim.AdamW``):

* ``mlp``: a 2-layer MLP (``Linear(256, 1024)``, GELU, ``Linear(1024, 256)``), batch 64, mean
  squared error; ``ColwiseParallel`` / ``RowwiseParallel`` over "tp", ``ReplicateParallel`` over
  "dp" (the batch split over "dp"); forward, ``torch.autograd.grad``, ``fd.Optimizer(AdamW)``
  (lr 1e-3).
* ``example``: ``examples/train_transformer.py``'s own tiny step (its default ``Config``, the
  ``tp`` plan, cross-entropy, clipping by the global norm 1.0, AdamW), as ``bench/train_step.py``
  runs it at a larger size.

Before timing, each pair's first step is checked: the same loss (and, for the example, gradient
norm). Printed: CPU-time medians of interleaved repetitions and fd / one device, against the
targets (mlp <= 1.5, example <= 2). ``--profile`` prints a cProfile of the two fd steps instead
(functions by own time); ``--host`` splits every step, by ``torch.profiler``, into the time
inside aten ops and the host's work around them (``_timing.host_split``). ``--steady-malloc``
fixes glibc malloc's thresholds first (``_timing.steady_malloc``): with the defaults, the
simulated MLP step page-faults several hundred times per step (its memory rises and falls past
the moving trim threshold), one device's none.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from _checks import checked
from _timing import host_split, interleaved, median_ms, print_table, steady_malloc, verdict
from torch import nn

import functional_dtensor as fd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_step  # noqa: E402
from train_transformer import Config  # noqa: E402

TARGETS = {"mlp": 1.5, "example": 2.0}
LR = 1e-3


def mlp_steps(mesh):
    """``(one device, fd)``: zero-argument steps of the MLP, parameters carried over; each
    returns its loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)

    single = copy.deepcopy(model)
    single_opt = torch.optim.AdamW(single.parameters(), lr=LR)

    def one_device():
        single_opt.zero_grad(set_to_none=True)
        loss = ((single(x) - y) ** 2).mean()
        loss.backward()
        single_opt.step()
        return loss

    plan = {"0": fd.ColwiseParallel(), "2": fd.RowwiseParallel(), "": fd.ReplicateParallel("dp")}
    sharded = fd.parallelize_module(model, mesh, plan)
    state = {"params": sharded.params, "opt": fd.Optimizer(torch.optim.AdamW, sharded.params, lr=LR)}
    x_d, y_d = (fd.distribute_tensor(t, mesh, fd.P("dp")) for t in (x, y))

    def on_mesh():
        params = state["params"]
        loss = ((sharded.apply(params, x_d) - y_d) ** 2).mean()
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        state["params"] = state["opt"].step(params, grads)
        return loss.full_tensor()

    return one_device, on_mesh


def example_steps(mesh):
    """``(one device, fd, first losses and norms)`` of the example's tiny step."""
    cfg = Config()
    model = train_step.make_model(cfg)
    tokens, targets = train_step.fixed_batch(cfg)
    one_device, first_one = train_step.unsharded_step(model, tokens, targets)
    on_mesh, first_mesh, _ = train_step.fd_step(model, mesh, "tp", tokens, targets)
    return one_device, on_mesh, (first_one, first_mesh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile the fd steps instead")
    parser.add_argument("--host", action="store_true", help="each step's aten time and host work apart")
    parser.add_argument(
        "--steady-malloc", action="store_true", help="fix glibc malloc's thresholds first (no page faults)"
    )
    args = parser.parse_args()
    if args.steady_malloc:
        steady_malloc()
    torch.set_num_threads(1)
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))

    mlp_one, mlp_fd = mlp_steps(mesh)
    checked("mlp: the first loss on the mesh", mlp_fd(), mlp_one().detach())
    ex_one, ex_fd, (first_one, first_mesh) = example_steps(mesh)
    want, got = torch.tensor(first_one()), torch.tensor(first_mesh())
    checked("example: the first loss and gradient norm on the mesh", got, want)
    print("first steps: the same loss on the mesh as on one device (and gradient norm, example)")
    steps = {"mlp, one device": mlp_one, "mlp, fd 2x2": mlp_fd, "example, one device": ex_one}
    steps["example, fd 2x2"] = ex_fd

    if args.profile:
        import cProfile
        import pstats

        for name in ("mlp, fd 2x2", "example, fd 2x2"):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                steps[name]()
            profiler.disable()
            print(f"--- {name}: 20 steps, functions by own time ---")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return

    reps = args.reps or (15 if args.quick else 100)
    if args.host:
        reps = min(reps, 40)
        rows = [[name, *[f"{us:.0f}" for us in split]] for name, split in host_split(steps, reps).items()]
        print_table(
            f"Where the steps' time goes (torch.profiler, medians of {reps} interleaved reps, us)",
            ["step", "whole step", "in aten ops", "host, around them"],
            rows,
        )
        return
    times = interleaved(steps, reps=reps, warmup=3)
    cpu = {name: median_ms(t.cpu) for name, t in times.items()}
    rows = []
    for which in ("mlp", "example"):
        one, sharded = cpu[f"{which}, one device"], cpu[f"{which}, fd 2x2"]
        ratio = sharded / one
        rows.append([which, f"{one:.2f}", f"{sharded:.2f}", f"{ratio:.2f}", verdict(ratio, TARGETS[which])])
    print_table(
        f"small training steps, simulated mesh dp 2 x tp 2 vs one device: CPU-time medians of {reps} "
        "interleaved reps, 1 thread",
        ["step", "one device ms", "fd ms", "fd / one device", "target"],
        rows,
    )


if __name__ == "__main__":
    main()
