"""A record of the communication that collectives perform, for :class:`CommDebugMode`.

Collectives report each execution here: the op, the mesh axes, and the bytes of the local
value each device contributes. Nothing is recorded, and nothing costs, unless a recorder is
active.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

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
        return self

    def __exit__(self, *exc):
        _recorders().remove(self.events)
        return False


def set_module(name: str | None) -> str | None:
    previous = getattr(_local, "module", None)
    _local.module = name
    return previous
