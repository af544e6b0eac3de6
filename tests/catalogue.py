"""A catalogue of per-device programs for the systematic shard_map tests.

Each case is built for a mesh and a tuple of mesh axes ``A`` (in any order: device ``i`` along
them is the one with index ``i``, the first axis major, which is also the block order of a
``P(A)`` entry) with ``N`` devices along them, and gives: the per-device function, its specs,
global input shapes, a reference on global tensors (plain torch, single device: the oracle for
values and gradients), and the collectives its forward runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from backends import Mesh, events
from common import assert_close
from hypothesis import strategies as st

import functional_dtensor as fd


@dataclass(frozen=True)
class Case:
    name: str
    f: Callable
    in_specs: tuple
    out_specs: object
    shapes: tuple[tuple[int, ...], ...]
    reference: Callable
    comm: dict = field(default_factory=dict)
    check_rep: bool = True
    smooth: bool = True  # differentiable almost everywhere at random inputs


def blocks(x: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """Split dim ``dim`` into ``n`` contiguous blocks stacked at a new leading dim."""
    shape = (*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :])
    return x.reshape(shape).movedim(dim, 0)


def cases(mesh: fd.DeviceMesh, A: tuple[str, ...], m: int = 2) -> list[Case]:
    """Every catalogue case for axes ``A`` (any order) of ``mesh``; local sizes ``m``."""
    N = mesh.axis_size(A)
    a = A if len(A) > 1 else A[0]
    S, R = fd.P(a), fd.P()
    col = fd.P(None, a)

    def tiled_gather(x):
        return fd.all_gather(x, A, axis=0, tiled=True)

    out = [
        Case("identity", lambda x: x, (S,), S, ((N * m, 3),), lambda x: x),
        Case(
            "elementwise",
            lambda x: torch.sin(x) * 2 + 1,
            (fd.P(None, a),),
            fd.P(None, a),
            ((3, N * m),),
            lambda x: torch.sin(x) * 2 + 1,
        ),
        Case("local matmul", lambda x, w: x @ w, (S, R), S, ((N * m, 3), (3, 2)), lambda x, w: x @ w),
        Case(
            "psum",
            lambda x: fd.psum(x, A),
            (S,),
            R,
            ((N * m, 2),),
            lambda x: blocks(x, N).sum(0),
            {"all_reduce": 1},
        ),
        Case(
            "pmean",
            lambda x: fd.pmean(x, A),
            (S,),
            R,
            ((N * m, 2),),
            lambda x: blocks(x, N).mean(0),
            {"all_reduce": 1},
        ),
        Case(
            "pmax",
            lambda x: fd.pmax(x, A),
            (S,),
            R,
            ((N * m, 2),),
            lambda x: blocks(x, N).amax(0),
            {"all_reduce": 1},
        ),
        Case(
            "pmin",
            lambda x: fd.pmin(x, A),
            (S,),
            R,
            ((N * m, 2),),
            lambda x: blocks(x, N).amin(0),
            {"all_reduce": 1},
        ),
        Case(
            "psum of replicated",
            lambda x: fd.psum(x, A),
            (R,),
            R,
            ((m, 2),),
            lambda x: N * x,
            {"all_reduce": 1},
        ),
        Case(
            "all_gather",
            lambda x: fd.all_gather(x, A, axis=1),
            (S,),
            S,
            ((N * m, 2),),
            lambda x: blocks(x, N).transpose(0, 1).repeat(N, 1, 1),
            {"all_gather": 1},
        ),
        Case(
            "all_gather tiled, unchecked",
            tiled_gather,
            (S,),
            R,
            ((N * m, 2),),
            lambda x: x,
            {"all_gather": 1},
            check_rep=False,
        ),
        Case(
            "psum_scatter",
            lambda x: fd.psum_scatter(x, A, scatter_dimension=0),
            (col,),
            S,
            ((N, N * m),),
            lambda x: blocks(x, N, 1).sum(0).reshape(-1),
            {"reduce_scatter": 1},
        ),
        Case(
            "psum_scatter tiled",
            lambda x: fd.psum_scatter(x, A, scatter_dimension=0, tiled=True),
            (col,),
            S,
            ((N * m, N * 2),),
            lambda x: blocks(x, N, 1).sum(0),
            {"reduce_scatter": 1},
        ),
        Case(
            "all_to_all",
            lambda x: fd.all_to_all(x, A, 1, 0),
            (S,),
            S,
            ((N * m, N),),
            lambda x: blocks(x, N).permute(2, 0, 1).reshape(N * N, m),
            {"all_to_all": 1},
        ),
        Case(
            "all_to_all tiled",
            lambda x: fd.all_to_all(x, A, 1, 0, tiled=True),
            (S,),
            col,
            ((N * m, N * 2),),
            lambda x: x,
            {"all_to_all": 1},
        ),
        Case(
            "ppermute ring",
            lambda x: fd.ppermute(x, A, [(i, (i + 1) % N) for i in range(N)]),
            (S,),
            S,
            ((N * m, 2),),
            lambda x: blocks(x, N).roll(1, 0).reshape(N * m, 2),
            {"ppermute": 1},
        ),
        Case(
            "ppermute to one",
            lambda x: fd.ppermute(x, A, [(0, N - 1)]),
            (S,),
            S,
            ((N * m, 2),),
            lambda x: (
                torch.cat([torch.zeros_like(blocks(x, N)[1:]), blocks(x, N)[:1]]).reshape(N * m, 2)
                if N > 1
                else x
            ),
            {"ppermute": 1},
        ),
        Case(
            "axis_index",
            lambda x: x * (fd.axis_index(A) + 1),
            (S,),
            S,
            ((N * m, 2),),
            lambda x: x * torch.arange(1, N + 1).repeat_interleave(m).unsqueeze(1),
        ),
        Case(
            "tensor-parallel matmul + psum",
            lambda x, w: fd.psum(x @ w, A),
            (col, S),
            R,
            ((3, N * m), (N * m, 2)),
            lambda x, w: x @ w,
            {"all_reduce": 1},
        ),
        Case(
            "all_gather then psum_scatter",
            lambda x: fd.psum_scatter(torch.sin(tiled_gather(x)), A, tiled=True),
            (S,),
            S,
            ((N * m, 2),),
            lambda x: N * torch.sin(x),
            {"all_gather": 1, "reduce_scatter": 1},
        ),
        Case(
            "mlp",
            lambda x, w1, w2: fd.psum(torch.tanh(x @ w1) @ w2, A),
            (R, col, S),
            R,
            ((4, 3), (3, N * m), (N * m, 3)),
            lambda x, w1, w2: torch.tanh(x @ w1) @ w2,
            {"all_reduce": 1},
        ),
    ]
    return out


def global_inputs(case: Case, dtype=torch.float64, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator, dtype=dtype) for s in case.shapes]


@st.composite
def mesh_and_axes(draw, max_devices: int = 16):
    """A simulated mesh of 1 to 3 axes and the axes a program maps over, in any order."""
    ndim = draw(st.integers(1, 3))
    shape = []
    for _ in range(ndim):
        budget = max_devices // math.prod(shape)
        shape.append(draw(st.integers(1, max(1, min(4, budget)))))
    names = ("x", "y", "z")[:ndim]
    axes = draw(st.lists(st.sampled_from(names), min_size=1, max_size=ndim, unique=True))
    return Mesh(tuple(shape), names, tuple(axes))


# --- running a case (a job for either backend: see backends.py) ---------------------------------


def pick(mesh, axes, name: str, check_rep: bool | None = None) -> Case:
    case = next(c for c in cases(mesh, axes) if c.name == name)
    if mesh.axis_size(axes) == 1:  # a collective over a group of one device communicates nothing
        case = dataclasses.replace(case, comm={})
    return case if check_rep is None else dataclasses.replace(case, check_rep=check_rep)


def mapped(case: Case, mesh):
    return fd.shard_map(
        case.f, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs, check_rep=case.check_rep
    )


def run_case(mesh, axes, name: str, check_rep: bool | None = None, seed: int = 0) -> dict:
    """A job: one catalogue case on ``mesh``, the output's shards and global value, the
    gradients of the global inputs for a fixed cotangent, and the collectives of the forward
    and the backward."""
    case = pick(mesh, axes, name, check_rep)
    inputs = [t.requires_grad_() for t in global_inputs(case, seed=seed)]
    with fd.CommDebugMode() as forward:
        out = mapped(case, mesh)(*inputs)
    full = out.full_tensor()
    cotangent = torch.randn(full.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(seed + 1))
    with fd.CommDebugMode() as backward:
        grads = torch.autograd.grad(full, inputs, cotangent, allow_unused=True)
    return {
        "shape": tuple(out.shape),
        "placements": out.placements,
        "full": full.detach(),
        "shards": [s.detach() for s in out.local_shards()],
        "grads": [None if g is None else g.detach() for g in grads],
        "forward": events(forward),
        "backward": events(backward),
    }


def reference(case: Case, seed: int = 0) -> dict:
    inputs = [t.requires_grad_() for t in global_inputs(case, seed=seed)]
    out = case.reference(*inputs)
    cotangent = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(out, inputs, cotangent, allow_unused=True)
    return {
        "full": out.detach(),
        "grads": [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads, strict=True)],
    }


# --- derivatives of a program, by mode (see test_higher_order.py) -------------------------------


def _global(out):
    return out.full_tensor() if isinstance(out, fd.DTensor) else out


def loss(y: torch.Tensor) -> torch.Tensor:
    return (torch.sin(y) * y).sum()


def derivatives(mode: str, f, xs: list[torch.Tensor], vs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The derivatives of ``f`` (global tensors in, a global tensor or DTensor out) at ``xs`` in
    the direction ``vs``, by ``mode`` (see test_higher_order.py's docstring)."""

    def g(*a):
        return _global(f(*a))

    argnums = tuple(range(len(xs)))
    if mode == "hvp":
        xs = [x.detach().requires_grad_() for x in xs]
        grads = torch.autograd.grad(loss(g(*xs)), xs, create_graph=True)
        inner = sum((d * v).sum() for d, v in zip(grads, vs, strict=True))
        second = torch.autograd.grad(inner, xs, allow_unused=True)
        return [torch.zeros_like(x) if s is None else s for x, s in zip(xs, second, strict=True)]
    if mode == "jvp":
        return list(torch.func.jvp(g, tuple(xs), tuple(vs)))
    if mode == "linearize":
        out, tangent_of = torch.func.linearize(g, *xs)
        return [out, tangent_of(*vs)]
    if mode == "jvp of grad":
        gradient = torch.func.grad(lambda *a: loss(g(*a)), argnums=argnums)
        return list(torch.func.jvp(gradient, tuple(xs), tuple(vs))[1])
    raise ValueError(mode)


def check_rep_as(case: Case, check_rep: bool) -> Case:
    """``case`` with ``check_rep`` off if asked (a case that needs it off keeps it off)."""
    return case if check_rep else dataclasses.replace(case, check_rep=False)


def compare(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_close(a, b, msg=lambda m, i=i: f"{what}, result {i}: {m}")
