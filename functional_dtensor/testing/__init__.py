"""Testing helpers shipped with functional_dtensor (they need ``hypothesis`` installed).

* :mod:`functional_dtensor.testing.strategies`: hypothesis strategies for meshes, placements,
  partition specs, layouts, global shapes, dtypes and whole sharded cases, for users' own
  property tests.
"""

from . import strategies

__all__ = ["strategies"]
