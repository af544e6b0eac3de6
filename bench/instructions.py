"""Instructions per call, counted by valgrind: a figure that a loaded machine does not move.

    python bench/instructions.py [identity|add|floors|mlp|example|tp-mlp ...] [--calls N]

On a shared machine, times of a few microseconds move by 2x from one minute to the next; the
number of instructions a call executes does not. Each workload runs warm (its caches filled),
then ``N`` more times inside one ``functools.reduce`` call, under valgrind's callgrind with
counting switched on only inside that C function (``--toggle-collect=functools_reduce``): the
count covers those calls and nothing else (not the start-up, not the warm-up). Printed: the
instructions per call. Each workload is a process of its own under valgrind (a few minutes
each: importing torch under valgrind is most of it).

* ``identity``: a warm ``fd.shard_map`` call of the identity over one ``fd.DTensor`` argument on
  8 simulated devices (what a property test pays per example);
* ``add``: an add inside ``shard_map`` (``check_rep`` on): the difference between calls of 50
  adds and of none, per add;
* ``floors``: the same add counted the same way as plain torch runs it on one 4-element tensor,
  under functorch's vmap primitives over 8 devices, and under them with an empty Python
  torch-function mode (``tiny_op.py``'s floors): what any simulation by a device vmap with a
  Python mode pays per op before any work of its own;
* ``mlp``, ``example``: one step of ``bench/small_step.py``'s MLP and example steps, fd's and
  one device's (plain torch's, the same step's denominator);
* ``tp-mlp``: one step of ``bench/jax_mlp.py``'s tensor-parallel MLP at a toy size (batch 8, dim
  8, hidden 16: the kernels next to nothing), as plain torch runs it unsharded, as the stacked
  per-device math written by hand, and as ``fd.shard_map`` on 8 simulated devices: the host
  work a call of each costs, which the benchmark's size adds to kernels equal to the stacked
  step's.

To compare two versions of the package, run the script with each first on ``sys.path`` (for
example ``PYTHONPATH=/path/to/other/checkout``). Needs ``valgrind`` on the PATH.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

WORKLOADS = ("identity", "add", "floors", "mlp", "example", "tp-mlp")
FLOORS = {"plain torch": "plain", "vmap primitives": "vmap", "vmap + empty mode": "mode"}
ADDS = 50  # adds per call of the ``add`` workload
DEFAULT_CALLS = {"identity": 300, "add": 20, "floors": 20, "mlp": 3, "example": 5, "tp-mlp": 20}
#: the steps each of the workloads that count several compares: name -> the child's workload
STEPS = {
    "mlp": {"one device": "mlp/one", "fd": "mlp"},
    "example": {"one device": "example/one", "fd": "example"},
    "tp-mlp": {
        "torch, unsharded": "tp/unsharded",
        "stacked torch, 8": "tp/stacked",
        "fd.shard_map, 8": "tp/fd",
    },
}


def _call(workload: str, adds: int):
    """A zero-argument call of ``workload``, warm."""
    import torch

    import functional_dtensor as fd

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if workload in FLOORS.values():
        import tiny_op

        body = tiny_op.adds(adds)
        if workload == "plain":
            call = tiny_op.plain(body, torch.zeros(tiny_op.LOCAL))
        else:
            call = tiny_op.vmap_floor(body, 8, with_mode=workload == "mode")
    elif workload in ("identity", "add"):
        mesh = fd.simulated_mesh(8, "x")

        def body(x):
            for _ in range(adds):
                x = x + 1
            return x

        f = fd.shard_map(body, mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x"))
        x = fd.distribute_tensor(torch.zeros(8 * 4), mesh, fd.P("x"))
        call = lambda: f(x)  # noqa: E731
    elif workload.startswith("tp/"):
        import jax_mlp

        x, w1, w2 = jax_mlp.make_inputs(8, 8, 16)
        steps = {
            "unsharded": jax_mlp.torch_unsharded,
            "stacked": jax_mlp.torch_stacked,
            "fd": jax_mlp.fd_sharded,
        }
        call = steps[workload.removeprefix("tp/")](x, w1, w2)
    else:
        import small_step

        mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
        which, _, one = workload.partition("/")
        if which == "mlp":
            one_device, call = small_step.mlp_steps(mesh)
        else:
            one_device, call, _ = small_step.example_steps(mesh)
        call = one_device if one else call
    for _ in range(3 if workload.split("/")[0] in ("mlp", "example") else 20):
        call()
    return call


def _counted(workload: str, calls: int, adds: int) -> int:
    """The instructions of ``calls`` warm calls, by callgrind in a child process."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--toggle-collect=functools_reduce",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--run",
        workload,
        "--calls",
        str(calls),
        "--adds",
        str(adds),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or not found:
        raise SystemExit(f"valgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", default=["identity", "add"], help=", ".join(WORKLOADS))
    parser.add_argument("--calls", type=int, default=None, help="counted calls (default per workload)")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # the child under valgrind
    parser.add_argument("--adds", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run is not None:
        call = _call(args.run, args.adds)
        functools.reduce(lambda _, __: call(), range(args.calls), None)
        return
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    if shutil.which("valgrind") is None:
        raise SystemExit("bench/instructions.py needs valgrind (apt install valgrind)")
    for workload in args.workloads:
        calls = args.calls or DEFAULT_CALLS[workload]
        if workload == "add":
            per = (_counted("add", calls, ADDS) - _counted("add", calls, 0)) / (calls * ADDS)
            print(f"add inside shard_map (check_rep): {per:,.0f} instructions per add")
        elif workload == "floors":
            for name, floor in FLOORS.items():
                per = (_counted(floor, calls, ADDS) - _counted(floor, calls, 0)) / (calls * ADDS)
                print(f"add, floor: {name}: {per:,.0f} instructions per add")
        elif workload in STEPS:
            counts = {name: _counted(child, calls, 0) / calls for name, child in STEPS[workload].items()}
            first = next(iter(counts.values()))
            for name, per in counts.items():
                print(
                    f"{workload}, {name}: {per:,.0f} instructions per step ({per / first:.2f} of the first)"
                )
        else:
            per = _counted(workload, calls, 0) / calls
            print(f"{workload}: {per:,.0f} instructions per call")


if __name__ == "__main__":
    main()
