"""The tensor-parallel MLP as ``fd.shard_map`` on the simulated mesh and as JAX's ``shard_map``
on forced host devices, each beside its own unsharded program, on the same CPU.

    python bench/jax_mlp.py [--quick] [--reps N] [--no-compile]
    python bench/jax_mlp.py --host       # where the eager torch steps' time goes, not timed
    pip install -e '.[bench]'    # JAX; without it the JAX variants are skipped

One step is the loss and its gradients with respect to w1 and w2 of the Megatron MLP
``loss = mean((relu(x @ w1) @ w2) ** 2)``: x ``(64, 512)`` replicated, w1 ``(512, 2048)`` split
on its columns and w2 ``(2048, 512)`` on its rows over the 8 devices of one axis ``"tp"``, a
psum before the loss. The per-device function returns the loss (the same on every device).

Variants, interleaved in one loop in one process:

* ``torch, unsharded``: the same math in plain torch, ``torch.autograd.grad``: the denominator
  of ``fd.shard_map``'s ratio.
* ``fd.shard_map, 8``: ``fd.shard_map`` over ``fd.simulated_mesh(8, "tp")`` with specs
  ``(P(), P(None, "tp"), P("tp", None)) -> P()`` and ``fd.psum``, called on the global tensors,
  ``torch.autograd.grad`` through it (the gradients come back as global tensors).
* ``torch.compile, unsharded`` and ``torch.compile(fd.shard_map), 8``: the two torch steps with
  their loss function compiled by ``torch.compile`` (inductor; the backward compiled with it),
  as ``jax.jit`` compiles JAX's. Compiled first, before timing (``--no-compile`` leaves them
  out).
* ``jax.jit, unsharded``: ``jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))`` on one host
  device: the denominator of JAX's ratio.
* ``jax.jit(shard_map), 8``: ``jax.jit`` of ``jax.value_and_grad`` of ``jax.shard_map`` of the
  per-device MLP (``jax.lax.psum``), on a ``Mesh`` of 8 host devices forced by
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the arguments are placed with their
  ``NamedSharding``s once, before timing. JAX's calls end with ``jax.block_until_ready``.

torch runs one thread (``torch.set_num_threads(1)``), XLA single-threaded Eigen ops
(``--xla_cpu_multi_thread_eigen=false``, set before JAX is imported). Ratios are of CPU-time
medians (the work done, every thread of the process counted), wall-clock beside them. Before
timing, every variant's loss and gradients are checked against a float64 torch reference,
within a few times the float32 error of its own unsharded program (``_checks.py``; each
unsharded program within a few times plain torch's). glibc malloc's thresholds are fixed
first (``steady_malloc``), so that no variant page-faults its buffers back in on every call.

``--host`` leaves the ratios out: it splits each eager torch step (``torch, unsharded``,
``stacked torch, 8``: the per-device math written by hand on the stacked shards, the kernels
``fd.shard_map`` runs, and ``fd.shard_map, 8``) into its kernels (the time ``torch.profiler``
finds inside aten ops) and the host's work around them (Python, the autograd engine's
bookkeeping), at the benchmark's size and at a toy size (batch 8, dim 8, hidden 16) where the
kernels take almost nothing. A second table times the same steps' forward (the loss) and
backward (``torch.autograd.grad``) apart, by the thread's CPU time with no profiler
(``_timing.phase_split``). Medians over interleaved reps, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import warnings

# 8 host devices; XLA's Eigen ops single-threaded. ``intra_op_parallelism_threads`` is not an
# XLA flag (XLA_FLAGS aborts on ``--intra_op_parallelism_threads=1``); XLA's own thread pool may
# still run ops at once, which the CPU time counts
XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_FLAGS}".strip()  # before jax is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _checks import checked, in_float64  # noqa: E402
from _timing import host_split, interleaved, median_ms, phase_split, print_table, steady_malloc  # noqa: E402

import functional_dtensor as fd  # noqa: E402

try:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as JP
except ImportError:  # the bench extra is not installed
    jax = None

BATCH, DIM, HIDDEN, DEVICES = 64, 512, 2048, 8
LABELS = ("loss", "dw1", "dw2")


def make_inputs(batch: int = BATCH, dim: int = DIM, hidden: int = HIDDEN):
    torch.manual_seed(0)
    x = torch.randn(batch, dim)
    w1 = (torch.randn(dim, hidden) / dim**0.5).requires_grad_()
    w2 = (torch.randn(hidden, dim) / hidden**0.5).requires_grad_()
    return x, w1, w2


def unsharded_loss(x, w1, w2):
    return ((torch.relu(x @ w1) @ w2) ** 2).mean()


def stacked_loss(x, w1, w2):
    """The per-device math by hand on the stacked shards: ``x`` times every device's columns of
    ``w1`` in one product, each device's block of it times its rows of ``w2`` (one ``bmm``),
    the devices' products summed (the psum)."""
    batch, hidden = x.shape[0], w1.shape[1]
    h = (x @ w1).view(batch, DEVICES, hidden // DEVICES).transpose(0, 1)  # (devices, batch, block)
    y = (torch.relu(h) @ w2.view(DEVICES, hidden // DEVICES, -1)).sum(0)
    return (y**2).mean()


def _step(loss_of, x, w1, w2):
    """A zero-argument step: the loss and its gradients with respect to w1 and w2."""

    def step():
        loss = loss_of(x, w1, w2)
        return (loss, *torch.autograd.grad(loss, (w1, w2)))

    return step


def torch_unsharded(x, w1, w2):
    return _step(unsharded_loss, x, w1, w2)


def torch_stacked(x, w1, w2):
    return _step(stacked_loss, x, w1, w2)


def print_host_split(reps: int) -> None:
    rows = []
    for size in ((BATCH, DIM, HIDDEN), (8, 8, 16)):
        x, w1, w2 = make_inputs(*size)
        steps = {
            "torch, unsharded": torch_unsharded(x, w1, w2),
            "stacked torch, 8": torch_stacked(x, w1, w2),
            "fd.shard_map, 8": fd_sharded(x, w1, w2),
        }
        reference = dict(zip(LABELS, torch_unsharded(*in_float64((x, w1, w2)))()))
        torch_f32 = dict(zip(LABELS, (t.detach() for t in steps["torch, unsharded"]())))
        for name in ("stacked torch, 8", "fd.shard_map, 8"):
            got = dict(zip(LABELS, (t.detach() for t in steps[name]())))
            checked(f"{name} against the torch unsharded step", got, reference, torch_f32)
        for name, (total, kernels, host) in host_split(steps, reps).items():
            rows.append(["x".join(map(str, size)), name, f"{total:.0f}", f"{kernels:.0f}", f"{host:.0f}"])
    print_table(
        f"Where the eager steps' time goes (torch.profiler, medians of {reps} interleaved reps, us)",
        ["batch x dim x hidden", "variant", "step", "in aten ops", "host, around them"],
        rows,
    )
    rows = []
    for size in ((BATCH, DIM, HIDDEN), (8, 8, 16)):
        x, w1, w2 = make_inputs(*size)
        losses = {
            "torch, unsharded": unsharded_loss,
            "stacked torch, 8": stacked_loss,
            "fd.shard_map, 8": fd_loss(),
        }
        for name, (forward, backward) in phase_split(losses, (x, w1, w2), (w1, w2), reps).items():
            rows.append(["x".join(map(str, size)), name, f"{forward:.0f}", f"{backward:.0f}"])
    print_table(
        f"The same steps' forward (the loss) and backward (torch.autograd.grad) apart: thread CPU "
        f"time, no profiler, medians of {reps} interleaved reps, us",
        ["batch x dim x hidden", "variant", "forward", "backward"],
        rows,
    )


def torch_compiled(x, w1, w2):
    return _step(torch.compile(unsharded_loss), x, w1, w2)


def fd_loss():
    mesh = fd.simulated_mesh(DEVICES, "tp")

    @fd.shard_map(mesh=mesh, in_specs=(fd.P(), fd.P(None, "tp"), fd.P("tp", None)), out_specs=fd.P())
    def mlp_loss(x, w1_cols, w2_rows):
        y = fd.psum(torch.relu(x @ w1_cols) @ w2_rows, "tp")
        return (y**2).mean()

    return lambda x, w1, w2: mlp_loss(x, w1, w2).full_tensor()


def fd_sharded(x, w1, w2, *, compiled: bool = False):
    return _step(torch.compile(fd_loss()) if compiled else fd_loss(), x, w1, w2)


def jax_steps(x, w1, w2):
    """(unsharded step, shard_map step): zero-argument calls that return (loss, dw1, dw2),
    finished (``block_until_ready``)."""
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # JAX before 0.7
        from jax.experimental.shard_map import shard_map

    def loss(x, w1, w2):
        return jnp.mean((jax.nn.relu(x @ w1) @ w2) ** 2)

    def local_loss(x, w1_cols, w2_rows):
        y = jax.lax.psum(jax.nn.relu(x @ w1_cols) @ w2_rows, "tp")
        return jnp.mean(y**2)

    devices = jax.devices()
    if len(devices) < DEVICES:
        raise SystemExit(f"JAX sees {len(devices)} devices, not {DEVICES}: XLA_FLAGS was set too late")
    mesh = Mesh(np.array(devices[:DEVICES]), ("tp",))
    specs = (JP(), JP(None, "tp"), JP("tp", None))
    sharded_loss = shard_map(local_loss, mesh=mesh, in_specs=specs, out_specs=JP())
    grad_args = lambda f: jax.jit(jax.value_and_grad(f, argnums=(1, 2)))  # noqa: E731
    unsharded, sharded = grad_args(loss), grad_args(sharded_loss)

    values = [jnp.asarray(t.detach().numpy()) for t in (x, w1, w2)]
    on_one = [jax.device_put(v, devices[0]) for v in values]
    on_mesh = [jax.device_put(v, NamedSharding(mesh, spec)) for v, spec in zip(values, specs)]

    def call(f, args):
        def step():
            loss, (dw1, dw2) = jax.block_until_ready(f(*args))
            return loss, dw1, dw2

        return step

    return call(unsharded, on_one), call(sharded, on_mesh)


def as_torch(result):
    return dict(zip(LABELS, (torch.from_numpy(np.asarray(t)) for t in result)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variants")
    parser.add_argument("--host", action="store_true", help="the eager steps' kernels and host work apart")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steady_malloc()
    reps = args.reps or (10 if args.quick else 100)
    warnings.filterwarnings("ignore")
    if args.host:
        print_host_split(min(reps, 40))
        return

    x, w1, w2 = make_inputs()
    reference = dict(zip(LABELS, torch_unsharded(*in_float64((x, w1, w2)))()))
    result = lambda step: dict(zip(LABELS, (t.detach() for t in step())))  # noqa: E731
    steps = {"torch, unsharded": torch_unsharded(x, w1, w2)}
    torch_f32 = result(steps["torch, unsharded"])
    steps["fd.shard_map, 8"] = fd_sharded(x, w1, w2)
    got = result(steps["fd.shard_map, 8"])
    checked("fd.shard_map against the torch unsharded step", got, reference, torch_f32)
    if not args.no_compile:
        steps["torch.compile, unsharded"] = torch_compiled(x, w1, w2)
        compiled_f32 = result(steps["torch.compile, unsharded"])
        checked("torch.compile unsharded against torch unsharded", compiled_f32, reference, torch_f32)
        steps["torch.compile(fd.shard_map), 8"] = fd_sharded(x, w1, w2, compiled=True)
        got = result(steps["torch.compile(fd.shard_map), 8"])
        checked("torch.compile(fd.shard_map) against torch.compile unsharded", got, reference, compiled_f32)
    if jax is None:
        print("JAX is not installed: the JAX variants are skipped (pip install -e '.[bench]')")
    else:
        steps["jax.jit, unsharded"], steps["jax.jit(shard_map), 8"] = jax_steps(x, w1, w2)
        jax_f32 = as_torch(steps["jax.jit, unsharded"]())
        checked("jax.jit unsharded against the torch unsharded step", jax_f32, reference, torch_f32)
        got = as_torch(steps["jax.jit(shard_map), 8"]())
        checked("jax.jit(shard_map) against the jax.jit unsharded step", got, reference, jax_f32)

    times = interleaved(steps, reps=reps, warmup=3)
    cpu = {name: median_ms(t.cpu) for name, t in times.items()}
    wall = {name: median_ms(t.wall) for name, t in times.items()}
    denominator = {
        "torch, unsharded": "torch, unsharded",
        "fd.shard_map, 8": "torch, unsharded",
        "torch.compile, unsharded": "torch.compile, unsharded",
        "torch.compile(fd.shard_map), 8": "torch.compile, unsharded",
        "jax.jit, unsharded": "jax.jit, unsharded",
        "jax.jit(shard_map), 8": "jax.jit, unsharded",
    }
    rows = [
        [
            name,
            f"{cpu[name]:.2f}",
            f"{wall[name]:.2f}",
            f"{cpu[name] / cpu[denominator[name]]:.2f}",
            f"{wall[name] / wall[denominator[name]]:.2f}",
            "" if name.startswith("jax") else f"{cpu[name] / cpu['torch, unsharded']:.2f}",
        ]
        for name in steps
    ]
    caption = f"fd.shard_map / torch unsharded: {cpu['fd.shard_map, 8'] / cpu['torch, unsharded']:.2f}x (cpu)"
    if not args.no_compile:
        compiled = cpu["torch.compile(fd.shard_map), 8"]
        caption += (
            f"; torch.compile(fd.shard_map) / torch.compile unsharded: "
            f"{compiled / cpu['torch.compile, unsharded']:.2f}x, / eager torch unsharded: "
            f"{compiled / cpu['torch, unsharded']:.2f}x (cpu)"
        )
    if jax is not None:
        ratio = cpu["jax.jit(shard_map), 8"] / cpu["jax.jit, unsharded"]
        caption += f"; jax.jit(shard_map) / jax.jit unsharded: {ratio:.2f}x (cpu); jax {jax.__version__}"
    print_table(
        f"TP MLP loss and gradients (batch {BATCH}, dim {DIM}, hidden {HIDDEN}, {DEVICES} devices): "
        f"medians of {reps} interleaved reps, 1 torch thread",
        ["variant", "cpu ms", "wall ms", "/ own unsharded", "/ own unsharded (wall)", "/ torch unsharded"],
        rows,
        caption=caption,
    )


if __name__ == "__main__":
    main()
