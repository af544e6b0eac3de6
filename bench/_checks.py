"""The benchmarks' correctness checks: the tests' comparison (``tests/common.assert_close``,
tolerances from the dtype and a float64 reference), so a benchmark times only what it has
checked, by the rule the tests use. Run the benchmarks in the test environment (``.[test]``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import assert_close, in_float64  # noqa: E402

__all__ = ["assert_close", "checked", "in_float64"]


def checked(what: str, got, want, want_in_dtype=None, *, terms: float = 1) -> None:
    """``assert_close(got, want, want_in_dtype, terms=terms)``, or the run stops with ``what``
    and the difference (a benchmark of a wrong result measures nothing)."""
    try:
        assert_close(got, want, want_in_dtype, terms=terms, msg=what)
    except AssertionError as error:
        raise SystemExit(str(error)) from None
