"""``explain_redistribute``: the plan of a layout change, step by step, with its cost.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> x = fd.distribute_tensor(torch.zeros(8, 8), mesh, fd.P("x", "y"))
>>> report = fd.explain_redistribute(x, fd.P("y", "x"), show=False)
>>> print(report.summary)
S(0)S(1) -> S(1)S(0): 1 step, 64 B received per device (lower bound 64 B)
>>> [str(step) for step in report.steps]
['ppermute(x, y)']
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import torch

from ._dtensor import DTensor, layout_for
from ._errors import InputTypeError, explain
from ._global_ops import decision_for
from ._layout import Layout, PlacementsOrSpec
from ._plan import Step, lower_bound, plan, step_bytes
from ._public import public

__all__ = ["explain_redistribute", "PlanReport", "explain_op", "OpReport"]


@public
class PlanReport(NamedTuple):
    """What :func:`explain_redistribute` found: the steps, the bytes each step makes a device
    receive (and send), their total and the lower bound, all per device; exact fractions (a
    collective over 3 devices can move a third of a block's bytes), printed with two decimals
    where not whole."""

    source: Layout
    target: Layout
    shape: tuple[int, ...]
    steps: tuple[Step, ...]
    step_bytes: tuple[Fraction, ...]
    total_bytes: Fraction
    lower_bound: Fraction

    def __repr__(self) -> str:
        return f"<PlanReport {self.summary}>"

    @property
    def summary(self) -> str:
        count = len(self.steps)
        return (
            f"{self.source} -> {self.target}: {count} step{'s' * (count != 1)}, "
            f"{_size(self.total_bytes)} received per device (lower bound {_size(self.lower_bound)})"
        )

    def table(self):
        """The plan as a rich table."""
        from rich.table import Table

        table = Table(title=self.summary)
        for column in ("step", "over axes", "layout after", "sent = received per device"):
            table.add_column(column)
        table.add_row("", "", str(self.source), "")
        for step, nbytes in zip(self.steps, self.step_bytes):
            kind = step.collective or f"{type(step).__name__.lower()} (local)"
            axes = f"{', '.join(step.names)} ({step.group_size} devices)"
            table.add_row(kind, axes, str(step.target), _size(nbytes))
        table.add_row("total", "", "", _size(self.total_bytes))
        table.add_row("lower bound", "", "", _size(self.lower_bound))
        return table


def explain_redistribute(
    x: DTensor | Layout,
    target: PlacementsOrSpec,
    shape=None,
    *,
    dtype: torch.dtype | None = None,
    show: bool = True,
) -> PlanReport:
    """The plan :func:`redistribute` runs to move ``x`` (a value, or a layout with its global
    ``shape``) to ``target``: printed as a table (unless ``show=False``) and returned."""
    if isinstance(x, DTensor):
        source, shape, dtype = x.sharding, tuple(x.shape), x.dtype
    elif isinstance(x, Layout):
        if shape is None:
            raise InputTypeError(
                explain(
                    "fd.explain_redistribute(shape)",
                    "a layout alone has no size",
                    expected="the global shape of the value",
                    got="None",
                    fix="pass shape=(rows, cols, ...), or pass the DTensor itself",
                )
            )
        source, shape = x, tuple(shape)
    else:
        raise InputTypeError(
            explain(
                "fd.explain_redistribute(x)",
                "a value or a layout is needed",
                expected="an fd.DTensor or an fd.Layout",
                got=type(x).__name__,
                fix="pass the DTensor you would redistribute",
            )
        )
    source = source.normalized(len(shape), where="fd.explain_redistribute")
    destination = layout_for(source.mesh, target, len(shape), "fd.explain_redistribute")
    dtype = dtype or torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    steps = plan(source, destination, shape, itemsize, not (dtype.is_floating_point or dtype.is_complex))
    costs = tuple(step_bytes(s, shape, itemsize) for s in steps)
    report = PlanReport(
        source,
        destination,
        shape,
        steps,
        costs,
        sum(costs),
        lower_bound(source, destination, shape, itemsize),
    )
    if show:
        from rich.console import Console

        Console().print(report.table())
    return report


@public
class OpReport(NamedTuple):
    """How a torch op runs on ``fd.DTensor`` inputs: each input's layout, the layout the op's
    rule needs and the redistribute between them, and the output's layout. ``str()`` is a
    few readable lines."""

    op: str
    inputs: tuple[Layout, ...]
    required: tuple[Layout, ...]
    steps: tuple[tuple[Step, ...], ...]
    total_bytes: Fraction
    output: Layout
    out_shape: tuple[int, ...]

    def __str__(self) -> str:
        moved = (
            "no communication" if not self.total_bytes else f"{_size(self.total_bytes)} received per device"
        )
        lines = [f"{self.op}: {moved}"]
        for i, (have, need, steps) in enumerate(zip(self.inputs, self.required, self.steps)):
            how = ", then ".join(str(s) for s in steps) if steps else "as it is"
            lines.append(f"  input {i}: {have} -> {need}: {how}")
        lines.append(f"  then {self.op} on each device's shard")
        lines.append(f"  output: {self.output}, global shape {tuple(self.out_shape)}")
        return "\n".join(lines)


def explain_op(op, /, *args, **kwargs) -> OpReport:
    """How ``op(*args, **kwargs)`` would run on its ``fd.DTensor`` arguments, without running
    it: the layouts its rule needs, the redistributes (with the bytes each device receives),
    and the output's layout.

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(4, "x")
    >>> a = fd.distribute_tensor(torch.ones(8, 8), mesh, fd.P(None, "x"))
    >>> b = fd.distribute_tensor(torch.ones(8, 8), mesh, fd.P("x"))
    >>> print(fd.explain(torch.matmul, a, b))
    matmul: no communication
      input 0: S(1) -> S(1): as it is
      input 1: S(0) -> S(0): as it is
      then matmul on each device's shard
      output: P(sum), global shape (8, 8)
    """
    name, tensors, d = decision_for(op, args, kwargs)
    return OpReport(
        name, tuple(t.sharding for t in tensors), d.inputs, d.steps, d.cost, d.output, d.out_shapes[0]
    )


def _size(nbytes: Fraction) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{float(nbytes / scale):.2f} {unit}"
    return f"{int(nbytes)} B" if nbytes == int(nbytes) else f"{float(nbytes):.2f} B"
