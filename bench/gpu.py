"""GPU benchmarks: the simulated mesh on one CUDA device.

    python bench/gpu.py [--quick] [--parts mlp,compiled,redistribute,train] [--reps N]
    python bench/gpu.py --device cpu --quick --compile-backend aot_eager   # checks the script, no GPU

Three parts, each printing a rich table of medians (CUDA events around every sample, after
warm-ups, the variants interleaved in a shuffled order each repetition; ``--device cpu``
times with ``time.perf_counter``):

* ``mlp`` / ``compiled``: a bf16 tensor-parallel MLP training step, ``y = relu(x @ w1) @ w2``
  with batch 4096, dim 4096, hidden 16384 (``--quick``: the same sizes on CUDA, fewer
  repetitions); w1 split on its columns and w2 on its rows over 8 simulated devices
  (``fd.shard_map`` with ``fd.psum``), the loss ``mean((y - target)^2)`` in float32, its
  backward, and a ``torch.optim.SGD`` step (foreach) on the global weights. Against the same
  step unsharded in plain torch; ``compiled``: both loss functions under
  ``torch.compile(fullgraph=True)`` (``--compile-backend``, default inductor). Targets: the
  simulated step's throughput >= 0.9x the unsharded one's (time ratio <= 1.11); compiled,
  within 1.05x of the compiled unsharded step.
* ``redistribute``: the redistribute catalogue of ``bench/redistribute.py`` (a 2048 x 2048
  float32 value; the 1-D cases on a simulated mesh of 4, the 2-D ones on 2 x 2) on the device,
  each checked against the global value, beside a copy of the global value (``clone``) as a
  yardstick of the memory traffic.
* ``train``: one step of the example transformer (``bench/train_step.py``'s step: forward,
  cross-entropy, backward, clipping, AdamW) on a simulated ``("dp" 2, "tp" 2)`` mesh of the
  device, plans ``tp`` and ``sp+fsdp``, against the unsharded model in plain torch; the first
  step's loss and gradient norm are checked against the unsharded ones.

Without a CUDA device (and without ``--device cpu``) the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _checks import checked, in_float64
from _timing import print_table, verdict

import functional_dtensor as fd

MLP_SIZES = {"full": (4096, 4096, 16384), "cpu": (64, 64, 256)}  # batch, dim, hidden
MLP_DEVICES = 8
MLP_TARGET = 1 / 0.9  # fd / unsharded time: >= 0.9x the throughput
COMPILED_TARGET = 1.05
LR = 1e-4


# --- timing -------------------------------------------------------------------------------------


def sample_ms(step: Callable[[], object], calls: int, cuda: bool) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls: CUDA events on a GPU."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    begin = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - begin) * 1e3 / calls


def interleaved_ms(
    steps: dict[str, Callable[[], object]],
    *,
    reps: int,
    warmup: int,
    cuda: bool,
    calls: int = 1,
    seed: int = 0,
) -> dict[str, float]:
    """The median milliseconds per call of each step, the steps in a fresh shuffled order each
    repetition, after ``warmup`` untimed calls of each."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    if cuda:
        torch.cuda.synchronize()
    order, rng = list(steps), random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            times[name].append(sample_ms(steps[name], calls, cuda))
    return {name: statistics.median(t) for name, t in times.items()}


def same(what: str, got: list[float], want64: list[float], want: list[float], dtype: torch.dtype) -> None:
    """``got`` (values of a ``dtype`` computation) against the float64 one, within a few times the
    error of plain torch's own ``dtype`` computation (``want``): the tests' comparison."""
    print(f"{what}: {', '.join(f'{v:.6g}' for v in got)} vs {', '.join(f'{v:.6g}' for v in want)}")
    low = torch.tensor(want, dtype=dtype)
    checked(what, torch.tensor(got, dtype=dtype), torch.tensor(want64, dtype=torch.float64), low)


# --- (1) the tensor-parallel MLP training step ---------------------------------------------------


def mlp_loss(x, w1, w2, target):
    return (torch.relu(x @ w1) @ w2 - target).float().square().mean()


def tp_mlp_loss(mesh: fd.DeviceMesh):
    """The same loss over ``mesh`` (axis "tp"): w1's columns and w2's rows split, one psum."""

    @fd.shard_map(mesh=mesh, in_specs=(fd.P(), fd.P(None, "tp"), fd.P("tp", None), fd.P()), out_specs=fd.P())
    def per_device(x, w1_cols, w2_rows, target):
        y = fd.psum(torch.relu(x @ w1_cols) @ w2_rows, "tp")
        return (y - target).float().square().mean()

    def loss(x, w1, w2, target):
        return per_device(x, w1, w2, target).full_tensor()

    return loss


def training_step(loss_fn, x, w1, w2, target):
    """``(step, first)``: the step on its own copy of the weights (loss, backward, SGD);
    ``first()`` the loss and the gradients' norms of one step from the initial weights."""
    weights = [w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()]
    opt = torch.optim.SGD(weights, lr=LR, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, *weights, target)
        loss.backward()
        opt.step()
        return loss

    def first():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(x, *weights, target)
        grads = torch.autograd.grad(loss, weights)
        return [loss.item(), *[g.float().norm().item() for g in grads]]

    return step, first


def mlp_main(args, compiled: bool) -> list[list[str]]:
    device, cuda = args.device, args.device == "cuda"
    batch, dim, hidden = MLP_SIZES["full" if cuda else "cpu"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, dim, generator=g).to(device, torch.bfloat16)
    target = torch.randn(batch, dim, generator=g).to(device, torch.bfloat16)
    w1 = (torch.randn(dim, hidden, generator=g) / dim**0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(hidden, dim, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    mesh = fd.simulated_mesh(MLP_DEVICES, "tp", device_type=device)
    losses = {"unsharded": mlp_loss, f"fd.shard_map, {MLP_DEVICES} simulated": tp_mlp_loss(mesh)}
    if compiled:
        losses = {
            f"{name}, compiled": torch.compile(fn, fullgraph=True, backend=args.compile_backend)
            for name, fn in losses.items()
        }
    steps, firsts = {}, {}
    for name, fn in losses.items():
        steps[name], firsts[name] = training_step(fn, x, w1, w2, target)
    base = next(iter(steps))
    want = firsts[base]()
    want64 = training_step(mlp_loss, *in_float64((x, w1, w2, target)))[1]()
    for name in list(steps)[1:]:
        same(f"{name}: first loss and gradient norms", firsts[name](), want64, want, torch.bfloat16)
    reps = args.reps or (5 if args.quick else 30)
    ms = interleaved_ms(steps, reps=reps, warmup=2 if args.quick else 5, cuda=cuda, calls=args.calls)
    flops = 12 * batch * dim * hidden  # two matmuls, forward and backward (3x)
    target_ratio = COMPILED_TARGET if compiled else MLP_TARGET
    rows = []
    for name in steps:
        ratio = ms[name] / ms[base]
        rows.append(
            [
                name,
                f"{ms[name]:.3f}",
                f"{flops / ms[name] / 1e9:.2f}",
                f"{ratio:.3f}",
                f"{1 / ratio:.3f}",
                verdict(ratio, target_ratio) if name != base else "",
            ]
        )
    print_table(
        f"bf16 TP MLP training step{' (compiled, ' + args.compile_backend + ')' if compiled else ''} on "
        f"{device}: batch {batch}, dim {dim}, hidden {hidden}; medians of {reps} interleaved samples of "
        f"{args.calls} step(s)",
        ["variant", "ms per step", "TFLOP/s", "time / unsharded", "throughput x", "target"],
        rows,
    )
    return rows


# --- (2) the redistribute catalogue -------------------------------------------------------------


def redistribute_main(args) -> None:
    from redistribute import CASES_1D, CASES_2D, case_name

    device, cuda = args.device, args.device == "cuda"
    shape = (2048, 2048) if cuda else (128, 128)
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    mesh1 = fd.simulated_mesh(4, "x", device_type=device)
    mesh2 = fd.simulated_mesh((2, 2), ("a", "b"), device_type=device)
    steps, received = {"copy of the global value (clone)": value.clone}, {}
    for mesh, cases in ((mesh1, CASES_1D), (mesh2, CASES_2D)):
        for source, target in cases:
            src = fd.distribute_tensor(value, mesh, source)
            got = fd.redistribute(src, target)
            checked(f"redistribute {source} -> {target}", got.full_tensor(), value, terms=mesh.size)
            name = f"{mesh.shape}: {case_name(src.sharding, got.sharding)}"
            steps[name] = lambda src=src, target=target: fd.redistribute(src, target)
            received[name] = float(fd.explain_redistribute(src, target, show=False).total_bytes) / 2**20
    reps = args.reps or (5 if args.quick else 30)
    ms = interleaved_ms(steps, reps=reps, warmup=2, cuda=cuda, calls=args.calls)
    base = ms["copy of the global value (clone)"]
    rows = [
        [
            name,
            f"{received[name]:.2f}" if name in received else "",
            f"{ms[name]:.3f}",
            f"{ms[name] / base:.2f}",
        ]
        for name in steps
    ]
    print_table(
        f"fd.redistribute on a simulated mesh of {device}, a {shape[0]} x {shape[1]} float32 value: "
        f"medians of {reps} interleaved samples",
        ["case", "MiB received per device", "ms", "/ clone"],
        rows,
        caption="every case checked against the global value first",
    )


# --- (3) the training example's step ---------------------------------------------------------------


def train_main(args) -> None:
    import train_step as ts
    from train_transformer import Config

    device, cuda = args.device, args.device == "cuda"
    if cuda:
        cfg = (
            ts.SIM_CFG
            if args.quick
            else Config(vocab=8192, dim=1024, heads=16, hidden=4096, layers=4, seq=512, batch=16)
        )
    else:
        cfg = Config(vocab=64, dim=32, heads=2, hidden=64, layers=1, seq=16, batch=4)
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"), device_type=device)
    model = ts.make_model(cfg).to(device)
    tokens, targets = (t.to(device) for t in ts.fixed_batch(cfg))
    u_step, _ = ts.unsharded_step(model, tokens, targets)
    want64, want = (t.tolist() for t in ts.first_on_one_device(model, tokens, targets))
    steps = {"unsharded (plain torch)": u_step}
    for variant in ts.VARIANTS:
        f_step, f_first, _ = ts.fd_step(model, mesh, variant, tokens, targets)
        same(f"fd {variant}: first loss, gradient norm", list(f_first()), want64, want, torch.float32)
        steps[f"fd {variant}, simulated 2x2"] = f_step
    reps = args.reps or (3 if args.quick else 20)
    ms = interleaved_ms(steps, reps=reps, warmup=2, cuda=cuda, calls=args.calls)
    base = "unsharded (plain torch)"
    rows = [
        [name, f"{ms[name]:.2f}", f"{ms[name] / ms[base]:.2f}", verdict(ms[name] / ms[base], ts.SIM_TARGET)]
        for name in steps
    ]
    rows[0][-1] = ""
    print_table(
        f"the example's training step on a simulated dp 2 x tp 2 mesh of {device} ({ts.describe(cfg)}): "
        f"medians of {reps} interleaved samples",
        ["variant", "ms per step", "/ unsharded", "target"],
        rows,
    )


PARTS = {
    "mlp": lambda args: mlp_main(args, compiled=False),
    "compiled": lambda args: mlp_main(args, compiled=True),
    "redistribute": redistribute_main,
    "train": train_main,
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smaller models)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--calls", type=int, default=1, help="back-to-back steps per sample")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument("--compile-backend", default="inductor")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}: choose among {list(PARTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/gpu.py needs a CUDA device, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Run it on a GPU machine, or check the script on the CPU "
            "with small sizes: python bench/gpu.py --device cpu --quick --compile-backend aot_eager",
            file=sys.stderr,
        )
        raise SystemExit(2)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}; TF32 matmul: {torch.backends.cuda.matmul.allow_tf32}"
        )
    else:
        torch.set_num_threads(1)
        print(f"CPU check run (small sizes, 1 thread); torch {torch.__version__}")
    for part in parts:
        PARTS[part](args)


if __name__ == "__main__":
    main()
