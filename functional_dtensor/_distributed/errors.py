"""Failures of ``torch.distributed`` calls, translated: a collective that fails because a peer
died, hung past the process group's timeout or dropped its connection becomes a
:class:`CommunicationError` that names the library's collective (``psum``, ``all_gather``, ...),
its mesh axes and group, the user's line that called it, and tells where to look.

The timeout (:data:`DEFAULT_TIMEOUT`, 60 s unless ``FD_COLLECTIVE_TIMEOUT`` says otherwise)
bounds every collective of the process group ``fd.init_device_mesh`` creates."""

from __future__ import annotations

import datetime
import linecache
import os
import sys

import torch
import torch.distributed as dist

from .._errors import CommunicationError, explain

__all__ = ["c10d", "DEFAULT_TIMEOUT", "call_site", "describe", "seconds"]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("FD_COLLECTIVE_TIMEOUT", 60)))

_LOST_PEER = ("timed out", "timeout", "connection", "closed", "reset by peer", "broken pipe")
_INTERNAL = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # the library
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(datetime.__file__)) + os.sep + "contextlib.py",
)


def seconds(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


def call_site(depth: int = 1) -> str:
    """``file:line`` (and the line's code) of the innermost frame outside the library and torch
    (and outside helpers that hide themselves with ``__tracebackhide__``, as pytest's do): the
    user's line that led to the collective (``?`` when there is none)."""
    frame = sys._getframe(depth)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_INTERNAL) or frame.f_locals.get("__tracebackhide__")
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    filename, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(filename, line).strip()
    try:
        shown = os.path.relpath(filename)
        shown = filename if shown.startswith("..") else shown
    except ValueError:
        shown = filename
    return f"{shown}:{line}" + (f" `{code}`" if code else "")


def describe(name: str, axes: tuple[str, ...], group) -> str:
    """``psum over mesh axis 'tp' (group of ranks [0, 1])``."""
    over = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes!r}"
    try:
        ranks = f" (group of ranks {dist.get_process_group_ranks(group)})"
    except Exception:  # the group is gone (the process group was destroyed)
        ranks = ""
    return f"{name} over {over}{ranks}"


def c10d(collective, *args, group, name: str, axes: tuple[str, ...], **kwargs) -> None:
    """``collective(*args, group=group, **kwargs)`` for the library's collective ``name`` over
    mesh ``axes``; a lost peer or a timeout raised as CommunicationError."""
    try:
        collective(*args, group=group, **kwargs)
    except RuntimeError as error:
        if not isinstance(error, dist.DistBackendError) and not any(
            [word in str(error).lower() for word in _LOST_PEER]
        ):
            raise
        raise CommunicationError(
            explain(
                f"{describe(name, axes, group)}, called at {call_site(2)}",
                f"the collective failed on rank {dist.get_rank() if dist.is_initialized() else '?'}",
                expected="every rank of the group to join it within the process group's timeout",
                got=str(error).splitlines()[0],
                fix="check the other ranks' logs: a rank that died, or that skipped this "
                "collective, stops the others; the timeout (fd.init_device_mesh(timeout=...), "
                "FD_COLLECTIVE_TIMEOUT) bounds the wait; run with FD_CHECK_COLLECTIVES=1 to find "
                "ranks that call different collectives",
            )
        ) from error
