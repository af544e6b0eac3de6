"""The collective checks (``fd.check_collectives``): ranks that call different collectives at
the same position are found before the collective runs, on every rank, with both ranks' calls
and lines; a rank that never arrives is reported after the timeout with the last collective it
called. Twenty kinds of mismatch seeded on 2 and 4 real gloo ranks (the session's pools: a
mismatch found leaves their groups usable), and ranks that exit or wait elsewhere (fresh ranks,
:mod:`rank_trials`)."""

from __future__ import annotations

import os

import pytest
import rank_trials
import torch

import functional_dtensor as fd

pytestmark = pytest.mark.distributed

S, R, Pa = fd.Shard, fd.Replicate, fd.Partial
X = torch.arange(64.0).reshape(16, 4)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _mesh(world: int) -> fd.DeviceMesh:
    return fd.init_device_mesh("cpu", (world,), ("x",))


def _run(world: int, body, *, out=fd.P("x"), x=X):
    """``body`` on every rank's block of ``x``, in shard_map over a 1-d mesh."""
    f = fd.shard_map(body, mesh=_mesh(world), in_specs=fd.P("x"), out_specs=out, check_rep=False)
    return f(x)


# Each kind: every rank runs it; the last rank (``odd``) does something else at one position.


def kind_psum_vs_all_gather(world, odd):
    _run(world, lambda v: fd.all_gather(v, "x", tiled=True) if odd else fd.psum(v, "x"))


def kind_psum_vs_pmax(world, odd):
    _run(world, lambda v: fd.pmax(v, "x") if odd else fd.psum(v, "x"))


def kind_psum_vs_pmean(world, odd):
    _run(world, lambda v: fd.pmean(v, "x") if odd else fd.psum(v, "x"))


def kind_psum_vs_psum_scatter(world, odd):
    _run(world, lambda v: fd.psum_scatter(v, "x", tiled=True) if odd else fd.psum(v, "x"))


def kind_other_axis(world, odd):
    mesh = fd.init_device_mesh("cpu", (2, world // 2), ("x", "y"))
    other = ("x", "y") if world == 2 else "y"  # on 2 ranks 'y' has one device: the pair instead
    f = fd.shard_map(
        lambda v: fd.psum(v, other if odd else "x"),
        mesh=mesh,
        in_specs=fd.P(),
        out_specs=fd.P(),
        check_rep=False,
    )
    f(X)


def kind_all_gather_dim(world, odd):
    _run(world, lambda v: fd.all_gather(v, "x", axis=1 if odd else 0, tiled=True))


def kind_all_gather_tiled(world, odd):
    _run(world, lambda v: fd.all_gather(v, "x", tiled=not odd).reshape(-1, 4))


def kind_shape(world, odd):
    _run(world, lambda v: fd.psum(v[:2] if odd else v, "x"))


def kind_dtype(world, odd):
    _run(world, lambda v: fd.psum(v.double() if odd else v, "x").float())


def kind_extra_collective(world, odd):
    def body(v):
        v = fd.psum(v, "x")
        if odd:
            v = fd.psum(v, "x")
        return fd.all_gather(v, "x", tiled=True)

    _run(world, body, out=fd.P())


def kind_skipped_collective(world, odd):
    def body(v):
        if not odd:
            v = fd.psum(v, "x")
        return fd.all_gather(v, "x", tiled=True)

    _run(world, body, out=fd.P())


def kind_swapped_order(world, odd):
    def body(v):
        if odd:
            return fd.psum(fd.all_gather(v, "x", tiled=True), "x")
        return fd.all_gather(fd.psum(v, "x"), "x", tiled=True)

    _run(world, body, out=fd.P())


def kind_ppermute_perm(world, odd):
    ring = [(i, (i + 1) % world) for i in range(world)]
    _run(world, lambda v: fd.ppermute(v, "x", ring[:-1] if odd else ring))  # a shift, or the ring


def kind_all_to_all_dims(world, odd):
    split, concat = (1, 0) if odd else (0, 1)
    _run(world, lambda v: fd.all_to_all(v.reshape(-1)[:16].reshape(4, 4), "x", split, concat, tiled=True))


def kind_bucket_order(world, odd):
    """The bug of iterating a set: buckets of gradients summed in another order per process."""
    sizes = [3, 5, 7]
    if odd:
        sizes.reverse()
    _run(world, lambda v: torch.cat([fd.psum(v.reshape(-1)[:n], "x") for n in sizes]), out=fd.P())


def kind_redistribute_target(world, odd):
    x = fd.distribute_tensor(X, _mesh(world), fd.P("x"))
    fd.redistribute(x, fd.P(None, "x") if odd else fd.P())


def kind_global_op_layouts(world, odd):
    mesh = _mesh(world)
    a = fd.distribute_tensor(X.reshape(8, 8), mesh, fd.P("x"))
    b = fd.distribute_tensor(X.reshape(8, 8), mesh, fd.P(None, "x") if odd else fd.P("x"))
    (a @ b).full_tensor()


def kind_full_tensor_layouts(world, odd):
    mesh = _mesh(world)
    local = X[:4] if odd else X[: 16 // world]
    placements = (Pa("sum"),) if odd else (S(0),)
    fd.from_local(local, mesh, placements, shape=(4 if odd else 16, 4)).full_tensor()


def kind_other_mesh(world, odd):
    meshes = [fd.init_device_mesh("cpu", (world,), (name,)) for name in ("x", "z")]  # on every rank
    mesh = meshes[odd]
    name = mesh.axis_names[0]
    f = fd.shard_map(lambda v: fd.psum(v, name), mesh=mesh, in_specs=fd.P(name), out_specs=fd.P(name))
    f(X)


def kind_backward(world, odd):
    x = X.clone().requires_grad_()
    y = _run(world, lambda v: fd.all_gather(v, "x", tiled=True), out=fd.P(), x=x)
    if odd:  # skips the backward pass: its next collective meets the others' transpose
        _run(world, lambda v: fd.psum(v, "x"))
    else:
        torch.autograd.grad(y.full_tensor().sum(), x)  # all_gather's transpose: psum_scatter


KINDS = {name.removeprefix("kind_"): fn for name, fn in list(globals().items()) if name.startswith("kind_")}


def job_mismatch(kind: str) -> dict:
    """Every rank runs ``kind`` with the checks on; each answers how it ended, and whether the
    process group still works after (a psum, unchecked)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    try:
        with fd.check_collectives(timeout=20):
            KINDS[kind](world, _rank() == world - 1)
        ended = {"types": [], "message": "no error"}
    except Exception as e:
        ended = {"types": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=_mesh(world), in_specs=fd.P("x"), out_specs=fd.P())
    ended["after"] = f(torch.ones(world)).full_tensor().tolist()
    return ended


def test_there_are_twenty_kinds():
    assert len(KINDS) == 20, sorted(KINDS)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_mismatch_is_found_on_every_rank(kind, world, gloo):
    answers = gloo.run(world, job_mismatch, kind, timeout=60)
    here = os.path.basename(__file__)
    for rank, got in enumerate(answers):
        assert "CollectiveMismatchError" in got["types"], f"rank {rank}: {got}"
        assert "CommunicationError" in got["types"] and "RuntimeError" in got["types"]
        message = got["message"]
        # found by comparing the ranks' calls (the message says how they differ), not at the checks'
        # timeout (20 s): the job's own bound (60 s) is the harness's, no clock is read here
        # both ranks' calls, each with its line in this file
        assert message.count(f"{here}:") >= 2, message
        assert "called different collectives" in message and "they differ in" in message, message
        assert got["after"] == [float(world)], f"rank {rank}: the process group is unusable after: {got}"
    odd = answers[-1]["message"]
    assert f"this rank ({world - 1})" in odd, odd


def test_checks_off_by_default_and_scoped():
    from functional_dtensor._distributed import checks

    assert checks.on is False
    with fd.check_collectives():
        assert checks.on is True
        with fd.check_collectives(False):
            assert checks.on is False
        assert checks.on is True
    assert checks.on is False


def test_fingerprints_of_one_group_are_compared_field_by_field():
    """The verdict, from fingerprints alone: ranks of one group compared in every field;
    ranks of different groups only in their position (uneven shards may differ in shape)."""
    from functional_dtensor._distributed import checks

    def fp(rank, group, **changes):
        base = {
            "rank": rank,
            "position": 3,
            "name": "psum",
            "params": {},
            "mesh": [[2, 2], ["x", "y"]],
            "axes": ["x"],
            "group": group,
            "shape": [4],
            "dtype": "float32",
            "site": f"train.py:{10 + rank}",
        }
        return {**base, **changes}

    same = [fp(0, [0, 2]), fp(1, [1, 3], shape=[3]), fp(2, [0, 2]), fp(3, [1, 3], shape=[3])]
    assert checks._problems(same) == []
    other_axis = [fp(0, [0, 2]), fp(1, [1, 3]), fp(2, [2, 3], axes=["y"]), fp(3, [2, 3], axes=["y"])]
    assert checks._problems(other_axis)[0] == (0, 2, ["axes", "group"])
    later = [fp(0, [0, 2]), fp(1, [1, 3], position=4), fp(2, [0, 2]), fp(3, [1, 3], position=4)]
    assert checks._problems(later) == [(0, 1, ["position"]), (0, 3, ["position"])]
    message = checks._mismatch(2, other_axis, checks._problems(other_axis))
    assert "this rank (2) and rank 0" in message and "train.py:12" in message and "train.py:10" in message


# --- ranks that do not arrive: fresh ranks ------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["exits", "waits elsewhere"])
def test_a_rank_that_never_arrives_is_reported_with_its_last_collective(how, world):
    program = "skip_last_then_exit" if how == "exits" else "skip_last_then_wait"
    timeout = 3.0
    trial = rank_trials.run_trial(
        world,
        program,
        rank_trials.Plan(world - 1, 0, how="exit" if how == "exits" else "stall"),
        timeout=timeout,
        check=True,
    )
    for rank in range(world - 1):
        got = trial.results[rank]
        assert got is not None and not got["ok"], (rank, trial.results, trial.logs[rank])
        assert "CommunicationError" in got["types"], got
        message = got["message"]
        assert "psum over mesh axis 'x'" in message and "rank_trials.py:" in message, message
        assert f"rank {world - 1} last called psum" in message, message  # as the store says
        if how == "waits elsewhere":  # alive: found at the timeout
            assert timeout * 0.8 < got["time"] - trial.failed["time"] < timeout + 5, (got, trial.failed)
    assert all(not rank_trials.alive(pid) for pid in trial.pids)
