"""Loss-parallel cross-entropy on stacked storage: every device's part of it in a few kernels.

The global ops compute a cross-entropy whose class dim is split over a mesh axis as the ranks
do (``ops/losses.py``): per-row maxima and sums of exponentials reduced over the axis, each
row's target log-probability picked on the device that holds its class, the loss a Partial sum
of the devices' parts. On a simulated mesh each of those is a global op, with its decision and
autograd node, on tiny per-row tensors. Here the same arithmetic runs on the grid of every
device's block at once: the reductions over the axis are reductions over one grid dim, and the
parts are those the global ops leave on each device (the replicated log-sum-exp in equal parts,
as a Partial value's partition). Autograd differentiates it as it is, to any order; the caller
records the collectives the ranks run.
"""

from __future__ import annotations

import torch

__all__ = ["cross_entropy_parts"]


def cross_entropy_parts(
    logits: torch.Tensor,
    target: torch.Tensor,
    mesh_shape: tuple[int, ...],
    axis: int,
    ignore_index: int,
    reduction: str,
) -> torch.Tensor:
    """Every device's part of ``F.cross_entropy`` of class indices: ``logits`` ``(n, rows,
    classes)``, each device's rows and its block of the classes, split over mesh dim ``axis``
    (device ``k`` along it holds classes ``[k * classes, (k + 1) * classes)``); ``target``
    ``(n, rows)``, each device's rows' class indices. The parts sum, over the devices, to the
    loss: ``(n, rows)`` for ``reduction="none"``, ``(n,)`` for ``"sum"`` and ``"mean"`` (the
    mean over the rows of every device that are not ``ignore_index``)."""
    size, rows, classes = mesh_shape[axis], logits.shape[1], logits.shape[2]
    grid = logits.reshape(*mesh_shape, rows, classes)
    labels = target.reshape(*mesh_shape, rows)
    top = grid.detach().amax(-1, keepdim=True).amax(axis, keepdim=True)  # (a constant: no gradient)
    shifted = grid - top
    log_total = shifted.exp().sum(-1).sum(axis, keepdim=True).log()
    keep = labels != ignore_index
    # each device's first class, along the axis (broadcast over the later dims and the rows)
    first = torch.arange(size, device=logits.device).mul_(classes)
    first = first.view(size, *[1] * (len(mesh_shape) - axis))
    local = torch.where(keep, labels, 0) - first
    held = (local >= 0) & (local < classes)
    picked = shifted.gather(-1, local.clamp(0, classes - 1).unsqueeze(-1)).squeeze(-1)
    # (not products with the masks: an ignored row of infinite logits reads 0, as torch)
    parts = torch.where(keep, log_total / size - torch.where(held, picked, 0.0), 0.0)
    devices = logits.shape[0]
    if reduction == "none":
        return parts.reshape(devices, rows)
    total = parts.sum(-1)
    if reduction == "sum":
        return total.reshape(devices)
    others = tuple([d for d in range(len(mesh_shape)) if d != axis])
    counts = keep.sum(-1).sum(others, keepdim=True) if others else keep.sum(-1)
    return (total / counts).reshape(devices)
