"""``fd.redistribute`` against torch DTensor's ``redistribute`` on real gloo ranks (CPU).

    torchrun --standalone --nproc-per-node 2 bench/redistribute.py [--quick]
    torchrun --standalone --nproc-per-node 4 bench/redistribute.py [--quick]

One 2048 x 2048 float32 value (16 MiB), the same on every rank, moved between layouts by both
libraries in the same processes. Cases: on a 1-D mesh of all the ranks, ``S(0)->R``,
``S(0)->S(1)``, ``P->R``, ``P->S(0)``, ``R->S(0)``, ``S(1)->R``; with 4 ranks also on a 2 x 2
mesh, ``(S0,S1)->(S1,S0)``, ``(S0,S1)->(R,R)``, ``(P,P)->(R,R)``, ``(S0,R)->(R,S0)``,
``(S0,S0)->(R,R)``, ``(P,S0)->(S0,R)`` (P is ``Partial("sum")``), and ``P(("b", "a")) ->
P(("a", "b"))``: the rows split over both axes, ``b`` major, then ``a`` major (a reorder of one
dim's axes; for DTensor, ``(_StridedShard(0, sf=2), Shard(0)) -> (Shard(0), Shard(0))``, the
same layouts by torch's own conversion of the shard order).

Per case, the source is built once in each library over the same contiguous local shard:
this rank's block of ``fd.distribute_tensor`` (Partial axes: the value divided by the axis
size), wrapped by ``fd.from_local`` and by DTensor's ``DTensor.from_local``, so Partial
sources hold the same parts. Before timing, every result is checked against the other
library's (this rank's shard, and ``full_tensor()``) and against the value, by the tests'
comparison (``_checks.py``: float32's tolerance, widened for the sum of a Partial value's
parts). DTensor's log lines about its own plans (the gloo all-to-all fallback, sequential
all-reduces) are silenced.

Columns:

* ``fd plan``: the steps of ``fd.explain_redistribute`` (what ``fd.redistribute`` runs).
* ``fd MiB``: ``report.total_bytes``, bytes received per device by fd's plan.
* ``DTensor MiB``: bytes received per device by what DTensor actually runs. A
  ``TorchDispatchMode`` (a subclass of ``torch.distributed.tensor.debug.CommDebugMode``, whose
  counts it keeps) records every collective op dispatched during one ``redistribute`` and its
  input; bytes per rank use the formulas fd's planner uses, ``b`` the input bytes on the rank:
  all_gather ``(k-1) b``, all_reduce ``2 (k-1)/k b``, reduce_scatter ``(k-1)/k b``,
  all_to_all ``(k-1)/k b`` (with split sizes: what comes from other ranks), reduce ``(k-1) b``
  into the root, broadcast ``b`` into each non-root. The most any rank receives is reported
  (max over ranks), as fd's ``step_bytes``. ``DTensor ran`` lists the collectives and group
  sizes. fd's own run is captured the same way and must agree with its plan (checked).
* ``lower bound MiB``: ``report.lower_bound``.
* ``fd ms`` / ``DTensor ms``: median over the repetitions of the slowest rank's wall-clock
  time for the call: ``fd.redistribute(x, target).to_local()`` and
  ``dt.redistribute(mesh, placements).to_local()`` followed by ``.wait()`` when that is an
  ``AsyncCollectiveTensor``. Every variant of every case runs in one loop, in a freshly
  shuffled order each repetition (the same order on every rank), with an untimed
  ``dist.barrier()`` before each call, so all ranks start together; the per-repetition times
  are gathered across ranks after the loop. ``fd / DTensor`` is the ratio of those medians.
* ``bytes``: ``ok`` when fd's bytes are <= DTensor's and == the lower bound. ``time``: the
  ratio against its target (<= 1.0, and <= 0.5 on ``S0->S1``, ``(S0,S1)->(S1,S0)`` and
  ``(P,S0)->(S0,R)``).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _checks import checked
from _timing import interleaved, median_ms, table, verdict
from rich.console import Console
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor.debug import CommDebugMode

import functional_dtensor as fd

SHAPE = (2048, 2048)
S0, S1, R, P = fd.Shard(0), fd.Shard(1), fd.Replicate(), fd.Partial()
CASES_1D = [((S0,), (R,)), ((S0,), (S1,)), ((P,), (R,)), ((P,), (S0,)), ((R,), (S0,)), ((S1,), (R,))]
CASES_2D = [
    ((S0, S1), (S1, S0)),
    ((S0, S1), (R, R)),
    ((P, P), (R, R)),
    ((S0, R), (R, S0)),
    ((S0, S0), (R, R)),
    ((P, S0), (S0, R)),
    (fd.P(("b", "a")), fd.P(("a", "b"))),
]
# time target 0.5
FAST = {((S0,), (S1,)), ((S0, S1), (S1, S0)), ((P, S0), (S0, R)), (fd.P(("b", "a")), fd.P(("a", "b")))}
MIB = 1 << 20


def torch_placements(layout: fd.Layout, tmesh):
    """The layout as torch DTensor placements: a shard order other than the mesh's becomes
    ``_StridedShard`` placements, by torch's own conversion."""
    out = []
    for p in layout.placements:
        if isinstance(p, fd.Shard):
            out.append(TShard(p.dim))
        elif isinstance(p, fd.Partial):
            out.append(TPartial(p.op))
        else:
            out.append(TReplicate())
    if layout.shard_order:
        order = tuple(ShardOrderEntry(dim, axes) for dim, axes in layout.shard_order)
        out = list(DTensorSpec._convert_shard_order_to_StridedShard(order, tuple(out), tmesh))
    return out


def case_name(source: fd.Layout, target: fd.Layout) -> str:
    """Placements in short form; partition specs where a dim's axes are not in mesh order."""
    if source.shard_order or target.shard_order:
        return f"{source.spec} -> {target.spec}"

    def show(layout):
        text = ",".join(str(p).replace("(sum)", "") for p in layout.placements)
        return f"({text})" if len(layout.placements) > 1 else text

    return f"{show(source)} -> {show(target)}"


# --- what collectives run, and the bytes they make each rank receive ----------------------------

_FUNCOL = torch.ops._c10d_functional
_C10D = torch.ops.c10d


def _group_size_rank(group) -> tuple[int, int]:
    if isinstance(group, torch.ScriptObject):  # c10d ops carry the group boxed
        group = dist.ProcessGroup.unbox(group)
    elif not isinstance(group, dist.ProcessGroup):  # a group name (functional collectives)
        group = dist.distributed_c10d._resolve_process_group(group)
    return group.size(), group.rank()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def received(func, args) -> tuple[str, int, int] | None:
    """(collective, group size, bytes this rank receives) for a collective op, else None."""
    packet = func._overloadpacket
    if packet is _FUNCOL.all_gather_into_tensor:
        k, _ = _group_size_rank(args[2])
        return "all_gather", k, (k - 1) * _nbytes(args[0])
    if packet is _FUNCOL.all_reduce:
        k, _ = _group_size_rank(args[2])
        return "all_reduce", k, 2 * (k - 1) * _nbytes(args[0]) // k
    if packet is _FUNCOL.reduce_scatter_tensor:
        k, _ = _group_size_rank(args[3])
        return "reduce_scatter", k, (k - 1) * _nbytes(args[0]) // k
    if packet is _FUNCOL.all_to_all_single:
        k, me = _group_size_rank(args[3])
        return "all_to_all", k, _all_to_all_bytes(args[0], args[1], k, me)
    if packet is _FUNCOL.broadcast:
        k, me = _group_size_rank(args[2])
        return "broadcast", k, 0 if me == args[1] else _nbytes(args[0])
    if packet is torch.ops._dtensor.shard_dim_alltoall:
        k, _ = _group_size_rank(args[3])
        return "all_to_all", k, (k - 1) * _nbytes(args[0]) // k
    if packet is _C10D._allgather_base_:
        k, _ = _group_size_rank(args[2])
        return "all_gather", k, (k - 1) * _nbytes(args[1])
    if packet is _C10D.allreduce_:
        k, _ = _group_size_rank(args[1])
        return "all_reduce", k, sum(2 * (k - 1) * _nbytes(t) // k for t in args[0])
    if packet is _C10D._reduce_scatter_base_:
        k, _ = _group_size_rank(args[2])
        return "reduce_scatter", k, (k - 1) * _nbytes(args[1]) // k
    if packet is _C10D.alltoall_base_:
        k, me = _group_size_rank(args[2])
        return "all_to_all", k, _all_to_all_bytes(args[1], args[3], k, me)
    if packet is _C10D.reduce_:
        k, me = _group_size_rank(args[1])
        return "reduce", k, (k - 1) * sum(_nbytes(t) for t in args[0]) if me == args[3] else 0
    if packet is _C10D.broadcast_:
        k, me = _group_size_rank(args[1])
        return "broadcast", k, 0 if me == args[2] else sum(_nbytes(t) for t in args[0])
    return None


def _all_to_all_bytes(x: torch.Tensor, out_splits, k: int, me: int) -> int:
    if not out_splits:  # equal splits
        return (k - 1) * _nbytes(x) // k
    row = _nbytes(x) // x.shape[0] if x.shape[0] else 0  # split sizes count dim-0 rows
    return sum(n for src, n in enumerate(out_splits) if src != me) * row


class CollectiveLog(CommDebugMode):
    """``CommDebugMode`` that also keeps, per collective op, its group size and the bytes this
    rank receives (:func:`received`)."""

    def __init__(self):
        super().__init__()
        self.collectives: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(t is DTensor for t in types) and not isinstance(func, torch._ops.HigherOrderOperator):
            found = received(func, args)
            if found is not None:
                self.collectives.append(found)
        return super().__torch_dispatch__(func, types, args, kwargs)

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.collectives)

    def summary(self) -> str:
        counts = Counter((name, k) for name, k, _ in self.collectives)
        parts = [f"{name}({k})" + (f" x{n}" if n > 1 else "") for (name, k), n in counts.items()]
        return " + ".join(parts) or "local"


def max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return int(t.item())


# --- one case ------------------------------------------------------------------------------------


class Case:
    def __init__(self, mesh: fd.DeviceMesh, tmesh, source, target, value: torch.Tensor):
        self.fast = (source, target) in FAST
        source, target = (_layout(mesh, x) for x in (source, target))
        self.name = case_name(source, target)
        self.source, self.target = source, target
        self.tmesh, self.tplacements = tmesh, torch_placements(target, tmesh)
        local = fd.distribute_tensor(value, mesh, source).to_local().contiguous()  # S(1): a copy
        self.x = fd.from_local(local, mesh, source, shape=SHAPE)
        self.dt = DTensor.from_local(
            self.x.to_local(),
            tmesh,
            torch_placements(source, tmesh),
            run_check=False,
            shape=SHAPE,
            stride=(SHAPE[1], 1),
        )
        self.report = fd.explain_redistribute(self.x, target, show=False)

    def run_fd(self) -> torch.Tensor:
        return fd.redistribute(self.x, self.target).to_local()

    def run_dtensor(self) -> torch.Tensor:
        local = self.dt.redistribute(self.tmesh, self.tplacements).to_local()
        if isinstance(local, funcol.AsyncCollectiveTensor):
            local = local.wait()
        return local

    def check(self, value: torch.Tensor, rank: int) -> None:
        """Both results equal (this rank's shard and the global value), and equal the value."""
        ours = fd.redistribute(self.x, self.target)
        theirs = self.dt.redistribute(self.tmesh, self.tplacements)
        a, b = ours.to_local(), self.run_dtensor()
        world = dist.get_world_size()  # a Partial value's parts sum over up to every rank
        checked(f"rank {rank}: {self.name}: fd's shard against DTensor's", a, b, terms=world)
        full_a, full_b = ours.full_tensor(), theirs.full_tensor()
        if isinstance(full_b, funcol.AsyncCollectiveTensor):
            full_b = full_b.wait()
        for label, full in (("fd", full_a), ("DTensor", full_b)):
            checked(
                f"rank {rank}: {self.name}: {label}'s full_tensor() against the value",
                full,
                value,
                terms=world,
            )

    def measure_bytes(self) -> None:
        """Run each library once under :class:`CollectiveLog`; bytes are maxed over ranks."""
        with CollectiveLog() as log:
            self.run_dtensor()
        self.dtensor_ran = log.summary()
        self.dtensor_bytes = max_over_ranks(log.nbytes)
        with CollectiveLog() as log:
            self.run_fd()
        self.fd_ran = log.summary()
        self.fd_ran_bytes = max_over_ranks(log.nbytes)


def _layout(mesh: fd.DeviceMesh, layout) -> fd.Layout:
    return fd.Layout.from_spec(mesh, layout) if isinstance(layout, fd.P) else fd.Layout(mesh, layout)


def make_cases(world: int, value: torch.Tensor) -> list[Case]:
    mesh = fd.init_device_mesh("cpu", (world,), ("x",))
    tmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    cases = [Case(mesh, tmesh, s, t, value) for s, t in CASES_1D]
    if world == 4:
        mesh2 = fd.init_device_mesh("cpu", (2, 2), ("a", "b"))
        tmesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        cases += [Case(mesh2, tmesh2, s, t, value) for s, t in CASES_2D]
    return cases


def slowest_median_ms(samples: list[float]) -> float:
    """The median over repetitions of the slowest rank's time (all ranks call this together)."""
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return statistics.median(t.tolist()) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few repetitions only")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("_collective_utils", "_redistribute"):  # DTensor's notes on its own plans
        logging.getLogger(f"torch.distributed.tensor.{name}").setLevel(logging.ERROR)
    world = int(os.environ["WORLD_SIZE"])
    reps = args.reps or (5 if args.quick else (80 if world == 2 else 50))

    torch.manual_seed(0)
    value = torch.randn(SHAPE)
    cases = make_cases(world, value)  # initializes the gloo process group
    rank = dist.get_rank()
    for case in cases:
        case.check(value, rank)
        case.measure_bytes()

    steps = {}
    for i, case in enumerate(cases):
        steps[(i, "fd")] = case.run_fd
        steps[(i, "DTensor")] = case.run_dtensor
    times = interleaved(steps, reps=reps, warmup=1, before_each=dist.barrier)
    ms = {key: slowest_median_ms(samples.wall) for key, samples in times.items()}
    cpu = {key: median_ms(samples.cpu) for key, samples in times.items()}  # rank 0's

    if rank == 0:
        rows, mismatches = [], []
        for i, case in enumerate(cases):
            r = case.report
            if case.fd_ran_bytes != r.total_bytes:
                mismatches.append(
                    f"{case.name}: fd ran {case.fd_ran} = {case.fd_ran_bytes} B, planned {r.total_bytes} B"
                )
            ok = r.total_bytes <= case.dtensor_bytes and r.total_bytes == r.lower_bound
            fd_ms, dt_ms = ms[(i, "fd")], ms[(i, "DTensor")]
            ratio = fd_ms / dt_ms
            rows.append(
                [
                    case.name,
                    " + ".join(str(s) for s in r.steps) or "nothing",
                    f"{float(r.total_bytes / MIB):.2f}",
                    f"{case.dtensor_bytes / MIB:.2f}",
                    f"{float(r.lower_bound / MIB):.2f}",
                    case.dtensor_ran,
                    f"{fd_ms:.2f}",
                    f"{dt_ms:.2f}",
                    f"{ratio:.2f}",
                    f"{cpu[(i, 'fd')] / cpu[(i, 'DTensor')]:.2f}",
                    "[green]ok[/green]" if ok else "[red]MISS[/red]",
                    verdict(ratio, 0.5 if case.fast else 1.0),
                ]
            )
        caption = (
            "MiB received per device (max over ranks); ms: median over reps of the slowest rank; "
            "cpu: rank 0's CPU time (its gloo threads included), ratio of medians.\n"
            + (
                "fd's captured collectives match its plan's bytes on every case."
                if not mismatches
                else "fd's captured collectives differ from its plan:\n  " + "\n  ".join(mismatches)
            )
        )
        console = Console(width=200)
        console.print(
            table(
                f"redistribute of a {SHAPE[0]}x{SHAPE[1]} float32 value on {world} gloo ranks: "
                f"medians of {reps} interleaved reps, 1 thread per rank",
                [
                    "case",
                    "fd plan",
                    "fd MiB",
                    "DTensor MiB",
                    "lower bound MiB",
                    "DTensor ran",
                    "fd ms",
                    "DTensor ms",
                    "fd / DTensor",
                    "/ DT (cpu)",
                    "bytes",
                    "time",
                ],
                rows,
            )
        )
        console.print(caption)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
