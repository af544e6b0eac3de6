"""``CommDebugMode``: count the collectives a block of code runs, and the bytes they move.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(4, "x")
>>> f = fd.shard_map(lambda v: fd.psum(v, "x"), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P())
>>> with fd.CommDebugMode() as comm:
...     _ = f(torch.ones(8))
>>> comm.get_comm_counts(), comm.get_total_counts(), comm.get_total_bytes()
({'all_reduce': 1}, 1, 8)
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._dynamo.eval_frame import OptimizedModule

from . import _comm_log as comm_log
from ._public import public

__all__ = ["CommDebugMode"]


@public
class CommDebugMode:
    """Context manager counting collectives per op and per module (the innermost
    ``torch.nn.Module`` running when the collective was issued; ``None`` outside any, which
    includes backward passes). Bytes are per device: what each device contributes.

    A compiled function's collectives are counted when its graph runs, every call, as eager
    ones are (its first call under a ``CommDebugMode`` compiles a variant of its graph that
    records); their module is the innermost one running around the compiled code (modules
    traced into the graph run no hooks; the compiler's own wrappers are not named)."""

    def __init__(self) -> None:
        self._recording = comm_log.recording()
        self._handles: list = []
        self._modules: list[str] = []

    @property
    def events(self) -> list[comm_log.CommEvent]:
        return self._recording.events

    def get_comm_counts(self) -> dict[str, int]:
        return dict(Counter(e.op for e in self.events))

    def get_total_counts(self) -> int:
        return len(self.events)

    def get_total_bytes(self) -> int:
        return sum(e.nbytes for e in self.events)

    def get_bytes_by_op(self) -> dict[str, int]:
        totals: Counter = Counter()
        for e in self.events:
            totals[e.op] += e.nbytes
        return dict(totals)

    def get_comm_counts_by_module(self) -> dict[str | None, dict[str, int]]:
        by_module: dict[str | None, Counter] = {}
        for e in self.events:
            by_module.setdefault(e.module, Counter())[e.op] += 1
        return {m: dict(c) for m, c in by_module.items()}

    def table(self):
        """A rich table: one row per (module, op) with counts and bytes per device."""
        from rich.table import Table

        table = Table(title="Communication")
        for column in ("module", "op", "count", "bytes per device"):
            table.add_column(column)
        rows: dict = {}
        for e in self.events:
            count, nbytes = rows.get((e.module, e.op), (0, 0))
            rows[(e.module, e.op)] = (count + 1, nbytes + e.nbytes)
        for (module, op), (count, nbytes) in rows.items():
            table.add_row(module or "-", op, str(count), f"{nbytes:,}")
        return table

    def __enter__(self) -> CommDebugMode:
        self._recording.__enter__()
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._enter_module),
            hooks.register_module_forward_hook(self._leave_module),
        ]
        return self

    def __exit__(self, *exc) -> bool:
        for handle in self._handles:
            handle.remove()
        self._recording.__exit__(*exc)
        return False

    def _enter_module(self, module, args):
        if isinstance(module, _COMPILER_MODULES):
            return
        self._modules.append(type(module).__name__)
        comm_log.set_module(".".join(self._modules))

    def _leave_module(self, module, args, output):
        if isinstance(module, _COMPILER_MODULES):
            return
        if self._modules:
            self._modules.pop()
        comm_log.set_module(".".join(self._modules) or None)


#: the modules ``torch.compile`` wraps a user's code in: a compiled module, a traced graph
_COMPILER_MODULES = (OptimizedModule, torch.fx.GraphModule)
