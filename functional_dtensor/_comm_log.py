"""A record of the communication that collectives perform, for :class:`CommDebugMode`.

Collectives report each execution here: the op, the mesh axes, and the bytes of the local
value each device contributes. Nothing is recorded, and nothing costs, unless a recorder is
active.

A collective traced by ``torch.compile`` reports when the compiled graph runs, not when it is
traced: :func:`record` then puts the op ``functional_dtensor::record_communication`` into the
graph, an ordered side effect that the compiler keeps, in forward and backward graphs alike,
and that records if a recorder is active when it runs. It does so only while some recorder is
active, in any thread: Dynamo guards the graph on that flag, so a compiled function first
called under a recorder compiles a variant that records, and outside any recorder its graph
carries no op and costs nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch._library.effects import EffectType

__all__ = ["CommEvent", "recording", "record", "active"]


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One collective executed: ``op`` over mesh ``axes``, ``nbytes`` per device."""

    op: str
    axes: tuple[str, ...]
    nbytes: int
    module: str | None = None


_local = threading.local()


def _recorders() -> list:
    found = getattr(_local, "recorders", None)
    if found is None:
        found = _local.recorders = []
    return found


def active() -> bool:
    return bool(getattr(_local, "recorders", None))


def record(op: str, axes: tuple[str, ...], nbytes: int) -> None:
    """Record ``op`` over mesh ``axes`` moving ``nbytes`` per device (while compiling: when
    the compiled graph runs)."""
    if torch.compiler.is_compiling():
        if _recording_anywhere:
            _record_when_run(op, _SEPARATOR.join(axes), nbytes)
        return
    recorders = _recorders()
    if recorders:
        module = getattr(_local, "module", None)
        event = CommEvent(op, axes, nbytes, module)
        for recorder in recorders:
            recorder.append(event)


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


def set_module(name: str | None) -> str | None:
    previous = getattr(_local, "module", None)
    _local.module = name
    return previous


_SEPARATOR = "\x1f"  # joins the axis names: an op's arguments are strings, not tuples of them


@torch.library.custom_op("functional_dtensor::record_communication", mutates_args=())
def _record_when_run(op: str, axes: str, nbytes: int) -> None:
    """:func:`record`, as an op of a compiled graph."""
    if active():
        record(op, tuple(axes.split(_SEPARATOR)) if axes else (), nbytes)


@_record_when_run.register_fake
def _(op: str, axes: str, nbytes: int) -> None:
    return None


_record_when_run.register_effect(EffectType.ORDERED)  # kept where it is, never dropped
