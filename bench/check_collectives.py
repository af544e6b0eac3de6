"""The cost of the collective checks: median eager time of ``fd.psum`` in ``shard_map`` and of
the kernel's all-reduce alone, with ``fd.check_collectives`` off and on, alternating in blocks.

    torchrun --standalone --nproc-per-node 2 bench/check_collectives.py [--quick]
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch

import functional_dtensor as fd
from functional_dtensor._distributed import kernels


def main() -> None:
    quick = "--quick" in sys.argv
    torch.set_num_threads(1)
    mesh = fd.init_device_mesh("cpu", (2,), ("x",))
    f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())
    x = fd.distribute_tensor(torch.ones(8), mesh, fd.P("x"))
    local = x.to_local()
    cases = {
        "psum in shard_map": lambda: f(x),
        "kernel all_reduce": lambda: kernels.all_reduce(local, mesh, ("x",)),
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(3 if quick else 10):
        for mode in ("off", "on"):  # every rank in the same order: the checks must agree
            with fd.check_collectives() if mode == "on" else contextlib.nullcontext():
                for name, fn in cases.items():
                    for _ in range(20):
                        fn()
                    for _ in range(100 if quick else 300):
                        start = time.perf_counter()
                        fn()
                        times.setdefault((name, mode), []).append(time.perf_counter() - start)
    if int(os.environ.get("RANK", 0)) == 0:
        for name in cases:
            off, on = (statistics.median(times[name, m]) * 1e6 for m in ("off", "on"))
            print(f"{name:20s} checks off {off:8.1f} us   on {on:8.1f} us   ({on / off:.1f}x)")


if __name__ == "__main__":
    main()
