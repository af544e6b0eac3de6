"""A record of the communication that collectives perform, for :class:`CommDebugMode`.

Collectives report each execution here: the op, the mesh axes, the number of devices in the
group, and the bytes of the local value each device contributes; the record adds the module
running (set by :class:`CommDebugMode`) and the phase (``"backward"`` while the autograd
engine runs). Nothing is recorded, and nothing costs, unless a recorder is active. Each
collective is also logged at DEBUG on the logger ``functional_dtensor.collectives`` (checked
with ``isEnabledFor`` first: nothing costs while it is off).

A collective traced by ``torch.compile`` reports when the compiled graph runs, not when it is
traced: :func:`record` then puts the op ``functional_dtensor::record_communication`` into the
graph, an ordered side effect that the compiler keeps, in forward and backward graphs alike,
and that records if a recorder is active when it runs. It does so only while some recorder is
active, in any thread: Dynamo guards the graph on that flag, so a compiled function first
called under a recorder compiles a variant that records, and outside any recorder its graph
carries no op and costs nothing.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch._library.effects import EffectType

from ._plan import collective_bytes

__all__ = ["CommEvent", "recording", "record", "active", "logger"]

#: each collective issued, at DEBUG
logger = logging.getLogger("functional_dtensor.collectives")


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One collective executed: ``op`` over mesh ``axes`` (a group of ``group_size``
    devices), each device contributing ``nbytes`` (its local input); ``module`` the path of
    the innermost module running (``None`` outside any), ``phase`` ``"forward"`` or
    ``"backward"``."""

    op: str
    axes: tuple[str, ...]
    nbytes: int
    module: str | None = None
    group_size: int = 1
    phase: str = "forward"

    @property
    def wire_bytes(self) -> Fraction:
        """The bytes each device sends (= receives) on the wire, as ``fd.explain_redistribute``
        counts them: ``(k-1) b`` for an all_gather, ``2 (k-1)/k b`` for a (ring) all_reduce,
        ``(k-1)/k b`` for a reduce_scatter or all_to_all, ``b`` for a ppermute (``b`` =
        ``nbytes``, ``k`` = ``group_size``)."""
        return collective_bytes(self.op, self.group_size, self.nbytes)


_local = threading.local()


def _recorders() -> list:
    found = getattr(_local, "recorders", None)
    if found is None:
        found = _local.recorders = []
    return found


def active() -> bool:
    return bool(getattr(_local, "recorders", None))


def wanted() -> bool:
    """Whether :func:`record` has anything to do: a recorder active, the DEBUG log on, or a
    graph being compiled (which records when it runs)."""
    return torch.compiler.is_compiling() or active() or logger.isEnabledFor(logging.DEBUG)


def record(op: str, axes: tuple[str, ...], nbytes: int, group_size: int) -> None:
    """Record ``op`` over mesh ``axes`` (``group_size`` devices) on ``nbytes`` per device
    (while compiling: when the compiled graph runs)."""
    if torch.compiler.is_compiling():
        if _recording_anywhere:  # (a compiled graph logs only where it also records)
            _record_when_run(op, _SEPARATOR.join(axes), nbytes, group_size)
        return
    recorders = _recorders()
    logging_on = logger.isEnabledFor(logging.DEBUG)
    if not (recorders or logging_on):
        return
    backward = torch._C._current_graph_task_id() != -1  # the autograd engine is running
    module = getattr(_local, "backward_module" if backward else "module", None)
    event = CommEvent(op, axes, nbytes, module, group_size, "backward" if backward else "forward")
    for recorder in recorders:
        recorder.append(event)
    if logging_on:
        logger.debug(
            "%s over %s (%d devices): %d bytes in, %s bytes on the wire per device [%s, %s]",
            op,
            ",".join(axes),
            group_size,
            nbytes,
            event.wire_bytes,
            module or "-",
            event.phase,
        )


class recording:
    """Context manager collecting :class:`CommEvent` s into ``self.events``."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def __enter__(self):
        _recorders().append(self.events)
        _count_open(1)
        return self

    def __exit__(self, *exc):
        _recorders().remove(self.events)
        _count_open(-1)
        return False


_open = 0  # recorders active in all threads
_recording_anywhere = False  # _open > 0: a global, so that Dynamo guards the graphs it traces on it
_open_lock = threading.Lock()


def _count_open(change: int) -> None:
    global _open, _recording_anywhere
    with _open_lock:
        _open += change
        _recording_anywhere = _open > 0


def set_module(name: str | None, *, backward: bool = False) -> str | None:
    """Name the module running forward (``backward``: whose backward is running), for the
    events recorded in this thread from now; returns the previous name."""
    attribute = "backward_module" if backward else "module"
    previous = getattr(_local, attribute, None)
    setattr(_local, attribute, name)
    return previous


_SEPARATOR = "\x1f"  # joins the axis names: an op's arguments are strings, not tuples of them


@torch.library.custom_op("functional_dtensor::record_communication", mutates_args=())
def _record_when_run(op: str, axes: str, nbytes: int, group_size: int) -> None:
    """:func:`record`, as an op of a compiled graph."""
    record(op, tuple(axes.split(_SEPARATOR)) if axes else (), nbytes, group_size)


@_record_when_run.register_fake
def _(op: str, axes: str, nbytes: int, group_size: int) -> None:
    return None


_record_when_run.register_effect(EffectType.ORDERED)  # kept where it is, never dropped
