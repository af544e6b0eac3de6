"""Logging through the standard :mod:`logging` module: one logger per area under
``functional_dtensor``, switched on by the ``FD_LOGS`` environment variable (read at import, as
torch reads ``TORCH_LOGS``) or by :func:`set_logs`.

=========================================  =====================================================
logger                                     what it logs (once per event: cached paths log nothing)
=========================================  =====================================================
``functional_dtensor.plans``               a redistribute plan chosen: layouts, steps, bytes
``functional_dtensor.rules``               a global op's decision: layouts in, needed, out; cost
``functional_dtensor.groups``              a process group created: mesh, axes, ranks
``functional_dtensor.compile``             a decision or plan made while Dynamo traces
``functional_dtensor.shard_map``           a ``shard_map`` plan built: specs, mesh
``functional_dtensor.collectives``         collectives issued
=========================================  =====================================================

INFO is one line per event; DEBUG adds detail lines (a plan's steps one by one, a decision's
shapes and redistributes). With nothing switched on the loggers have a ``NullHandler`` and no
level of their own, as a library's should: the logging calls sit where a plan or a decision is
made, guarded by ``isEnabledFor``, never on the cached paths.

>>> parse("+rules,plans")
({'rules': 10, 'plans': 20}, [])
>>> parse("+all, bogus")
({'all': 10}, ['bogus'])
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from fractions import Fraction

from ._errors import InputTypeError, explain

__all__ = [
    "ROOT",
    "AREAS",
    "ENV",
    "plans",
    "rules",
    "groups",
    "compiling",
    "shard_map",
    "collectives",
    "parse",
    "set_logs",
    "Formatter",
    "size",
    "layouts",
]

ROOT = "functional_dtensor"
ENV = "FD_LOGS"
#: the areas, each a child logger of ``functional_dtensor``; ``all`` stands for every one
AREAS = ("plans", "rules", "groups", "compile", "shard_map", "collectives")

root = logging.getLogger(ROOT)
root.addHandler(logging.NullHandler())
plans = logging.getLogger(f"{ROOT}.plans")
rules = logging.getLogger(f"{ROOT}.rules")
groups = logging.getLogger(f"{ROOT}.groups")
compiling = logging.getLogger(f"{ROOT}.compile")
shard_map = logging.getLogger(f"{ROOT}.shard_map")
collectives = logging.getLogger(f"{ROOT}.collectives")


def parse(value: str) -> tuple[dict[str, int], list[str]]:
    """The levels an ``FD_LOGS`` value asks for (``"plans"``: INFO, ``"+plans"``: DEBUG, ``all``
    for every area; names separated by commas or spaces), and the unknown names in it."""
    levels: dict[str, int] = {}
    unknown: list[str] = []
    for item in re.split(r"[,\s]+", value.strip()):
        if not item:
            continue
        name = item.lstrip("+")
        if name in AREAS or name == "all":
            levels[name] = logging.DEBUG if item.startswith("+") else logging.INFO
        else:
            unknown.append(item)
    return levels, unknown


class Formatter(logging.Formatter):
    """``[fd.rules] message``: the logger's name with ``functional_dtensor`` shortened to ``fd``;
    a level other than INFO and DEBUG is named."""

    def format(self, record: logging.LogRecord) -> str:
        name = "fd" + record.name[len(ROOT) :] if record.name.startswith(ROOT) else record.name
        level = "" if record.levelno <= logging.INFO else f"{record.levelname}: "
        text = f"[{name}] {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _Stderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a record comes (a notebook's, pytest's)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


_handler: _Stderr | None = None  # set while FD_LOGS or set_logs has switched some area on


def _apply(levels: dict[str, int]) -> None:
    """Every area at the level ``levels`` gives it (``all``: the package's logger), the others
    back to no level of their own; the stderr handler attached while something is on."""
    global _handler
    root.setLevel(levels.get("all", logging.NOTSET))
    for area in AREAS:
        logging.getLogger(f"{ROOT}.{area}").setLevel(levels.get(area, logging.NOTSET))
    if levels and _handler is None:
        _handler = _Stderr()
        _handler.setFormatter(Formatter())
        root.addHandler(_handler)
        root.propagate = False  # printed here, not a second time by the root logger's handlers
    elif not levels and _handler is not None:
        root.removeHandler(_handler)
        _handler = None
        root.propagate = True


def set_logs(*names: str, **areas: int | bool | None) -> None:
    """Switch logging on for some areas, in a notebook or a script, as ``FD_LOGS`` does at
    import: each area by name (``"plans"`` at INFO, ``"+plans"`` at DEBUG) or by keyword
    (``rules=logging.DEBUG``, ``plans=True`` for INFO); ``"all"`` (or ``all=...``) for every
    area (``plans``, ``rules``, ``groups``, ``compile``, ``shard_map``, ``collectives``). Each
    call replaces the last: areas it does not name are switched off, and ``fd.set_logs()``
    switches everything off. Lines go to ``sys.stderr``, one per event::

        [fd.rules] matmul: S(1)R, S(0)R -> P(sum)R (no communication)
        [fd.plans] S(0)R -> RR on (8, 4): all_gather(x); 96 B per device

    >>> import logging
    >>> set_logs("+rules", plans=True)
    >>> logging.getLogger("functional_dtensor.rules").level == logging.DEBUG
    True
    >>> set_logs()
    """
    levels, unknown = parse(" ".join(names))
    for name, level in areas.items():
        if name not in AREAS and name != "all":
            unknown.append(name)
        elif level is True:
            levels[name] = logging.INFO
        elif level is not None and level is not False:
            if not isinstance(level, int):
                raise InputTypeError(
                    explain(
                        f"fd.set_logs({name}=...)",
                        "an area's level is a logging level",
                        expected="logging.INFO, logging.DEBUG (or True for INFO, False or None for off)",
                        got=repr(level),
                        fix=f"fd.set_logs({name}=logging.DEBUG), or fd.set_logs('+{name}')",
                    )
                )
            levels[name] = level
    if unknown:
        raise InputTypeError(
            explain(
                "fd.set_logs",
                "logging is switched on by area",
                expected=f"some of {', '.join(('all', *AREAS))} (a leading '+' for DEBUG)",
                got=", ".join(repr(n) for n in unknown),
                fix="fd.set_logs('plans', '+rules'), or fd.set_logs(rules=logging.DEBUG)",
            )
        )
    _apply(levels)


def _from_environment() -> None:
    """``FD_LOGS`` applied at import; unknown names warned of, never raised."""
    value = os.environ.get(ENV, "")
    if not value.strip():
        return
    levels, unknown = parse(value)
    if unknown:
        warnings.warn(
            f"{ENV}={value!r}: unknown log area(s) {', '.join(repr(n) for n in unknown)} ignored; the "
            f"areas are {', '.join(('all', *AREAS))}, each at INFO, or at DEBUG with a leading '+' "
            f"(e.g. {ENV}=+all or {ENV}=plans,+rules)",
            stacklevel=2,
        )
    _apply(levels)


# --- text shared by the areas ------------------------------------------------------------------


def size(nbytes: Fraction | int) -> str:
    """Bytes as ``96 B``, ``1.50 KiB``, ``2.00 MiB`` (a fraction with two decimals)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{float(nbytes / scale):.2f} {unit}"
    return f"{int(nbytes)} B" if nbytes == int(nbytes) else f"{float(nbytes):.2f} B"


def layouts(items) -> str:
    """Layouts in short form, comma separated (``S(0)R, RR``)."""
    return ", ".join(str(item) for item in items)


_from_environment()
