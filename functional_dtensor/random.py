"""Random numbers from explicit keys, the same for every mesh, layout, backend and device.

A *key* is an int64 tensor of shape ``(2,)``: two 32-bit words. Functions take keys and return
new ones (:func:`split`, :func:`fold_in`); nothing writes to a key. A draw is a pure function of
its key and each element's index in the global tensor (Philox4x32-10, counter-based), so a
sharded draw holds exactly the values of the unsharded one, and each device computes only its
own shard.

>>> import torch, functional_dtensor as fd
>>> key = fd.random.key(0)
>>> mesh = fd.simulated_mesh((2, 2), ("x", "y"))
>>> a = fd.random.normal(key, (6, 5), mesh=mesh, placements=fd.P("x", "y"))
>>> b = fd.random.normal(key, (6, 5), mesh=mesh, placements=fd.P(None, ("y", "x")))
>>> torch.equal(a.full_tensor(), b.full_tensor())
True
>>> torch.equal(a.full_tensor(), fd.random.normal(key, (6, 5)))
True

Inside ``shard_map`` a draw without a mesh is a local tensor: the same on every device for a
replicated key; ``fold_in(key, fd.axis_index("x"))`` gives each device along ``x`` its own
stream, and :func:`dropout` does that for the axes its input varies over.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from . import _philox
from ._backend import backend_of
from ._collectives import axis_index
from ._context import current_frame
from ._dtensor import DTensor, check_mesh, layout_for, storage_of, without_partial
from ._errors import InputTypeError, ShapeError, explain
from ._factories import check_dtype, global_shape, on_meta
from ._layout import Layout, PlacementsOrSpec
from ._mesh import DeviceMesh
from ._random_draws import Draw, draw_local, draw_sharded
from ._varying import varying_in

__all__ = [
    "key",
    "split",
    "fold_in",
    "uniform",
    "normal",
    "bernoulli",
    "randint",
    "dropout",
    "rand",
    "randn",
    "default_key",
]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


# --- keys ---------------------------------------------------------------------------------------


def key(seed: int, *, device: str | torch.device | None = None) -> torch.Tensor:
    """A key from an integer seed (any size; taken modulo ``2**64``).

    >>> key(1)
    tensor([1, 0])
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        try:
            seed = operator.index(seed)
        except TypeError:
            seed = None
    if seed is None:
        raise InputTypeError(
            explain(
                "fd.random.key(seed)",
                "a key is built from an integer",
                expected="a Python int",
                got=repr(seed),
                fix="pass an int, e.g. fd.random.key(0)",
            )
        )
    return torch.tensor([seed & _philox.MASK, (seed >> 32) & _philox.MASK], dtype=torch.int64, device=device)


def _check_key(k, where: str) -> torch.Tensor:
    if not isinstance(k, torch.Tensor) or k.dtype != torch.int64 or tuple(k.shape) != (2,):
        got = (
            f"a {k.dtype} tensor of shape {tuple(k.shape)}"
            if isinstance(k, torch.Tensor)
            else type(k).__name__
        )
        fix = (
            "take one key of the batch: keys[i]"
            if isinstance(k, torch.Tensor) and k.ndim == 2
            else ("make one with fd.random.key(seed), fd.random.split or fd.random.fold_in")
        )
        raise InputTypeError(
            explain(
                where, "a key is two 32-bit words", expected="an int64 tensor of shape (2,)", got=got, fix=fix
            )
        )
    return k


def _words(k: torch.Tensor):
    return k[0] & _philox.MASK, k[1] & _philox.MASK


def split(key: torch.Tensor, num: int = 2) -> torch.Tensor:
    """``num`` new keys, independent of each other and of ``key``'s own draws: shape ``(num, 2)``.

    >>> k1, k2 = split(key(0))
    >>> bool((k1 != k2).any())
    True
    """
    _check_key(key, "fd.random.split(key)")
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise InputTypeError(
            explain(
                "fd.random.split(num)",
                "the number of keys is a count",
                expected="an int of 0 or more",
                got=repr(num),
                fix="pass e.g. num=2",
            )
        )
    counter = torch.arange(num, device=key.device)
    w = _philox.philox(*_words(key), counter, 0, _philox.SPLIT, 0)
    return torch.stack([w[0], w[1]], dim=-1)


def fold_in(key: torch.Tensor, data) -> torch.Tensor:
    """A new key for ``key`` and the integer ``data`` (an int, or an integer tensor of one
    element such as ``fd.axis_index("x")``): distinct data give independent keys.

    >>> torch.equal(fold_in(key(0), 3), fold_in(key(0), torch.tensor(3)))
    True
    """
    _check_key(key, "fd.random.fold_in(key)")
    if isinstance(data, torch.Tensor):
        if (
            data.dtype.is_floating_point
            or data.dtype.is_complex
            or data.dtype == torch.bool
            or data.numel() != 1
        ):
            raise InputTypeError(
                explain(
                    "fd.random.fold_in(data)",
                    "the data folded into a key is one integer",
                    expected="an int, or an integer tensor of one element",
                    got=f"a {data.dtype} tensor of shape {tuple(data.shape)}",
                    fix="fold in one integer at a time (e.g. fd.axis_index('x'))",
                )
            )
        data = data.reshape(()).to(torch.int64)
    elif isinstance(data, int) and not isinstance(data, bool):
        data &= 0xFFFFFFFFFFFFFFFF  # two's complement words, as an int64 holds them
        data = torch.tensor(
            data - (1 << 64) if data >= 1 << 63 else data, dtype=torch.int64, device=key.device
        )
    else:
        raise InputTypeError(
            explain(
                "fd.random.fold_in(data)",
                "the data folded into a key is one integer",
                expected="an int, or an integer tensor of one element",
                got=repr(data),
                fix="pass an int such as a step number, or fd.axis_index('x')",
            )
        )
    w = _philox.philox(*_words(key), data & _philox.MASK, (data >> 32) & _philox.MASK, _philox.FOLD, 0)
    return torch.stack([w[0], w[1]])


# --- a draw's arguments, and the tensor or value it makes ----------------------------------------


def _generate(api: str, draw: Draw, key, shape, mesh, placements, device, requires_grad=False):
    _check_key(key, f"{api}(key)")
    if mesh is None:
        if placements is not None:
            raise InputTypeError(
                explain(
                    f"{api}(placements)",
                    "placements lay out a value on a mesh",
                    expected="mesh= with placements=, or neither (a local tensor)",
                    got=f"placements={placements!r} without a mesh",
                    fix="pass mesh=..., or leave placements out",
                )
            )
        out = draw_local(draw, key, shape, device)
        return out.requires_grad_() if requires_grad else out
    if placements is None:
        raise InputTypeError(
            explain(
                f"{api}(placements)",
                "a value on a mesh needs a layout",
                expected="placements (one per mesh axis) or an fd.P spec",
                got="None",
                fix="pass e.g. placements=fd.P('x') (fd.P() replicates)",
            )
        )
    layout = placements if isinstance(placements, Layout) else layout_for(mesh, placements, len(shape), api)
    if on_meta(device, layout.mesh, api):
        storage = backend_of(layout.mesh).meta(layout, shape, draw.dtype)
        return DTensor(storage.requires_grad_(requires_grad), layout, shape)
    out = draw_sharded(draw, key, shape, layout)
    if requires_grad:
        storage_of(out).requires_grad_(True)
    return out


def _float_dtype(dtype, api: str) -> torch.dtype:
    check_dtype(dtype, api)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _FLOATS:
        raise InputTypeError(
            explain(
                f"{api}(dtype)",
                "this draw gives floating-point values",
                expected="torch.float32, float64, float16 or bfloat16",
                got=repr(dtype),
                fix="pass a floating dtype (fd.random.randint draws integers)",
            )
        )
    return dtype


def _number(value, name: str, api: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputTypeError(
            explain(
                f"{api}({name})",
                f"{name} is a number",
                expected="an int or a float",
                got=repr(value),
                fix=f"pass a Python number for {name}",
            )
        )
    return float(value)


def _draw_shape(shape, api: str) -> tuple[int, ...]:
    return global_shape((shape,), api)


# --- draws ---------------------------------------------------------------------------------------


def uniform(
    key: torch.Tensor,
    shape: Sequence[int] = (),
    dtype: torch.dtype | None = None,
    low: float = 0.0,
    high: float = 1.0,
    *,
    mesh: DeviceMesh | None = None,
    placements: PlacementsOrSpec | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor | DTensor:
    """Floats uniform in ``[low, high)``; with ``mesh`` and ``placements`` an ``fd.DTensor``
    whose global value is the same for every layout.

    The values in ``[0, 1)`` are exact: the dtype's significand bits of one 32-bit word (53
    bits of two for float64). ``device`` (without a mesh): where the tensor is made (default:
    the key's device); ``"meta"`` with a mesh draws nothing.
    """
    api = "fd.random.uniform"
    dtype = _float_dtype(dtype, api)
    low, high = _number(low, "low", api), _number(high, "high", api)
    draw = Draw("uniform", dtype, scale=high - low, shift=low)
    return _generate(api, draw, key, _draw_shape(shape, api), mesh, placements, device)


def normal(
    key: torch.Tensor,
    shape: Sequence[int] = (),
    dtype: torch.dtype | None = None,
    mean: float = 0.0,
    std: float = 1.0,
    *,
    mesh: DeviceMesh | None = None,
    placements: PlacementsOrSpec | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor | DTensor:
    """Normal floats (``mean``, ``std``); with ``mesh`` and ``placements`` an ``fd.DTensor``
    whose global value is the same for every layout.

    Box-Muller from one Philox block per element, computed in float32 (float64 for float64)
    with its own logarithm, cosine and square root, so every device computes the same bits.
    """
    api = "fd.random.normal"
    dtype = _float_dtype(dtype, api)
    draw = Draw("normal", dtype, scale=_number(std, "std", api), shift=_number(mean, "mean", api))
    return _generate(api, draw, key, _draw_shape(shape, api), mesh, placements, device)


def bernoulli(
    key: torch.Tensor,
    p: float | torch.Tensor = 0.5,
    shape: Sequence[int] | None = None,
    *,
    mesh: DeviceMesh | None = None,
    placements: PlacementsOrSpec | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor | DTensor:
    """Bools, each ``True`` with probability ``p`` (a float, or for a local draw a tensor that
    broadcasts to ``shape``; ``shape`` defaults to ``p``'s)."""
    api = "fd.random.bernoulli"
    if isinstance(p, torch.Tensor):
        if mesh is not None:
            raise InputTypeError(
                explain(
                    f"{api}(p)",
                    "a draw on a mesh takes one probability",
                    expected="a float in [0, 1]",
                    got=f"a tensor of shape {tuple(p.shape)}",
                    fix="pass a float, or draw uniform values and compare them with your tensor",
                )
            )
        shape = tuple(p.shape) if shape is None else shape
    else:
        p = _number(p, "p", api)
        if not 0.0 <= p <= 1.0:
            raise ShapeError(
                explain(
                    f"{api}(p)",
                    "p is a probability",
                    expected="0 <= p <= 1",
                    got=repr(p),
                    fix="pass p in [0, 1]",
                )
            )
        shape = () if shape is None else shape
    return _generate(
        api, Draw("bernoulli", torch.bool, p), key, _draw_shape(shape, api), mesh, placements, device
    )


def randint(
    key: torch.Tensor,
    shape: Sequence[int],
    low: int,
    high: int,
    dtype: torch.dtype = torch.int64,
    *,
    mesh: DeviceMesh | None = None,
    placements: PlacementsOrSpec | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor | DTensor:
    """Integers uniform in ``[low, high)`` (from 63 random bits: the bias is below
    ``(high - low) / 2**63``)."""
    api = "fd.random.randint"
    check_dtype(dtype, api)
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputTypeError(
                explain(
                    f"{api}({name})",
                    f"{name} is an integer",
                    expected="an int",
                    got=repr(value),
                    fix="pass an int",
                )
            )
    if dtype not in _INTEGERS or not low < high:
        raise (InputTypeError if dtype not in _INTEGERS else ShapeError)(
            explain(
                api,
                "randint draws integers from a non-empty range",
                expected=f"an integer dtype and low < high, got dtype={dtype}",
                got=f"low={low}, high={high}",
                fix="pass low < high and an integer dtype such as torch.int64",
            )
        )
    draw = Draw("randint", dtype, (low, high))
    return _generate(api, draw, key, _draw_shape(shape, api), mesh, placements, device)


def dropout(key: torch.Tensor, x, p: float = 0.5):
    """``x`` with each element zeroed with probability ``p`` and the rest scaled by
    ``1 / (1 - p)``, as ``torch.nn.functional.dropout`` in training.

    On an ``fd.DTensor`` the mask is a draw over the global shape: the same for every layout.
    Inside ``shard_map`` ``x`` is a local tensor and the key is folded with the device's index
    along the mesh axes that ``x`` varies over (every axis of the ``shard_map`` where
    ``check_rep=False``): devices that hold the same values drop the same elements, devices that
    hold different shards drop independently.
    """
    api = "fd.random.dropout"
    _check_key(key, f"{api}(key)")
    p = _number(p, "p", api)
    if not 0.0 <= p <= 1.0:
        raise ShapeError(
            explain(
                f"{api}(p)", "p is a probability", expected="0 <= p <= 1", got=repr(p), fix="pass p in [0, 1]"
            )
        )
    if isinstance(x, DTensor):
        keep = draw_sharded(
            Draw("bernoulli", torch.bool, 1.0 - p), key, tuple(x.shape), without_partial(x.sharding)
        )
        mask = storage_of(keep)
        scaled = storage_of(x) * mask * (1.0 / (1.0 - p)) if p < 1.0 else storage_of(x) * mask
        return DTensor(scaled, x.sharding, x.shape)
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(
            explain(
                f"{api}(x)",
                "dropout applies to a tensor",
                expected="a torch.Tensor or an fd.DTensor",
                got=type(x).__name__,
                fix="pass the activations to drop",
            )
        )
    frame = current_frame()
    if frame is not None:
        varying = varying_in(frame, x) if frame.check_rep else frozenset(frame.mesh.axis_names)
        axes = tuple(a for a in frame.mesh.axis_names if a in varying)
        if axes:
            key = fold_in(key, axis_index(axes))
    mask = bernoulli(key, 1.0 - p, tuple(x.shape), device=x.device)
    return x * mask * (1.0 / (1.0 - p)) if p < 1.0 else x * mask


# --- the factories' random forms -------------------------------------------------------------------


def default_key() -> torch.Tensor:
    """A key drawn from torch's default generator: ``torch.manual_seed`` makes it reproducible,
    and equally seeded ranks agree."""
    return key(int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)))


def _factory(name: str, kind: str):
    def factory(
        *size: int | Sequence[int],
        mesh: DeviceMesh,
        placements: PlacementsOrSpec,
        dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        device: str | torch.device | None = None,
        key: torch.Tensor | None = None,
    ) -> DTensor:
        api = f"fd.{name}"
        check_mesh(mesh, f"{api}(device_mesh)")  # a factory makes a value on a mesh
        shape = global_shape(size, api)
        draw = Draw(kind, _float_dtype(dtype, api))
        key = default_key() if key is None else key
        return _generate(api, draw, key, shape, mesh, placements, device, requires_grad)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = (
        f"A global value of shape ``size`` drawn as :func:`fd.random.{kind}` from ``key``, "
        "materializing only local shards; the same values for every mesh and layout. Without a key, "
        "one is drawn from torch's default generator (``torch.manual_seed`` makes it reproducible). "
        "``device='meta'``: shapes and layout only, drawing nothing."
    )
    return factory


rand = _factory("rand", "uniform")
randn = _factory("randn", "normal")
