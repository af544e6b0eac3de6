"""Counter-based random numbers: Philox4x32-10 and the draws built on it, in integer and IEEE
tensor ops.

Element ``i`` of a draw (its flat, row-major index in the global tensor) is a pure function of
the key and ``i``: the Philox block at counter ``(i, domain)``, turned into a value by integer
ops and correctly rounded float ops (``+ - * /``, ``sqrt``, ``frexp``; the logarithm and cosine
of the normal draw are polynomials written here). So every layout, backend, device and torch
version computes the same bits, and a device computes its own shard alone.

:mod:`._philox_native` computes the same draws in one fused loop on the CPU; the two are tested
equal bit for bit.
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = [
    "MASK",
    "MULTIPLIERS",
    "WEYL",
    "ROUNDS",
    "DRAW",
    "SPLIT",
    "FOLD",
    "DIGITS",
    "POLYNOMIALS",
    "SQRT_STEPS",
    "rounded",
    "philox",
    "draw",
]

MASK = 0xFFFFFFFF
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10

#: the third counter word: what a block is for, so that one key's uses never share a block
DRAW, SPLIT, FOLD = 0, 1, 2

#: the bits of a uniform draw in each floating dtype: its significand, so the value is exact
DIGITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def rounded(value: float, precision: str) -> float:
    """``value`` rounded to float32 (``"f"``) or left a float64 (``"d"``)."""
    return struct.unpack(precision, struct.pack(precision, value))[0]


def _series(precision: str, terms: int) -> dict[str, tuple[float, ...]]:
    """Taylor coefficients, rounded to the working precision: ``log`` of ``(1+s)/(1-s)`` over
    ``2s`` in powers of ``s**2``; ``cos`` and ``sin(a)/a`` in powers of ``a**2``."""
    log = [1 / (2 * j + 1) for j in range(terms)]
    cos = [(-1) ** j / math.factorial(2 * j) for j in range(terms + 1)]
    sin = [(-1) ** j / math.factorial(2 * j + 1) for j in range(terms)]
    table = {"log": log, "cos": cos, "sin": sin}
    constants = {"ln2": [math.log(2)], "sqrt_half": [math.sqrt(0.5)]}
    return {k: tuple(rounded(c, precision) for c in v) for k, v in (table | constants).items()}


#: the polynomial coefficients per working dtype (float32 serves float16 and bfloat16 too)
POLYNOMIALS = {torch.float32: _series("f", 6), torch.float64: _series("d", 11)}
#: Newton steps of a square root per working dtype, from a guess within 6%
SQRT_STEPS = {torch.float32: 3, torch.float64: 4}


def philox(key0, key1, c0, c1, c2, c3):
    """The four 32-bit output words of Philox4x32-10 at counter ``(c0, c1, c2, c3)`` under key
    ``(key0, key1)``: int64 tensors (or ints) holding values in ``[0, 2**32)``."""
    m0, m1 = MULTIPLIERS
    for r in range(ROUNDS):
        if r:
            key0, key1 = (key0 + WEYL[0]) & MASK, (key1 + WEYL[1]) & MASK
        p0, p1 = c0 * m0, c2 * m1  # < 2**64: wraps in int64, the low and high words survive
        c0, c1, c2, c3 = (
            ((p1 >> 32) & MASK) ^ c1 ^ key0,
            p1 & MASK,
            ((p0 >> 32) & MASK) ^ c3 ^ key1,
            p0 & MASK,
        )
    return c0, c1, c2, c3


def _horner(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    out = x * coefficients[-1] + coefficients[-2]
    for c in reversed(coefficients[:-2]):
        out = out * x + c
    return out


def _sqrt(x: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """The square root of ``x`` in ``[0, 2**63)`` by Newton's method (torch's own is not
    correctly rounded on every CPU): ``x = m * 2**e`` with ``e`` even and ``m`` in
    ``[1/2, 2)``, so ``sqrt(x) = sqrt(m) * 2**(e/2)``."""
    m, e = torch.frexp(x)
    odd = (e & 1).to(torch.bool)
    m, e = torch.where(odd, m * 2.0, m), e - odd.to(e.dtype)
    y = m * 0.5 + 0.5
    for _ in range(SQRT_STEPS[work]):
        y = (y + m / y) * 0.5
    scale = (1 << ((e >> 1).to(torch.int64) + 32)).to(work) * 2.0**-32  # 2**(e/2), exact
    return torch.where(x == 0.0, 0.0, y * scale)


def _uniform_integer(w0, w1, digits: int):
    """``digits`` random bits as an int64 in ``[0, 2**digits)``."""
    if digits <= 32:
        return w0 >> (32 - digits)
    return (w0 << (digits - 32)) | (w1 >> (64 - digits))


def _normal(words, odd, dtype: torch.dtype) -> torch.Tensor:
    """Box-Muller from four words, radius from the first half and angle ``t`` from the second:
    ``r cos(t)`` for an even index, ``r sin(t)`` (``cos(t - pi/2)``) for the odd one after it."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    digits, c = DIGITS[work], POLYNOMIALS[work]
    scale = 2.0**-digits
    u = (_uniform_integer(words[0], words[1], digits) + 1).to(work) * scale  # (0, 1]
    m, e = torch.frexp(u)  # u = m * 2**e, m in [1/2, 1)
    small = m < c["sqrt_half"][0]
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).to(work)
    s = (m - 1.0) / (m + 1.0)
    log_u = e * c["ln2"][0] + (s + s) * _horner(s * s, c["log"])
    radius = _sqrt(log_u * -2.0, work)
    k = _uniform_integer(words[2], words[3], digits)  # the angle 2*pi*k/2**digits
    quadrant, rest = k >> (digits - 2), k & ((1 << (digits - 2)) - 1)
    up = (rest >= 1 << (digits - 3)).to(torch.int64)
    rest, quadrant = rest - (up << (digits - 2)), (quadrant + up + 3 * odd) & 3  # rest in [-1/8, 1/8) turns
    a = rest.to(work) * rounded(2 * math.pi * scale, "f" if work == torch.float32 else "d")
    a2 = a * a
    cos, sin = _horner(a2, c["cos"]), a * _horner(a2, c["sin"])
    turned = torch.where(
        quadrant == 0, cos, torch.where(quadrant == 1, -sin, torch.where(quadrant == 2, -cos, sin))
    )
    return (radius * turned).to(dtype)


def draw(key: torch.Tensor, index: torch.Tensor, kind: str, dtype: torch.dtype, param=None) -> torch.Tensor:
    """The draw ``kind`` at global flat indices ``index`` (int64) under ``key`` (int64 ``(2,)``):

    - ``"uniform"``: floats in ``[0, 1)`` with the dtype's significand bits, exact;
    - ``"normal"``: standard normal floats (Box-Muller, computed in float32 or float64; the
      pair of one block at an even index and the odd one after it);
    - ``"bernoulli"``: bools, ``True`` with probability ``param`` (a float or a tensor);
    - ``"randint"``: ints in ``[low, high)`` for ``param = (low, high)``, in ``dtype``.
    """
    if kind == "normal":  # a pair of normals per block
        block = index >> 1
        words = philox(key[0], key[1], block & MASK, block >> 32, DRAW, 0)
        return _normal(words, index & 1, dtype)
    words = philox(key[0], key[1], index & MASK, index >> 32, DRAW, 0)
    if kind == "uniform":
        digits = DIGITS[dtype]
        work = torch.float64 if digits > 24 else torch.float32
        return (_uniform_integer(words[0], words[1], digits).to(work) * 2.0**-digits).to(dtype)
    if kind == "bernoulli":
        return words[0].to(torch.float64) * 2.0**-32 < param
    if kind == "randint":
        low, high = param
        return (low + (((words[1] & 0x7FFFFFFF) << 32) | words[0]) % (high - low)).to(dtype)
    raise ValueError(kind)
