"""``CommDebugMode``: count the collectives a block of code runs, and the bytes they move.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())
>>> with fd.CommDebugMode() as comm:
...     _ = f(torch.ones(8))
>>> comm.get_comm_counts(), comm.get_total_counts(), comm.get_total_bytes(), comm.get_total_wire_bytes()
({'all_reduce': 1}, 1, 8, Fraction(12, 1))
"""

from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction

import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch.autograd.graph import register_multi_grad_hook

from . import _comm_log as comm_log
from ._dtensor import DTensor, data_of
from ._public import public

__all__ = ["CommDebugMode"]

PHASES = ("forward", "backward")


@public
class CommDebugMode:
    """Context manager recording every collective run inside it, forward and backward.

    Each event (``comm.events``, a :class:`CommEvent`) has the ``op``, the mesh ``axes``, the
    ``group_size``, ``nbytes`` (the bytes of the local input each device contributes),
    ``wire_bytes`` (the bytes each device sends, equal to those it receives, as
    ``fd.explain_redistribute`` counts them: ``(k-1) b`` for an all_gather, ``2 (k-1)/k b`` for
    a ring all_reduce, ``(k-1)/k b`` for a reduce_scatter or an all_to_all, ``b`` for a
    ppermute or a broadcast (``fd.distribute_tensor`` on ranks: the source rank's tensor), over
    ``k`` devices of ``b`` bytes each), ``module`` and ``phase``.

    ``module`` is the path of the innermost ``torch.nn.Module`` running, named as in
    ``named_modules()`` of the outermost module running (``layers.0.attn``; the outermost
    module itself by its class name, ``None`` outside any module). In the ``"backward"``
    phase it is the module whose backward is running (tracked as
    ``torch.utils.module_tracker.ModuleTracker`` does, by gradient hooks on each module's
    inputs and outputs), ``None`` where no module's is.

    A compiled function's collectives are counted when its graph runs, every call, as eager
    ones are (its first call under a ``CommDebugMode`` compiles a variant of its graph that
    records); their module is the innermost one running around the compiled code (modules
    traced into the graph run no hooks; the compiler's own wrappers are not named)."""

    def __init__(self) -> None:
        self._recording = comm_log.recording()
        self._handles: list = []
        self._forward: list[str] = []  # the modules running forward, outermost first
        self._backward: list[str] = []  # the modules whose backward is running
        self._names: dict[int, str] = {}  # id(module) -> its path, under the outermost module
        self._grad_hooks: list = []
        self._leave_hooks: dict[int, object] = {}  # id(module) -> its hook that leaves it
        self._end_of_backward_queued = False

    @property
    def events(self) -> list[comm_log.CommEvent]:
        """Every collective recorded, in the order they ran."""
        return self._recording.events

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives run per op: ``{"all_reduce": 2, ...}``."""
        return dict(Counter(e.op for e in self.events))

    def get_total_counts(self) -> int:
        """Collectives run in all."""
        return len(self.events)

    def get_total_bytes(self) -> int:
        """The bytes of the local inputs each device gave the collectives (input bytes, not
        the bytes moved: see :meth:`get_total_wire_bytes`)."""
        return sum(e.nbytes for e in self.events)

    def get_total_wire_bytes(self) -> Fraction:
        """The bytes each device sent (= received) on the wire, in all: exact, a fraction
        where a group size does not divide a block."""
        return sum((e.wire_bytes for e in self.events), Fraction(0))

    def get_bytes_by_op(self) -> dict[str, int]:
        """Input bytes per device (as :meth:`get_total_bytes`) per op."""
        totals: Counter = Counter()
        for e in self.events:
            totals[e.op] += e.nbytes
        return dict(totals)

    def get_wire_bytes_by_op(self) -> dict[str, Fraction]:
        """Wire bytes per device (as :meth:`get_total_wire_bytes`) per op."""
        totals: dict[str, Fraction] = {}
        for e in self.events:
            totals[e.op] = totals.get(e.op, Fraction(0)) + e.wire_bytes
        return totals

    def get_comm_counts_by_axis(self) -> dict[tuple[str, ...], dict[str, int]]:
        """Collectives per mesh axes (a tuple of names, as the collective took them) and op."""
        found: dict[tuple[str, ...], Counter] = {}
        for e in self.events:
            found.setdefault(tuple(e.axes), Counter())[e.op] += 1
        return {axes: dict(c) for axes, c in found.items()}

    def get_comm_counts_by_module(self) -> dict[str | None, dict[str, dict[str, int]]]:
        """Collectives per module path, phase and op:
        ``{"layers.0.attn": {"forward": {"all_reduce": 1}, "backward": {...}}}`` (a phase with
        no collective left out; ``None``: outside any module)."""
        found: dict[str | None, dict[str, Counter]] = {}
        for e in self.events:
            found.setdefault(e.module, {}).setdefault(e.phase, Counter())[e.op] += 1
        return {
            module: {phase: dict(phases[phase]) for phase in PHASES if phase in phases}
            for module, phases in found.items()
        }

    def rows(self) -> list[dict]:
        """One row per (module, phase, op, axes), in the order first seen: ``count``,
        ``input_bytes`` and ``wire_bytes`` per device (summed over the row's events)."""
        found: dict[tuple, dict] = {}
        for e in self.events:
            key = (e.module, e.phase, e.op, tuple(e.axes))
            row = found.get(key)
            if row is None:
                row = found[key] = {
                    "module": e.module,
                    "phase": e.phase,
                    "op": e.op,
                    "axes": list(e.axes),
                    "count": 0,
                    "input_bytes": 0,
                    "wire_bytes": Fraction(0),
                }
            row["count"] += 1
            row["input_bytes"] += e.nbytes
            row["wire_bytes"] += e.wire_bytes
        return list(found.values())

    def to_dict(self) -> dict:
        """Everything recorded, as plain data (bytes per device; wire bytes as ``int`` where
        whole, else ``float``): ``{"events": [...], "rows": [...], "totals": {...}}``."""

        def plain(x: Fraction):
            return int(x) if x.denominator == 1 else float(x)

        events = [
            {
                "op": e.op,
                "axes": list(e.axes),
                "group_size": e.group_size,
                "input_bytes": e.nbytes,
                "wire_bytes": plain(e.wire_bytes),
                "module": e.module,
                "phase": e.phase,
            }
            for e in self.events
        ]
        rows = [{**row, "wire_bytes": plain(row["wire_bytes"])} for row in self.rows()]
        totals = {
            "count": self.get_total_counts(),
            "input_bytes": self.get_total_bytes(),
            "wire_bytes": plain(self.get_total_wire_bytes()),
        }
        return {"events": events, "rows": rows, "totals": totals}

    def to_json(self, **kwargs) -> str:
        """:meth:`to_dict` as JSON (``kwargs`` go to ``json.dumps``, ``indent=2`` say)."""
        return json.dumps(self.to_dict(), **kwargs)

    def table(self, *, title: str = "Communication per device", module_width: int = 20):
        """A ``rich`` table: one row per (module, phase, op, axes) with the count, the input
        bytes and the wire bytes per device (``K``/``M``/``G``: binary multiples), and a totals
        row. It fits 80 columns: module paths longer than ``module_width`` break after a dot."""
        from rich import box
        from rich.table import Table

        table = Table(title=title, show_footer=True, box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("module", "total", no_wrap=True, max_width=module_width)
        table.add_column("phase", no_wrap=True)
        table.add_column("op", no_wrap=True)
        table.add_column("axes", no_wrap=True)
        table.add_column("count", str(self.get_total_counts()), justify="right", no_wrap=True)
        table.add_column("input B", _bytes(self.get_total_bytes()), justify="right", no_wrap=True)
        table.add_column("wire B", _bytes(self.get_total_wire_bytes()), justify="right", no_wrap=True)
        for row in self.rows():
            table.add_row(
                _wrapped(row["module"], module_width),
                "bwd" if row["phase"] == "backward" else "fwd",
                row["op"],
                ",".join(row["axes"]),
                str(row["count"]),
                _bytes(row["input_bytes"]),
                _bytes(row["wire_bytes"]),
            )
        return table

    def __enter__(self) -> CommDebugMode:
        self._recording.__enter__()
        hooks = torch.nn.modules.module
        # a module is left by a hook of its own, run after the others it has (a global forward
        # hook would run before them, and so miss the communication of a style's output hook);
        # where the hooks run inside a graph that torch.compile traces, the global one leaves
        self._handles = [
            hooks.register_module_forward_pre_hook(self._enter_module),
            hooks.register_module_forward_hook(self._leave_compiled_module),
        ]
        return self

    def __exit__(self, *exc) -> bool:
        for handle in [*self._handles, *self._grad_hooks, *self._leave_hooks.values()]:
            handle.remove()
        self._handles, self._grad_hooks, self._leave_hooks = [], [], {}
        comm_log.set_module(None)
        comm_log.set_module(None, backward=True)
        self._recording.__exit__(*exc)
        return False

    # --- module paths, forward and backward ---------------------------------------------------

    def _name_of(self, module: torch.nn.Module) -> str:
        name = self._names.get(id(module))
        if name is None:
            if not self._forward:  # an outermost module: its own and its children's paths
                self._names = {id(m): path for path, m in module.named_modules() if path}
                name = type(module).__name__
            else:  # a module outside the outermost one's tree
                name = f"{self._forward[-1]}.{type(module).__name__}"
            self._names[id(module)] = name
        return name

    def _enter_module(self, module, args):
        if isinstance(module, _COMPILER_MODULES):
            return
        name = self._name_of(module)
        self._forward.append(name)
        comm_log.set_module(name)
        if torch.compiler.is_compiling():
            return
        if id(module) not in self._leave_hooks:
            leave = module.register_forward_hook(self._leave_eager_module, always_call=True)
            self._leave_hooks[id(module)] = leave
        # its backward ends when the gradients of its inputs are computed
        self._on_gradients(args, lambda *_: self._leave_backward(name))

    def _leave_compiled_module(self, module, args, output):
        if torch.compiler.is_compiling():
            self._leave_module(module, args, output)

    def _leave_eager_module(self, module, args, output):
        if not torch.compiler.is_compiling():
            self._leave_module(module, args, output)

    def _leave_module(self, module, args, output):
        if isinstance(module, _COMPILER_MODULES):
            return
        if self._forward:
            name = self._forward.pop()
            if not torch.compiler.is_compiling():
                # its backward starts when the gradients of its outputs are computed
                self._on_gradients(output, lambda *_: self._enter_backward(name))
        comm_log.set_module(self._forward[-1] if self._forward else None)
        if not self._forward:
            self._names = {}

    def _on_gradients(self, values, hook) -> None:
        tensors = []
        for leaf in torch.utils._pytree.tree_leaves(values):
            if isinstance(leaf, DTensor):
                leaf = data_of(leaf)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                tensors.append(leaf)
        if tensors:
            try:
                self._grad_hooks.append(register_multi_grad_hook(tensors, hook))
            except RuntimeError:  # a value torch.func transforms: no hook, no backward module
                pass

    def _enter_backward(self, name: str) -> None:
        if not self._end_of_backward_queued:  # the engine's callback clears the stack at the end
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._end_of_backward_queued = True
        self._backward.append(name)
        comm_log.set_module(name, backward=True)

    def _leave_backward(self, name: str) -> None:
        if name in self._backward:
            del self._backward[len(self._backward) - 1 - self._backward[::-1].index(name)]
        comm_log.set_module(self._backward[-1] if self._backward else None, backward=True)

    def _end_backward(self) -> None:
        self._backward.clear()
        self._end_of_backward_queued = False
        comm_log.set_module(None, backward=True)


def _bytes(n) -> str:
    """Bytes, short: ``512``, ``24.0K``, ``1.5M`` (binary multiples), exact below 10,000."""
    n = float(n)
    if n < 10_000:
        return f"{n:,.0f}" if n == int(n) else f"{n:,.1f}"
    for unit in ("K", "M", "G", "T"):
        n /= 1024
        if n < 1024 or unit == "T":
            return f"{n:,.1f}{unit}"
    raise AssertionError("unreachable")


def _wrapped(module: str | None, width: int) -> str:
    """A module path in lines of at most ``width`` characters, broken after dots where it
    is longer (``-``: outside any module)."""
    if module is None:
        return "-"
    lines = [""]
    for part in module.replace(".", ".\n").split("\n"):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


#: the modules ``torch.compile`` wraps a user's code in: a compiled module, a traced graph
_COMPILER_MODULES = (OptimizedModule, torch.fx.GraphModule)
