"""The axis environment: which mesh axes the running per-device code is mapped over.

``shard_map`` pushes a frame while the per-device function runs; collectives look their axis
names up here. A frame records the mesh and its backend, whether replication is checked, the
functorch level the per-device function runs at, and the level of the vmap that carries the
device dim (a simulated mesh's; ``None`` where each process runs its own device).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ._errors import AxisNameError, InputTypeError, explain
from ._mesh import DeviceMesh

__all__ = ["Frame", "bound_axes", "current_frame", "frame_stack", "frame_for"]


@dataclass(frozen=True, slots=True)
class Frame:
    """One ``shard_map`` in progress (or, with ``level`` None, a collective run on storage)."""

    mesh: DeviceMesh
    check_rep: bool
    backend: Any  # the mesh's backend (see ._backend)
    level: int | None = None  # the functorch level the per-device function runs at
    device_level: int | None = None  # the level of the vmap over the devices, if any
    #: where the device vmap's batching is the record of what varies (a bare call, see
    #: ._shard_map): the axes a value batched over the devices varies over; None where the
    #: tracker records it (see ._varying.varying_in)
    batched_varying: frozenset[str] | None = None


class _Frames(threading.local):
    """Each thread's stack of frames, there from the thread's first look (a compiled graph
    guarded on the stack then holds on the next call: no attribute appears after the first)."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []


_local = _Frames()


def frame_stack() -> list[Frame]:
    """This thread's frames in progress, innermost last: a caller that binds a frame appends it
    and pops it after, as :class:`bound_axes` does (``shard_map``'s warm call, without the
    context manager's calls)."""
    return _local.frames


class bound_axes:
    """Bind the axes of ``frame.mesh`` while the body runs (``with bound_axes(frame): ...``)."""

    __slots__ = ("frame",)

    def __init__(self, frame: Frame) -> None:
        self.frame = frame

    def __enter__(self) -> Frame:
        frame_stack().append(self.frame)
        return self.frame

    def __exit__(self, *exc) -> None:
        _local.frames.pop()


def current_frame() -> Frame | None:
    frames = frame_stack()
    return frames[-1] if frames else None


def frame_for(axis_name, where: str) -> tuple[Frame, tuple[str, ...]]:
    """The frame that binds ``axis_name`` (a name or a tuple of names) and the names."""
    frame = current_frame()
    if frame is not None and isinstance(axis_name, str) and axis_name in frame.mesh.axis_names:
        return frame, (axis_name,)  # the common case, checked cheaply
    names = _axis_names(axis_name, where)
    if frame is None:
        raise AxisNameError(
            explain(
                f"{where}(axis_name)",
                f"no shard_map binds mesh axis {axis_name!r}",
                expected="a call inside a function wrapped by fd.shard_map",
                got="a call outside any shard_map",
                fix="call collectives from the per-device function given to fd.shard_map",
            )
        )
    unknown = [n for n in names if n not in frame.mesh.axis_names]
    if unknown or not names or len(set(names)) != len(names):
        raise AxisNameError(
            explain(
                f"{where}(axis_name)",
                "the axis names must be distinct axes of the enclosing shard_map's mesh",
                expected=f"names from {frame.mesh.axis_names}",
                got=repr(axis_name),
                fix="use the mesh's axis names, each at most once",
            )
        )
    return frame, names


def _axis_names(axis_name, where: str) -> tuple[str, ...]:
    """``axis_name`` as a tuple of names: a name, or a tuple or list of names."""
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, (tuple, list)) and all(isinstance(n, str) for n in axis_name):
        return tuple(axis_name)
    raise InputTypeError(
        explain(
            f"{where}(axis_name)",
            "collectives name mesh axes by name",
            expected="an axis name such as 'x', or a tuple of names",
            got=repr(axis_name),
            fix="pass the name of the mesh axis, not its position (mesh.axis_names[i])",
        )
    )
