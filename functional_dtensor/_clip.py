"""Gradient clipping by the global norm of sharded gradients: :func:`clip_grad_norm`.

Each device's shards are reduced by plain torch ops on the storage, each distinct block of a
large gradient read once; the devices' parts are summed by one all-reduce over the mesh axes
the gradients are split over, not one per parameter.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(2, "x")
>>> g = fd.distribute_tensor(torch.tensor([3.0, 4.0]), mesh, fd.P("x"))
>>> clipped, norm = fd.clip_grad_norm({"w": g}, 1.0)
>>> norm.full_tensor().item(), [round(v, 4) for v in clipped["w"].full_tensor().tolist()]
(5.0, [0.6, 0.8])
"""

from __future__ import annotations

import math
import operator

import optree
import torch

from ._backend import backend_of
from ._cache import cached
from ._dtensor import DTensor, held_of, new_held, new_value, storage_of, without_partial
from ._errors import InputTypeError, MeshError, explain
from ._layout import Layout
from ._placements import Partial, Replicate
from ._redistribute import redistribute
from ._shard_map import NAMESPACE

__all__ = ["clip_grad_norm"]


def clip_grad_norm(grads, max_norm: float, norm_type: float = 2.0):
    """``(clipped, total_norm)``: ``grads`` (a pytree of ``fd.DTensor``) scaled so that their
    global ``norm_type``-norm is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``),
    and that norm, a replicated scalar, both not differentiated (as torch's). Each device's
    shards are reduced by plain torch ops on the storage; the devices' parts are summed by one
    all-reduce over the mesh axes the gradients are split over."""
    where = "fd.clip_grad_norm"
    leaves, spec = optree.tree_flatten(grads, none_is_leaf=True, namespace=NAMESPACE)
    present = [g for g in leaves if g is not None]
    if any([type(g) is not DTensor for g in present]):
        paths = optree.tree_paths(grads, none_is_leaf=True, namespace=NAMESPACE)
    else:
        paths = ()
    for path, g in zip(paths, leaves):
        if g is not None and not isinstance(g, DTensor):
            raise InputTypeError(
                explain(
                    f"{where}(grads{''.join(f'[{p!r}]' for p in path)})",
                    "the gradients are fd.DTensor values",
                    expected="an fd.DTensor or None",
                    got=type(g).__name__,
                    fix="pass what torch.autograd.grad returned for fd.DTensor parameters",
                )
            )
    if not present:
        raise InputTypeError(
            explain(
                f"{where}(grads)",
                "there is no gradient to clip",
                expected="some fd.DTensor",
                got="none",
                fix="pass the gradients torch.autograd.grad returned for the parameters",
            )
        )
    mesh = present[0].device_mesh
    other = next((g for g in present if g.device_mesh is not mesh and g.device_mesh != mesh), None)
    if other is not None:
        raise MeshError(
            explain(
                f"{where}(grads)",
                "one global norm is summed over one mesh's devices",
                expected=f"every gradient on {mesh!r}",
                got=f"a gradient on {other.device_mesh!r}",
                fix="clip the gradients of each mesh apart, or redistribute them onto one mesh first",
            )
        )
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise InputTypeError(
            explain(
                f"{where}(norm_type)",
                "a p-norm",
                expected="p > 0 or math.inf",
                got=repr(norm_type),
                fix="use 2.0 (the default), 1.0 or math.inf",
            )
        )
    with torch.no_grad():  # as torch's (the gradients are the step's data, not differentiated)
        total = _total_norm(present, norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        backend = backend_of(total.device_mesh)
        one = backend.replica(storage_of(coef))  # the same on every device: one device's copy
        clipped = _scaled(leaves, one)
    return optree.tree_unflatten(spec, clipped), total


def _scaled(grads: list, coef: torch.Tensor) -> list:
    """Each of ``grads`` (or None) times the scalar ``coef``, held once where it is: one
    ``_foreach_mul`` per dtype, not a product per gradient."""
    out = list(grads)
    for dtype in {g.dtype for g in grads if g is not None}:
        indices = [i for i, g in enumerate(grads) if g is not None and g.dtype == dtype]
        data = [held_of(grads[i]) if held_of(grads[i]) is not None else storage_of(grads[i]) for i in indices]
        for i, product in zip(indices, torch._foreach_mul(data, coef.to(dtype))):
            g = grads[i]
            new = new_value if held_of(g) is None else new_held
            out[i] = new(product, g.sharding, g.shape)
    return out


def _total_norm(grads: list[DTensor], norm_type: float) -> DTensor:
    """The global ``norm_type``-norm of ``grads``, a replicated scalar: per gradient, the norm of
    each device's block by plain torch on the storage (of each distinct block, for a large
    gradient: a block replicated over an axis read once; small gradients split over the same
    axes side by side, one kernel for all of them); per set of mesh axes the gradients
    are split over, the norm of their blocks' norms on each device, to the power ``p`` (or their
    maximum), a Partial value over those axes; their sum (or maximum) all-reduced at once. As
    torch's ``clip_grad_norm_``, the norm of the norms. A Partial gradient is reduced first."""
    infinite = math.isinf(norm_type)
    mesh = grads[0].device_mesh
    backend = backend_of(mesh)
    lead = backend.block_dim(0)  # the storage's dims before a device's block
    norms: dict = {}  # the split axes -> the norms of their gradients' blocks, per device
    small: dict = {}  # (split axes, dtype) -> the blocks of small gradients, flat: one norm of all
    for g in grads:
        if g.sharding.has_partial:
            g = redistribute(g, without_partial(g.sharding))
        held = held_of(g)
        storage = storage_of(g) if held is None else held  # (held: one row per distinct block)
        split = _split_axes(g.sharding)
        if held is None and storage.numel() < _DISTINCT_FROM:  # every device's block, as it is
            flat = storage if storage.dim() == lead + 1 else storage.reshape(*storage.shape[:lead], -1)
            small.setdefault((split, storage.dtype), []).append(flat)
            continue
        if held is not None:
            blocks = backend.distinct_held(held, g.sharding)
        else:
            blocks = backend.distinct(storage, g.sharding)
        flat = blocks.reshape(*blocks.shape[: blocks.dim() - (storage.dim() - lead)], -1)
        norms.setdefault(split, []).append(backend.from_distinct(_row_norms(flat, norm_type), mesh))
    for (split, _), flats in small.items():  # (one kernel for them all: the norm of their norms)
        flat = flats[0] if len(flats) == 1 else torch.cat(flats, -1)
        norms.setdefault(split, []).append(_row_norms(flat, norm_type))
    # the parts of every set of split axes as parts over all of them (a part replicated over an
    # axis is Partial there too: divided evenly among its devices by the redistribute, or the
    # same on each for a maximum), combined on each device: one all-reduce for the whole norm; the norm of
    # gradients replicated everywhere joins after it (a replicated value meeting a Partial one
    # would be made Partial first)
    union = tuple([name for name in mesh.axis_names if any([name in split for split in norms])])
    replicated = (Replicate(),) * mesh.ndim
    combine = torch.maximum if infinite else operator.add
    total = None
    for split in sorted(norms, key=lambda split: not split):  # the replicated ones last
        stacked = torch.stack(norms[split])
        part = stacked.amax(0) if infinite else torch.linalg.vector_norm(stacked, norm_type, 0) ** norm_type
        value = new_value(part, _summed_over(mesh, split, infinite), torch.Size(()))
        if not split:
            total = value if total is None else combine(redistribute(total, replicated), value)
            continue
        if split != union:
            value = redistribute(value, _summed_over(mesh, union, infinite))
        total = value if total is None else combine(total, value)
    total = redistribute(total, replicated)
    return total if infinite else total ** (1.0 / norm_type)


def _row_norms(flat: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of each row of ``flat`` (along its last dim), in float32 or
    float64 (one pass, no ``|g|**p`` tensor)."""
    dtype = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
    if flat.shape[-1] == 0:  # empty shards
        return flat.new_zeros(flat.shape[:-1], dtype=dtype)
    if math.isinf(norm_type):
        return flat.abs().amax(-1).to(dtype)
    return torch.linalg.vector_norm(flat, norm_type, dim=-1, dtype=dtype)


@cached(1024)
def _summed_over(mesh, split: tuple[str, ...], infinite: bool) -> Layout:
    """The layout of the devices' parts of a norm over values split along the axes ``split``:
    Partial there (their maximum, for the infinity norm), Replicate elsewhere."""
    reduce = Partial("max" if infinite else "sum")
    return Layout(mesh, tuple([reduce if n in split else Replicate() for n in mesh.axis_names]))


@cached(1024)
def _split_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes ``layout`` splits a value over (its Shard axes)."""
    return tuple([name for name, p in zip(layout.mesh.axis_names, layout.placements) if p.is_shard()])


#: the elements (every device's) from which a gradient's norm reads its distinct blocks alone;
#: below, reading the replicas too costs less than the ops that leave them out
_DISTINCT_FROM = 1 << 16
