"""Users' own sharding rules: ``fd.register_sharding``, torch DTensor's decorator, for torch
functions and ``torch.library`` custom ops; the op then runs on each device's shard.
"""

from __future__ import annotations

import optree
import torch

from . import _rules as rules
from ._dtensor import DTensor
from ._op_decisions import Handler, register
from ._shard_map import NAMESPACE

__all__ = ["register_sharding", "GlobalShape"]


class GlobalShape(tuple):
    """The global shape of an ``fd.DTensor`` argument, as a user's rule sees it: a tuple of
    ints (``x[0]``, ``len(x)``) that also answers ``x.ndim`` and ``x.shape``, as torch's
    ``DTensorSpec`` does in torch's own strategy style."""

    @property
    def ndim(self) -> int:
        return len(self)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self)


def register_sharding(op):
    """Give ``op`` (a torch function, or a ``torch.library`` custom op) a sharding rule, as a
    decorator of the rule (torch DTensor's ``register_sharding`` as the model).

    The rule is called with the op's arguments, each ``fd.DTensor`` replaced by its global
    shape (a tuple of ints with ``.ndim`` and ``.shape``), and returns the acceptable layouts on
    one mesh axis: a list of ``(output placement, input placements)``, one input placement per
    ``fd.DTensor`` argument in order (``None`` for other arguments may be included and is
    skipped). torch's style is taken as it is: ``([output placement], [input placements])``. The op then runs
    on each device's shard (on the simulated backend once per device, on its own unpadded
    shard), after the cheapest redistribute to one of the layouts, as every global op.

    >>> import torch, functional_dtensor as fd
    >>> @torch.library.custom_op("fd_doc::scale_rows", mutates_args=())
    ... def scale_rows(x: torch.Tensor) -> torch.Tensor:
    ...     return x * torch.arange(1, x.shape[-1] + 1, dtype=x.dtype)
    >>> @scale_rows.register_fake
    ... def _(x):
    ...     return torch.empty_like(x)
    >>> @fd.register_sharding(scale_rows)
    ... def _(x):  # rows may be split; the last dim must be whole
    ...     return [(fd.Shard(0), [fd.Shard(0)]), (fd.Replicate(), [fd.Replicate()])]
    >>> mesh = fd.simulated_mesh(2, "x")
    >>> x = fd.distribute_tensor(torch.ones(4, 3), mesh, fd.P(None, "x"))
    >>> y = scale_rows(x)
    >>> y.placements, y.full_tensor()[0]
    ((Shard(dim=0),), tensor([1., 2., 3.]))
    """

    def decorate(user_rule):
        def params(args, kwargs, tensors):
            shapes = optree.tree_map(
                lambda v: GlobalShape(v.shape) if isinstance(v, DTensor) else v,
                (args, kwargs),
                none_is_leaf=True,
                namespace=NAMESPACE,
            )
            return shapes

        def rule(call):
            args, kwargs = call.params
            options = []
            for output, inputs in user_rule(*args, **kwargs):
                if isinstance(output, (list, tuple)):  # torch's style: a placement per output
                    (output,) = output
                placements = tuple(p for p in inputs if p is not None)
                options.append(rules.Option(placements, output))
            return options

        name = getattr(op, "__name__", None) or getattr(op, "_name", None) or repr(op)
        handler = Handler(rule, params, _user_op, name)
        register(_forms_of(op), handler)
        return user_rule

    return decorate


def _user_op(func, args, kwargs, ctx):
    """A user's op with a rule: run on each device's own shard (on the simulated backend once
    per device, on its unpadded block)."""
    return func(*args, **kwargs)


def _forms_of(op) -> list:
    """An op and the forms it is called by (a custom op's overload packet and default)."""
    forms = [op]
    for name in ("_opoverload", "default"):
        form = getattr(op, name, None)
        if form is not None:
            forms.append(form)
    packet = getattr(getattr(op, "_opoverload", None), "overloadpacket", None)
    if packet is not None:
        forms.append(packet)
    return forms
