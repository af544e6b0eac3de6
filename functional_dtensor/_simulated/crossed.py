"""Linear layers on a simulated mesh whose weight is held once along the axes that split the
input by rows, the devices along the other axes holding its blocks: one product per outer
position of the mesh, the block its devices share taken as a view, nothing copied to them.

* :func:`crossed_linear`: every device's product (a column-parallel layer, or a row-parallel
  one whose partial output is summed later);
* :func:`reduced_linear`: a row-parallel layer and the all-reduce of its output at once, the
  products of the devices that split the weight summed as they are written (no device's part
  written, no cotangent spread to every part backward).
"""

from __future__ import annotations

import torch

from .. import _autograd as autograd

__all__ = ["crossed_linear", "reduced_linear"]


def crossed_linear(x, weight, bias, x_outer: bool, x_held: bool) -> torch.Tensor:
    """``F.linear`` per device where the weight's blocks (and the bias's) are held once along
    some mesh axes, the ones that split the input by rows: ``weight`` ``(W, out, features)`` and
    ``bias`` ``(W, out)`` a block per position along the other axes; ``x`` every device's
    block, stacked ``(n, *rows, features)``, or with ``x_held`` held once along those other
    axes (one block per position along the weight's). The weight's positions are the inner
    ones in device order where ``x_outer``. No operand is copied to the devices that share it:
    one product per outer position takes the shared operand's block as a view, and the
    weight's gradient is summed over its held axes by products of their parts."""
    n_w, rows = weight.shape[0], x.shape[1:-1]
    n_x = x.shape[0] if x_held else x.shape[0] // n_w  # (positions along the weight's held axes)
    if x_outer:
        grid = (n_x, 1 if x_held else n_w)
    else:
        grid = (1 if x_held else n_w, n_x)
    out = autograd.apply(_Crossed, x.reshape(*grid, -1, x.shape[-1]), weight, bias, x_outer)
    return out.reshape(out.shape[0], *rows, out.shape[-1])


def _expanded(x, weight, bias, x_outer: bool):
    """The operands on the device grid ``(outer, inner)``, views: ``x`` ``(outer, inner, rows,
    features)``, the weight transposed and the bias ``(outer, inner, 1, out)``."""
    n_w, (rows, features), width = weight.shape[0], x.shape[2:], weight.shape[1]
    n_x = x.shape[0] if x_outer else x.shape[1]
    devices, at = ((n_x, n_w), 0) if x_outer else ((n_w, n_x), 1)
    xs = x.expand(*devices, rows, features)
    ws = weight.mT.unsqueeze(at).expand(*devices, features, width)
    bs = None if bias is None else bias.unsqueeze(at).unsqueeze(2).expand(*devices, 1, width)
    return xs, ws, bs


def _crossed(x, weight, bias, x_outer: bool) -> torch.Tensor:
    xs, ws, bs = _expanded(x, weight, bias, x_outer)
    out = x.new_empty((*xs.shape[:3], ws.shape[-1]))
    for i in range(out.shape[0]):  # the outer positions; the inner ones in one product
        if bs is None:
            torch.bmm(xs[i], ws[i], out=out[i])
        else:
            torch.baddbmm(bs[i], xs[i], ws[i], out=out[i])
    return out.reshape(-1, *out.shape[2:])


def _input_cotangent(grid, weights, shape, x_outer: bool) -> torch.Tensor:
    """The cotangent of :func:`crossed_linear`'s input, of ``shape`` on the device grid:
    each device's product of its cotangent ``grid[i, j]`` and weight ``weights[i, j]``, summed
    over the weight's positions where the input is held once along them (accumulated in place:
    no device's part is kept)."""
    outer, inner = grid.shape[:2]
    if tuple(shape[:2]) == (outer, inner):  # stacked: every device's own
        if torch.is_grad_enabled():  # (differentiated again: no out=)
            return torch.stack([torch.bmm(grid[i], weights[i]) for i in range(outer)])
        out = grid.new_empty(outer, inner, grid.shape[2], weights.shape[-1])
        for i in range(outer):
            torch.bmm(grid[i], weights[i], out=out[i])
        return out
    if x_outer:  # held along the inner positions
        again = torch.is_grad_enabled()
        out = None if again else grid.new_empty(outer, 1, grid.shape[2], weights.shape[-1])
        parts = []
        for i in range(outer):
            part = torch.mm(grid[i, 0], weights[i, 0], **({} if again else {"out": out[i, 0]}))
            for j in range(1, inner):
                part = part.addmm_(grid[i, j], weights[i, j])
            parts.append(part)
        return torch.stack(parts).unsqueeze(1) if again else out
    summed = torch.bmm(grid[0], weights[0])  # held along the outer positions
    for i in range(1, outer):
        summed = summed.baddbmm_(grid[i], weights[i])
    return summed.unsqueeze(0)


def _saved(ctx, inputs, output) -> None:
    """The products' ``setup_context``: both operands saved, for either mode."""
    x, weight, _, ctx.x_outer = inputs
    ctx.save_for_backward(x, weight)
    ctx.save_for_forward(x, weight)


def _product_rule(function, ctx, tx, tw, bias) -> torch.Tensor:
    """The tangent of ``function``'s product of the saved operands (linear in each): each
    operand's tangent times the other, plus ``bias``, the bias's tangent's term (or None)."""
    x, weight = ctx.saved_tensors
    terms = [] if bias is None else [bias]
    if tx is not None:
        terms.append(autograd.apply(function, tx, weight, None, ctx.x_outer))
    if tw is not None:
        terms.append(autograd.apply(function, x, tw, None, ctx.x_outer))
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out


@autograd.compilable
class _Crossed(torch.autograd.Function):
    """:func:`crossed_linear` on ``x`` laid on the device grid ``(outer, inner, rows,
    features)`` (a dim of one where it is held). Backward: the input's and the weight's
    cotangents each summed over the positions that share them (as the collectives of their
    ``pvary`` would), by products and sums of the saved operands and the cotangent, so that
    every order of differentiation works; forward mode: the product rule."""

    @staticmethod
    def forward(x, weight, bias, x_outer):
        return _crossed(x, weight, bias, x_outer)

    setup_context = staticmethod(_saved)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        xs, ws, _ = _expanded(x, weight, None, ctx.x_outer)
        (outer, inner, rows, features), width = xs.shape, weight.shape[1]
        grid = g.reshape(outer, inner, rows, width)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_cotangent(grid, ws.mT, x.shape, ctx.x_outer)
        if ctx.needs_input_grad[1]:
            if ctx.x_outer:  # the weight's positions inner: the outer ones' parts summed
                grad_w = torch.bmm(grid[0].mT, xs[0])
                for i in range(1, outer):
                    grad_w = grad_w.baddbmm_(grid[i].mT, xs[i])
            else:  # the weight's positions outer: its held axes' rows end to end, one product
                grad_w = torch.bmm(grid.reshape(outer, -1, width).mT, xs.reshape(outer, -1, features))
        if ctx.needs_input_grad[2]:  # (one reduction over dims 0 and 2 is several times slower)
            grad_b = grid.sum(2).sum(0 if ctx.x_outer else 1)
        return grad_x, grad_w, grad_b, None

    @staticmethod
    def jvp(ctx, tx, tw, tb, _):
        bias = None
        if tb is not None:  # every device's rows take its bias's tangent
            xs, _, bs = _expanded(*ctx.saved_tensors, tb, ctx.x_outer)
            bias = bs.expand(*xs.shape[:3], bs.shape[-1]).reshape(-1, xs.shape[2], bs.shape[-1])
        return _product_rule(_Crossed, ctx, tx, tw, bias)


def reduced_linear(x, weight, bias, x_outer: bool) -> torch.Tensor:
    """``F.linear`` per device, summed over the devices that hold the weight's different
    blocks (a row-parallel layer and the all-reduce of its output): ``weight`` ``(W, out,
    features)`` and ``bias`` ``(W, out)`` a block (a part) per position along the axes the
    weight is split over, held once along the others, which split ``x`` (stacked, ``(n, *rows,
    features)``) by rows. One result per position along those, ``(n // W, *rows, out)``, each
    written by its products as they are summed. The weight's positions are the inner ones in
    device order where ``x_outer``."""
    n_w, rows = weight.shape[0], x.shape[1:-1]
    grid = (x.shape[0] // n_w, n_w) if x_outer else (n_w, x.shape[0] // n_w)
    out = autograd.apply(_Reduced, x.reshape(*grid, -1, x.shape[-1]), weight, bias, x_outer)
    return out.reshape(out.shape[0], *rows, out.shape[-1])


def _by_input(grid: torch.Tensor, x_outer: bool) -> torch.Tensor:
    """A tensor on the device grid as ``(input position, weight position, ...)``: a view."""
    return grid if x_outer else grid.transpose(0, 1)


def _summed(x, weight, bias, x_outer: bool) -> torch.Tensor:
    xs, ws = _by_input(x, x_outer), weight.mT
    out = x.new_empty(xs.shape[0], xs.shape[2], weight.shape[1])
    total = None if bias is None else bias.sum(0).expand(out.shape[1:])
    for i in range(out.shape[0]):  # one batch-summed product per position of the input
        if total is None:
            torch.addbmm(out[i], xs[i], ws, beta=0, out=out[i])
        else:
            torch.addbmm(total, xs[i], ws, out=out[i])
    return out


@autograd.compilable
class _Reduced(torch.autograd.Function):
    """:func:`reduced_linear` on ``x`` laid on the device grid ``(outer, inner, rows,
    features)``. Backward: each device's input cotangent the product of its position's
    cotangent (held once, as an all-reduce's transpose spreads it) and its weight block; the
    weight's summed over the input's positions; every part of the bias takes the whole sum.
    Plain products and sums, so that every order of differentiation works; forward mode: the
    product rule."""

    @staticmethod
    def forward(x, weight, bias, x_outer):
        return _summed(x, weight, bias, x_outer)

    setup_context = staticmethod(_saved)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        xs = _by_input(x, ctx.x_outer)  # (input positions, weight positions, rows, features)
        (positions, n_w, rows, features), width = xs.shape, weight.shape[1]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if torch.is_grad_enabled():  # (differentiated again: no out=)
                parts = [torch.bmm(g[i].expand(n_w, rows, width), weight) for i in range(positions)]
                grad_x = _by_input(torch.stack(parts), ctx.x_outer).contiguous()
            else:
                grad_x = x.new_empty(x.shape)
                into = _by_input(grad_x, ctx.x_outer)
                for i in range(positions):
                    torch.bmm(g[i].expand(n_w, rows, width), weight, out=into[i])
        if ctx.needs_input_grad[1]:
            if ctx.x_outer:  # the input's positions outer: their parts summed
                grad_w = torch.bmm(g[0].mT.expand(n_w, width, rows), xs[0])
                for i in range(1, positions):
                    grad_w = grad_w.baddbmm_(g[i].mT.expand(n_w, width, rows), xs[i])
            else:  # the weight's positions outer: the input's rows end to end, one product
                ends = g.reshape(-1, width).mT.expand(n_w, width, positions * rows)
                grad_w = torch.bmm(ends, x.reshape(n_w, -1, features))
        if ctx.needs_input_grad[2]:
            grad_b = g.sum(1).sum(0).expand(n_w, width).contiguous()
        return grad_x, grad_w, grad_b, None

    @staticmethod
    def jvp(ctx, tx, tw, tb, _):
        bias = None
        if tb is not None:  # every row takes the sum of the bias's parts' tangents
            xs = _by_input(ctx.saved_tensors[0], ctx.x_outer)
            bias = tb.sum(0).expand(xs.shape[0], xs.shape[2], tb.shape[-1])
        return _product_rule(_Reduced, ctx, tx, tw, bias)
