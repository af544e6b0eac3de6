"""Killed and stuck ranks: a rank that raises, exits, is killed (SIGKILL) or gets stuck, before,
inside or between collectives, inside ``shard_map``, ``redistribute``, global operations and a
training step. Every other rank must fail within the trial's deadline with a
``fd.CommunicationError`` that names the collective and the mesh axis, and no process may be
left behind. Twenty trials at seeded random points on fresh gloo ranks (:mod:`rank_trials`), in
the slow tier; the slowest detection is printed (a figure, not a verdict: no test reads a
clock to pass or fail)."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import rank_trials
from rank_trials import Plan

import functional_dtensor as fd

pytestmark = pytest.mark.distributed

TIMEOUT = 3.0  # the process groups' collective timeout in the trials, seconds
TRIALS = 20
HOWS = ["raise", "exit", "os_exit", "sigkill", "stall"]
PROGRAMS = ["shard_map", "redistribute", "global_ops", "training"]
# the library's c10d calls each program makes, on 2 and on 4 ranks, the last a psum over the whole
# mesh (a trial fails a rank at one of them but the last: the others have a collective left)
CALLS = {
    ("shard_map", 2): 16,
    ("shard_map", 4): 16,
    ("redistribute", 2): 6,
    ("redistribute", 4): 12,
    ("global_ops", 2): 10,
    ("global_ops", 4): 10,
    ("training", 2): 4,
    ("training", 4): 20,
}
_NAMED = re.compile(
    r"\b(psum|pmean|pmax|pmin|all_gather|psum_scatter|all_to_all|ppermute|reduce|broadcast) "
    r"over mesh ax[ie]s "
)


def plans(seed: int = 20261123) -> list[tuple[str, int, Plan]]:
    """``TRIALS`` trials: every (program, how) pair once; the world, the failing rank, the call
    and the moment (before, inside, between) drawn at random. The first fails before any
    collective."""
    draw = random.Random(seed)
    out = []
    for i in range(TRIALS):
        program, how = PROGRAMS[i % len(PROGRAMS)], HOWS[i % len(HOWS)]
        world = draw.choice([2, 2, 4])
        whens = ["before", "after"] + (["inside"] if how in ("os_exit", "sigkill") else [])
        at = 1 if i == 0 else draw.randrange(1, CALLS[program, world])
        when = "before" if i == 0 else draw.choice(whens)
        out.append((program, world, Plan(draw.randrange(world), at, when, how)))
    return out


def test_the_trials_cover_every_failure_and_place():
    drawn = plans()
    assert len(drawn) == TRIALS
    assert {(p, plan.how) for p, _, plan in drawn} == {(p, h) for p in PROGRAMS for h in HOWS}
    assert {plan.when for _, _, plan in drawn} == {"before", "inside", "after"}
    assert {w for _, w, _ in drawn} == {2, 4}


@pytest.mark.slow
def test_killed_and_stuck_ranks_fail_every_other_rank(capsys):
    records = []
    hangs = []
    for program, world, plan in plans():
        trial = rank_trials.run_trial(world, program, plan, timeout=TIMEOUT, deadline=TIMEOUT + 30)
        where = f"{program} on {world} ranks, {plan}"
        assert trial.failed is not None, f"{where}: the failure was never injected\n{trial.logs}"
        for rank in range(world):
            if rank == plan.rank:
                continue
            got = trial.results[rank]
            if got is None:
                hangs.append(where)
                continue
            assert not got["ok"], f"{where}: rank {rank} finished as if nothing happened"
            assert "CommunicationError" in got["types"], f"{where}: rank {rank}: {got}\n{trial.logs[rank]}"
            assert _NAMED.search(got["message"]), f"{where}: rank {rank}: {got['message']}"
            records.append((got["time"] - trial.failed["time"], where, rank, got["message"]))
        # no process left behind: the survivors exited by themselves, only a stuck rank was
        # killed (as torchrun would tear it down), and every process is gone
        assert set(trial.killed) <= ({plan.rank} if plan.how == "stall" else set()), (where, trial.killed)
        assert not [pid for pid in trial.pids if rank_trials.alive(pid)], where
    assert hangs == [], hangs
    slowest = max(records)
    prompt = [r for r in records if "stall" not in r[1]]
    summary = {
        "trials": TRIALS,
        "hangs": len(hangs),
        "detections": len(records),
        "slowest_s": round(slowest[0], 3),
        "slowest_trial": slowest[1],
        "slowest_not_stuck_s": round(max(prompt)[0], 3),
        "timeout_s": TIMEOUT,
    }
    with capsys.disabled():
        print(f"\nkill trials: {json.dumps(summary)}\nslowest message: {slowest[3][:400]}")


def test_the_default_collective_timeout_is_at_most_a_minute():
    from functional_dtensor._distributed import errors, runtime

    assert runtime.DEFAULT_TIMEOUT is errors.DEFAULT_TIMEOUT
    if "FD_COLLECTIVE_TIMEOUT" not in os.environ:
        assert errors.DEFAULT_TIMEOUT.total_seconds() == 60


def test_the_error_names_the_collective_axis_group_and_line():
    """The message of a failed c10d call, from the translation alone (a group-less stand-in)."""
    from functional_dtensor._distributed import errors

    def lost(*args, group):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    with pytest.raises(fd.CommunicationError) as info:
        errors.c10d(lost, group=None, name="all_gather", axes=("tp",))
    message = str(info.value)
    assert message.startswith("all_gather over mesh axis 'tp'"), message
    assert f"{os.path.basename(__file__)}:" in message and "Connection closed by peer" in message
    assert "FD_CHECK_COLLECTIVES=1" in message


def job_group_timeouts() -> list[float]:
    """The timeout of every group of a 2x2 mesh (each axis, the flattened pair)."""
    import torch

    from functional_dtensor._distributed import runtime

    mesh = fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    groups = [runtime.group(mesh, axes) for axes in (("dp",), ("tp",), ("dp", "tp"))]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def test_mesh_axis_groups_share_the_collective_timeout(gloo):
    """torch gives the groups it makes its own default timeout (30 minutes): a stuck rank of one
    mesh axis would hang the others that long. The mesh's groups get the process group's."""
    pool = gloo.pool(4)
    for rank, timeouts in enumerate(pool.run(job_group_timeouts)):
        assert timeouts == [pool.timeout] * 3, (rank, timeouts)
