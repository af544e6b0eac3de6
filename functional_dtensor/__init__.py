"""functional_dtensor: JAX-style functional sharding for PyTorch.

Layouts are immutable values; distributed programs are per-device functions wrapped by pure
transformations; every collective is an explicit functional op on a :class:`DeviceMesh`. The
same program runs on the simulated backend (every device in one process) and on
``torch.distributed``.
"""

from . import checkpoint, random
from ._clip import clip_grad_norm
from ._collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
    pvary,
)
from ._comm_debug import CommDebugMode
from ._distributed.checks import check_collectives
from ._distributed.runtime import init_device_mesh
from ._dtensor import DTensor, distribute_tensor, from_local
from ._errors import (
    AxisNameError,
    BatchedFunctionError,
    CheckpointError,
    CollectiveMismatchError,
    CommunicationError,
    FunctionalDTensorError,
    ImmutableError,
    InputTypeError,
    LayoutError,
    MeshError,
    ShapeError,
    SpecError,
    UnsupportedAttributeError,
)
from ._explain import OpReport, PlanReport, explain_redistribute
from ._explain import explain_op as explain
from ._factories import empty, full, ones, zeros
from ._fallback import strict_ops
from ._global_ops import implicit_replication
from ._interop import from_torch, to_torch
from ._layout import Layout
from ._local_map import local_map
from ._log import set_logs
from ._mesh import DeviceMesh, simulated_mesh
from ._optim import Optimizer
from ._parallelize import (
    ColwiseParallel,
    FullyShard,
    PrepareModuleInput,
    PrepareModuleOutput,
    ReplicateParallel,
    RowwiseParallel,
    SequenceParallel,
    ShardedModule,
    distribute_module,
    parallelize_module,
)
from ._placements import Partial, Placement, Replicate, Shard
from ._redistribute import redistribute  # installs DTensor.redistribute
from ._ring_attention import context_parallel, context_parallel_attention, ring_attention
from ._shard_map import shard_map
from ._spec import P
from ._surface import install as _install_surface  # noqa: F401  (torch ops, operators, methods)
from ._user_rules import register_sharding
from ._visualize import ShardingPicture, sharding_picture, visualize_sharding  # and the HTML reprs
from .random import rand, randn

__version__ = "0.1.0"

__all__ = [
    "CommDebugMode",
    "visualize_sharding",
    "sharding_picture",
    "ShardingPicture",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "init_device_mesh",
    "check_collectives",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
    "ring_attention",
    "context_parallel",
    "context_parallel_attention",
    "shard_map",
    "local_map",
    "AxisNameError",
    "BatchedFunctionError",
    "CheckpointError",
    "CommunicationError",
    "CollectiveMismatchError",
    "DTensor",
    "DeviceMesh",
    "FunctionalDTensorError",
    "ImmutableError",
    "InputTypeError",
    "Layout",
    "LayoutError",
    "MeshError",
    "P",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "ShapeError",
    "SpecError",
    "UnsupportedAttributeError",
    "distribute_tensor",
    "empty",
    "checkpoint",
    "explain",
    "explain_redistribute",
    "OpReport",
    "register_sharding",
    "implicit_replication",
    "PlanReport",
    "from_local",
    "from_torch",
    "full",
    "ones",
    "rand",
    "randn",
    "random",
    "redistribute",
    "simulated_mesh",
    "to_torch",
    "zeros",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "ReplicateParallel",
    "FullyShard",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "ShardedModule",
    "parallelize_module",
    "distribute_module",
    "Optimizer",
    "clip_grad_norm",
    "set_logs",
    "strict_ops",
]
