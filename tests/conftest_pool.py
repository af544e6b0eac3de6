"""The session fixture for the gloo rank pools (import ``gloo`` into a test module).

``gloo.run(world_size, fn, *args)`` runs ``fn`` on every rank of the session's pool of that size
(started on first use, replaced after an error, killed at the end of the session) and returns
the per-rank results. ``fn`` must be a module-level function of an importable module (a test
module, or :mod:`distributed_pool`).
"""

from __future__ import annotations

import distributed_pool
import pytest

WORLD_SIZES = (2, 4)


class Gloo:
    """Access to the session's rank pools. The first use spawns the ranks of every size in
    :data:`WORLD_SIZES` at once, so that the 4-rank pool starts while 2-rank tests run."""

    def __init__(self) -> None:
        self._started = False

    def pool(self, world_size: int) -> distributed_pool.RankPool:
        if not self._started:
            self._started = True
            distributed_pool.prestart(*sorted(WORLD_SIZES, key=lambda n: n != world_size))
        return distributed_pool.pool(world_size)

    def run(
        self, world_size: int, fn, *args, timeout: float = distributed_pool.JOB_TIMEOUT, **kwargs
    ) -> list:
        return self.pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def gloo():
    try:
        yield Gloo()
    finally:
        distributed_pool.close_all()
