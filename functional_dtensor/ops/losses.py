"""Losses: ``cross_entropy`` of class logits (loss parallel where the class dim is sharded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._backend import is_transformed
from .._dtensor import DTensor, storage_of, without_partial
from .._errors import InputTypeError, ShapeError, explain
from .._op_decisions import Handler, register
from .common import no_params

__all__: list[str] = []


# --- losses ------------------------------------------------------------------------------------


def _whole(value: DTensor) -> DTensor:
    """``value`` with its Partial axes reduced."""
    return value.redistribute(without_partial(value.sharding)) if value.sharding.has_partial else value


def _check_targets(target: DTensor, classes: int, ignore_index: int) -> None:
    """Class indices are classes (or ignored), as torch's kernel checks: each rank checks its
    own (the padding of uneven ones holds 0, a class)."""
    held = storage_of(target)
    if torch.compiler.is_compiling() or is_transformed(held) or target.sharding.has_partial:
        return
    outside = (held != ignore_index) & ((held < 0) | (held >= classes))
    if bool(outside.any()):
        raise InputTypeError(
            explain(
                "torch.nn.functional.cross_entropy(target)",
                "a target is a class index (or the ignore_index)",
                expected=f"targets in [0, {classes}) or {ignore_index}",
                got=f"targets {held[outside].unique().tolist()[:8]}",
                fix="check the targets against the number of classes first",
            )
        )


def _cross_entropy(func, args, kwargs, ctx):
    """``F.cross_entropy`` of class logits and integer targets, as global ops: the log of a
    stable sum of exponentials over the class dim, less the target's logit (gathered). Where
    the class dim is sharded (loss parallel), only per-row maxima, sums and the target's logit
    cross devices, never the logits."""
    names = (
        "input",
        "target",
        "weight",
        "size_average",
        "ignore_index",
        "reduce",
        "reduction",
        "label_smoothing",
    )
    bound = dict(zip(names, args)) | kwargs
    logits, target = bound["input"], bound["target"]
    unsupported_args = [n for n in ("weight", "size_average", "reduce") if bound.get(n) is not None]
    if unsupported_args or bound.get("label_smoothing", 0.0) or not isinstance(target, DTensor):
        raise InputTypeError(
            explain(
                "F.cross_entropy",
                "cross_entropy of fd.DTensor takes class indices as an fd.DTensor, without weights",
                expected="F.cross_entropy(logits, target, ignore_index=..., reduction=...)",
                got=", ".join(unsupported_args) or f"target of type {type(target).__name__}",
                fix="distribute the target (fd.distribute_tensor(t, mesh, fd.P(...))); apply class weights "
                "or label smoothing inside fd.local_map",
            )
        )
    if not logits.dtype.is_floating_point or target.dtype != torch.int64:  # as torch's kernels
        raise InputTypeError(
            explain(
                "F.cross_entropy",
                "cross_entropy takes floating logits and int64 class indices",
                expected="logits of a floating dtype, a target of torch.int64",
                got=f"logits of {logits.dtype}, a target of {target.dtype}",
                fix="convert them first: F.cross_entropy(logits.float(), target.long())",
            )
        )
    dim = 1 if logits.ndim > 1 else 0
    rows = tuple(logits.shape[:dim] + logits.shape[dim + 1 :])
    if tuple(target.shape) != rows:
        raise ShapeError(
            explain(
                "torch.nn.functional.cross_entropy(target)",
                "a target holds one class index per row of the logits",
                expected=f"shape {rows} (the logits' {tuple(logits.shape)} without the class dim {dim})",
                got=f"shape {tuple(target.shape)}",
                fix="pass the targets of these logits (flatten both alike: logits.flatten(0, 1), "
                "targets.flatten(0, 1))",
            )
        )
    ignore_index = bound.get("ignore_index", -100)
    keep = torch.ne(target, ignore_index)
    classes = logits.shape[dim]
    _check_targets(target, classes, ignore_index)
    # of a sharded class dim, the maxima and sums are Partial: each reduced once, here
    top = _whole(logits.detach().amax(dim, keepdim=True))
    log_total = torch.add(_whole(torch.sub(logits, top).exp().sum(dim)).log(), top.squeeze(dim))
    # the target's logit; an ignored target (any value) reads class 0, multiplied by 0 after
    safe = torch.where(keep, target, 0)
    picked = torch.gather(logits, dim, safe.unsqueeze(dim)).squeeze(dim)
    if picked.sharding.has_partial and picked.sharding != log_total.sharding:
        # the class dim sharded: the loss stays a Partial sum (the row totals as parts, with no
        # communication) until it is reduced
        log_total = log_total.redistribute(picked.sharding)
    losses = torch.mul(torch.sub(log_total, picked), keep)
    reduction = bound.get("reduction", "mean")
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else torch.div(losses.sum(), keep.sum())


register([F.cross_entropy], Handler(None, no_params, _cross_entropy, "cross_entropy"))
