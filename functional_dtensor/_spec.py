"""``P``: a partition spec, one entry per tensor dim, as in JAX.

An entry is ``None`` (the dim is not split), a mesh axis name, or a tuple of axis names that
split the dim together, major axis first. A spec shorter than the tensor's rank leaves the
trailing dims unsplit. One-name tuples and empty tuples are canonicalized, so equal specs
compare and hash equal:

>>> import functional_dtensor as fd
>>> fd.P(("x",), None) == fd.P("x", None), fd.P((), "y") == fd.P(None, "y")
(True, True)
>>> fd.P("x", ("y", "z")), str(fd.P("x", None))
(P('x', ('y', 'z')), "P('x', None)")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from ._errors import InputTypeError, LayoutError, explain
from ._public import public

__all__ = ["P", "SpecEntry"]

SpecEntry: TypeAlias = "str | tuple[str, ...] | None"


def _canonical_entry(entry: object, position: int) -> str | tuple[str, ...] | None:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(name, str) for name in entry):
        names = tuple(entry)
        if not names:
            return None
        return names[0] if len(names) == 1 else names
    raise InputTypeError(
        explain(
            f"fd.P(entries[{position}])",
            "a spec entry must name mesh axes",
            expected="None, an axis name, or a tuple of axis names",
            got=repr(entry),
            fix="write e.g. fd.P('x', None) or fd.P(('x', 'y'))",
        )
    )


@public
@dataclass(frozen=True, slots=True, init=False)
class P:
    """A partition spec: ``P('x', None)`` splits dim 0 over mesh axis ``x``."""

    entries: tuple[str | tuple[str, ...] | None, ...]

    def __init__(self, *entries: str | tuple[str, ...] | None) -> None:
        canonical = tuple(_canonical_entry(e, i) for i, e in enumerate(entries))
        seen: dict[str, int] = {}
        for position, entry in enumerate(canonical):
            for name in _names(entry):
                if name in seen:
                    raise LayoutError(
                        explain(
                            f"fd.P(entries[{position}])",
                            f"mesh axis {name!r} is used twice",
                            expected="each mesh axis at most once in a spec",
                            got=f"{name!r} in entries[{seen[name]}] and entries[{position}]",
                            fix="a mesh axis can split only one tensor dim; drop one of them",
                        )
                    )
                seen[name] = position
        object.__setattr__(self, "entries", canonical)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __getitem__(self, index: int) -> str | tuple[str, ...] | None:
        return self.entries[index]

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Every mesh axis the spec uses, in order of appearance."""
        return tuple(name for entry in self.entries for name in _names(entry))

    def __repr__(self) -> str:
        return f"P({', '.join(repr(e) for e in self.entries)})"

    __str__ = __repr__

    def _repr_pretty_(self, printer, cycle) -> None:
        # IPython and hypothesis's failure reports print this, not the dataclass field
        # ``P(entries=...)``, which does not evaluate.
        printer.text(repr(self))

    def __reduce__(self):
        return (P, self.entries)


def _names(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else entry
