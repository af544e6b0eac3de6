"""A pool of gloo rank processes kept for a whole test session.

Starting ranks dominates multi-process tests (a spawned rank imports torch and the library and
joins the process group in seconds), so the ranks are started once and then serve jobs: the
parent sends a module-level function and its arguments to every rank, each rank runs it and
answers with its result or its formatted traceback.

The parent owns a ``TCPStore`` on port 0 (the OS picks a free port); the ranks connect to it
and join a gloo process group whose ``timeout`` bounds every collective, so a rank stuck in a
collective becomes an error instead of a hang. Ranks are daemons, use one thread each, and
leave when the parent goes away.

A pool that saw an error or a timeout is broken (its ranks may be stuck in a collective, or
disagree about which collectives ran): it is killed, and :func:`pool` starts a fresh one on
next use.

>>> with RankPool(2) as ranks:                                  # doctest: +SKIP
...     ranks.run(rank_and_world)
[(0, 2), (1, 2)]
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RankPool", "RankError", "Outcome", "pool", "prestart", "close_all", "rank_and_world", "resolve"]

START_TIMEOUT = 120.0  # seconds for every rank to start, join the group and warm up
JOB_TIMEOUT = 60.0  # default seconds for one job on every rank
GRACE = 1.0  # after a first error, seconds to wait for the other ranks' answers


@dataclass(frozen=True)
class Outcome:
    """What one rank answered: ``ok`` and its ``value``, or ``error`` (a formatted traceback,
    or why no answer came)."""

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None


class RankError(RuntimeError):
    """A job failed on some rank, a rank died, or the job timed out. ``outcomes`` holds every
    rank's answer (``None`` where none came)."""

    def __init__(self, message: str, outcomes: list[Outcome | None]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def rank_and_world() -> tuple[int, int]:
    """A job: this rank and the world size."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


class RankPool:
    """``world_size`` gloo ranks on loopback, serving jobs until closed.

    ``timeout`` (seconds) is the process group's timeout: it bounds every collective.
    """

    def __init__(
        self, world_size: int, *, timeout: float = 30.0, start_timeout: float = START_TIMEOUT
    ) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.timeout = timeout
        self.broken = False
        self._ready = False
        self._start_timeout = start_timeout
        self._next_job = 0
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size + 1,
            True,
            timeout=datetime.timedelta(seconds=60),
            wait_for_workers=False,
        )
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(
                    rank,
                    world_size,
                    self._store.port,
                    timeout,
                    list(sys.path),
                    self._jobs[rank],
                    self._results,
                ),
                name=f"fd-rank-{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            for proc in self._procs:
                proc.start()
        except BaseException:
            self.close()
            raise

    # --- life cycle ----------------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until every rank has joined the process group (started lazily by ``run``)."""
        if self._ready:
            return
        outcomes = self._collect(-1, self._start_timeout, grace=0.0)
        failed = [o for o in outcomes if o is None or not o.ok]
        if failed:
            self._break()
            raise RankError(_describe("starting the ranks", outcomes), outcomes)
        self.start_phases = [o.value for o in outcomes]
        self._ready = True

    def close(self) -> None:
        """Ask the ranks to leave; kill those that do not within a moment."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if not self.broken:
            for jobs in self._jobs:
                try:
                    jobs.put(None)
                except (ValueError, OSError):
                    pass
            deadline = time.monotonic() + 2.0
            for proc in self._procs:
                if proc.pid is not None:
                    proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(5.0)
        for q in (*self._jobs, self._results):
            q.close()
            q.cancel_join_thread()
        self._store = None

    def discard(self) -> None:
        """Kill the ranks now (their process group may be unusable); the pool is broken."""
        self.broken = True
        self.close()

    _break = discard

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._break()
        except Exception:
            pass

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    # --- jobs --------------------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: float = JOB_TIMEOUT, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; the per-rank results, in rank order.

        ``fn`` must be a module-level function (sent by module and name); arguments and
        results must pickle. Raises :class:`RankError` with every rank's traceback when a rank
        raises, dies, or does not answer within ``timeout`` seconds; the pool is then broken.
        """
        return [o.value for o in self.run_outcomes(fn, *args, timeout=timeout, **kwargs)]

    def run_outcomes(self, fn: Callable, *args, timeout: float = JOB_TIMEOUT, **kwargs) -> list[Outcome]:
        """As :meth:`run`, with every rank's :class:`Outcome`."""
        if self.broken or getattr(self, "_closed", False):
            raise RuntimeError("this RankPool is closed; start a new one (or use distributed_pool.pool(n))")
        self.wait_ready()
        module = sys.modules[fn.__module__]
        job = (
            fn.__module__,
            getattr(module, "__file__", None),
            fn.__qualname__,
            pickle.dumps((args, kwargs)),
        )
        self._next_job += 1
        job_id = self._next_job
        for jobs in self._jobs:
            jobs.put((job_id, job))
        outcomes = self._collect(job_id, timeout, grace=GRACE)
        if any(o is None or not o.ok for o in outcomes):
            self._break()
            raise RankError(_describe(f"{fn.__qualname__}{_short(args)}", outcomes), outcomes)
        return outcomes

    def _collect(self, job_id: int, timeout: float, grace: float) -> list[Outcome | None]:
        """Every rank's answer to ``job_id``; ``None`` for ranks that gave none in time.
        After the first error, wait only ``grace`` seconds more."""
        outcomes: list[Outcome | None] = [None] * self.world_size
        deadline = time.monotonic() + timeout
        while any(o is None for o in outcomes):
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, answered, ok, payload = self._results.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if outcomes[r] is None and not p.is_alive()]
                for r in dead:
                    outcomes[r] = Outcome(
                        r, False, error=f"rank {r} died (exit code {self._procs[r].exitcode})"
                    )
                if dead:
                    deadline = min(deadline, time.monotonic() + grace)
                continue
            if answered != job_id:
                continue  # a late answer to an earlier job
            if ok:
                try:
                    outcomes[rank] = Outcome(rank, True, value=pickle.loads(payload))
                except Exception:
                    outcomes[rank] = Outcome(
                        rank, False, error="unpickling the result:\n" + traceback.format_exc()
                    )
            else:
                outcomes[rank] = Outcome(rank, False, error=payload)
            if not outcomes[rank].ok:
                deadline = min(deadline, time.monotonic() + grace)
        return outcomes


def _short(args) -> str:
    text = repr(args)
    return text if len(text) < 200 else text[:197] + "..."


def _describe(what: str, outcomes: list[Outcome | None]) -> str:
    lines = [f"{what} failed on the gloo ranks:"]
    for rank, outcome in enumerate(outcomes):
        if outcome is None:
            lines.append(f"--- rank {rank}: no answer (stuck, or killed at the timeout)")
        elif outcome.ok:
            lines.append(f"--- rank {rank}: ok")
        else:
            lines.append(f"--- rank {rank}:\n{outcome.error.rstrip()}")
    return "\n".join(lines)


# --- the rank side ------------------------------------------------------------------------------


def _serve(rank: int, world_size: int, port: int, timeout: float, path: list[str], jobs, results) -> None:
    """A rank process: join the gloo group, warm up, then run jobs until told to stop."""
    sys.path[:] = path
    parent = os.getppid()
    phases = {"spawned": time.monotonic()}
    try:
        import torch
        import torch.distributed as dist

        phases["imported"] = time.monotonic()
        torch.set_num_threads(1)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        store = dist.TCPStore(
            "127.0.0.1", port, world_size + 1, False, timeout=datetime.timedelta(seconds=60)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        phases["joined"] = time.monotonic()
        _warm_up()
        phases["warm"] = time.monotonic()
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    results.put((rank, -1, True, pickle.dumps(phases)))
    while True:
        try:
            message = jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the parent is gone: nobody will ask again
                return
            continue
        if message is None:
            break
        job_id, (module_name, module_file, qualname, payload) = message
        try:
            fn = resolve(module_name, module_file, qualname)
            args, kwargs = pickle.loads(payload)
            answer = (rank, job_id, True, pickle.dumps(fn(*args, **kwargs)))
        except BaseException:
            answer = (rank, job_id, False, traceback.format_exc())
        results.put(answer)
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    finally:
        os._exit(0)  # skip interpreter teardown: the parent only waits for the exit


def _warm_up() -> None:
    """Import the library and run one collective, so that every link of the group is up before
    the first job (dynamo, which torch.compile and functional collectives import on first use,
    is left to the jobs that need it: a second per rank)."""
    import torch
    import torch.distributed as dist

    import functional_dtensor  # noqa: F401

    probe = torch.ones(1)
    dist.all_reduce(probe)
    if probe.item() != dist.get_world_size():
        raise RuntimeError(f"the warm-up all_reduce gave {probe.item()}, not {dist.get_world_size()}")


def resolve(module_name: str, module_file: str | None, qualname: str) -> Callable:
    """The job's function: import its module by name, or from its file under the parent's
    module name (pytest's importlib mode names test modules in ways ``import`` cannot find)."""
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if module_file is None:
                raise
            spec = importlib.util.spec_from_file_location(module_name, module_file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


# --- session-wide pools -------------------------------------------------------------------------

_pools: dict[tuple[int, float], RankPool] = {}


def pool(world_size: int, *, timeout: float = 30.0) -> RankPool:
    """The session's pool of ``world_size`` ranks, started on first use and replaced when
    broken."""
    key = (world_size, timeout)
    found = _pools.get(key)
    if found is None or found.broken or getattr(found, "_closed", False):
        found = _pools[key] = RankPool(world_size, timeout=timeout)
    return found


def prestart(*world_sizes: int, timeout: float = 30.0) -> None:
    """Spawn the session pools of these sizes now, without waiting for them: their ranks start
    while the caller works (the first ``run`` on each waits for its ranks)."""
    for world_size in world_sizes:
        pool(world_size, timeout=timeout)


def close_all() -> None:
    """Close every session pool (at session end)."""
    while _pools:
        _, found = _pools.popitem()
        found.close()


atexit.register(close_all)
