"""The torch ops an ``fd.DTensor`` takes, by family: each op an entry in its family's module,
with its sharding rule (:mod:`.._rules`) and its local form. Importing the package registers
them with :mod:`.._global_ops`.
"""

from . import elementwise, indexing, losses, matmul, nn, padding, reductions, values, views  # noqa: F401
from .views import getitem

__all__ = ["getitem"]
