"""The styles of a module-sharding plan (:func:`fd.parallelize_module`), as DTensor's: each
style is the placements on its mesh axis of the parameters of the module it names, and the
layout changes of that module's inputs and outputs (the table in :mod:`._parallelize`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ._errors import InputTypeError, explain
from ._placements import Placement, Replicate, Shard
from ._public import public

__all__ = [
    "Style",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "ReplicateParallel",
    "FullyShard",
    "PrepareModuleInput",
    "PrepareModuleOutput",
]


class Style:
    """A style: the placements on its mesh axis of the parameters of the module it names
    (:meth:`param_entries`), and the layout changes of that module's inputs and outputs."""

    axis: str

    def param_dims(self, module: nn.Module, name: str) -> int | None:
        """The dim of parameter ``name`` (of ``module`` itself) sharded over the axis, or None."""
        return None

    def inputs(self, module: nn.Module) -> tuple[Placement | None, ...] | None:
        """Per positional input, the placement it needs on the axis (None: as it comes)."""
        return None

    def outputs(self, module: nn.Module) -> tuple[Placement | None, ...] | None:
        return None


def _kind(module: nn.Module, style: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise InputTypeError(
        explain(
            f"fd.{style}",
            f"{style} shards the weights of nn.Linear and nn.Embedding",
            expected="a plan entry naming an nn.Linear or nn.Embedding",
            got=type(module).__name__,
            fix="name the Linear or Embedding inside it, or use fd.distribute_module(partition_fn=...)",
        )
    )


@public
@dataclass(frozen=True)
class ColwiseParallel(Style):
    """Shard an ``nn.Linear``'s output features (weight and bias ``Shard(0)``; an
    ``nn.Embedding``'s embedding dim) over ``axis``: the input is made ``Replicate`` there, the
    output comes out ``Shard(-1)`` (``output_layouts``: another placement to redistribute it
    to). ``input_layouts`` (DTensor's annotation) lays out a plain tensor input: an
    ``fd.DTensor`` input carries its own layout."""

    axis: str = "tp"
    input_layouts: Placement = Replicate()
    output_layouts: Placement = Shard(-1)

    def param_dims(self, module, name):
        kind = _kind(module, "ColwiseParallel")
        return 1 if kind == "embedding" else 0

    def inputs(self, module):
        return (Replicate(),)

    def outputs(self, module):
        return (self.output_layouts,)


@public
@dataclass(frozen=True)
class RowwiseParallel(Style):
    """Shard an ``nn.Linear``'s input features (weight ``Shard(1)``, bias replicated; an
    ``nn.Embedding``'s rows) over ``axis``: the input is made ``Shard(-1)`` there (an
    embedding's indices ``Replicate``), the partial output reduced to ``output_layouts``
    (``Replicate``: an all-reduce; ``Shard(1)``: a reduce-scatter, for sequence parallel)."""

    axis: str = "tp"
    input_layouts: Placement = Shard(-1)
    output_layouts: Placement = Replicate()

    def param_dims(self, module, name):
        kind = _kind(module, "RowwiseParallel")
        if kind == "embedding":
            return 0
        return 1 if name == "weight" else None

    def inputs(self, module):
        return (Replicate(),) if isinstance(module, nn.Embedding) else (Shard(-1),)

    def outputs(self, module):
        return (self.output_layouts,)


@public
@dataclass(frozen=True)
class SequenceParallel(Style):
    """Run a module whose computation is independent along the sequence (``LayerNorm``,
    ``RMSNorm``, dropout) on a sequence sharded over ``axis``: parameters replicated, the
    input made ``Shard(sequence_dim)``, the output left so."""

    axis: str = "tp"
    sequence_dim: int = 1

    def inputs(self, module):
        return (Shard(self.sequence_dim),)


@public
@dataclass(frozen=True)
class ReplicateParallel(Style):
    """Parameters replicated over ``axis`` (the default for a module no style names); inputs
    and outputs as they come. On a data axis (``fd.ReplicateParallel("dp")`` on the root, as
    torch's ``replicate``): the gradients of every parameter of the module and of those inside
    it, replicated over ``axis``, are summed over it in one all-reduce per step, not one per
    use."""

    axis: str = "tp"


@public
@dataclass(frozen=True)
class FullyShard(Style):
    """FSDP-style sharding over a data axis: every parameter of the module and of the modules
    inside it that no other ``FullyShard`` claims is held with dim 0 sharded over ``axis``
    (after the tensor-parallel styles: a dim 0 already sharded over ``tp`` is split further,
    ``tp`` major), gathered when the module's ``forward`` starts; its gradient comes back
    summed over ``axis`` and sharded again. Each device holds ``1/n`` of the parameters (and
    of the optimizer state that :class:`fd.Optimizer` keeps beside them)."""

    axis: str = "dp"


@public
@dataclass(frozen=True)
class PrepareModuleInput(Style):
    """Redistribute a module's positional inputs on ``axis``: ``desired_input_layouts`` one
    placement (or None: as it comes) per input; ``input_layouts`` lays out plain tensors."""

    input_layouts: tuple[Placement | None, ...] | Placement | None = None
    desired_input_layouts: tuple[Placement | None, ...] | Placement | None = None
    axis: str = "tp"

    def inputs(self, module):
        return _as_tuple(self.desired_input_layouts)


@public
@dataclass(frozen=True)
class PrepareModuleOutput(Style):
    """Redistribute a module's outputs on ``axis``: ``desired_output_layouts`` one placement
    (or None) per output."""

    output_layouts: tuple[Placement | None, ...] | Placement | None = None
    desired_output_layouts: tuple[Placement | None, ...] | Placement | None = None
    axis: str = "tp"

    def outputs(self, module):
        return _as_tuple(self.desired_output_layouts)


def _as_tuple(value) -> tuple | None:
    if value is None:
        return None
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
