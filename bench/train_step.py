"""A 2-D ("dp" 2 x "tp" 2) training step of the example's transformer: fd against torch.

    torchrun --standalone --nproc-per-node 4 bench/train_step.py [--quick]   # (1) gloo
    python bench/train_step.py [--quick] [--profile] [--steady-malloc] [--compile] [--bytes]  # (2) simulated

One step is forward, cross-entropy loss, backward, gradient clipping by the global norm (1.0)
and an AdamW step (lr 1e-3), on a fixed batch, the parameters carried from step to step.

(1) On 4 gloo ranks (a 2 x 2 mesh, one torch thread per rank), per plan variant:

* ``fd``: ``fd.parallelize_module(model, mesh, plan_for(variant))`` with the example's plans
  (``tp``: Megatron tensor parallel over "tp", the batch over "dp", parameters replicated
  over "dp"; ``sp+fsdp``: plus sequence parallelism and the parameters sharded over "dp"),
  ``fd.Optimizer(torch.optim.AdamW)``, ``fd.clip_grad_norm``, ``torch.autograd.grad``. Every
  rank holds the fixed batch and takes its rows (``fd.distribute_tensor(...,
  src_data_rank=None)``: no broadcast from rank 0), as torch's step slices its rows.
* ``torch DTensor``: torch's ``parallelize_module`` on ``mesh["tp"]`` with the same styles
  (ColwiseParallel / RowwiseParallel, SequenceParallel and PrepareModuleInput for ``sp``), the
  logits sharded over the vocabulary and the loss under ``loss_parallel()``; then over
  ``mesh["dp"]``, per block and on the root, ``fully_shard`` (``sp+fsdp``) or FSDP2's
  ``replicate`` (``tp``: parameters replicated over "dp", gradients all-reduced);
  ``torch.optim.AdamW`` (its default, single-tensor on CPU), and torch's clipping pieces
  (``torch.nn.utils.get_total_norm`` per mesh, then ``clip_grads_with_norm_``: FSDP leaves
  the parameters tensor parallel did not touch on the 1-D "dp" mesh, the others on the 2-D
  one, and ``clip_grad_norm_`` refuses norms on two meshes).
  Torch's tensor parallel runs the module's code on local shards, so each attention module is
  given its local head count (``heads / tp``) and a forward that reshapes with ``-1`` (the
  same math, as torch's Llama TP tutorial does); with sequence parallelism the positional
  embedding is made a replicated DTensor on "tp" so that it adds to the sequence-sharded
  embedding output, and the residual stream stays a DTensor (``use_local_output=False``).

Before timing, each pair's first step is checked: the same loss and the same global gradient
norm (before clipping), within 1e-4 relative. Printed: medians per step (rank 0, and the
slowest rank's median), fd / torch DTensor, per-rank bytes of parameters and AdamW state
against the unsharded model, and the collectives of one step of each library (fd's
``fd.CommDebugMode``; torch's ``torch.distributed.tensor.debug.CommDebugMode``).

(2) On ``fd.simulated_mesh((2, 2), ("dp", "tp"))`` in one process, one thread: the fd step of
both plans against the same step of the unsharded model in plain torch (``torch.optim.AdamW``,
``clip_grad_norm_``), on a larger model (more compute per op). ``--profile`` prints a cProfile
of fd's ``tp`` step instead of timing; ``--steady-malloc`` fixes glibc malloc's thresholds
first (``_timing.steady_malloc``: no buffer page-faulted back in on every step);
``--bytes`` counts the bytes the ops of one step write instead of timing (every op's outputs
and what it changes in place; a figure this machine's load does not move); ``--compile``
compiles the forward and loss of every step (``torch.compile(fullgraph=True)``,
inductor; the gradients, clipping and AdamW eager) and adds the unsharded step compiled so, the
eager unsharded step staying the reference of the ratios (a few minutes of compiling first).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import types
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from _checks import checked, in_float64
from _timing import interleaved, median_ms, print_table, steady_malloc, verdict
from torch.utils._python_dispatch import TorchDispatchMode

import functional_dtensor as fd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_transformer import Config, Transformer, loss_of, plan_for  # noqa: E402

#: gloo: compute per op not negligible, a step well under a second on the 2-core box
GLOO_CFG = Config(vocab=512, dim=256, heads=4, hidden=1024, layers=2, seq=64, batch=16)
#: simulated: more compute per op
SIM_CFG = Config(vocab=1024, dim=512, heads=8, hidden=2048, layers=2, seq=128, batch=16)
VARIANTS = ("tp", "sp+fsdp")
LR = 1e-3
GLOO_TARGET = 0.85  # fd / torch DTensor
SIM_TARGET = 1.3  # fd / unsharded


def fixed_batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_model(cfg: Config) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- fd ----------------------------------------------------------------------------------------


def fd_step(model, mesh, variant, tokens, targets, compiled: bool = False):
    """``(step, first)``: one training step (parameters carried over); ``first()`` is the
    first step's (loss, global gradient norm before clipping), on fresh state. ``compiled``:
    the forward and loss by ``torch.compile(fullgraph=True)`` (the rest eager)."""
    sharded = fd.parallelize_module(model, mesh, plan_for(variant))
    state = {}
    forward = lambda params, x, y: loss_of(sharded.apply(params, x), y)  # noqa: E731
    forward = torch.compile(forward, fullgraph=True) if compiled else forward

    def reset():
        state["params"] = sharded.params
        state["opt"] = fd.Optimizer(torch.optim.AdamW, sharded.params, lr=LR)

    def step():
        params = state["params"]
        # every rank holds the batch and takes its rows, as torch's step does: no broadcast
        tokens_d = fd.distribute_tensor(tokens, mesh, fd.P("dp"), src_data_rank=None, copy=False)
        targets_d = fd.distribute_tensor(targets, mesh, fd.P("dp"), src_data_rank=None, copy=False)
        loss = forward(params, tokens_d, targets_d)
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
        grads, norm = fd.clip_grad_norm(grads, 1.0)
        state["params"] = state["opt"].step(params, grads)
        return loss, norm

    def first():
        reset()
        loss, norm = step()
        return loss.full_tensor().item(), norm.full_tensor().item()

    def held():
        """Bytes this rank (or the first simulated device) holds: parameters, AdamW state."""
        shard = lambda leaf: nbytes(leaf.local_shards()[0]) if isinstance(leaf, fd.DTensor) else 0  # noqa: E731
        params = sum(shard(p) for p in state["params"].values())
        opt = sum(shard(v) for entry in state["opt"].state_dict()["state"].values() for v in entry.values())
        return params, opt

    reset()
    return step, first, held


# --- torch DTensor -----------------------------------------------------------------------------


def _local_attention(self, x):
    """The example's attention on local shards: ``self.heads`` is this rank's head count."""
    b, t, _ = x.shape
    q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(o.transpose(1, 2).reshape(b, t, -1))


def torch_plan(variant: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if "sp" not in variant.split("+"):
        return {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attn.wq": ColwiseParallel(),
            "layers.*.attn.wk": ColwiseParallel(),
            "layers.*.attn.wv": ColwiseParallel(),
            "layers.*.attn.wo": RowwiseParallel(),
            "layers.*.mlp.up": ColwiseParallel(),
            "layers.*.mlp.down": RowwiseParallel(),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
    seq = dict(output_layouts=Shard(1), use_local_output=False)  # the residual stream: a DTensor
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), **seq),
        "layers.*.attn_norm": SequenceParallel(),
        "layers.*.attn": gather,
        "layers.*.attn.wq": ColwiseParallel(),
        "layers.*.attn.wk": ColwiseParallel(),
        "layers.*.attn.wv": ColwiseParallel(),
        "layers.*.attn.wo": RowwiseParallel(**seq),
        "layers.*.mlp_norm": SequenceParallel(),
        "layers.*.mlp": gather,
        "layers.*.mlp.up": ColwiseParallel(),
        "layers.*.mlp.down": RowwiseParallel(**seq),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def clip_grad_norm_by_mesh(params: list, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on several meshes: FSDP over "dp"
    leaves the parameters that tensor parallel did not touch (norms, biases, the positional
    embedding) on the 1-D "dp" mesh and the others on the 2-D mesh, and ``clip_grad_norm_``
    stacks their norms into one op (DTensor refuses operands on two meshes). torch's own
    pieces, per mesh: ``get_total_norm``, the norms combined, ``clip_grads_with_norm_``."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def torch_step(model, mesh, variant, tokens, targets):
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    tp, dp = mesh["tp"], mesh["dp"]
    cfg_dp = dp.size()
    state = {}

    def build():
        m = copy.deepcopy(model)
        for block in m.layers:
            block.attn.heads //= tp.size()
            block.attn.forward = types.MethodType(_local_attention, block.attn)
        if "sp" in variant.split("+"):
            m.pos = torch.nn.Parameter(distribute_tensor(m.pos.detach(), tp, [Replicate()]))
        parallelize_module(m, tp, torch_plan(variant))
        wrap = fully_shard if "fsdp" in variant.split("+") else replicate
        for block in m.layers:
            wrap(block, mesh=dp)
        wrap(m, mesh=dp)
        state["model"] = m
        state["opt"] = torch.optim.AdamW(m.parameters(), lr=LR)

    rows = slice(
        dp.get_local_rank() * len(tokens) // cfg_dp, (dp.get_local_rank() + 1) * len(tokens) // cfg_dp
    )

    def step():
        m, opt = state["model"], state["opt"]
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = loss_of(m(tokens[rows]), targets[rows])
            loss.backward()
        norm = clip_grad_norm_by_mesh(list(m.parameters()), 1.0)
        opt.step()
        return loss, norm

    def first():
        build()
        loss, norm = step()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss, group=dp.get_group())  # this dp rank's half of the batch
        return loss.item() / cfg_dp, norm.item()

    def held():
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        params = sum(nbytes(local(p)) for p in state["model"].parameters())
        opt = sum(
            nbytes(local(v))
            for entry in state["opt"].state.values()
            for key, v in entry.items()
            if key != "step"
        )
        return params, opt

    build()
    return step, first, held


# --- the gloo part -----------------------------------------------------------------------------


def gloo_main(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    cfg = GLOO_CFG
    mesh = fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    talk = rank == 0
    model = make_model(cfg)
    tokens, targets = fixed_batch(cfg)
    unsharded = sum(nbytes(p) for p in model.parameters())

    want = first_on_one_device(model, tokens, targets)
    steps, held, checks, comms = {}, {}, [], {}
    for variant in VARIANTS:
        f_step, f_first, f_held = fd_step(model, mesh, variant, tokens, targets)
        t_step, t_first, t_held = torch_step(model, tmesh, variant, tokens, targets)
        (f_loss, f_norm), (t_loss, t_norm) = f_first(), t_first()
        for name, got in (("fd", (f_loss, f_norm)), ("torch DTensor", (t_loss, t_norm))):
            checked(
                f"rank {rank}: {variant}: {name}'s first loss and gradient norm", torch.tensor(got), *want
            )
        checks.append(
            f"{variant}: first-step loss fd {f_loss:.6f} / torch {t_loss:.6f}, "
            f"grad norm fd {f_norm:.6f} / torch {t_norm:.6f}: same as one device"
        )
        with fd.CommDebugMode() as comm:
            f_step()
        with TorchCommDebugMode() as tcomm:
            t_step()
        by_axes = Counter(f"{e.op}({','.join(e.axes)})" for e in comm.events)
        comms[variant] = (
            dict(by_axes),
            comm.get_total_bytes(),
            {str(k).split(".")[-1]: v for k, v in tcomm.get_comm_counts().items()},
        )
        steps[f"{variant}: fd"], steps[f"{variant}: DTensor"] = f_step, t_step
        held[f"{variant}: fd"], held[f"{variant}: DTensor"] = f_held(), t_held()

    if args.profile:
        gloo_profile(steps, talk)
        dist.destroy_process_group()
        return
    reps = args.reps or (3 if args.quick else 20)
    times = interleaved(
        steps, reps=reps, warmup=1 if args.quick else 2, before_each=dist.barrier, calls=args.calls
    )
    wall = {name: median_ms(t.wall) for name, t in times.items()}
    cpu = {name: median_ms(t.cpu) for name, t in times.items()}
    slowest = torch.tensor(list(wall.values()))
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    slowest = dict(zip(steps, slowest.tolist(), strict=True))
    if talk:
        for line in checks:
            print(line)
        rows = []
        for name in steps:
            variant, lib = name.split(": ")
            ratio = wall[name] / wall[f"{variant}: DTensor"]
            p, o = held[name]
            rows.append(
                [
                    name,
                    f"{wall[name]:.1f}",
                    f"{slowest[name]:.1f}",
                    f"{cpu[name]:.1f}",
                    f"{ratio:.3f}" if lib == "fd" else "1.000",
                    f"{slowest[name] / slowest[f'{variant}: DTensor']:.3f}" if lib == "fd" else "1.000",
                    f"{p / 2**20:.2f} ({p / unsharded:.2f}x)",
                    f"{o / 2**20:.2f} ({o / (2 * unsharded):.2f}x)",
                    verdict(ratio, GLOO_TARGET) if lib == "fd" else "",
                ]
            )
        print_table(
            f"training step on 4 gloo ranks, mesh dp 2 x tp 2 ({describe(cfg)}): medians of {reps} "
            f"interleaved samples of {args.calls} steps, 1 thread per rank",
            [
                "variant",
                "rank 0 ms",
                "slowest ms",
                "cpu ms",
                "fd / DTensor",
                "(slowest)",
                "params MiB",
                "AdamW MiB",
                "target",
            ],
            rows,
            caption=f"unsharded: parameters {unsharded / 2**20:.2f} MiB, AdamW state "
            f"{2 * unsharded / 2**20:.2f} MiB (exp_avg, exp_avg_sq); bytes are rank 0's shards (x: of the "
            "unsharded); ms: wall-clock per step, cpu: rank 0's CPU time.",
        )
        for variant, (counts, total, tcounts) in comms.items():
            print(
                f"{variant}: fd's collectives per step: {sum(counts.values())} "
                f"{dict(sorted(counts.items()))}, "
                f"{total / 2**20:.2f} MiB per device; torch's: {sum(tcounts.values())} "
                f"{dict(sorted(tcounts.items()))}"
            )
    dist.barrier()
    dist.destroy_process_group()


def gloo_profile(steps: dict, talk: bool, n: int = 5) -> None:
    """Rank 0's cProfile (own time) and torch.profiler (ops by self CPU time) of ``n`` steps
    of each step in ``steps`` (every rank runs them, in the same order)."""
    import cProfile
    import pstats

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in steps.items():
        fn()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        dist.barrier()
        with torch_profile(activities=[ProfilerActivity.CPU]) as tprof:
            for _ in range(n):
                fn()
        dist.barrier()
        if talk:
            print(f"--- rank 0, cProfile of {n} steps: {name} ---")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            print(f"--- rank 0, torch.profiler of {n} steps: {name} ---")
            print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def describe(cfg: Config) -> str:
    return (
        f"vocab {cfg.vocab}, dim {cfg.dim}, heads {cfg.heads}, hidden {cfg.hidden}, "
        f"layers {cfg.layers}, seq {cfg.seq}, batch {cfg.batch}"
    )


# --- the simulated part ------------------------------------------------------------------------


def first_on_one_device(model, tokens, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """The first step's (loss, gradient norm) on one device, in float64 and in float32: the
    reference of the checks and plain torch's own float32 error."""
    firsts = [unsharded_step(m, tokens, targets)[1]() for m in (in_float64(model), model)]
    return torch.tensor(firsts[0], dtype=torch.float64), torch.tensor(firsts[1], dtype=torch.float32)


def unsharded_step(model, tokens, targets, compiled: bool = False):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    forward = lambda x, y: loss_of(m(x), y)  # noqa: E731
    forward = torch.compile(forward, fullgraph=True) if compiled else forward

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward(tokens, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return loss, norm

    def first():
        loss, norm = step()
        return loss.item(), norm.item()

    return step, first


def simulated_main(args) -> None:
    torch.set_num_threads(1)
    cfg = SIM_CFG
    mesh = fd.simulated_mesh((2, 2), ("dp", "tp"))
    model = make_model(cfg)
    tokens, targets = fixed_batch(cfg)
    u_step, _ = unsharded_step(model, tokens, targets)
    want = first_on_one_device(model, tokens, targets)
    print(f"unsharded first step: loss {want[1][0]:.6f}, grad norm {want[1][1]:.6f}")
    steps = {"unsharded (plain torch)": u_step}
    if args.compile:
        steps["unsharded, compiled"] = unsharded_step(model, tokens, targets, compiled=True)[0]
    for variant in VARIANTS:
        name = f"fd {variant}, simulated 2x2" + (", compiled" if args.compile else "")
        f_step, f_first, _ = fd_step(model, mesh, variant, tokens, targets, compiled=args.compile)
        got = f_first()
        checked(f"{name}: first loss and gradient norm", torch.tensor(got), *want)
        print(f"{name} first step: loss {got[0]:.6f}, grad norm {got[1]:.6f}: same")
        steps[name] = f_step
    if args.profile:
        profile(
            steps[next(name for name in steps if name.startswith("fd"))], steps["unsharded (plain torch)"]
        )
        return
    if args.bytes:
        written = {name: bytes_written(step) for name, step in steps.items()}
        base = written["unsharded (plain torch)"]
        rows = [[name, f"{n / 1e6:.0f}", f"{n / base:.2f}"] for name, n in written.items()]
        print_table(
            f"bytes the ops write in one step ({describe(cfg)})",
            ["variant", "MB", "/ unsharded"],
            rows,
        )
        return
    reps = args.reps or (3 if args.quick else 20)
    times = interleaved(steps, reps=reps, warmup=1 if args.quick else 2)
    cpu = {name: median_ms(t.cpu) for name, t in times.items()}
    wall = {name: median_ms(t.wall) for name, t in times.items()}
    base = "unsharded (plain torch)"
    rows = [
        [
            name,
            f"{cpu[name]:.1f}",
            f"{wall[name]:.1f}",
            f"{cpu[name] / cpu[base]:.2f}",
            f"{wall[name] / wall[base]:.2f}",
            verdict(cpu[name] / cpu[base], SIM_TARGET) if name != base else "",
        ]
        for name in steps
    ]
    print_table(
        f"training step, simulated mesh dp 2 x tp 2 vs one device ({describe(cfg)}): medians of "
        f"{reps} interleaved reps, 1 thread",
        ["variant", "cpu ms", "wall ms", "/ unsharded", "/ unsharded (wall)", "target"],
        rows,
    )


class _Written(TorchDispatchMode):
    """Counts the bytes of every tensor an op writes: its outputs, or the tensors it changes in
    place (an ``out=`` tensor, ``add_``'s self, a ``_foreach_mul_``'s list); views and
    allocations write nothing (``_unsafe_view`` too: a view, whose schema does not say so)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if schema.is_mutable:
            written = []
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    written += value if isinstance(value, (list, tuple)) else [value]
        elif (
            any(r.alias_info is not None for r in schema.returns)
            or "empty" in func.__name__
            or func is torch.ops.aten._unsafe_view.default
        ):
            written = []
        else:
            written = list(out) if isinstance(out, (tuple, list)) else [out]
        self.nbytes += sum([t.numel() * t.element_size() for t in written if isinstance(t, torch.Tensor)])
        return out


def bytes_written(step) -> int:
    """The bytes the ops of one call of ``step`` write (after a call to warm it): a count that
    the machine's load does not move, of the simulated mesh's copies beside the program's own."""
    step()
    with _Written() as written:
        step()
    return written.nbytes


def profile(fd_fn, plain_fn, n: int = 3) -> None:
    """cProfile (Python functions by own time, then cumulative) and torch.profiler (aten ops
    by self CPU time) of ``n`` steps of fd's step and of the unsharded one."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for fn in (fd_fn, plain_fn):
        fn()
    for label, fn in (("fd tp, simulated 2x2", fd_fn), ("unsharded", plain_fn)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        print(f"--- cProfile of {n} steps: {label} ---")
        stats = pstats.Stats(prof).sort_stats("tottime")
        stats.print_stats(30)
        stats.sort_stats("cumulative").print_stats(60)
        with torch_profile(activities=[ProfilerActivity.CPU]) as tprof:
            for _ in range(n):
                fn()
        print(f"--- torch.profiler of {n} steps: {label} ---")
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--calls", type=int, default=2, help="back-to-back steps per timed sample (gloo)")
    parser.add_argument("--profile", action="store_true", help="cProfile fd's simulated step")
    parser.add_argument(
        "--bytes", action="store_true", help="count the bytes the ops write per step instead (simulated)"
    )
    parser.add_argument(
        "--steady-malloc", action="store_true", help="fix glibc malloc's thresholds first (simulated)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="forward and loss by torch.compile, fd's and torch's (simulated)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if "WORLD_SIZE" in os.environ:
        torch.set_num_threads(1)
        gloo_main(args)
    else:
        if args.steady_malloc:
            steady_malloc()
        simulated_main(args)


if __name__ == "__main__":
    main()
