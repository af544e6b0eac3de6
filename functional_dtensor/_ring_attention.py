"""Context parallelism: attention over a sequence split across a mesh axis, by ring attention.

Each device holds a contiguous block of the sequence: its queries, keys and values. The key and
value blocks go round the ring of devices along the axis with ``fd.ppermute`` (``n - 1`` steps
for ``n`` devices); at every step a device scores its queries against the block it holds and
folds the result into a running softmax (a running row maximum, the sum of exponentials below
it, and the weighted sum of values), so the result is exactly ``softmax(q k^T * scale) v``
without any device gathering the keys and values. A causal mask compares global positions,
found from ``fd.axis_index``. Each step is one autograd function whose backward recomputes the
step's weights: what a step keeps for the backward is its blocks, never its scores.

==========================  =================================  ============================
per device, step ``s``      shape                              held
==========================  =================================  ============================
``q_block``                 ``(..., heads, T / n, head_dim)``  throughout
``k_block``, ``v_block``    ``(..., heads, T / n, head_dim)``  from device ``i - s mod n``
scores, weights             ``(..., heads, T / n, T / n)``     within the step
``running_max``, ``total``  ``(..., heads, T / n, 1)``         throughout
``weighted``                ``(..., heads, T / n, head_dim)``  throughout
==========================  =================================  ============================

:func:`ring_attention` is the per-device function (inside ``fd.shard_map``);
:func:`context_parallel_attention` runs it on ``fd.DTensor`` values through ``shard_map``; and
:class:`context_parallel` makes ``F.scaled_dot_product_attention`` on values whose sequence dim
is split over its axis do so, by standing in for the op's handler while any such context is
open (other ops, and attention outside the context, are untouched).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ._cache import cached
from ._collectives import axis_index, ppermute
from ._context import frame_for
from ._dtensor import DTensor
from ._errors import AxisNameError, InputTypeError, LayoutError, MeshError, ShapeError, explain
from ._global_ops import dispatch
from ._mesh import DeviceMesh
from ._op_decisions import Handler, register, resolved
from ._shard_map import shard_map
from ._spec import P
from .ops import nn as _ops_nn  # noqa: F401  (registers attention's own handler, which the context stands in for)

__all__ = ["ring_attention", "context_parallel", "context_parallel_attention"]

AxisName = str | tuple[str, ...]

#: dtypes whose scores and running sums are kept in float32
_LOW_PRECISION = (torch.float16, torch.bfloat16)


# --- the per-device function --------------------------------------------------------------------


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    axis_name: AxisName,
    *,
    causal: bool = False,
    scale: float | None = None,
    zigzag: bool = False,
) -> torch.Tensor:
    """Attention of this device's queries against the whole sequence, split over ``axis_name``.

    Call it inside ``fd.shard_map``: ``q``, ``k``, ``v`` are this device's contiguous blocks
    ``(..., heads, T_local, head_dim)`` of a sequence split evenly over ``axis_name`` (a name or
    a tuple of names, major first). The key and value blocks go round the ring with
    ``fd.ppermute``, ``n - 1`` times each for ``n`` devices, merged by an online softmax. The
    result is this device's block of ``F.scaled_dot_product_attention(Q, K, V,
    is_causal=causal, scale=scale)`` on the global tensors, with its gradients.

    >>> import torch, torch.nn.functional as F, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(4, "cp")
    >>> q, k, v = torch.randn(3, 2, 4, 16, 8, dtype=torch.float64).unbind(0)
    >>> attend = fd.shard_map(
    ...     lambda q, k, v: fd.ring_attention(q, k, v, "cp", causal=True),
    ...     mesh=mesh, in_specs=fd.P(None, None, "cp"), out_specs=fd.P(None, None, "cp"),
    ... )
    >>> out = attend(q, k, v)
    >>> torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    True

    ``zigzag=True`` (load-balanced causal attention) reads the blocks in zigzag order instead:
    the sequence cut into ``2 n`` chunks, device ``i`` holds chunks ``i`` and ``2 n - 1 - i``,
    one after the other. Every device then has as many visible keys as any other, and a causal
    ring skips the hidden chunk pairs: about half the work of ``zigzag=False``. The result is in
    the same order. Put a sequence in that order with ``x[..., order, :]``, ``order =
    torch.arange(T).view(2 * n, -1)``, ``order = torch.cat([order[:n], order[n:].flip(0)],
    1).flatten()``, and back with ``argsort(order)``.
    """
    where = "fd.ring_attention"
    _check_local(q, k, v, where)
    frame, axes = frame_for(axis_name, where)
    n = frame.mesh.axis_size(axes)
    t_q, t_k = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dtype = torch.float32 if q.dtype in _LOW_PRECISION else q.dtype
    ring = [(i, (i + 1) % n) for i in range(n)]  # device i sends its block to device i + 1
    index = axis_index(axes)
    if causal and zigzag:
        if t_q != t_k or t_q % 2:
            raise ShapeError(
                explain(
                    f"{where}(q, k)",
                    "a zigzag block is two chunks of one sequence, queries and keys alike",
                    expected="as many queries as keys per device, an even number",
                    got=f"{t_q} queries and {t_k} keys",
                    fix="split a sequence of 2 * n * c tokens (pad it), or use zigzag=False",
                )
            )
        return _zigzag(q, k, v, axes, ring, index, scale, dtype)
    if causal:
        q_positions = index * t_q + torch.arange(t_q, device=q.device)
        k_offsets = torch.arange(t_k, device=q.device)
    q_block = q.to(dtype)
    state = _start(q_block, v)
    k_block, v_block = k, v
    for step in range(n):
        hidden = None
        if causal:  # the block came from device index - step: its global key positions
            k_positions = ((index - step) % n) * t_k + k_offsets
            hidden = k_positions.unsqueeze(-2) > q_positions.unsqueeze(-1)  # (T_q, T_k)
        state = _fold(state, q_block, k_block.to(dtype), v_block.to(dtype), hidden, scale)
        if step < n - 1:
            k_block = ppermute(k_block, axes, ring)
            v_block = ppermute(v_block, axes, ring)
    return _finish(state).to(q.dtype)


def _zigzag(q, k, v, axes, ring, index, scale, dtype) -> torch.Tensor:
    """Causal ring attention on zigzag blocks: ``q_a``, ``q_b`` are the queries of chunks ``i``
    and ``2n - 1 - i``; the block from device ``j`` holds key chunks ``j`` and ``2n - 1 - j``.

    ======================  =====================================  ========================
    step                    visible (chunk pairs)                  hidden, skipped
    ======================  =====================================  ========================
    0 (``j = i``)           ``q_a k_a``, ``q_b k_b`` (diagonal),   ``q_a k_b``
                            ``q_b k_a``
    ``j < i`` (``s <= i``)  ``q_b k_a``, ``q_a k_a``               ``q_a k_b``, ``q_b k_b``
    ``j > i`` (``s > i``)   ``q_b k_a``, ``q_b k_b``               ``q_a k_a``, ``q_a k_b``
    ======================  =====================================  ========================

    After step 0 every pair is wholly visible or wholly hidden, and each device computes two
    of its four: ``q_b k_a`` and one chosen by ``where`` on the device index (no mask).
    """
    n = len(ring)
    c = q.shape[-2] // 2
    q_a, q_b = q.to(dtype).split(c, dim=-2)
    diagonal = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)  # key after query
    state_a, state_b = _start(q_a, v), _start(q_b, v)
    k_block, v_block = k, v
    for step in range(n):
        k_a, k_b = k_block.to(dtype).split(c, dim=-2)
        v_a, v_b = v_block.to(dtype).split(c, dim=-2)
        if step == 0:
            state_a = _fold(state_a, q_a, k_a, v_a, diagonal, scale)
            state_b = _fold(state_b, q_b, k_a, v_a, None, scale)
            state_b = _fold(state_b, q_b, k_b, v_b, diagonal, scale)
        else:
            state_b = _fold(state_b, q_b, k_a, v_a, None, scale)
            earlier = index >= step  # the block is from device j < i: q_a sees k_a, else q_b sees k_b

            def pick(x, y, earlier=earlier):
                return torch.where(earlier, x, y)

            chosen = tuple(map(pick, state_a, state_b))
            folded = _fold(chosen, pick(q_a, q_b), pick(k_a, k_b), pick(v_a, v_b), None, scale)
            state_a = tuple(map(pick, folded, state_a))
            state_b = tuple(map(pick, state_b, folded))
        if step < n - 1:
            k_block = ppermute(k_block, axes, ring)
            v_block = ppermute(v_block, axes, ring)
    return torch.cat([_finish(state_a), _finish(state_b)], dim=-2).to(q.dtype)


def _start(q, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The online softmax's state before any key: ``(running_max, total, weighted)``."""
    rows = (*q.shape[:-1], 1)
    return (
        torch.full(rows, -torch.inf, dtype=q.dtype, device=q.device),
        torch.zeros(rows, dtype=q.dtype, device=q.device),
        torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device),
    )


def _fold(state, q, k, v, hidden, scale):
    """``state`` with the key block ``k``, ``v`` folded in."""
    running_max, total, weighted = state
    sums, block, running_max, rescale, _ = _Block.apply(q, k, v, running_max, hidden, scale)
    return running_max, total * rescale + sums, weighted * rescale + block


def _finish(state) -> torch.Tensor:
    _, total, weighted = state
    # a row no key is visible to (none in self-attention) gets zeros, not 0 / 0
    return weighted / torch.where(total == 0, torch.ones_like(total), total)


class _Block(torch.autograd.Function):
    """One step of the online softmax: the scores ``q k^T * scale`` of a key block (``-inf``
    where ``hidden``), the new running maximum, the weights ``w = exp(scores - shift)`` and
    ``(rowsum(w), w @ v, new_max, rescale)``, where ``shift`` is the new maximum (0 in a row
    every key so far was hidden from: no ``-inf - -inf``) and ``rescale = exp(old_max - shift)``
    brings the sums so far to the new shift.

    The maximum only keeps ``exp`` in range (the result does not depend on it), so it and
    ``rescale`` take no gradient. The backward recomputes ``w`` from ``q`` and ``k`` rather than
    saving it: a step keeps its blocks, ``(T_q, E)`` and ``(T_k, E)``, not ``(T_q, T_k)``
    weights.
    """

    generate_vmap_rule = True

    @staticmethod
    def _scores(q, k, hidden, scale):
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        return scores if hidden is None else scores.masked_fill(hidden, -torch.inf)

    @staticmethod
    def forward(q, k, v, running_max, hidden, scale):
        scores = _Block._scores(q, k, hidden, scale)
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        shift = torch.where(new_max == -torch.inf, torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - shift)
        rescale = torch.exp(running_max - shift)
        return weights.sum(-1, keepdim=True), torch.matmul(weights, v), new_max, rescale, shift

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, _, hidden, scale = inputs
        _, _, new_max, rescale, shift = output
        ctx.save_for_backward(q, k, v, shift, hidden)
        ctx.mark_non_differentiable(new_max, rescale, shift)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, d_sums, d_block, *_):
        q, k, v, shift, hidden = ctx.saved_tensors
        weights = torch.exp(_Block._scores(q, k, hidden, ctx.scale) - shift)
        d_v = torch.matmul(weights.transpose(-2, -1), d_block)
        d_scores = weights * (d_sums + torch.matmul(d_block, v.transpose(-2, -1))) * ctx.scale
        return torch.matmul(d_scores, k), torch.matmul(d_scores.transpose(-2, -1), q), d_v, None, None, None


def _check_local(q, k, v, where: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            raise InputTypeError(
                explain(
                    f"{where}({name})",
                    "the per-device function attends local blocks",
                    expected="a torch.Tensor (this device's block, inside fd.shard_map)",
                    got=type(x).__name__,
                    fix="call it from the function given to fd.shard_map; for fd.DTensor values use "
                    "fd.context_parallel_attention",
                )
            )
    _check_agree(q, k, v, where, "block")


def _check_agree(q, k, v, where: str, what: str) -> None:
    """dtypes alike and floating; batch and head dims alike; key and value lengths alike, and
    the query and key feature sizes."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    if len(set(dtypes)) > 1 or not q.dtype.is_floating_point:
        raise InputTypeError(
            explain(
                f"{where}(q, k, v)",
                "attention takes queries, keys and values of one floating dtype",
                expected="q.dtype == k.dtype == v.dtype, a floating dtype",
                got=", ".join(map(str, dtypes)),
                fix="convert them to one dtype first, e.g. k.to(q.dtype)",
            )
        )
    shapes = tuple(tuple(x.shape) for x in (q, k, v))
    if (
        q.ndim < 2
        or not q.ndim == k.ndim == v.ndim
        or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
        or k.shape[-2] != v.shape[-2]
        or q.shape[-1] != k.shape[-1]
    ):
        raise ShapeError(
            explain(
                f"{where}(q, k, v)",
                f"the {what}s must agree: the same leading (batch, heads) dims, as many keys as "
                "values, and the feature size of the queries the keys'",
                expected="q (..., T_q, E), k (..., T_k, E), v (..., T_k, E_v)",
                got=f"q {shapes[0]}, k {shapes[1]}, v {shapes[2]}",
                fix="check how q, k and v are split into heads (grouped-query attention: repeat "
                "k and v over the heads first)",
            )
        )


# --- on fd.DTensor values -----------------------------------------------------------------------


def _axes_of(axis_name, where: str) -> tuple[str, ...]:
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, (tuple, list)) and axis_name and all(isinstance(n, str) for n in axis_name):
        return tuple(axis_name)
    raise InputTypeError(
        explain(
            f"{where}(axis_name)",
            "the sequence is split over mesh axes named by name",
            expected="an axis name such as 'cp', or a tuple of names",
            got=repr(axis_name),
            fix="pass the name of the mesh axis, not its position (mesh.axis_names[i])",
        )
    )


def _sequence_axes(x: DTensor) -> tuple[str, ...] | None:
    """The mesh axes that split ``x``'s dim -2 (major first); None where ``x`` holds partial
    values."""
    if x.sharding.has_partial:
        return None
    entries = x.spec.entries
    entry = entries[x.ndim - 2] if len(entries) > x.ndim - 2 else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def context_parallel_attention(
    q: DTensor,
    k: DTensor,
    v: DTensor,
    axis_name: AxisName,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> DTensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` on global
    values whose sequence dim (-2) is split over ``axis_name``, by ring attention.

    ``q`` must have its sequence dim split over exactly ``axis_name`` (evenly) and its feature
    dim whole; other dims (batch, heads) may be split over other axes. ``k`` and ``v`` are
    redistributed to ``q``'s layout where theirs differs. The result has ``q``'s layout; no
    device gathers the keys or values.

    >>> import torch, torch.nn.functional as F, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh((2, 2), ("dp", "cp"))
    >>> q, k, v = torch.randn(3, 4, 2, 8, 8, dtype=torch.float64).unbind(0)
    >>> qd, kd, vd = (fd.distribute_tensor(t, mesh, fd.P("dp", None, "cp")) for t in (q, k, v))
    >>> out = fd.context_parallel_attention(qd, kd, vd, "cp", causal=True)
    >>> out.placements
    (Shard(dim=0), Shard(dim=2))
    >>> torch.allclose(out.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    True
    """
    where = "fd.context_parallel_attention"
    axes = _axes_of(axis_name, where)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if type(x) is not DTensor:
            raise InputTypeError(
                explain(
                    f"{where}({name})",
                    "context parallel attention takes global values",
                    expected="an fd.DTensor with its sequence dim split over the axis",
                    got=type(x).__name__,
                    fix="lay it out first: fd.distribute_tensor(t, mesh, fd.P(None, None, 'cp')); "
                    "inside fd.shard_map call fd.ring_attention",
                )
            )
    mesh = q.device_mesh
    for name, x in (("k", k), ("v", v)):
        if x.device_mesh != mesh:
            raise MeshError(
                explain(
                    f"{where}({name})",
                    "q, k and v must live on one mesh",
                    expected=repr(mesh),
                    got=repr(x.device_mesh),
                    fix="build them on the same mesh",
                )
            )
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown or len(set(axes)) != len(axes):
        raise AxisNameError(
            explain(
                f"{where}(axis_name)",
                "the sequence is split over distinct axes of the values' mesh",
                expected=f"names from {mesh.axis_names}",
                got=repr(axis_name),
                fix="name an axis of the mesh q, k and v live on, each at most once",
            )
        )
    _check_agree(q, k, v, where, "global shape")
    seq = _sequence_axes(q)
    if seq != axes or (q.sharding.sharding_axes(q.ndim - 1) if q.ndim else ()):
        raise LayoutError(
            explain(
                f"{where}(q)",
                f"q's sequence dim (-2) must be split over {axes} and its feature dim (-1) whole",
                expected=f"a layout whose spec names {axes if len(axes) > 1 else axes[0]!r} at dim "
                f"{q.ndim - 2}",
                got=str(q.sharding),
                fix=f"fd.redistribute(q, fd.P(..., {axes if len(axes) > 1 else axes[0]!r}, None)) first",
            )
        )
    n = mesh.axis_size(axes)
    for name, x in (("q", q), ("k", k)):
        if x.shape[-2] % n:
            length = x.shape[-2]
            raise ShapeError(
                explain(
                    f"{where}({name})",
                    f"the sequence length must split evenly over {axes} ({n} devices)",
                    expected=f"a multiple of {n}",
                    got=f"{length} = {length // n} * {n} + {length % n}",
                    fix=f"pad the sequence to {-(-length // n) * n} (and mask the padding), or use a "
                    "mesh axis whose size divides it",
                )
            )
    spec = q.spec
    k, v = (x if x.sharding == q.sharding else x.redistribute(spec) for x in (k, v))
    return _mapped(mesh, spec, axes, bool(causal), None if scale is None else float(scale))(q, k, v)


@cached(maxsize=128)
def _mapped(mesh: DeviceMesh, spec: P, axes: tuple[str, ...], causal: bool, scale: float | None):
    def attend(q_block, k_block, v_block):
        return ring_attention(q_block, k_block, v_block, axes, causal=causal, scale=scale)

    return shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec)


# --- the context manager ------------------------------------------------------------------------

_local = threading.local()  # this thread's open contexts: a stack of axis tuples
_lock = threading.Lock()
_open = 0  # contexts open in any thread; while there are, the attention handler stands in
_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _stack() -> list[tuple[str, ...]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class context_parallel:
    """Within ``with fd.context_parallel(axis_name):``, ``F.scaled_dot_product_attention`` on
    ``fd.DTensor`` values whose sequence dim (-2) is split over ``axis_name`` runs ring
    attention (:func:`context_parallel_attention`) instead of gathering the keys and values.

    Attention on other values, and every other op, runs as outside the context. Contexts nest
    (the innermost wins) and are per thread.

    >>> import torch, torch.nn.functional as F, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(4, "cp")
    >>> q, k, v = (fd.distribute_tensor(torch.randn(2, 16, 8), mesh, fd.P(None, "cp")) for _ in range(3))
    >>> with fd.context_parallel("cp"), fd.CommDebugMode() as comm:
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> out.placements, comm.get_total_counts()
    ((Shard(dim=1),), 6)
    """

    __slots__ = ("axes",)

    def __init__(self, axis_name: AxisName) -> None:
        self.axes = _axes_of(axis_name, "fd.context_parallel")

    def __repr__(self) -> str:
        return f"fd.context_parallel({self.axes if len(self.axes) > 1 else self.axes[0]!r})"

    def __enter__(self) -> context_parallel:
        global _open
        _stack().append(self.axes)
        with _lock:
            if _open == 0:
                register([_SDPA], Handler(None, _none, _attention, "scaled_dot_product_attention"))
            _open += 1
        return self

    def __exit__(self, *exc) -> None:
        global _open
        _stack().pop()
        with _lock:
            _open -= 1
            if _open == 0:
                register([_SDPA], _ORIGINAL[0])


def _none(args, kwargs, tensors):
    return ()


def _attention(func, args, kwargs, ctx):
    """The stand-in handler: ring attention where this thread's innermost context applies, the
    op's own handler otherwise."""
    stack = _stack()
    bound = dict(zip(_SDPA_ARGS, args)) | kwargs
    q = bound.get("query")
    if not stack or type(q) is not DTensor or q.ndim < 2 or _sequence_axes(q) != stack[-1]:
        return dispatch(func, args, kwargs, _ORIGINAL)
    axes = stack[-1]
    unsupported = {
        name: bound[name]
        for name, default in (("attn_mask", None), ("dropout_p", 0.0), ("enable_gqa", False))
        if name in bound and bound[name] is not None and bound[name] != default
    }
    if unsupported:
        raise InputTypeError(
            explain(
                "F.scaled_dot_product_attention under fd.context_parallel",
                "ring attention takes is_causal and scale only",
                expected="no attn_mask, dropout_p=0 and enable_gqa=False",
                got=", ".join(f"{name}={value!r}" for name, value in unsupported.items()),
                fix="use is_causal=True for a causal mask, repeat k and v over the heads for grouped "
                "queries, or call attention outside the context",
            )
        )
    return context_parallel_attention(
        q, bound.get("key"), bound.get("value"), axes, causal=bool(bound.get("is_causal", False)),
        scale=bound.get("scale"),
    )  # fmt: skip


_ORIGINAL = resolved(_SDPA)  # the op's own handler (registered by .ops.nn) and number
