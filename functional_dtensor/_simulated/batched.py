"""How the simulated backend runs a global op's local form on every device's block at once.

A local form (``ops/``) is plain torch on one device's block, as the distributed backend runs
it on its shard. The simulated backend holds every device's block in one stacked tensor
``(n, *padded)``, and runs a local form on it in one of three ways:

* ``"leading"``: the local form itself, on the stack, where it counts dims from the end and
  takes leading dims as torch's ops take batch dims (reductions, softmax, ``cat``);
* a **batched form** of this module, by name: the same op on the stack in a few kernels (a
  matrix product per device as one ``bmm``, a view with the device dim kept in front, ...);
* **per device** (:func:`per_device`): the local form on each device's unpadded block in turn,
  the results padded and stacked. This is how every op runs on uneven blocks, and ops without a
  batched form: what a device sees is what a rank sees.

Batched forms run on even blocks only (no padding), and may decline (return
``NotImplemented``) where the call is one they do not cover: the op then runs per device.
"""

from __future__ import annotations

import math

import optree
import torch
import torch.nn.functional as F

from .. import _autograd as autograd
from .._blocks import block_numel, outside, pad
from .._cache import cached
from .._op_args import quiet_if
from .._sharding import shard_table
from . import kernels

__all__ = ["run_local", "per_device", "PER_DEVICE_KERNEL"]


def run_local(local, batched: str | None, func, args, kwargs, ctx, storages, held=None):
    """``local`` (an op's local form) on stacked storage: by its batched form where the
    blocks are even and it has one, else per device. ``storages``: the inputs' storages among
    ``args``/``kwargs``, in the decision's order (None: every tensor among ``args``).
    ``held``: the storages are the blocks held once by this plan (``ctx.held``), one per
    distinct block, and so is the output."""
    if ctx.even and batched is not None and (held is None or not _offsets_by_device(batched, ctx)):
        if batched == "leading":
            return local(func, args, kwargs, ctx)
        out = FORMS[batched](local, func, args, kwargs, ctx)
        if out is not NotImplemented:
            return out
    if storages is None:
        storages = [a for a in args if isinstance(a, torch.Tensor)]
    return per_device(local, func, args, kwargs, ctx, storages, None if held is None else held.devices)


def per_device(local, func, args, kwargs, ctx, storages, devices=None):
    """``local`` on each device's unpadded block (the inputs' blocks cut to the sizes their
    layouts give that device; other arguments as they are), its outputs padded to the
    output's padded block and stacked. Gradients flow to the blocks, none to the padding.
    ``devices``: the device each block of held storages stands for (None: every device's)."""
    decision = ctx.decision
    tables = [shard_table(layout, shape) for layout, shape in zip(decision.inputs, decision.call.shapes)]
    inputs = {}
    for i, storage in enumerate(storages):
        inputs.setdefault(id(storage), i)
    # the keywords' values as a tuple: Dynamo traces optree's sequences, not its dicts
    leaves, tree = optree.tree_flatten((args, tuple(kwargs.values())), none_is_leaf=True)
    slots = [
        (p, inputs[id(v)]) for p, v in enumerate(leaves) if isinstance(v, torch.Tensor) and id(v) in inputs
    ]
    # each storage unbound once: one autograd node whose backward stacks the blocks' gradients
    # (indexing a device's block would be a node per device, each filling a whole storage)
    blocks = {position: leaves[position].unbind(0) for position, _ in slots}
    results = []
    for row, device in enumerate(range(decision.output.mesh.size) if devices is None else devices):
        local_leaves = list(leaves)
        for position, i in slots:
            block, size = blocks[position][row], tables[i].local_shapes[device]
            local_leaves[position] = (
                block if block.shape == size else block[tuple([slice(0, n) for n in size])]
            )
        a, values = tree.unflatten(local_leaves)
        k = dict(zip(kwargs, values))
        empty = any(0 in tables[i].local_shapes[device] for _, i in slots)
        results.append(quiet_if(empty, local, func, a, k, ctx._replace(device=device)))
    first = results[0]
    if isinstance(first, torch.Tensor):
        return _stacked(results, decision.output, decision.out_shapes[0])
    outs = [
        _stacked([r[j] for r in results], decision.output, shape)
        for j, shape in enumerate(decision.out_shapes)
    ]
    return type(first)(*outs) if hasattr(first, "_fields") else type(first)(outs)


def _offsets_by_device(batched: str, ctx) -> bool:
    """Whether a lookup's batched form offsets each device's indices by where its block starts
    (it looks up along a split dim): on held blocks, one per distinct block, the op runs block
    by block instead. Along a whole dim the lookup is the same on every block."""
    if batched == "gather":
        return bool(ctx.decision.inputs[0].sharding_axes(ctx.decision.call.params[0]))
    if batched == "embedding":
        return bool(ctx.decision.inputs[1].sharding_axes(0))
    return False


def _stacked(blocks: list[torch.Tensor], layout, shape) -> torch.Tensor:
    padded = shard_table(layout, tuple(shape)).padded_shape
    return torch.stack([pad(b, padded) if tuple(b.shape) != padded else b for b in blocks])


# --- batched forms -----------------------------------------------------------------------------


def _aligned_values(values, ndim: int):
    """Singleton dims after the device dim for storages of lower rank than the output, so that
    broadcasting pairs a block's dims with the other blocks' dims, not with the device dim."""

    def align(value):
        if isinstance(value, torch.Tensor) and 1 <= value.dim() <= ndim:
            missing = ndim - (value.dim() - 1)
            return value.reshape(value.shape[:1] + (1,) * missing + value.shape[1:]) if missing else value
        return value

    return [align(v) for v in values]


def _aligned(args, kwargs, ctx):
    if not ctx.align:
        return args, kwargs
    ndim = len(ctx.decision.out_shapes[0])
    keys = list(kwargs)
    values = _aligned_values([*args, *kwargs.values()], ndim)
    return values[: len(args)], dict(zip(keys, values[len(args) :]))


def elementwise(local, func, args, kwargs, ctx):
    """The local form on aligned storages. A 0-d value's storage has a dim (the devices'), so
    torch's type promotion counts it as a dimensioned tensor (int64 0-d + int32 vector is int32
    on one device): the output takes the decision's dtype."""
    args, kwargs = _aligned(args, kwargs, ctx)
    out = local(func, args, kwargs, ctx)
    dtype = ctx.decision.out_dtypes[0]
    return out if out.dtype == dtype else out.to(dtype)


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ b`` per device, plus ``bias`` (``(n, cols)``: a row per device) as torch's ``addmm``
    adds it: written into the output before the product, no pass of its own."""
    return torch.bmm(a, b) if bias is None else torch.baddbmm(bias.unsqueeze(1), a, b)


class _Bmm(torch.autograd.Function):
    """:func:`_product` whose gradient of ``b`` has ``b``'s memory order, as torch's ``mm``
    gives it: ``b`` a transposed view (``x @ w.t()``, a linear layer's weight), its gradient is
    the transpose of a row-major product, so the weight's own gradient is row-major (an
    optimizer reads it in one pass; a transposed one it reads several times slower). The
    backward is products and sums of its inputs, so every order of differentiation works."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, bias):
        return _product(a, b, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:2])

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = torch.bmm(grad, b.mT) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = torch.bmm(grad.mT, a).mT if b.mT.is_contiguous() else torch.bmm(a.mT, grad)
        return grad_a, grad_b, grad.sum(1) if ctx.needs_input_grad[2] else None


#: elements of a device's weight block from which its gradient keeps its memory order
#: (:class:`_Bmm`): below, the autograd function's Python outweighs the optimizer's slower read
_ORDERED_FROM = 1 << 12


def _bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One product per device (plus ``bias``, a row per device); a contraction of length one is
    a broadcast product (one kernel) where the dtype is one every device multiplies matrices of.
    A transposed weight of large blocks keeps its gradient's memory order (:class:`_Bmm`)."""
    if a.size(2) == 1 and a.is_floating_point():
        return a * b if bias is None else torch.addcmul(bias.unsqueeze(1), a, b)
    ordered = block_numel(b) >= _ORDERED_FROM
    if ordered and b.requires_grad and b.mT.is_contiguous() and not b.is_contiguous():
        return autograd.apply(_Bmm, a, b, bias)
    return _product(a, b, bias)


def gathered_linear(x_held, weight, mesh, axis: str) -> torch.Tensor:
    """``x @ weight.T`` of a linear split by its output features over ``axis`` and then gathered
    over it, at once: ``x_held`` the input's blocks held once over ``axis`` (one per position
    along the other axes), ``weight`` every device's rows (stacked). Each held block meets the
    rows of its devices along ``axis`` end to end (the held all-gather's kernel: a view where
    ``axis`` is the mesh's last), so one product per block writes the gathered output's held
    blocks. The product's gradient of the held input is the sum of the devices' parts over
    ``axis``."""
    rows = kernels.all_gather_held(weight, mesh.shape, mesh, (axis,), 0)
    out = _bmm(x_held.reshape(x_held.shape[0], -1, x_held.shape[-1]), rows.mT)
    return out.reshape(*x_held.shape[:-1], out.shape[-1])


def folded_linear(x, weight_rows, bias_rows, mesh_shape, axes: tuple[int, ...]) -> torch.Tensor:
    """``F.linear`` per device, device ``k``'s weight block (and bias) the held row of its
    coordinates off ``axes``: the devices along ``axes`` lay their rows end to end, so one
    product per held row contracts all of theirs (the weight's gradient summed over ``axes`` by
    the product itself), then each device's rows go back to its block."""
    dims = len(mesh_shape)
    order = (*[a for a in range(dims) if a not in axes], *axes)
    rows, features = x.shape[1:-1], x.shape[-1]
    grid = x.reshape(*mesh_shape, math.prod(rows), features).permute(*order, dims, dims + 1)
    out = _bmm(grid.reshape(weight_rows.shape[0], -1, features), weight_rows.mT, bias_rows)
    out = out.reshape(*[mesh_shape[a] for a in order], math.prod(rows), out.shape[-1])
    out = out.permute(*sorted(range(dims), key=order.__getitem__), dims, dims + 1)
    return out.reshape(math.prod(mesh_shape), *rows, out.shape[-1])


def mm(local, func, args, kwargs, ctx):
    """A matrix per device: one ``bmm``."""
    return _bmm(args[0], args[1])


def linear(local, func, args, kwargs, ctx):
    """``F.linear`` per device: the rows of a device's block times its weight's transpose, plus
    its bias, one ``baddbmm`` for every device (torch's ``addmm`` on one)."""
    x, weight = args[0], args[1]
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])
    out = _bmm(rows, weight.mT, args[2] if len(args) > 2 else None)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def matmul(local, func, args, kwargs, ctx):
    """Batches of matrices per device: a batch of rows times one matrix per device folded into
    one product per device (broadcasting the matrix over the batch would copy it and split the
    product); other batch dims aligned after the device dim."""
    a, b = args[0], args[1]
    dims = a.dim(), b.dim()
    if dims == (3, 3):
        return _bmm(a, b)
    if dims[1] == 3 and dims[0] > 3:
        rows = a.reshape(a.shape[0], -1, a.shape[-1])
        return _bmm(rows, b).reshape(*a.shape[:-1], b.shape[-1])
    a, b = _aligned_values([a, b], len(ctx.decision.out_shapes[0]))
    return torch.matmul(a, b)


def einsum(local, func, args, kwargs, ctx):
    """The equation with a label for the device dim, leading every operand and the output."""
    inputs, output = ctx.decision.call.params
    operands = args[1:] if len(args) > 1 and not isinstance(args[1], (list, tuple)) else args[1]
    device = next(
        c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in "".join(inputs)
    )
    equation = f"{','.join(device + term for term in inputs)}->{device + output}"
    return torch.einsum(equation, *operands)


def _out_block(ctx) -> tuple[int, ...]:
    return shard_table(ctx.decision.output, tuple(ctx.decision.out_shapes[0])).padded_shape


def permute(local, func, args, kwargs, ctx):
    (order,) = ctx.decision.call.params
    return args[0].permute(0, *[d + 1 for d in order])


def reshape(local, func, args, kwargs, ctx):
    storage = args[0]
    return storage.reshape((storage.shape[0], *_out_block(ctx)))


def expand(local, func, args, kwargs, ctx):
    (storage,), _ = _aligned([args[0]], {}, ctx)
    return storage.expand((storage.shape[0], *_out_block(ctx)))


def index(local, func, args, kwargs, ctx):
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return args[0][(slice(None), *index)]


def along_flattened(local, func, args, kwargs, ctx):
    """``argmax``/``argmin`` of every element: each device's block flattened."""
    (whole,), ndim = ctx.decision.call.params, len(ctx.decision.call.shapes[0])
    x = args[0]
    if len(whole) != 1 or not ndim:
        return func(x.reshape(x.shape[0], -1), -1).reshape((x.shape[0], *_out_block(ctx)))
    return local(func, args, kwargs, ctx)


def embedding(local, func, args, kwargs, ctx):
    """A lookup in every device's table (``(n, rows, d)``) by its indices, as one gather; from a
    table split by rows, each device's indices into its own rows, zeros for the others' (the
    Partial sum of the devices'). Declined for ``max_norm``, ``padding_idx`` and indices out
    of range (the local form, per device, looks those up and refuses bad indices)."""
    indices, table = args[0], args[1]
    rows = ctx.decision.call.shapes[1][0]
    if ctx.decision.call.params != (None, 2.0, None):
        return NotImplemented
    if indices.numel() and not torch.compiler.is_compiling():
        if outside(indices, rows):
            return NotImplemented
    n, inside = table.shape[0], None
    layout = ctx.decision.inputs[1]
    if layout.sharding_axes(0):
        starts = _starts(layout, tuple(ctx.decision.call.shapes[1]), 0, str(indices.device))
        local = indices - starts.reshape(n, *[1] * (indices.dim() - 1))
        inside = (local >= 0) & (local < table.shape[1])
        indices = local.clamp(0, table.shape[1] - 1)
    if table.is_contiguous():  # one lookup in the devices' tables end to end (its backward too)
        offsets = _row_offsets(n, table.shape[1], str(indices.device))
        picked = F.embedding(indices + offsets.reshape(n, *[1] * (indices.dim() - 1)), table.flatten(0, 1))
    else:
        flat = indices.reshape(n, -1)
        picked = torch.gather(table, 1, flat.unsqueeze(-1).expand(*flat.shape, table.shape[-1]))
        picked = picked.reshape(*indices.shape, table.shape[-1])
    return picked if inside is None else picked * inside.unsqueeze(-1)


@cached(1024)
def _row_offsets(n: int, rows: int, device: str) -> torch.Tensor:
    """``(n,)``: where device ``i``'s table starts among the devices' tables end to end."""
    return torch.arange(0, n * rows, rows, device=device)


@cached(1024)
def _starts(layout, shape: tuple[int, ...], dim: int, device: str) -> torch.Tensor:
    """``(n,)``: where each device's block starts in dim ``dim``."""
    return torch.tensor([o[dim] for o in shard_table(layout, shape).offsets], device=device)


def gather(local, func, args, kwargs, ctx):
    """``torch.gather``: along a dim no device splits, the local form on the stack (it counts
    dims from the end); along a split dim, each device's indices into its own block, zeros for
    the others' (the Partial sum of the devices'). Declined for indices out of range (the local
    form, per device, refuses them)."""
    (dim,) = ctx.decision.call.params
    shape = tuple(ctx.decision.call.shapes[0])
    layout = ctx.decision.inputs[0]
    if not shape or not layout.sharding_axes(dim):
        return local(func, args, kwargs, ctx)
    x, index = args[0], args[2] if len(args) > 2 else kwargs["index"]
    if index.numel() and not torch.compiler.is_compiling():
        if outside(index, shape[dim]):
            return NotImplemented
    local_dim, size = dim - len(shape), x.shape[dim + 1]
    starts = _starts(layout, shape, dim, str(index.device)).reshape(-1, *[1] * (index.dim() - 1))
    into = index - starts
    inside = (into >= 0) & (into < size)
    return torch.gather(x, local_dim, into.clamp(0, size - 1)) * inside


#: per-device elements from which a stacked op runs torch's fused kernel once per device (the
#: kernels outweigh a call per device) rather than a batched form of several kernels
PER_DEVICE_KERNEL = 1 << 14


def normalization(local, func, args, kwargs, ctx):
    """``layer_norm`` / ``rms_norm`` (each device's copy of a replicated weight takes its own
    gradient): large blocks run the fused op once per device with that device's weights
    (forward and backward one kernel each); small ones are normalized at once without the
    affine weights, which are then applied elementwise in one kernel."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    if func is not torch.nn.functional.layer_norm:
        names = ("input", "normalized_shape", "weight", "eps")
    bound = dict(zip(names, args)) | kwargs
    x = bound.pop("input")
    if block_numel(x) >= PER_DEVICE_KERNEL:
        return NotImplemented
    bound["input"] = x
    affine = [bound.pop(name, None) for name in ("weight", "bias")]
    out = func(**bound)
    weight, bias = _aligned_values(affine, len(ctx.decision.out_shapes[0])) if ctx.align else affine
    if weight is not None and bias is not None:
        return torch.addcmul(bias, out, weight)
    out = out if weight is None else out * weight
    return out if bias is None else out + bias


def attention(local, func, args, kwargs, ctx):
    """The device dim folded into the batch dim: torch's fused CPU kernels take 4-d inputs, and
    a 5-d call falls back to the unfused math."""
    if len(args) == 3 and not isinstance(kwargs.get("attn_mask"), torch.Tensor):
        q, k, v = args
        if q.dim() == 5 and q.shape[:2] == k.shape[:2] == v.shape[:2]:
            return func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), **kwargs).unflatten(0, q.shape[:2])
    return func(*args, **kwargs)


FORMS = {
    "elementwise": elementwise,
    "mm": mm,
    "matmul": matmul,
    "linear": linear,
    "einsum": einsum,
    "permute": permute,
    "reshape": reshape,
    "expand": expand,
    "index": index,
    "along_flattened": along_flattened,
    "embedding": embedding,
    "gather": gather,
    "normalization": normalization,
    "attention": attention,
}
