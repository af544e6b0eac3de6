"""The library's exceptions: one base class, subclasses that are also the fitting builtin.

Every message names the API and the argument (with its pytree path where there is one), says
what was expected and what was got, and ends with the fix. Messages are built with
:func:`explain`, so that they all read the same way.
"""

from __future__ import annotations

from ._public import public

__all__ = [
    "FunctionalDTensorError",
    "LayoutError",
    "MeshError",
    "SpecError",
    "ShapeError",
    "InputTypeError",
    "AxisNameError",
    "CommunicationError",
    "CollectiveMismatchError",
    "ImmutableError",
    "BatchedFunctionError",
    "CheckpointError",
    "explain",
]


@public
class FunctionalDTensorError(Exception):
    """Base class of every error raised by functional_dtensor."""


@public
class LayoutError(FunctionalDTensorError, ValueError):
    """A placement, a partition spec or a layout is invalid, or does not fit a tensor."""


@public
class MeshError(FunctionalDTensorError, ValueError):
    """A device mesh is malformed, or a value lives on another mesh or backend."""


@public
class SpecError(FunctionalDTensorError, ValueError):
    """``shard_map`` specs do not fit the arguments or outputs they describe."""


@public
class ShapeError(FunctionalDTensorError, ValueError):
    """A local or global shape does not agree with a layout."""


@public
class InputTypeError(FunctionalDTensorError, TypeError):
    """An argument has the wrong type (a list where a tensor was expected, say)."""


@public
class AxisNameError(FunctionalDTensorError, NameError):
    """A collective names a mesh axis that no enclosing ``shard_map`` binds."""


@public
class CommunicationError(FunctionalDTensorError, RuntimeError):
    """A collective failed or timed out on the distributed backend (a dead or stuck rank)."""


@public
class CollectiveMismatchError(CommunicationError):
    """Ranks called different collectives at the same position (another collective, mesh axes,
    shape, dtype, reduce op or parameter): found by the collective checks
    (``fd.check_collectives``) before the collective runs, on every rank."""


@public
class ImmutableError(FunctionalDTensorError, RuntimeError, AttributeError):
    """A value would be changed in place: an ``fd.DTensor`` (which has no in-place methods) or
    an input of a ``shard_map``'d function (inputs are values). Also an ``AttributeError``, as
    the answer to looking up an in-place method such as ``x.add_``."""


@public
class UnsupportedAttributeError(FunctionalDTensorError, AttributeError):
    """An attribute of ``torch.Tensor`` that a global value held as shards cannot honour (its
    storage, strides, autograd node); the message names what to use instead."""


class BatchedFunctionError(FunctionalDTensorError, RuntimeError):
    """The per-device function reads a value into Python (``.item()``, ``if x > 0:``) on the
    simulated backend, where it runs once, batched over every device."""


@public
class CheckpointError(FunctionalDTensorError, ValueError):
    """A checkpoint is missing, incomplete or corrupted, does not fit the values it is loaded
    into (``like``), or could not be written."""


def explain(where: str, what: str, *, expected: str, got: str, fix: str) -> str:
    """Build an error message: ``where: what: expected ..., got .... Fix: ...``.

    ``where`` names the API and argument (``"fd.distribute_tensor(placements[1])"``).
    """
    return f"{where}: {what}: expected {expected}, got {got}. Fix: {fix}"
