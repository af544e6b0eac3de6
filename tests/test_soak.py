"""A shortened soak (``bench/soak.py``): 2,000 mixed collectives, redistributes and global ops on
the 4 gloo ranks of the test pool, right every 25th operation, with no growth in process groups,
caches, memory or Python objects from the first chunk of 1,000 to the last. Whether the last
chunk runs as fast as the first is a timing, measured by the benchmark (``python bench/soak.py``
prints the ratio), not decided here: a test reads no clock."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"
RSS_GROWTH_MB = 16.0  # after the first chunk (allocator pools, dynamo's first traces)
OBJECT_GROWTH = 2_000  # Python objects from the first chunk to the last


def _soak_module():
    module = sys.modules.get("fd_bench_soak")
    if module is None:
        spec = importlib.util.spec_from_file_location("fd_bench_soak", SOAK)
        module = importlib.util.module_from_spec(spec)
        sys.modules["fd_bench_soak"] = module
        spec.loader.exec_module(module)
    return module


def job_soak(ops: int) -> dict:
    from functional_dtensor import _cache

    _cache.clear_caches()  # the pool's ranks ran other tests' programs first: the soak counts its own
    return _soak_module().run_soak(ops, check_every=25)


@pytest.mark.slow
@pytest.mark.distributed
def test_soak_on_four_gloo_ranks_is_right_and_grows_nothing(gloo):
    records = gloo.run(4, job_soak, 2_000, timeout=180)
    soak = _soak_module()
    summary = soak.summary(records)
    assert summary["ops"] == 2_000 and summary["checks"] == 80
    for record in records:
        start, first, last = record["start"], record["chunks"][0], record["chunks"][-1]
        at = f"rank {record['rank']}"
        assert last["process_groups"] == start["process_groups"], at
        assert last["mesh_tables"] == start["mesh_tables"], at
        assert last["cache_entries"] == first["cache_entries"], at  # every key seen in warm-up
        assert not last["caches_full"], f"{at}: caches at their bound: {last['caches_full']}"
        assert last["rss_mb"] - first["rss_mb"] < RSS_GROWTH_MB, (at, first["rss_mb"], last["rss_mb"])
        assert last["objects"] - first["objects"] < OBJECT_GROWTH, (at, first["objects"], last["objects"])
