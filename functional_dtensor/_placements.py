"""Placements: how a global tensor is laid out along one mesh axis (as in DTensor).

``repr`` evaluates back to an equal value; ``str`` is the short form used in plans and tables:

>>> import functional_dtensor as fd
>>> fd.Shard(0), str(fd.Shard(0)), str(fd.Replicate()), str(fd.Partial("max"))
(Shard(dim=0), 'S(0)', 'R', 'P(max)')
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ._errors import InputTypeError, LayoutError, explain
from ._public import public

__all__ = ["Placement", "Shard", "Replicate", "Partial", "PARTIAL_OPS", "PartialOp"]

PartialOp: TypeAlias = Literal["sum", "avg", "max", "min"]
PARTIAL_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")


@public
class Placement:
    """Base class of :class:`Shard`, :class:`Replicate` and :class:`Partial`."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)


@public
@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Split tensor dim ``dim`` into ``torch.chunk`` blocks along the mesh axis.

    A negative ``dim`` counts from the end; it is normalized once the tensor's rank is known.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            try:
                if isinstance(self.dim, bool):  # operator.index(True) == 1: not a dim
                    raise TypeError
                object.__setattr__(self, "dim", operator.index(self.dim))
            except TypeError:
                raise InputTypeError(
                    explain(
                        "fd.Shard(dim)",
                        "the tensor dim to split must be an integer",
                        expected="an int such as 0 or -1",
                        got=repr(self.dim),
                        fix="pass the index of the tensor dim, e.g. fd.Shard(0)",
                    )
                ) from None

    def __str__(self) -> str:
        return f"S({self.dim})"


@public
@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every device along the mesh axis holds the whole (already split) block."""

    def __str__(self) -> str:
        return "R"


@public
@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every device along the mesh axis holds a partial value; the global value is their
    reduction by ``op`` (``"sum"``, ``"avg"``, ``"max"`` or ``"min"``)."""

    op: PartialOp = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise LayoutError(
                explain(
                    "fd.Partial(op)",
                    "unknown reduction",
                    expected=" or ".join(repr(o) for o in PARTIAL_OPS),
                    got=repr(self.op),
                    fix='use one of the supported reductions, e.g. fd.Partial("sum")',
                )
            )

    def __str__(self) -> str:
        return f"P({self.op})"
