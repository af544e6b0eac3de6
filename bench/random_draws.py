"""Throughput of ``fd.random`` draws against ``torch.randn`` / ``torch.rand``.

    python bench/random_draws.py [--quick]

2**24 float32 elements: drawn on one device (a local draw), and as an ``fd.DTensor`` of shape
(4096, 4096) over 8 simulated devices, split by rows (``P("x")``: each device's shard is one
run of indices) and by columns (``P(None, "x")``: 4096 runs of 512 per device). The fused CPU
kernel runs on torch's intra-op threads, so each table is measured at one thread and at
torch's default count. The tensor-op path (what runs under ``torch.compile``, inside the
simulated mesh's vmap, on CUDA, and without a C compiler) is measured on 2**20 elements and
reported as elements per second beside the rest. Target: >= 0.5x ``torch.randn``'s
throughput, sharded or not.
"""

from __future__ import annotations

import argparse

import torch
from _timing import interleaved, median_ms, print_table

import functional_dtensor as fd
from functional_dtensor import _philox_native

N = 1 << 24
SMALL = 1 << 20
TARGET = 0.5


def tensor_ops(draw):
    """``draw`` with the fused kernel switched off: the tensor-op path."""

    def run():
        saved, _philox_native._library = _philox_native._library, False
        try:
            return draw()
        finally:
            _philox_native._library = saved

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reps, warmup = (5, 1) if args.quick else (15, 2)
    key = fd.random.key(0)
    mesh = fd.simulated_mesh((8,), ("x",))
    if not _philox_native.available():
        print("no C compiler: fd.random uses the tensor ops only")
    steps = {
        "torch.randn": (N, lambda: torch.randn(N)),
        "torch.rand": (N, lambda: torch.rand(N)),
        "fd.random.normal, 1 device": (N, lambda: fd.random.normal(key, (N,))),
        "fd.random.uniform, 1 device": (N, lambda: fd.random.uniform(key, (N,))),
        "fd.random.normal, 8 devices P('x')": (
            N,
            lambda: fd.random.normal(key, (4096, 4096), mesh=mesh, placements=fd.P("x")),
        ),
        "fd.random.normal, 8 devices P(None, 'x')": (
            N,
            lambda: fd.random.normal(key, (4096, 4096), mesh=mesh, placements=fd.P(None, "x")),
        ),
        "fd.randn, 8 devices P('x')": (
            N,
            lambda: fd.randn(4096, 4096, mesh=mesh, placements=fd.P("x"), key=key),
        ),
        "tensor ops: fd.random.normal, 1 device": (
            SMALL,
            tensor_ops(lambda: fd.random.normal(key, (SMALL,))),
        ),
    }
    default = torch.get_num_threads()
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        times = interleaved({name: step for name, (_, step) in steps.items()}, reps=reps, warmup=warmup)
        rate = {name: steps[name][0] / (median_ms(times[name].wall) / 1e3) for name in steps}
        reference = rate["torch.randn"]
        rows = []
        for name in steps:
            ratio = rate[name] / reference
            mark = "" if not name.startswith("fd") else ("  ok" if ratio >= TARGET else "  < 0.5x")
            rows.append(
                [name, f"{median_ms(times[name].wall):.1f}", f"{rate[name] / 1e6:.0f}", f"{ratio:.2f}{mark}"]
            )
        print_table(
            f"2**24 float32 draws, {threads} thread(s), medians of {reps} (wall clock)",
            ["variant", "ms", "M elements/s", "x torch.randn"],
            rows,
            caption=f"target: fd draws >= {TARGET}x torch.randn's throughput",
        )
    torch.set_num_threads(default)


if __name__ == "__main__":
    main()
