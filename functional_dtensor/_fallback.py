"""Ops without a sharding rule: run on replicated inputs, visibly — or refused, in strict mode.

Where no rule applies, the op's ``fd.DTensor`` inputs are redistributed to Replicate (the
cheapest planned redistribute: an all-gather of a Shard axis, an all-reduce of a Partial one),
the op runs on the global values (once per process: the simulated backend computes its
devices' equal copies once) and each tensor it returns is a replicated value. The gather is
what any user would write by hand with ``x.full_tensor()``; here it is counted by
``fd.CommDebugMode``, shown by ``fd.explain`` and logged on the ``rules`` logger
(``[fd.rules] median: S(0) -> R (no rule: run on replicated inputs, 96 B per device)``).

:func:`strict_ops` (or ``FD_STRICT_OPS=1``) refuses such ops instead, with the fixes: a rule of
one's own (``fd.register_sharding``), ``fd.local_map``, or the explicit ``full_tensor()``.

An op that draws from torch's global generator is never run this way: each process would draw
its own numbers, and the replicas would differ. It is refused with ``fd.random``'s equivalent.
"""

from __future__ import annotations

import contextlib
import logging
import os

import optree
import torch

from . import _log as log
from ._backend import backend_of
from ._dtensor import DTensor, new_value, storage_of
from ._errors import FunctionalDTensorError, ImmutableError, explain
from ._layout import Layout
from ._placements import Replicate
from ._redistribute import redistribute
from ._rules import Option, R
from ._shard_map import NAMESPACE

__all__ = ["strict_ops", "is_strict", "run_replicated", "refused_random", "name_of", "all_replicated"]

ENV = "FD_STRICT_OPS"
_strict = [os.environ.get(ENV, "0").lower() in ("1", "true", "yes", "on")]


@contextlib.contextmanager
def strict_ops(strict: bool = True):
    """Within the block, an op without a sharding rule is refused (the library's error and
    its fixes) rather than run on replicated inputs; ``strict_ops(False)`` allows it again.
    The environment variable ``FD_STRICT_OPS=1`` makes strict the default.

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(4, "x")
    >>> x = fd.distribute_tensor(torch.arange(8.0), mesh, fd.P("x"))
    >>> torch.median(x).full_tensor()  # no rule: gathered, run, replicated
    tensor(3.)
    >>> with fd.strict_ops():
    ...     torch.median(x)
    Traceback (most recent call last):
    ...
    functional_dtensor.FunctionalDTensorError: torch.median: median has no sharding rule...
    """
    _strict.append(bool(strict))
    try:
        yield
    finally:
        _strict.pop()


def is_strict() -> bool:
    """Whether an op without a rule is refused now (:func:`strict_ops`, ``FD_STRICT_OPS``)."""
    return _strict[-1]


def name_of(func) -> str:
    return getattr(func, "__name__", None) or repr(func)


#: what fd.random offers for torch's draws (by the aten op's name, the function's name)
_RANDOM_FIXES = {
    "dropout": "fd.random.dropout(key, x, p)",
    "bernoulli": "fd.random.bernoulli(key, shape, p, mesh=..., placements=...)",
    "normal": "fd.random.normal(key, shape, mesh=..., placements=...)",
    "randint": "fd.random.randint(key, low, high, shape, mesh=..., placements=...)",
    "rand": "fd.random.uniform(key, shape, mesh=..., placements=...)",
}


def refused_random(func) -> FunctionalDTensorError:
    name = name_of(func)
    fix = next((f for n, f in _RANDOM_FIXES.items() if n in name), None)
    return FunctionalDTensorError(
        explain(
            f"torch.{name}",
            f"{name} draws from torch's global generator: on each device its own numbers, so the "
            "replicas of its output would differ (the library's draws do not depend on the mesh)",
            expected="random numbers from an fd.random key",
            got=f"{name} called on an fd.DTensor",
            fix=f"draw with {fix}"
            if fix
            else "draw with fd.random (keys, uniform, normal, bernoulli, randint, "
            "dropout), or run it on each device's shard in fd.local_map",
        )
    )


def _aten_packet(func):
    return getattr(torch.ops.aten, getattr(func, "__name__", "") or "", None)


def _draws_random(func) -> bool:
    """Whether torch tags the aten op of ``func``'s name as drawing from the global generator."""
    packet = _aten_packet(func)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _generator_states(mesh) -> tuple:
    states = (torch.random.get_rng_state(),)
    if mesh.device_type == "cuda" and torch.cuda.is_available():
        states += (torch.cuda.get_rng_state(),)
    return states


def _restore(states: tuple) -> None:
    torch.random.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def all_replicated(call) -> list[Option]:
    """The rule of an op without one: every input replicated, and the output (what
    :func:`run_replicated` does, as ``fd.explain`` shows it)."""
    return [Option((R,) * len(call.shapes), R)]


def replicated_layout(mesh) -> Layout:
    return Layout(mesh, (Replicate(),) * mesh.ndim)


def run_replicated(func, tensors: list[DTensor], leaves, tree, unsupported, failed):
    """``func`` on the global values of its ``fd.DTensor`` arguments (``tensors``; the call
    flattened to ``leaves`` and ``tree``), its tensors returned as replicated values.
    ``unsupported(func)``/``failed(name, error)``: the library's errors for a refused op and
    an op torch refuses."""
    name = name_of(func)
    if name.endswith("_") and not name.endswith("__"):  # torch.zero_(x), torch.relu_(x)
        raise ImmutableError(
            explain(
                f"torch.{name}",
                "an fd.DTensor is immutable: no op changes it in place",
                expected="an out-of-place operation",
                got=f"torch.{name} on an fd.DTensor",
                fix=f"use the out-of-place form, y = torch.{name[:-1]}(x, ...), where there is one",
            )
        )
    if is_strict():
        raise unsupported(func, strict=True)
    if _draws_random(func):
        raise refused_random(func)
    mesh = tensors[0].device_mesh
    target = replicated_layout(mesh)
    if log.rules.isEnabledFor(logging.INFO):
        log.rules.info(
            "%s: %s -> %s (no rule: run on replicated inputs)",
            name,
            log.layouts(t.sharding for t in tensors),
            target,
        )
    backend = backend_of(mesh)
    # a global value is laid out as torch.empty(x.shape) is: contiguous (as_strided reads it so)
    feed = iter([backend.replica(storage_of(redistribute(t, target))).contiguous() for t in tensors])
    local_args, local_kwargs = tree.unflatten([next(feed) if type(v) is DTensor else v for v in leaves])
    before = _generator_states(mesh)
    try:
        out = func(*local_args, **local_kwargs)
    except FunctionalDTensorError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError, NotImplementedError) as error:
        raise failed(name, error) from error
    after = _generator_states(mesh)
    if any(not torch.equal(a, b) for a, b in zip(before, after)):
        _restore(before)  # the draw is undone: the caller's generator as it was
        raise refused_random(func)

    def wrapped(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if value.layout != torch.strided:
                raise FunctionalDTensorError(
                    explain(
                        f"torch.{name}",
                        "an fd.DTensor holds dense (strided) tensors",
                        expected="an op whose outputs are dense",
                        got=f"an output of layout {value.layout}",
                        fix="run it on the global value (x.full_tensor()) or inside fd.local_map",
                    )
                )
            return new_value(backend.replicated(value, target), target, value.shape)
        return value

    return optree.tree_map(wrapped, out, none_is_leaf=True, namespace=NAMESPACE)
