"""Padding: ``F.pad`` in every mode. The dims it pads (or crops) are whole, the others keep
their layout: ``F.pad(labels, (0, 1), value=-100)`` of labels sharded over the batch dim
pads each device's rows, with no communication."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _rules as rules
from .._op_decisions import Handler, register
from .._placements import Partial
from .common import on_meta

__all__: list[str] = []


# --- padding -----------------------------------------------------------------------------------

_NAMES = ("input", "pad", "mode", "value")


def _pad_params(args, kwargs, tensors):
    """``(padded dims, linear, pad, mode, value)``: the dims with a nonzero pad at either end
    (counted from 0), whether the op is linear in its input (every mode but a constant other
    than 0: it copies elements), and the op's own arguments. torch checks them first, on a
    meta tensor of the input's global shape."""
    on_meta(F.pad, args, kwargs)
    bound = dict(zip(_NAMES, args)) | kwargs
    pad = tuple(int(p) for p in bound["pad"])
    mode, value = bound.get("mode", "constant"), bound.get("value")
    ndim = tensors[0].ndim
    padded = tuple(sorted(ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]))
    linear = mode != "constant" or not value
    return (padded, linear, pad, mode, value)


def _pad_rule(call):
    """The padded dims whole, the others as they are (every tensor dim of the output is the
    input's); a Partial average stays one (the parts' average, padded, is the average padded),
    and so does a Partial sum where the op is linear in its input."""
    padded, linear = call.params[:2]
    options = rules.along(call._replace(params=(padded,)))
    options.append(rules.Option((Partial("avg"),), Partial("avg")))
    if linear:
        options.append(rules.Option((rules.SUM,), rules.SUM))
    return options


def _pad_local(func, args, kwargs, ctx):
    """``F.pad`` of one device's block (or of every device's, a device dim in front: the pads
    count dims from the end). The modes other than ``constant`` take a batch of one dim before
    the padded dims and the one before them: the dims before those are flattened into it."""
    _, _, pad, mode, value = ctx.decision.call.params
    x = args[0]
    if mode == "constant" or not x.numel():  # an empty block: padded with nothing to copy
        return F.pad(x, pad, value=value)
    kept = len(pad) // 2 + 1  # the padded dims and the one before them
    out = F.pad(x.reshape(-1, *x.shape[x.dim() - kept :]), pad, mode)
    return out.reshape(*x.shape[: x.dim() - kept], *out.shape[1:])


register(
    [F.pad, torch._C._nn.pad],
    Handler(_pad_rule, _pad_params, _pad_local, "nn.functional.pad", batched="leading"),
)
