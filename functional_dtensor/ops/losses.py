"""Losses: ``cross_entropy`` and ``nll_loss`` with torch's every option (class weights, class
probabilities as targets, label smoothing, an ignored class, each reduction), as global ops;
loss parallel where the class dim is sharded."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn import _reduction

from .. import _blocks as blocks
from .. import _varied as varied
from .._backend import backend_of, is_transformed
from .._cache import Bounded
from .._dtensor import DTensor, data_of, distribute_tensor, held_of, new_value, storage_of, without_partial
from .._errors import InputTypeError, ShapeError, explain
from .._layout import Layout
from .._op_decisions import Handler, refused, register
from .._placements import Partial, Replicate, Shard
from .._sharding import shard_table
from .common import no_params

__all__: list[str] = []


# --- arguments ---------------------------------------------------------------------------------

_NLL_LOSS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_CROSS_ENTROPY = (*_NLL_LOSS, "label_smoothing")


class _Loss(NamedTuple):
    """A loss call's arguments, checked: ``dim`` is the class dim; ``probabilities`` whether the
    target holds class probabilities (of the input's shape) rather than class indices."""

    input: DTensor
    target: DTensor
    weight: DTensor | None
    ignore_index: int
    reduction: str
    smoothing: float
    dim: int
    probabilities: bool


def _whole(value: DTensor) -> DTensor:
    """``value`` with its Partial axes reduced."""
    return value.redistribute(without_partial(value.sharding)) if value.sharding.has_partial else value


def _split_along(value: DTensor, dim: int) -> bool:
    """Whether ``value``'s dim ``dim`` is split over some mesh axis (or Partial: its rows summed
    from parts)."""
    return value.sharding.has_partial or any(
        p.is_shard() and p.dim == dim % value.ndim for p in value.placements
    )


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a torch.Tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _weight(weight, mesh, name: str) -> DTensor | None:
    """The class weights as a value on ``mesh``, replicated: a plain tensor taken as it is (every
    device holds the same class weights), with no communication; a value sharded, gathered (one
    weight per class, far fewer than the logits)."""
    if weight is None:
        return None
    if isinstance(weight, DTensor):  # small (one weight per class): replicated once, here
        return weight.redistribute([Replicate()] * weight.device_mesh.ndim)
    if not isinstance(weight, torch.Tensor):
        raise InputTypeError(
            explain(
                f"torch.nn.functional.{name}(weight)",
                "class weights are a tensor of one weight per class",
                expected="an fd.DTensor, a torch.Tensor or None",
                got=_described(weight),
                fix="pass weight=torch.tensor([...]) (one weight per class)",
            )
        )
    placements = [Replicate()] * mesh.ndim
    return distribute_tensor(weight.to(mesh.device_type), mesh, placements, src_data_rank=None)


def _arguments(func, name: str, names: tuple[str, ...], args, kwargs) -> _Loss:
    """The call's arguments, checked as torch checks them (the shapes and options on meta
    tensors, by torch itself), refused as the library's errors."""
    bound = dict(zip(names, args)) | kwargs
    x, target = bound.get("input"), bound.get("target")
    for role, value in (("input", x), ("target", target)):
        if not isinstance(value, DTensor):
            raise InputTypeError(
                explain(
                    f"torch.nn.functional.{name}({role})",
                    f"{name} of fd.DTensor takes its input and target as fd.DTensor values",
                    expected=f"F.{name}(input, target, ...) with both fd.DTensor",
                    got=f"{role} as {_described(value)}",
                    fix="distribute it: fd.distribute_tensor(t, mesh, fd.P(...)) (the target laid out "
                    "like the input's rows, or replicated)",
                )
            )
    reduction = bound.get("reduction", "mean")
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        reduction = _reduction.legacy_get_string(bound.get("size_average"), bound.get("reduce"))
    weight = _weight(bound.get("weight"), x.device_mesh, name)
    dim = 1 if x.ndim > 1 else 0
    probabilities = name == "cross_entropy" and tuple(target.shape) == tuple(x.shape)
    if not x.dtype.is_floating_point or (
        not probabilities and target.dtype not in (torch.int64, torch.uint8)
    ):  # as torch's kernels
        raise InputTypeError(
            explain(
                f"torch.nn.functional.{name}",
                f"{name} takes floating inputs and int64 class indices (or class probabilities)",
                expected="an input of a floating dtype, a target of torch.int64 (or torch.uint8)",
                got=f"an input of {x.dtype}, a target of {target.dtype}",
                fix=f"convert them first: F.{name}(input.float(), target.long())",
            )
        )
    if probabilities and not target.dtype.is_floating_point:
        raise InputTypeError(
            explain(
                f"torch.nn.functional.{name}(target)",
                "a target of the input's shape holds class probabilities (as in torch)",
                expected="a floating target",
                got=str(target.dtype),
                fix="pass class indices of the input's shape without its class dim, or target.float()",
            )
        )
    if not probabilities:
        rows = tuple(x.shape[:dim] + x.shape[dim + 1 :])
        if tuple(target.shape) != rows:
            raise ShapeError(
                explain(
                    f"torch.nn.functional.{name}(target)",
                    "a target holds one class index per row of the input",
                    expected=f"shape {rows} (the input's {tuple(x.shape)} without the class dim {dim})",
                    got=f"shape {tuple(target.shape)}",
                    fix="pass the targets of this input (flatten both alike: logits.flatten(0, 1), "
                    "targets.flatten(0, 1))",
                )
            )
        if weight is not None and weight.dtype != x.dtype:  # as torch's kernel (not its meta)
            raise InputTypeError(
                explain(
                    f"torch.nn.functional.{name}(weight)",
                    "class weights of class indices have the input's dtype (as in torch)",
                    expected=str(x.dtype),
                    got=str(weight.dtype),
                    fix=f"pass weight.to({x.dtype})",
                )
            )
    options = {"ignore_index": bound.get("ignore_index", -100), "reduction": reduction}
    if name == "cross_entropy":
        options["label_smoothing"] = bound.get("label_smoothing", 0.0)
    _check_on_meta(func, name, (x, target, weight), options)
    if target.dtype == torch.uint8:  # compared with ignore_index as torch's kernel does: int64
        target = target.to(torch.int64)
    if not probabilities:
        _check_targets(target, x.shape[dim], options["ignore_index"], name)
    return _Loss(
        x,
        target,
        weight,
        options["ignore_index"],
        reduction,
        float(options.get("label_smoothing", 0.0)),
        dim,
        probabilities,
    )


#: the calls torch's checks passed: (loss, shapes and dtypes, options)
_CHECKED = Bounded(1024, "losses: calls checked on meta")


def _check_on_meta(func, name: str, values, options: dict) -> None:
    """torch's own checks of the call (shapes, weights, the options' values) on meta tensors of
    the global shapes; once per shapes, dtypes and options."""

    def meta(value):
        return None if value is None else torch.empty(value.shape, dtype=value.dtype, device="meta")

    key = None
    if not torch.compiler.is_compiling():
        key = (func, *[None if v is None else (tuple(v.shape), v.dtype) for v in values], *options.items())
        try:
            if key in _CHECKED:
                return
        except TypeError:  # an unhashable option: checked every time
            key = None
    x, target, weight = values
    try:
        func(meta(x), meta(target), weight=meta(weight), **options)
    except (RuntimeError, TypeError, ValueError, IndexError, AssertionError) as error:
        shapes = ", ".join(str(tuple(v.shape)) for v in values if v is not None)
        raise refused(f"nn.functional.{name}", f"{shapes} {options}", error) from None
    if key is not None:
        _CHECKED[key] = True


def _check_targets(target: DTensor, classes: int, ignore_index: int, name: str) -> None:
    """Class indices are classes (or ignored), as torch's kernel checks: each rank checks its
    own (the padding of uneven ones holds 0, a class)."""
    held = data_of(target)  # its distinct blocks: each device's block is one of them
    if torch.compiler.is_compiling() or is_transformed(held) or target.sharding.has_partial:
        return
    if blocks.outside(held, classes, ignore_index):
        outside = blocks.outside_mask(held, classes, ignore_index)
        raise InputTypeError(
            explain(
                f"torch.nn.functional.{name}(target)",
                "a target is a class index (or the ignore_index)",
                expected=f"targets in [0, {classes}) or {ignore_index}",
                got=f"targets {held[outside].unique().tolist()[:8]}",
                fix="check the targets against the number of classes first",
            )
        )


# --- the losses, as global ops -----------------------------------------------------------------


def _shifted(logits: DTensor, dim: int) -> tuple[DTensor, DTensor]:
    """The logits less their maximum along ``dim``, and the log of the sum of their exponentials
    (per row, ``dim`` dropped): a stable log-sum-exp. Where ``dim`` is sharded only the per-row
    maxima and sums cross devices."""
    logits = _whole(logits)
    # of a sharded class dim, the maxima and sums are Partial: each reduced once, here
    top = _whole(logits.detach().amax(dim, keepdim=True))
    shifted = torch.sub(logits, top)
    return shifted, _whole(shifted.exp().sum(dim)).log()


def _log_probabilities(logits: DTensor, dim: int) -> DTensor:
    """``log_softmax`` along ``dim`` as global ops."""
    shifted, log_total = _shifted(logits, dim)
    return torch.sub(shifted, log_total.unsqueeze(dim))


def _along_classes(weight: DTensor, loss: _Loss) -> DTensor:
    """The class weights shaped to broadcast along the input's class dim."""
    shape = [1] * loss.input.ndim
    shape[loss.dim] = weight.shape[0]
    return weight.reshape(shape)


def _class_losses(
    log_probs: DTensor, loss: _Loss, log_total: DTensor | None = None
) -> tuple[DTensor, DTensor]:
    """Per row: ``-w[t] * log_probs[t]`` (with label smoothing, mixed with the weighted mean of
    every class's), 0 where the target is ignored; and the weight ``w[t]`` each row counts for
    in a mean (1 without weights), 0 where ignored. Of a sharded class dim, the target's
    log-probability is gathered from the block that holds it (a Partial sum of the devices').
    ``log_total``: where given, ``log_probs`` are shifted logits, each row's log-probabilities
    those less ``log_total`` (subtracted from the picked entries only: per row, not per class,
    and kept Partial, so the backward sums nothing over the class dim either)."""
    dim, weight = loss.dim, loss.weight
    keep = torch.ne(loss.target, loss.ignore_index)
    safe = torch.where(keep, loss.target, 0)  # an ignored target reads class 0, dropped after
    picked = torch.gather(log_probs, dim, safe.unsqueeze(dim)).squeeze(dim)
    if log_total is not None:
        if picked.sharding.has_partial and log_total.sharding != picked.sharding:
            log_total = log_total.redistribute(picked.sharding)  # parts of it: no communication
        picked = torch.sub(picked, log_total)
    if weight is None:
        rows, counts = torch.neg(picked), keep
    else:
        chosen = F.embedding(safe, weight.unsqueeze(-1)).squeeze(-1)  # each row's class weight
        rows, counts = torch.neg(torch.mul(picked, chosen)), torch.mul(chosen, keep)
    if loss.smoothing:
        spread = log_probs if weight is None else torch.mul(log_probs, _along_classes(weight, loss))
        smooth = torch.neg(spread.sum(dim))
        classes = log_probs.shape[dim]
        rows = torch.add(torch.mul(rows, 1.0 - loss.smoothing), torch.mul(smooth, loss.smoothing / classes))
    # (not a product with the mask: an ignored row of infinite log-probabilities reads 0, as torch)
    return torch.where(keep, rows, 0.0), counts


def _reduced(rows: DTensor, counts: DTensor, reduction: str) -> DTensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else torch.div(total, counts.sum())


def _probability_loss(log_probs: DTensor, loss: _Loss) -> DTensor:
    """Class probabilities as the target: ``-sum(p * w * log_probs)`` along the class dim
    (a Partial sum where it is sharded), as torch computes it."""
    target, dim = loss.target, loss.dim
    classes = log_probs.shape[dim]
    if loss.smoothing:
        target = torch.add(torch.mul(target, 1.0 - loss.smoothing), loss.smoothing / classes)
    products = torch.mul(log_probs, target)
    if loss.weight is not None:
        products = torch.mul(products, _along_classes(loss.weight, loss))
    if loss.reduction == "none":
        return torch.neg(products.sum(dim))
    total = torch.neg(products.sum())
    if loss.reduction == "sum":
        return total
    rows = log_probs.numel() // classes if classes else 0
    return torch.div(total, rows) if rows else torch.mul(total, float("nan"))


def _cross_entropy(func, args, kwargs, ctx):
    """``F.cross_entropy`` as global ops: log-probabilities by a stable log-sum-exp along the
    class dim, then the negative log-likelihood of class indices (weighted, smoothed, ignored)
    or of class probabilities. Where the class dim is sharded (loss parallel) only per-row
    maxima and sums cross devices, never the logits."""
    loss = _arguments(func, "cross_entropy", _CROSS_ENTROPY, args, kwargs)
    if not _split_along(loss.input, loss.dim):  # whole rows on each device: torch's fused kernel
        log_probs = F.log_softmax(_whole(loss.input), loss.dim)
        if loss.probabilities:
            return _probability_loss(log_probs, loss)
        return _reduced(*_class_losses(log_probs, loss), loss.reduction)
    if loss.probabilities or loss.smoothing:  # every class's log-probability counts
        log_probs = _log_probabilities(loss.input, loss.dim)
        if loss.probabilities:
            return _probability_loss(log_probs, loss)
        return _reduced(*_class_losses(log_probs, loss), loss.reduction)
    at_once = _loss_parallel_at_once(loss)
    if at_once is not None:
        return at_once
    shifted, log_total = _shifted(loss.input, loss.dim)
    return _reduced(*_class_losses(shifted, loss, log_total), loss.reduction)


def _loss_parallel_at_once(loss: _Loss) -> DTensor | None:
    """The loss-parallel cross-entropy of class indices in a few kernels on every device's
    block at once, where the backend holds them all (a simulated mesh; see
    :meth:`.Backend.cross_entropy_parts`): the same parts as the global ops below leave on each
    device, the same collectives recorded. For logits ``(rows, classes)`` with the classes
    split evenly over one axis and the rows over the other (if any; no axis of one device), the
    target's rows laid out like them, no class weights; None elsewhere (the global ops below,
    every case)."""
    x, target = loss.input, loss.target
    mesh = x.device_mesh
    if loss.weight is not None or x.ndim != 2 or mesh.ndim > 2 or 1 in mesh.shape:
        return None
    if torch.compiler.is_compiling():
        return None
    class_axes = [a for a, p in enumerate(x.placements) if p == Shard(1)]
    if len(class_axes) != 1 or any(p != Shard(0) for a, p in enumerate(x.placements) if a != class_axes[0]):
        return None
    (axis,) = class_axes
    rows = tuple([Replicate() if a == axis else Shard(0) for a in range(mesh.ndim)])
    if tuple(target.placements) != rows or held_of(x) is not None or held_of(target) is not None:
        return None
    logits, labels = storage_of(x), storage_of(target)
    if logits.is_meta or any([is_transformed(s) or varied.axes_of(s) for s in (logits, labels)]):
        return None
    table = shard_table(x.sharding, tuple(x.shape))
    if not (table.is_even and shard_table(target.sharding, tuple(target.shape)).is_even):
        return None
    backend, name = backend_of(mesh), mesh.axis_names[axis]
    parts = backend.cross_entropy_parts(logits, labels, mesh, name, loss.ignore_index, loss.reduction)
    if parts is None:
        return None
    # the ranks' collectives: the per-row maxima and sums over the class axis, a mean's count
    # of the rows not ignored over the rows' axis
    row_bytes = table.padded_shape[0] * x.element_size()
    for _ in range(2):
        backend.count_bytes("all_reduce", (name,), row_bytes, mesh.shape[axis])
    if loss.reduction == "mean" and mesh.ndim == 2:
        other = 1 - axis
        backend.count_bytes("all_reduce", (mesh.axis_names[other],), 8, mesh.shape[other])  # (int64)
    if loss.reduction == "none":
        layout = Layout(mesh, tuple([Partial() if a == axis else Shard(0) for a in range(mesh.ndim)]))
        return new_value(parts, layout, x.shape[:1])
    return new_value(parts, Layout(mesh, (Partial(),) * mesh.ndim), torch.Size(()))


def _nll_loss(func, args, kwargs, ctx):
    """``F.nll_loss`` of log-probabilities as global ops: each row's target entry (gathered from
    the block that holds it where the class dim is sharded), weighted, ignored, reduced."""
    loss = _arguments(func, "nll_loss", _NLL_LOSS, args, kwargs)
    return _reduced(*_class_losses(loss.input, loss), loss.reduction)


register([F.cross_entropy], Handler(None, no_params, _cross_entropy, "cross_entropy"))
register([F.nll_loss], Handler(None, no_params, _nll_loss, "nll_loss"))
