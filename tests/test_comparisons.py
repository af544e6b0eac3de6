"""The tests' float comparison (``common.assert_close``): it accepts a result as close to the
float64 reference as plain torch's own float32 computation is, and refuses one that is not,
whatever the tolerance a caller would have liked."""

from __future__ import annotations

import pytest
import torch
from common import ERROR_FACTOR, assert_close, in_float64


def _sum_in_blocks(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """A sum in another order than torch's: per block, then the blocks' sums (a Partial value)."""
    return torch.stack([b.sum(0) for b in x.chunk(blocks)]).sum(0)


def test_a_sum_in_another_order_is_as_close_as_torchs_own():
    x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0)) * 100
    got = _sum_in_blocks(x, 8)
    assert_close(got, in_float64(x).sum(0), x.sum(0))


def test_a_result_off_by_more_than_the_factor_is_refused():
    x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0)) * 100
    want, want32 = in_float64(x).sum(0), x.sum(0)
    error = (want32.double() - want).abs().max()
    off = (want + (ERROR_FACTOR + 1) * error + 1e-3).float()  # beyond 4x torch's own error
    with pytest.raises(AssertionError, match="not close"):
        assert_close(off, want, want32, msg="the sum")


def test_float32_against_float64_without_torchs_error_keeps_float32s_tolerance():
    want = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert_close(torch.tensor([1.0, 2.0]), want)
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1.0, 2.001]), want)


def test_integers_dtypes_and_structures_compare_exactly():
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1, 2]), torch.tensor([1, 3]))
    with pytest.raises(AssertionError, match="dtype"):
        assert_close(torch.ones(2), torch.ones(2, dtype=torch.float16))
    with pytest.raises(AssertionError, match="structures differ"):
        assert_close({"a": torch.ones(1)}, {"b": torch.ones(1)})
    with pytest.raises(AssertionError, match=r"\['w'\]"):  # the path of the leaf that differs
        assert_close({"w": torch.ones(2)}, {"w": torch.zeros(2)}, msg="params")


def test_terms_widen_to_the_bound_of_a_sum_of_parts():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    parts = [x / 64] * 64  # a Partial(sum) value of 64 parts
    got = torch.stack(parts).sum(0)
    assert_close(got, x, terms=64)
    with pytest.raises(AssertionError):
        assert_close(got + 64 * 1.3e-6 * 4, x, terms=64)
