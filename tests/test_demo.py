"""``python -m functional_dtensor``: the tour runs, fits 80 columns, checks itself against one
device, and runs the same on gloo ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from functional_dtensor import _demo


def test_the_tour_runs_and_checks_itself(capsys):
    _demo.main([])
    out = capsys.readouterr().out
    assert "all checks against one device: ok" in out
    for section in ("who holds what", "shard_map", "a @ b", "redistribute"):
        assert section in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "all_reduce" in out and "all_to_all" in out and "P(sum)" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_the_tour_on_four_gloo_ranks():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    done = subprocess.run(
        [*command, "-m", "functional_dtensor", "--backend", "distributed"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("all checks against one device: ok") == 1  # rank 0 prints
