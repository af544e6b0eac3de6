"""Collective checks, a debug mode of the distributed backend: before each eager collective,
every rank says what it is about to call, and the ranks compare.

Ranks that call different collectives at the same position hang (gloo and NCCL wait for a
partner that never comes) or, worse, return wrong values without a word (the same collective on
tensors of different shapes or in another order). With the checks on, each collective first
exchanges a fingerprint over one gloo group spanning the whole world: the library's collective
(``psum``, ``all_gather``, ...), its parameters, the mesh, the mesh axes and the ranks of the
group, the shape and dtype of this rank's tensor, its position in the rank's sequence of
collectives, and the user's line that called it. Every rank compares the fingerprints of the
ranks of each group with one another, so all reach one verdict, and on a mismatch every rank
raises :class:`CollectiveMismatchError` before any of them enters the collective, naming what
each of the two ranks called and where. A rank that never arrives (it exited, died, or skipped
the collective while the others called it) is reported after the timeout with the last
collective it did call, read from the store.

Off by default, the kernels pay one boolean test (:data:`on`); on, each collective pays an
all-gather of a small fingerprint over the world and a write to the store. Eager only: a graph
traced by ``torch.compile`` runs its collectives unchecked. The checks assume SPMD programs:
every rank calls the same number of collectives (each in its own groups).
"""

from __future__ import annotations

import contextlib
import datetime
import json

import torch
import torch.distributed as dist

from .._errors import CollectiveMismatchError, CommunicationError, explain
from .._mesh import DeviceMesh
from .errors import DEFAULT_TIMEOUT, call_site, describe, seconds

__all__ = ["on", "check", "check_collectives", "enable", "start"]

on = False  # the one flag the kernels test: whether collectives are checked now

_SIZE = 2048  # bytes of one fingerprint
_COMPARED = ("position", "name", "params", "mesh", "axes", "group", "shape", "dtype")
_KEY = "fd_check_collectives/last/"
_FIELDS = {"name": "collective", "params": "parameters", "axes": "mesh axes"}  # as messages say them

_timeout: datetime.timedelta | None = None  # None: DEFAULT_TIMEOUT
_group = None  # the world's gloo group the fingerprints travel on
_world = None  # the default process group the check group was made in
_position = 0  # the collectives this process checked


@contextlib.contextmanager
def check_collectives(enabled: bool = True, *, timeout: float | datetime.timedelta | None = None):
    """Check, before each collective on the distributed backend, that every rank calls the
    same one: the same collective on the same mesh axes, with the same shapes, dtypes and
    parameters, at the same position in each rank's sequence of collectives. A mismatch raises
    :class:`fd.CollectiveMismatchError` on every rank, before any rank enters the collective,
    with what each of the two ranks called and the line of user code that called it.

    Enter it on every rank at the same point of the program (it makes a process group the
    first time). Also on for a whole run with ``FD_CHECK_COLLECTIVES=1`` or
    ``fd.init_device_mesh(..., check_collectives=True)``. ``timeout`` (seconds) bounds the wait
    for the other ranks at each collective (default: the collective timeout, 60 s or
    ``FD_COLLECTIVE_TIMEOUT``); a rank that does not arrive in time is reported with the last
    collective it called. Eager collectives only; on a simulated mesh it does nothing (one
    process runs every device).

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh((2,), ("x",))
    >>> with fd.check_collectives():
    ...     fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())(
    ...         torch.ones(4)
    ...     ).full_tensor()
    tensor([2., 2.])
    """
    global on, _timeout
    before = on, _timeout
    on = bool(enabled)
    if timeout is not None:
        _timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if on:
        start()
    try:
        yield
    finally:
        on, _timeout = before


def enable(timeout: datetime.timedelta | None = None) -> None:
    """Check every collective from now on (``timeout``: the wait for the other ranks)."""
    global on, _timeout
    on = True
    if timeout is not None:
        _timeout = timeout
    start()


def start() -> None:
    """Make the world's check group, once per process group (every rank at once), when
    ``torch.distributed`` is initialized."""
    global _group, _world
    if not dist.is_initialized():
        return
    world = dist.distributed_c10d._get_default_group()
    if _group is None or _world is not world:
        _group = dist.new_group(backend="gloo", timeout=_timeout or DEFAULT_TIMEOUT)
        _world = world


def check(name: str, x: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], group, params: dict) -> None:
    """Before the collective ``name`` over ``axes`` of ``mesh`` (on ``group``) on ``x``: compare
    with every rank what it is about to call; raise on every rank if two ranks of one group
    disagree, or if a rank does not arrive within the timeout."""
    global _position
    start()
    _position += 1
    rank = dist.get_rank()
    mine = {
        "rank": rank,
        "position": _position,
        "name": name,
        "params": {k: repr(v) for k, v in params.items()},
        "mesh": [list(mesh.shape), list(mesh.axis_names)],
        "axes": list(axes),
        "group": dist.get_process_group_ranks(group),
        "shape": list(x.shape),
        "dtype": str(x.dtype).removeprefix("torch."),
        "site": call_site(),
    }
    payload = _encode(mine)
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_KEY + str(rank), payload)
    timeout = _timeout or DEFAULT_TIMEOUT
    world = dist.get_world_size()
    gathered = [torch.empty(_SIZE, dtype=torch.uint8) for _ in range(world)]
    options = dist.distributed_c10d.AllgatherOptions()
    options.timeout = timeout
    sent = torch.frombuffer(bytearray(payload.ljust(_SIZE)), dtype=torch.uint8)
    try:
        _group.allgather([gathered], [sent], options).wait()
    except RuntimeError as error:
        raise CommunicationError(_absent(mine, group, timeout, error, store, world)) from error
    prints = [json.loads(t.numpy().tobytes()) for t in gathered]
    problems = _problems(prints)
    if problems:
        raise CollectiveMismatchError(_mismatch(rank, prints, problems))


def _encode(fingerprint: dict) -> bytes:
    """The fingerprint as JSON of at most ``_SIZE`` bytes (long texts shortened)."""
    payload = json.dumps(fingerprint).encode()
    if len(payload) > _SIZE:
        fingerprint = dict(fingerprint, site=fingerprint["site"][:400])
        fingerprint["params"] = {k: v[:200] for k, v in fingerprint["params"].items()}
        payload = json.dumps(fingerprint).encode()
    if len(payload) > _SIZE:
        fingerprint["params"] = {"hash": str(hash(json.dumps(fingerprint["params"])))}
        fingerprint["group"] = fingerprint["group"][:8] + ["..."] + [str(hash(str(fingerprint["group"])))]
        payload = json.dumps(fingerprint).encode()
    return payload


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _problems(prints: list[dict]) -> list[tuple[int, int, list[str]]]:
    """``(rank, other rank, fields that differ)`` for each pair of ranks that disagree: two
    ranks of one group (as either names it), or two ranks at different positions."""
    found: list[tuple[int, int, list[str]]] = []
    seen = set()
    for fp in prints:
        peers = [p for p in fp["group"] if isinstance(p, int)]
        for other in [*peers, 0]:
            pair = (min(fp["rank"], other), max(fp["rank"], other))
            if other == fp["rank"] or pair in seen or other >= len(prints):
                continue
            differ = [k for k in _COMPARED if fp[k] != prints[other][k]]
            if "name" in differ:  # other collectives: their parameters differ as a matter of course
                differ = [k for k in differ if k != "params"]
            if other == 0 and other not in peers:
                differ = [k for k in differ if k == "position"]  # ranks of other groups: in step
            if differ:
                seen.add(pair)
                found.append((pair[0], pair[1], differ))
    return found


def _what(fp: dict) -> str:
    """What a rank called, in a line: ``psum(...) over mesh axis 'x' (group of ranks [0, 1])
    of mesh [x=2] on float32 (4, 2), collective #3, at file:line `code```."""
    params = ", ".join(f"{k}={v}" for k, v in fp["params"].items())
    params = f"({params})" if params else ""
    axes = fp["axes"]
    over = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {tuple(axes)!r}"
    mesh = ", ".join(f"{n}={s}" for s, n in zip(*fp["mesh"]))
    return (
        f"{fp['name']}{params} over {over} (group of ranks {fp['group']}) of mesh [{mesh}] on "
        f"{fp['dtype']} {tuple(fp['shape'])}, collective #{fp['position']}, at {fp['site']}"
    )


_FIX = (
    "every rank must call the same collectives in the same order, on the same mesh axes, with "
    "the same shapes and dtypes: look for control flow that depends on the rank or on its data, "
    "and for iteration over a set (or another order that differs between processes)"
)


def _mismatch(rank: int, prints: list[dict], problems: list[tuple[int, int, list[str]]]) -> str:
    mine = [p for p in problems if rank in p[:2]]
    a, b, differ = (mine or problems)[0]
    if mine:
        other = b if a == rank else a
        first, second = prints[rank], prints[other]
        who, whom = f"this rank ({rank})", f"rank {other}"
        stop = ""
    else:
        first, second = prints[a], prints[b]
        who, whom = f"rank {a}", f"rank {b}"
        stop = f"; this rank ({rank}) stops too, rather than wait for them"
    return explain(
        f"fd.check_collectives (collective #{prints[rank]['position']} of rank {rank})",
        f"{who} and {whom} called different collectives at the same position{stop}",
        expected=f"the same collective on both: {who} called {_what(first)}",
        got=f"{whom} called {_what(second)}; they differ in {', '.join([_FIELDS.get(d, d) for d in differ])}",
        fix=_FIX,
    )


def _absent(mine: dict, group, timeout: datetime.timedelta, error: Exception, store, world: int) -> str:
    """The message of a check whose exchange failed: a rank died, or did not arrive in time;
    what each other rank last called, as it wrote it to the store."""
    seen = []
    for other in range(world):
        if other == mine["rank"] or store is None:
            continue
        try:
            last = json.loads(store.get(_KEY + str(other))) if store.check([_KEY + str(other)]) else None
        except Exception:
            last = None
        if last is None:
            seen.append(f"rank {other} called no checked collective")
        elif last["position"] < mine["position"]:
            seen.append(f"rank {other} last called {_what(last)}")
    return explain(
        f"{describe(mine['name'], tuple(mine['axes']), group)}, called at {mine['site']}",
        f"rank {mine['rank']} reached collective #{mine['position']} and not every rank came (it "
        f"waits {seconds(timeout)} at most, fd.check_collectives)",
        expected="every rank at the same collective",
        got=f"{str(error).splitlines()[0]}; " + ("; ".join(seen) or "no rank wrote what it last called"),
        fix="a rank that exited, died, or skipped this collective (or is stuck before it) stops the "
        "others: look at the ranks named above and their logs; " + _FIX,
    )
