"""The draws of :mod:`._philox` in one fused loop per kind, on the CPU: C built on first use
with the system's compiler, cached per source and machine, called through ``ctypes``.

The C mirrors the tensor ops step for step (the same constants, the same order of rounded
operations, no contraction into fused multiply-adds), so the values are the same bits. Without
a compiler, or with ``FD_NATIVE_RANDOM=0``, :func:`available` is false and the callers use the
tensor ops. A draw is split over ``torch.get_num_threads()`` threads (``ctypes`` releases the
GIL).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ._philox import DIGITS, DRAW, MULTIPLIERS, POLYNOMIALS, ROUNDS, SQRT_STEPS, WEYL, rounded

__all__ = ["available", "fill", "philox_fill"]

_log = logging.getLogger("functional_dtensor.random")

_KINDS = ("uniform32", "uniform64", "normal32", "normal64", "bernoulli", "randint")

#: per working dtype: C type, its unsigned twin, literal suffix, exponent shift, mask and bias
_C_TYPES = {
    torch.float32: ("float", "uint32_t", "f", 23, 0xFF, 127),
    torch.float64: ("double", "uint64_t", "", 52, 0x7FF, 1023),
}


def _horner(x: str, coefficients, suffix: str) -> str:
    """``_philox._horner`` as one C expression (the same order of roundings)."""
    c = [v.hex() + suffix for v in coefficients]
    out = f"({x} * {c[-1]} + {c[-2]})"
    for value in reversed(c[:-2]):
        out = f"({out} * {x} + {value})"
    return out


def _normal(work: torch.dtype) -> str:
    """``_philox._normal`` for one working dtype as a C function of the two integers it draws
    from, ``u`` in ``[1, 2**D]`` (the radius) and ``k`` in ``[0, 2**D)`` (the angle): the pair
    of normals ``r cos(t)`` and ``r sin(t)``, of an even index and the odd one after it."""
    T, U, f, shift, mask, bias = _C_TYPES[work]
    D, c = DIGITS[work], POLYNOMIALS[work]
    Int, one = ("int32_t", "1") if work == torch.float32 else ("int64_t", "1LL")
    exponent = f"(int)((bits >> {shift}) & {mask}u)"
    fraction = f"(bits & ~((({U})-1) << {shift}))"
    newton = f"y = (y + m / y) * 0.5{f};\n    " * SQRT_STEPS[work]
    turn = rounded(2 * math.pi * 2.0**-D, "f" if work == torch.float32 else "d").hex() + f
    return f"""
static inline void normal_{T}({U} u_int, {Int} k, {T} *even, {T} *odd) {{
    {U} bits; {T} m;
    {T} u = ({T})u_int * 0x1p-{D}{f};
    memcpy(&bits, &u, sizeof u);
    int e = {exponent} - {bias - 1};
    bits = {fraction} | (({U}){bias - 1} << {shift});
    memcpy(&m, &bits, sizeof m); /* u = m * 2**e, m in [1/2, 1) */
    int small = m < {c["sqrt_half"][0].hex()}{f};
    m = small ? m * 2.0{f} : m;
    e -= small;
    {T} s = (m - 1.0{f}) / (m + 1.0{f});
    {T} x = ({T})e * {c["ln2"][0].hex()}{f} + (s + s) * {_horner("(s * s)", c["log"], f)};
    x = x * -2.0{f};
    /* sqrt(x): x = m * 2**e, e even, m in [1/2, 2): Newton from a guess within 6% */
    memcpy(&bits, &x, sizeof x);
    e = {exponent} - {bias - 1};
    bits = {fraction} | (({U}){bias - 1} << {shift});
    memcpy(&m, &bits, sizeof m);
    int e_odd = e & 1;
    m = e_odd ? m * 2.0{f} : m;
    e -= e_odd;
    {T} y = m * 0.5{f} + 0.5{f};
    {newton}{U} scale_bits = ({U})((e >> 1) + {bias}) << {shift};
    {T} scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    {T} radius = x == 0.0{f} ? 0.0{f} : y * scale;
    {Int} quadrant = k >> {D - 2}, rest = k & (({one} << {D - 2}) - 1);
    {Int} up = rest >= ({one} << {D - 3});
    rest -= up << {D - 2};
    quadrant = (quadrant + up) & 3;
    {T} a = ({T})rest * {turn};
    {T} a2 = a * a;
    {T} cos = {_horner("a2", c["cos"], f)};
    {T} sin = a * {_horner("a2", c["sin"], f)};
    *even = radius * (quadrant == 0 ? cos : quadrant == 1 ? -sin : quadrant == 2 ? -cos : sin);
    *odd = radius * (quadrant == 1 ? cos : quadrant == 2 ? -sin : quadrant == 3 ? -cos : sin);
}}
"""


def _source() -> str:
    """The C source, written from :mod:`._philox`'s constants (floats in hex: exact)."""
    d64 = DIGITS[torch.float64]
    wide = lambda hi, lo: f"((((uint64_t)w[{hi}]) << {d64 - 32}) | (w[{lo}] >> {64 - d64}))"
    return _TEMPLATE.format(
        rounds=ROUNDS,
        m0=MULTIPLIERS[0],
        m1=MULTIPLIERS[1],
        w0=WEYL[0],
        w1=WEYL[1],
        draw=DRAW,
        normals=_normal(torch.float32) + _normal(torch.float64),
        u32=f"(w[0] >> {32 - DIGITS[torch.float32]})",
        k32=f"(w[2] >> {32 - DIGITS[torch.float32]})",
        wide01=wide(0, 1),
        wide23=wide(2, 3),
        d64=d64,
    )


_TEMPLATE = r"""
#include <stdint.h>
#include <string.h>

static inline void philox(uint32_t k0, uint32_t k1, uint64_t index, uint32_t w[4]) {{
    uint32_t c0 = (uint32_t)index, c1 = (uint32_t)(index >> 32), c2 = {draw}u, c3 = 0u;
    #pragma GCC unroll 16
    for (int r = 0; r < {rounds}; r++) {{
        if (r) {{ k0 += {w0}u; k1 += {w1}u; }}
        uint64_t p0 = (uint64_t)c0 * {m0}u, p1 = (uint64_t)c2 * {m1}u;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
    }}
    w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}}
{normals}
/* run r: indices [starts[r], starts[r] + lengths[r]), written from element offsets[r] of out */
#define RUNS(T, VALUE) \
    for (int64_t r = 0; r < runs; r++) {{ \
        uint64_t start = (uint64_t)starts[r]; T *dst = (T *)out + offsets[r]; \
        for (int64_t j = 0; j < lengths[r]; j++) {{ \
            uint32_t w[4]; philox(k0, k1, start + (uint64_t)j, w); dst[j] = (VALUE); \
        }} \
    }}

#define ARGS uint32_t k0, uint32_t k1, int64_t runs, const int64_t *starts, const int64_t *offsets, \
    const int64_t *lengths, void *out

void fd_uniform32(ARGS, int digits) {{
    float scale = 1.0f / (float)((uint32_t)1 << digits);
    RUNS(float, (float)(w[0] >> (32 - digits)) * scale)
}}

void fd_uniform64(ARGS) {{ RUNS(double, (double){wide01} * 0x1p-{d64}) }}

/* element i is the even (i % 2 == 0) or odd normal of block i / 2: pairs of a run in one step */
#define NORMAL_RUNS(T, U, V) \
    for (int64_t r = 0; r < runs; r++) {{ \
        uint64_t i = (uint64_t)starts[r], end = i + (uint64_t)lengths[r]; T *dst = (T *)out + offsets[r]; \
        uint32_t w[4]; T even, odd; \
        if (i < end && (i & 1)) {{ \
            philox(k0, k1, i >> 1, w); normal_##T(U, V, &even, &odd); *dst++ = odd; i++; \
        }} \
        uint64_t first = i >> 1, pairs = (end - i) >> 1; \
        for (uint64_t p = 0; p < pairs; p++) {{ \
            philox(k0, k1, first + p, w); normal_##T(U, V, &even, &odd); \
            dst[2 * p] = even; dst[2 * p + 1] = odd; \
        }} \
        if ((end - i) & 1) {{ \
            philox(k0, k1, first + pairs, w); normal_##T(U, V, &even, &odd); dst[2 * pairs] = even; \
        }} \
    }}

void fd_normal32(ARGS) {{ NORMAL_RUNS(float, {u32} + 1u, (int32_t){k32}) }}

void fd_normal64(ARGS) {{ NORMAL_RUNS(double, {wide01} + 1u, (int64_t){wide23}) }}

void fd_bernoulli(ARGS, double p) {{ RUNS(uint8_t, (double)w[0] * 0x1p-32 < p) }}

void fd_randint(ARGS, int64_t low, int64_t range) {{
    RUNS(int64_t, low + (int64_t)(((((uint64_t)w[1] & 0x7FFFFFFFu) << 32) | w[0]) % (uint64_t)range))
}}
"""


_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
_lock = threading.Lock()
_library: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable
_pool: ThreadPoolExecutor | None = None
_PARALLEL = 1 << 16  # the elements from which a draw is split over torch's threads


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "functional_dtensor"


def _build() -> ctypes.CDLL | bool:
    """The compiled library (built once per source and machine), or False without a compiler."""
    if os.environ.get("FD_NATIVE_RANDOM", "1") == "0":
        return False
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _log.info("no C compiler: random draws use tensor ops")
        return False
    source = _source()
    tag = hashlib.sha256("\0".join([source, *_FLAGS, platform.machine(), sys.platform]).encode()).hexdigest()[
        :16
    ]
    target = _cache_dir() / f"philox-{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            c_file, built = Path(scratch, "philox.c"), Path(scratch, "philox.so")
            c_file.write_text(source)
            result = subprocess.run(
                [compiler, *_FLAGS, str(c_file), "-o", str(built)], capture_output=True, text=True
            )
            if result.returncode != 0:
                _log.warning(
                    "building the random kernels failed; random draws use tensor ops:\n%s", result.stderr
                )
                return False
            os.replace(built, target)  # atomic: ranks building at once each write a whole file
        _log.info("built the random kernels: %s", target)
    library = ctypes.CDLL(str(target))
    pointer, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
    args = [u32, u32, i64, pointer, pointer, pointer, pointer]
    extra = {"uniform32": [ctypes.c_int], "bernoulli": [ctypes.c_double], "randint": [i64, i64]}
    for kind in _KINDS:
        function = getattr(library, f"fd_{kind}")
        function.argtypes, function.restype = args + extra.get(kind, []), None
    return library


def available() -> bool:
    """Whether the fused CPU kernels are built (building them on the first call)."""
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                _library = _build()
    return _library is not False


def fill(
    kind: str,
    key: tuple[int, int],
    starts: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    *extra,
) -> torch.Tensor:
    """Write draw ``kind`` into ``out`` (contiguous, on the CPU): run ``r`` of indices
    ``[starts[r], starts[r] + lengths[r])`` at element ``offsets[r]`` of ``out`` (int64
    tensors). Returns ``out``."""
    function = getattr(_library, f"fd_{kind}")
    base = out.data_ptr()

    def run(runs: slice) -> None:
        pointers = [t[runs].data_ptr() for t in (starts, offsets, lengths)]
        function(key[0], key[1], runs.stop - runs.start, *pointers, base, *extra)

    total = int(lengths.sum())
    parts = torch.get_num_threads() if total >= _PARALLEL else 1
    if parts == 1:
        run(slice(0, len(lengths)))
        return out
    chunk = -(-total // parts)
    starts, offsets, lengths = _cut(starts, offsets, lengths, chunk)
    part = (torch.cumsum(lengths, 0) - lengths) // chunk  # the thread of each piece, ascending
    edges = torch.searchsorted(part, torch.arange(parts + 1)).tolist()
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(thread_name_prefix="fd-random")
    for future in [_pool.submit(run, slice(lo, hi)) for lo, hi in zip(edges, edges[1:]) if hi > lo]:
        future.result()
    return out


def _cut(starts, offsets, lengths, most: int):
    """The same runs cut into pieces of at most ``most`` elements."""
    pieces = (lengths + most - 1) // most
    if int(pieces.max()) <= 1:
        return starts, offsets, lengths
    run = torch.repeat_interleave(torch.arange(len(lengths)), pieces)
    first = torch.repeat_interleave(torch.cumsum(pieces, 0) - pieces, pieces)
    step = (torch.arange(len(run)) - first) * most
    return starts[run] + step, offsets[run] + step, torch.clamp(lengths[run] - step, max=most)


# --- a draw per device under the simulated mesh's vmap -----------------------------------------

_BUFFERS = {
    "uniform32": torch.float32,
    "uniform64": torch.float64,
    "normal32": torch.float32,
    "normal64": torch.float64,
    "bernoulli": torch.bool,
    "randint": torch.int64,
}


def _extra(kind: str, p: float, a: int, b: int) -> tuple:
    return {"uniform32": (a,), "bernoulli": (p,), "randint": (a, b)}.get(kind, ())


@torch.library.custom_op("functional_dtensor::philox_fill", mutates_args=())
def philox_fill(key: torch.Tensor, shape: list[int], kind: str, p: float, a: int, b: int) -> torch.Tensor:
    """Draw ``kind`` for the indices ``0 ... prod(shape) - 1`` under ``key`` (the fused kernel as
    an op, so that a vmap over keys, such as the simulated mesh's over devices, draws each
    key's values with it: see its vmap rule)."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=_BUFFERS[kind])
    k0, k1 = (int(w) & 0xFFFFFFFF for w in key.tolist())
    runs = torch.tensor([0]), torch.tensor([0]), torch.tensor([n])
    return fill(kind, (k0, k1), *runs, out, *_extra(kind, p, a, b)).view(shape)


@philox_fill.register_fake
def _(key, shape, kind, p, a, b):
    return key.new_empty(shape, dtype=_BUFFERS[kind])


@philox_fill.register_vmap
def _(info, in_dims, key, shape, kind, p, a, b):
    if in_dims[0] is None:
        return philox_fill(key, shape, kind, p, a, b), None
    keys = key.movedim(in_dims[0], 0)
    return torch.stack([philox_fill(k, shape, kind, p, a, b) for k in keys]), 0
