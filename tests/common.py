"""Helpers shared by several test files: the library's error contract, drawn layout pairs
that split evenly, and a catalogue of global op calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

__all__ = ["check", "even_pairs", "op_catalogue"]


def check(error, builtin, call, *fragments):
    """``call()`` raises ``error``, a library error that is also ``builtin``, whose message says
    what was expected, what it got and the fix, and holds every fragment."""
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, builtin) and isinstance(info.value, fd.FunctionalDTensorError)
    message = str(info.value)
    assert "Fix:" in message and "expected" in message and "got" in message
    for fragment in fragments:
        assert fragment in message, message


@st.composite
def even_pairs(draw):
    """Meshes up to 8 devices, 1-3 dims of sizes multiple of the mesh size: every layout splits
    evenly, so the planner (not the fallback) runs. Any order of a dim's axes, Partial axes."""
    mesh = draw(fds.meshes(max_devices=8))
    ndim = draw(st.integers(1, 3))
    shape = tuple(mesh.size * draw(st.integers(1, 2)) for _ in range(ndim))
    source = draw(fds.layouts(mesh, ndim, allow_partial=True))
    target = draw(fds.layouts(mesh, ndim, allow_partial=True))
    return mesh, shape, source, target


def op_catalogue(mesh, x, w, idx) -> dict:
    """Op calls on several layouts over the mesh's first and last axes (``x`` (8, 6), ``w``
    (6, 8), ``idx`` (4, 2) indices below 8): ``"op layout-number" -> value``."""
    names = mesh.axis_names
    out = {}
    for n, spec in enumerate([fd.P(), fd.P(names[0]), fd.P(None, names[-1]), fd.P(names)]):
        d = fd.distribute_tensor(x, mesh, spec)
        e = fd.distribute_tensor(w, mesh, fd.P(*reversed(tuple(spec))) if len(spec) else fd.P())
        table = fd.distribute_tensor(x, mesh, fd.P(names[-1]))
        cases = {
            "add": d + d.sum(0),
            "matmul": d @ e,
            "mean": d.mean(),
            "amax": d.amax(1),
            "softmax": torch.softmax(d, -1),
            "view": d.t().reshape(3, 16),
            "index": d[1:5, ::2],
            "cat": torch.cat([d, d * 2], 1),
            "where": torch.where(d > 0, d, -d),
            "einsum": torch.einsum("ij,jk->ik", d, e),
            "embedding": F.embedding(fd.distribute_tensor(idx, mesh, fd.P(names[0])), table),
            "gather": torch.gather(d, 0, fd.distribute_tensor(idx, mesh, fd.P(names[0]))),
            "gather rows": torch.gather(d, 1, fd.distribute_tensor(idx % 6, mesh, fd.P())),
            "cross_entropy": F.cross_entropy(d, fd.distribute_tensor(idx[:, 0].repeat(2) % 6, mesh, fd.P())),
        }
        out.update({f"{name} {n}": value for name, value in cases.items()})
    return out
