"""What only the distributed backend has: process groups (built once, reused; sub-mesh groups
sliced from the mesh's, never made by one rank alone; the one ``init_device_mesh`` made is
destroyed at exit), torch.compile of collectives and redistributions on gloo ranks, run_check
agreeing on every rank, and dead or stuck ranks becoming errors instead of hangs. Real gloo
processes on loopback (``distributed_pool.py``), never mocked; the tests that break a pool on
purpose run last (``breaks_pool``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch
from catalogue import global_inputs, mapped, pick, run_case
from common import assert_close
from distributed_pool import RankError, RankPool

import functional_dtensor as fd

pytestmark = pytest.mark.distributed

S, R, Pa = fd.Shard, fd.Replicate, fd.Partial


def _gloo_mesh(shape, names) -> fd.DeviceMesh:
    return fd.init_device_mesh("cpu", shape, names)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def close(got, want, what: str) -> None:
    assert_close(got, want, msg=lambda m: f"{what}: {m}")


# --- process groups ------------------------------------------------------------------------------


#: a rank of a one-rank world: a probe registered before ``init_device_mesh`` runs after the
#: library's own exit handlers (atexit runs them last-registered first)
_EXIT_PROBE = """
import atexit
import torch
import torch.distributed as dist
import functional_dtensor as fd
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
mesh = fd.init_device_mesh("cpu", (1,), ("x",))
summed = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P(), out_specs=fd.P())
print("psum:", summed(torch.ones(2)).full_tensor().tolist(), flush=True)
"""


def test_the_process_group_init_device_mesh_made_is_destroyed_at_exit():
    """A program that lets ``init_device_mesh`` make the process group need not destroy it: the
    library does at exit, as torch asks. Left to the interpreter's teardown, a rank now and then
    aborted after its last line under load ("terminate called without an active exception",
    exit -6: 3 runs in 30 of a 4-rank program on a busy 2-core machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    command = [sys.executable, "-c", _EXIT_PROBE]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "psum: [1.0, 1.0]" in done.stdout, done.stdout
    assert "initialized at exit: False" in done.stdout, done.stdout


def job_groups_reused() -> dict:
    """Process groups are built once per (mesh, axes) and reused by later calls."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from functional_dtensor._distributed import runtime as distributed

    mesh = _gloo_mesh((2, 2), ("x", "y"))
    rounds = []
    for _ in range(3):
        for axes in (("x",), ("y",), ("x", "y")):
            run_case(mesh, axes, "psum")
            run_case(mesh, axes, "all_gather then psum_scatter")
        run_case(mesh, ("y", "x"), "ppermute ring")
        mine = {k[1]: v for k, v in distributed._groups.items() if k[0] == mesh}
        rounds.append(
            {
                "keys": sorted(mine),
                "ids": {k: id(v) for k, v in mine.items()},
                "sizes": {k: v.size() for k, v in mine.items()},
                "process_groups": len(c10d._world.pg_map),
            }
        )
    again = _gloo_mesh((2, 2), ("x", "y"))
    return {"rounds": rounds, "same_mesh": again == mesh, "world": dist.get_world_size()}


def test_process_groups_are_created_once_and_reused(gloo):
    for rank, got in enumerate(gloo.run(4, job_groups_reused)):
        first, *later = got["rounds"]
        assert len(later) == 2
        # one group per axis and per flattened tuple; a tuple in another order is the same group
        assert first["keys"] == [("x",), ("x", "y"), ("y",), ("y", "x")], (rank, first["keys"])
        assert first["ids"][("y", "x")] == first["ids"][("x", "y")], rank
        assert first["sizes"] == {("x",): 2, ("y",): 2, ("x", "y"): 4, ("y", "x"): 4}, rank
        for other in later:
            assert other == first, f"rank {rank}: groups were rebuilt: {first} then {other}"
        assert got["same_mesh"] and got["world"] == 4


def job_sub_mesh_groups() -> list:
    """The ``dist.new_group`` calls made to build the groups of ``mesh['y']`` (the sub-mesh
    through this rank of a 2x2 mesh). The calls are recorded and stopped, not run: run, they
    can hang (ranks of different sub-meshes rendezvous under one group name)."""
    import torch.distributed.device_mesh as torch_device_mesh

    from functional_dtensor._distributed import runtime as distributed

    mesh = _gloo_mesh((2, 2), ("x", "y"))
    sub = mesh["y"]
    calls: list[list[int]] = []

    class Stop(Exception):
        pass

    def recording_new_group(ranks=None, **kwargs):
        calls.append(sorted(ranks))
        raise Stop

    real = torch_device_mesh.new_group
    torch_device_mesh.new_group = recording_new_group
    try:
        found = distributed.group(sub, ("y",))
        built = found.size()
    except Stop:
        built = None
    finally:
        torch_device_mesh.new_group = real
    return [sub.device_ids, distributed.group_ids(sub), calls, built]


def test_sub_mesh_groups_are_sliced_from_the_mesh(gloo):
    """A sub-mesh's group comes from the groups every rank built with the mesh: slicing it makes
    no new group (one rank alone could not: the others would never join)."""
    answers = gloo.run(4, job_sub_mesh_groups)
    for rank, (ids, mine, calls, built) in enumerate(answers):
        assert ids == (0, 1, 2, 3), rank  # pure data: the same on every rank
        assert mine == ((0, 1) if rank < 2 else (2, 3)), rank
        assert calls == [], f"rank {rank} made new groups for mesh['y']: {calls}"
        assert built == 2, rank
    for rank, got in enumerate(gloo.run(4, job_sub_mesh_psum, timeout=20)):
        close(got["full"], got["value"][:2] + got["value"][2:], f"rank {rank}: psum over mesh['y']")


def job_sub_mesh_psum() -> dict:
    """shard_map on ``mesh['y']``: each row of the 2x2 mesh sums its own value."""
    from functional_dtensor._distributed import runtime

    mesh = _gloo_mesh((2, 2), ("x", "y"))
    sub = mesh["y"]
    f = fd.shard_map(lambda v: fd.psum(v, "y"), mesh=sub, in_specs=fd.P("y"), out_specs=fd.P())
    value = torch.arange(4.0) + 10 * runtime.group_ids(sub)[0]
    return {"full": f(value).full_tensor(), "value": value}


# --- torch.compile -------------------------------------------------------------------------------


def job_compile(backend: str, name: str, axes=("x",), shape=(2,)) -> dict:
    """Eager vs ``torch.compile(fullgraph=True)`` of a catalogue case, forward and backward. A
    compile error is returned, not raised: every rank fails alike while tracing, before any
    collective runs, so the pool stays usable."""
    torch._dynamo.reset()
    mesh = _gloo_mesh(shape, ("x", "y")[: len(shape)])
    case = pick(mesh, axes, name)
    f = mapped(case, mesh)

    def step(*args):
        return f(*args).full_tensor()

    inputs = [t.requires_grad_() for t in global_inputs(case, seed=5)]
    eager = step(*inputs)
    cotangent = torch.randn(eager.shape, dtype=eager.dtype, generator=torch.Generator().manual_seed(6))
    eager_grads = torch.autograd.grad(eager, inputs, cotangent, allow_unused=True)
    try:
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        got = compiled(*inputs)
        got_grads = torch.autograd.grad(got, inputs, cotangent, allow_unused=True)
        again = compiled(*[t.detach() * 2 for t in inputs])  # a second call reuses the graph
    except Exception:
        return {"error": traceback.format_exc()}
    return {
        "eager": eager.detach(),
        "compiled": got.detach(),
        "eager_grads": eager_grads,
        "compiled_grads": got_grads,
        "again": again.detach(),
        "again_eager": step(*[t.detach() * 2 for t in inputs]).detach(),
        "reference": case.reference(*[t.detach() for t in inputs]),
    }


def check_compiled(ranks: list[dict]) -> None:
    for rank, got in enumerate(ranks):
        assert "error" not in got, f"rank {rank}: torch.compile failed:\n{got['error']}"
        close(got["eager"], got["reference"], f"rank {rank}: eager forward")
        close(got["compiled"], got["eager"], f"rank {rank}: compiled forward")
        close(got["again"], got["again_eager"], f"rank {rank}: second compiled call")
        assert len(got["compiled_grads"]) == len(got["eager_grads"]) > 0
        for i, (g, w) in enumerate(zip(got["compiled_grads"], got["eager_grads"], strict=True)):
            close(g, w, f"rank {rank}: compiled backward, input {i}")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow)
        for n in ("mlp", "all_gather then psum_scatter", "ppermute ring")
    ],
)  # the default run compiles on gloo in tests/test_compile.py
def test_compile_aot_eager_on_gloo(name, gloo):
    check_compiled(gloo.run(2, job_compile, "aot_eager", name, timeout=300))


def job_compile_redistribute(shape: tuple[int, ...], source, target) -> dict:
    """Eager vs compiled (aot_eager, fullgraph) fd.redistribute of local shards, forward and
    backward; errors returned, as in :func:`job_compile`."""
    torch._dynamo.reset()
    mesh = _gloo_mesh(shape, ("x", "y")[: len(shape)])
    value = torch.arange(64.0).reshape(8, 8)

    def step(local):
        moved = fd.redistribute(fd.from_local(local, mesh, source, shape=(8, 8)), target)
        return moved.to_local()

    local = fd.distribute_tensor(value, mesh, source).to_local().detach().requires_grad_()
    eager = step(local)
    (eager_grad,) = torch.autograd.grad(eager, local, torch.ones_like(eager))
    want = fd.distribute_tensor(value, mesh, target).to_local()  # (no Partial target below)
    try:
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        got = compiled(local)
        (got_grad,) = torch.autograd.grad(got, local, torch.ones_like(got))
    except Exception:
        return {"error": traceback.format_exc()}
    return {
        "eager": eager.detach(),
        "want": want,
        "compiled": got.detach(),
        "eager_grad": eager_grad,
        "compiled_grad": got_grad,
    }


@pytest.mark.parametrize(
    "source, target",
    [
        pytest.param((S(0), S(1)), (S(1), S(0)), marks=pytest.mark.slow),  # tests/test_compile.py by default
        pytest.param((Pa("sum"), S(0)), (S(0), R()), marks=pytest.mark.slow),
        pytest.param((S(0), R()), (R(), R()), marks=pytest.mark.slow),
        pytest.param(fd.P(("y", "x")), fd.P(("x", "y")), marks=pytest.mark.slow),
    ],
)
def test_compile_redistribute_on_gloo(source, target, gloo):
    for rank, got in enumerate(gloo.run(4, job_compile_redistribute, (2, 2), source, target, timeout=300)):
        assert "error" not in got, f"rank {rank}: torch.compile failed:\n{got['error']}"
        close(got["eager"], got["want"], f"rank {rank}: eager forward")
        close(got["compiled"], got["eager"], f"rank {rank}: compiled forward")
        close(got["compiled_grad"], got["eager_grad"], f"rank {rank}: compiled backward")


@pytest.mark.slow  # tests/test_compile.py compiles over axes out of mesh order on gloo-4 by default
def test_compile_over_axes_out_of_mesh_order_on_gloo(gloo):
    check_compiled(gloo.run(4, job_compile, "aot_eager", "ppermute ring", ("y", "x"), (2, 2), timeout=300))


@pytest.mark.slow
def test_compile_inductor_on_gloo(gloo):
    check_compiled(gloo.run(2, job_compile, "inductor", "mlp", timeout=400))


# --- failures: these leave their pool broken, so they run last ----------------------------------


def job_run_check_mixed() -> str:
    """run_check on a 2x2 mesh, (Replicate, Replicate): only rank 0's shard differs, so the
    axis-'x' check fails in group {0, 2} and passes in group {1, 3}."""
    mesh = _gloo_mesh((2, 2), ("x", "y"))
    local = torch.full((2,), 1.0 if _rank() == 0 else 0.0)
    try:
        fd.from_local(local, mesh, (R(), R()), run_check=True)
    except fd.LayoutError:
        return "LayoutError"
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    return "no error"


def test_from_local_run_check_raises_on_every_rank(gloo):
    """Every rank raises, also those whose own groups agree: a rank that went on alone would
    wait for the others in its next collective."""
    try:
        answers = gloo.run(4, job_run_check_mixed, timeout=3)
    except RankError as e:
        answers = [o.value if o is not None and o.ok else (o.error if o else "no answer") for o in e.outcomes]
    assert answers == ["LayoutError"] * 4, answers


COLLECTIVE_TIMEOUT = 5.0


def job_stuck_rank(mode: str) -> dict | None:
    """Rank 1 skips a collective (returns to its job loop, or exits); rank 0 runs psum and
    reports how it ended."""
    mesh = _gloo_mesh((2,), ("x",))
    f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())
    f(torch.ones(2))  # both ranks: the groups exist and work
    if _rank() == 1:
        if mode == "exit":
            os._exit(3)
        return None  # alive, but never joins rank 0's psum
    try:
        f(torch.ones(2)).full_tensor()
    except BaseException as e:
        return {"types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    return {"types": [], "message": "no error"}


@pytest.mark.breaks_pool
def test_stuck_rank_becomes_an_error_within_the_timeout():
    """A rank that never joins a collective: the others raise when the group's timeout fires
    (a pool of its own, with a short timeout, discarded after). The bound is the job's: rank 0
    answers within it or the run fails; the test reads no clock."""
    with RankPool(2, timeout=COLLECTIVE_TIMEOUT) as pool:
        pool.wait_ready()
        got = pool.run(job_stuck_rank, "skip", timeout=COLLECTIVE_TIMEOUT + 25)[0]
        pool.discard()  # rank 0's group timed out: it is unusable
        assert all(not alive for alive in _alive(pool)), "ranks left running"
    assert "CommunicationError" in got["types"] and "RuntimeError" in got["types"], got
    assert "Timed out" in got["message"], got  # gloo's word: the group's timeout fired


def _alive(pool: RankPool) -> list[bool]:
    return [p.is_alive() for p in pool._procs]


@pytest.mark.breaks_pool
def test_dead_rank_becomes_a_communication_error(gloo):
    """Rank 1 of the session's 2-rank pool exits while rank 0 runs psum: rank 0 raises promptly
    (the pool is broken after, and the next use starts a fresh one). Promptly: well within the
    group's 60 s timeout, or the job's 30 s bound fails the run; the test reads no clock."""
    with pytest.raises(RankError, match="rank 1 died") as info:
        gloo.run(2, job_stuck_rank, "exit", timeout=30)
    rank0 = info.value.outcomes[0]
    assert rank0 is not None and rank0.ok, info.value
    got = rank0.value
    assert "CommunicationError" in got["types"] and "RuntimeError" in got["types"], got
    assert "Timed out" not in got["message"], got  # the peer's exit, not the group's timeout
