"""Fresh gloo rank processes for trials in which a rank fails: it raises, exits, is killed
(SIGKILL) or gets stuck at a chosen collective, and the others must fail too, promptly, with an
error that names the collective and the mesh axis, and leave no process behind.

A pool's ranks cannot serve here (a trial breaks their process group), and spawning ranks
costs seconds each (importing torch): ranks are forked from a ``forkserver`` that imported
torch and the library once, so that a trial starts in a fraction of a second.

The failing rank counts the c10d calls of the library (``kernels.c10d``) and fails at call
``at``: ``before`` it, ``after`` it (between two collectives) or ``inside`` it (a thread kills
the rank while it waits in the collective for the others, which arrive late on purpose). Each
rank writes what happened to a file of its own: the time the failure was injected, or the
error it raised and when. A rank process is a watched daemon: it exits on its own after
``deadline`` seconds, whatever happens.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

__all__ = ["Plan", "Trial", "run_trial", "alive", "PROGRAMS", "stop_forkserver"]

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "functional_dtensor", "rank_trials"])


@dataclass(frozen=True)
class Plan:
    """Rank ``rank`` fails ``how`` (raise, exit, os_exit, sigkill, stall) ``when`` (before,
    inside, after) the library's c10d call number ``at`` (from 1; 0: the program itself fails
    the rank, see :func:`mark_failed`)."""

    rank: int
    at: int
    when: str = "before"
    how: str = "raise"


@dataclass
class Trial:
    """What each rank wrote (None where it wrote nothing), their exit codes, the pids, how long
    the trial took, when the failing rank failed, which ranks the parent had to kill (stuck
    ranks), and each rank's output."""

    results: list[dict | None]
    exitcodes: list[int | None]
    pids: list[int]
    elapsed: float
    failed: dict | None = None  # when and at which call the failing rank failed
    killed: list[int] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)


def run_trial(
    world: int,
    program: str,
    plan: Plan | None,
    *,
    timeout: float,
    check: bool = False,
    deadline: float = 60.0,
    seed: int = 0,
) -> Trial:
    """Run ``program`` (a key of :data:`PROGRAMS`) on ``world`` fresh ranks with a process-group
    timeout of ``timeout`` seconds (and the collective checks with ``check``), ``plan``'s rank
    failing as planned; wait until every rank that did not fail has written its result (or
    ``deadline``), then kill what is left (a stuck rank) and reap every process."""
    import torch.distributed as dist

    start = time.monotonic()
    store = dist.TCPStore(
        "127.0.0.1", 0, world + 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    out = tempfile.mkdtemp(prefix="fd_trial_")
    procs = [
        _CTX.Process(
            target=_rank_main,
            args=(
                rank,
                world,
                store.port,
                timeout,
                program,
                plan,
                check,
                out,
                deadline,
                seed,
                list(sys.path),
            ),
            name=f"fd-trial-rank-{rank}",
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    expected = [r for r in range(world) if plan is None or r != plan.rank]
    killed = []
    try:
        end = time.monotonic() + deadline
        while time.monotonic() < end and not all(
            os.path.exists(_path(out, r)) or not procs[r].is_alive() for r in expected
        ):
            time.sleep(0.02)
        grace = min(end, time.monotonic() + 10.0)  # each exits once it has written: a moment
        waited = expected if plan is None or plan.how == "stall" else range(world)
        for rank in waited:
            procs[rank].join(max(0.0, grace - time.monotonic()))
    finally:
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                killed.append(rank)
                proc.kill()
        for proc in procs:
            proc.join(10)
    results = []
    for rank in range(world):
        try:
            with open(_path(out, rank)) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append(None)
    try:
        with open(os.path.join(out, "failed_at")) as f:
            failed = json.load(f)
    except (OSError, ValueError):
        failed = None
    logs = []
    for rank in range(world):
        try:
            with open(os.path.join(out, f"rank{rank}.log")) as f:
                logs.append(f.read()[-3000:])
        except OSError:
            logs.append("")
    return Trial(
        results,
        [p.exitcode for p in procs],
        [p.pid for p in procs],
        time.monotonic() - start,
        failed,
        killed,
        logs,
    )


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_forkserver() -> None:
    """Stop the forkserver (it would otherwise live as long as the test session)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def _path(out: str, rank: int) -> str:
    return os.path.join(out, f"rank{rank}.json")


def _write(out: str, rank: int, record: dict) -> None:
    tmp = _path(out, rank) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, _path(out, rank))


# --- the rank side ------------------------------------------------------------------------------


def _rank_main(rank, world, port, timeout, program, plan, check, out, deadline, seed, path) -> None:
    sys.path[:] = path
    log = os.open(os.path.join(out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    watchdog = threading.Timer(deadline + 5, os._exit, (9,))
    watchdog.daemon = True
    watchdog.start()
    import torch
    import torch.distributed as dist

    import functional_dtensor as fd
    from functional_dtensor._distributed import kernels

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["FD_TRIAL_OUT"] = out
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    kernels.c10d = _Injector(kernels.c10d, plan, rank, out)
    record: dict = {"rank": rank}
    try:
        with fd.check_collectives(check, timeout=timeout):
            PROGRAMS[program](world, seed)
    except BaseException as e:
        record.update(
            ok=False,
            calls=kernels.c10d.calls,
            time=time.time(),
            types=[c.__name__ for c in type(e).__mro__],
            message=str(e),
        )
        _write(out, rank, record)
        import faulthandler

        faulthandler.dump_traceback_later(5, exit=False)  # in the log, should the exit hang
        raise  # as a script would: the process ends with the error
    record.update(ok=True, time=time.time(), calls=kernels.c10d.calls)
    _write(out, rank, record)


class _Injector:
    """Stands in for ``kernels.c10d``: counts the calls; on the failing rank, fails at call
    ``plan.at`` as planned; on the others, arrives late at that call when the failing rank is
    to be killed inside it."""

    def __init__(self, c10d, plan: Plan | None, rank: int, out: str) -> None:
        self.c10d, self.plan, self.rank, self.out, self.calls = c10d, plan, rank, out, 0

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True  # errors name the library's caller, not this stand-in
        self.calls += 1
        plan = self.plan
        if plan is None or self.calls != plan.at:
            return self.c10d(*args, **kwargs)
        if self.rank != plan.rank:
            if plan.when == "inside":
                time.sleep(0.3)  # the failing rank waits inside the collective meanwhile
            return self.c10d(*args, **kwargs)
        if plan.when == "before":
            self._fail()
        if plan.when == "inside":
            threading.Thread(target=self._fail, args=(0.1,), daemon=True).start()
        result = self.c10d(*args, **kwargs)
        if plan.when == "after":
            self._fail()
        return result

    def _fail(self, delay: float = 0.0) -> None:
        time.sleep(delay)
        mark_failed(self.calls)
        how = self.plan.how
        if how == "raise":
            raise RuntimeError(f"rank {self.rank} fails on purpose at collective call {self.calls}")
        if how == "exit":
            sys.exit(3)
        if how == "os_exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "stall":
            time.sleep(3600)


def mark_failed(call: int = 0) -> None:
    """Write when this rank failed (the start of the others' wait)."""
    import torch.distributed as dist

    with open(os.path.join(os.environ["FD_TRIAL_OUT"], "failed_at"), "w") as f:
        json.dump({"time": time.time(), "rank": dist.get_rank(), "call": call}, f)


# --- programs: what every rank runs -----------------------------------------------------------


def _mesh(world: int):
    import functional_dtensor as fd

    if world == 4:
        return fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    return fd.init_device_mesh("cpu", (world,), ("tp",))


def _finish(mesh) -> None:
    """The end of every program: a psum over the whole mesh (as a script reports its global
    loss), so that every rank has a collective left with every other."""
    import torch

    import functional_dtensor as fd

    axes = mesh.axis_names
    fd.shard_map(lambda v: fd.psum(v, axes), mesh=mesh, in_specs=fd.P(axes), out_specs=fd.P())(
        torch.ones(mesh.size)
    )


def program_shard_map(world: int, seed: int) -> None:
    """A per-device function of every collective, three times, then the result gathered."""
    import torch

    import functional_dtensor as fd

    mesh = _mesh(world)
    axis = "tp"
    n = mesh.axis_size(axis)

    def body(v):
        v = fd.psum(v, axis) + v
        v = fd.all_gather(v, axis, tiled=True)
        v = fd.ppermute(v, axis, [(i, (i + 1) % n) for i in range(n)])
        return fd.psum_scatter(v, axis, tiled=True)

    f = fd.shard_map(body, mesh=mesh, in_specs=fd.P(axis), out_specs=fd.P(axis), check_rep=False)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    for _ in range(3):
        x = f(x).full_tensor()
    _finish(mesh)


def program_redistribute(world: int, seed: int) -> None:
    """A value moved round a cycle of layouts, twice, then gathered."""
    import torch

    import functional_dtensor as fd

    mesh = _mesh(world)
    x = fd.distribute_tensor(
        torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)), mesh, fd.P("tp")
    )
    specs = [fd.P(None, "tp"), fd.P(), fd.P("tp"), fd.P(("tp",), None)]
    if world == 4:
        specs = [fd.P("dp", "tp"), fd.P("tp", "dp"), fd.P(("dp", "tp")), fd.P(), fd.P("tp")]
    for _ in range(2):
        for spec in specs:
            x = fd.redistribute(x, spec)
    x.full_tensor()
    _finish(mesh)


def program_global_ops(world: int, seed: int) -> None:
    """Global operations on sharded values (each with its redistributions), gathered."""
    import torch

    import functional_dtensor as fd

    mesh = _mesh(world)
    g = torch.Generator().manual_seed(seed)
    a = fd.distribute_tensor(torch.randn(8, 8, generator=g), mesh, fd.P("tp"))
    b = fd.distribute_tensor(torch.randn(8, 8, generator=g), mesh, fd.P(None, "tp"))
    for _ in range(2):
        c = a @ b
        d = (c + b.T).sum(dim=0)
        e = (a * 2).mean() + d.max()
        a = a + e
    a.full_tensor()
    _finish(mesh)


def program_training(world: int, seed: int) -> None:
    """Training steps of a small tensor-parallel MLP with fd.Optimizer (and data parallel on
    four ranks)."""
    import torch
    from torch import nn

    import functional_dtensor as fd

    mesh = _mesh(world)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    sharded = fd.parallelize_module(
        model, mesh, {"0": fd.ColwiseParallel("tp"), "2": fd.RowwiseParallel("tp")}
    )
    params = sharded.params
    opt = fd.Optimizer(torch.optim.AdamW, params, lr=1e-2)
    data = fd.P("dp") if world == 4 else fd.P()
    for _ in range(3):
        x = fd.distribute_tensor(torch.randn(8, 8), mesh, data)
        out = sharded.apply(params, x)
        loss = (out * out).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        params = opt.step(params, dict(zip(params, grads)))
    loss.full_tensor()
    _finish(mesh)


def _skip_last(world: int, wait: bool) -> None:
    """Two psums; the last rank skips the second: it returns (and its process exits), or waits
    elsewhere (alive, in no collective)."""
    import torch
    import torch.distributed as dist

    import functional_dtensor as fd

    mesh = fd.init_device_mesh("cpu", (world,), ("x",))
    f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())
    f(torch.ones(world))
    if dist.get_rank() == world - 1:
        mark_failed()
        if wait:
            time.sleep(3600)
        return
    f(torch.ones(world))


def program_skip_last_then_exit(world: int, seed: int) -> None:
    _skip_last(world, wait=False)


def program_skip_last_then_wait(world: int, seed: int) -> None:
    _skip_last(world, wait=True)


PROGRAMS = {
    "shard_map": program_shard_map,
    "redistribute": program_redistribute,
    "global_ops": program_global_ops,
    "training": program_training,
    "skip_last_then_exit": program_skip_last_then_exit,
    "skip_last_then_wait": program_skip_last_then_wait,
}
