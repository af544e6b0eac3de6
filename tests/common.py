"""Helpers shared by several test files: the library's error contract, and drawn layout pairs
that split evenly."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor.testing import strategies as fds

__all__ = ["check", "even_pairs"]


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
