"""The styles of a module-sharding plan (:func:`fd.parallelize_module`), as DTensor's: each
style is the placements on its mesh axis of the parameters of the module it names, and the
layout changes of that module's inputs and outputs (the table in :mod:`._parallelize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
    "TRANSFORMERS_STYLES",
    "style_of_string",
]


class Style:
    """A style: the placements on its mesh axis of the parameters of the module it names
    (:meth:`param_dims`), and the layout changes of that module's inputs and outputs.

    ``use_local_output`` is taken as torch's styles take it, and changes nothing: in torch it
    hands the next module a rank's local tensor, whose shapes the model code must expect; here
    every value stays a global ``fd.DTensor``, so the model code sees the shapes it sees on one
    device, and the layout travels with the value."""

    axis: str

    def param_dims(self, module: nn.Module, name: str) -> int | None:
        """The dim of parameter ``name`` (of ``module`` itself) sharded over the axis, or None."""
        return None

    def inputs(self, module: nn.Module) -> tuple[Placement | None, ...] | None:
        """Per positional input, the placement it needs on the axis (None: as it comes)."""
        return None

    def outputs(self, module: nn.Module) -> tuple[Placement | None, ...] | None:
        return None

    def arity(self) -> int | None:
        """How many positional inputs the module's call must have (None: any)."""
        return None

    def kwarg_inputs(self, module: nn.Module) -> dict[str, Placement] | None:
        """Per keyword input, the placement it needs on the axis (None: as they come)."""
        return None


def _kind(module: nn.Module, style: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if _is_conv1d(module):
        return "conv1d"
    raise InputTypeError(
        explain(
            f"fd.{style}",
            f"{style} shards the weights of nn.Linear and nn.Embedding (and transformers' Conv1D)",
            expected="a plan entry naming an nn.Linear or nn.Embedding",
            got=type(module).__name__,
            fix="name the Linear or Embedding inside it, or use fd.distribute_module(partition_fn=...)",
        )
    )


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers): ``x @ weight + bias`` with the weight
    stored ``(in, out)``, the transpose of ``nn.Linear``'s."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == module.nf
    )


@public
@dataclass(frozen=True)
class ColwiseParallel(Style):
    """Shard an ``nn.Linear``'s output features (weight and bias ``Shard(0)``; an
    ``nn.Embedding``'s embedding dim; transformers' ``Conv1D``, weight ``Shard(1)``) over
    ``axis``: the input is made ``Replicate`` there, the
    output comes out ``Shard(-1)`` (``output_layouts``: another placement to redistribute it
    to). ``input_layouts`` (DTensor's annotation) lays out a plain tensor input: an
    ``fd.DTensor`` input carries its own layout."""

    axis: str = "tp"
    input_layouts: Placement = Replicate()
    output_layouts: Placement = Shard(-1)
    use_local_output: bool = False  # torch's signature; outputs stay global values (see Style)

    def param_dims(self, module, name):
        kind = _kind(module, "ColwiseParallel")
        if kind == "conv1d":
            return 1 if name == "weight" else 0
        return 1 if kind == "embedding" else 0

    def inputs(self, module):
        return (Replicate(),)

    def outputs(self, module):
        return (self.output_layouts,)


@public
@dataclass(frozen=True)
class RowwiseParallel(Style):
    """Shard an ``nn.Linear``'s input features (weight ``Shard(1)``, bias replicated; an
    ``nn.Embedding``'s rows; transformers' ``Conv1D``, weight ``Shard(0)``) over ``axis``: the
    input is made ``Shard(-1)`` there (an
    embedding's indices ``Replicate``), the partial output reduced to ``output_layouts``
    (``Replicate``: an all-reduce, an ``nn.Linear``'s bias added once after it, as Megatron's
    RowParallelLinear; ``Shard(1)``: a reduce-scatter, for sequence parallel)."""

    axis: str = "tp"
    input_layouts: Placement = Shard(-1)
    output_layouts: Placement = Replicate()
    use_local_output: bool = False

    def param_dims(self, module, name):
        kind = _kind(module, "RowwiseParallel")
        if kind == "embedding":
            return 0
        if kind == "conv1d":
            return 0 if name == "weight" else None
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
    input made ``Shard(sequence_dim)``, the output left so. Each device's gradient of a
    parameter is its part of the sequence's: the parts of every such parameter in the module
    (and in the other ``SequenceParallel`` modules of the plan) are summed over ``axis`` in one
    all-reduce per step, as Megatron sums its sequence-parallel norms' gradients."""

    axis: str = "tp"
    sequence_dim: int = 1
    use_local_output: bool = False

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
    """Redistribute a module's inputs on ``axis``: ``desired_input_layouts`` one placement (or
    None: as it comes) per positional input, ``desired_input_kwarg_layouts`` one per keyword
    input by name; ``input_layouts`` / ``input_kwarg_layouts`` lay out plain tensors. As in
    torch, ``input_layouts`` and ``desired_input_layouts`` have one entry per positional input
    (the module's call is checked against them)."""

    input_layouts: tuple[Placement | None, ...] | Placement | None = None
    desired_input_layouts: tuple[Placement | None, ...] | Placement | None = None
    input_kwarg_layouts: dict[str, Placement] | None = None
    desired_input_kwarg_layouts: dict[str, Placement] | None = None
    use_local_output: bool = False
    axis: str = "tp"

    def __post_init__(self):
        given, desired = _as_tuple(self.input_layouts), _as_tuple(self.desired_input_layouts)
        if given is not None and desired is not None and len(given) != len(desired):
            raise InputTypeError(
                explain(
                    "fd.PrepareModuleInput(desired_input_layouts)",
                    "input_layouts and desired_input_layouts name the same positional inputs",
                    expected=f"{len(given)} desired layouts (one per input layout)",
                    got=f"{len(desired)}",
                    fix="give one placement (or None) per positional input in both",
                )
            )
        given_kw, desired_kw = self.input_kwarg_layouts or {}, self.desired_input_kwarg_layouts or {}
        if given_kw and set(given_kw) != set(desired_kw):
            raise InputTypeError(
                explain(
                    "fd.PrepareModuleInput(desired_input_kwarg_layouts)",
                    "input_kwarg_layouts and desired_input_kwarg_layouts name the same keyword inputs",
                    expected=f"the names {sorted(given_kw)}",
                    got=f"{sorted(desired_kw)}",
                    fix="give a desired placement for every keyword input you lay out",
                )
            )

    def inputs(self, module):
        return _as_tuple(self.desired_input_layouts)

    def arity(self) -> int | None:
        given = _as_tuple(self.input_layouts)
        return len(given) if given is not None else None

    def kwarg_inputs(self, module):
        return dict(self.desired_input_kwarg_layouts) if self.desired_input_kwarg_layouts else None


@public
@dataclass(frozen=True)
class PrepareModuleOutput(Style):
    """Redistribute a module's outputs on ``axis``: ``desired_output_layouts`` one placement
    (or None) per output."""

    output_layouts: tuple[Placement | None, ...] | Placement | None = None
    desired_output_layouts: tuple[Placement | None, ...] | Placement | None = None
    use_local_output: bool = False
    axis: str = "tp"

    def outputs(self, module):
        return _as_tuple(self.desired_output_layouts)


def _as_tuple(value) -> tuple | None:
    if value is None:
        return None
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


#: transformers' plan strings (``model._tp_plan``, ``config.base_model_tp_plan``) as fd's styles
TRANSFORMERS_STYLES = {
    "colwise": lambda axis: ColwiseParallel(axis),
    "colwise_rep": lambda axis: ColwiseParallel(axis, output_layouts=Replicate()),
    "colwise_gather_output": lambda axis: ColwiseParallel(axis, output_layouts=Replicate()),
    "rowwise": lambda axis: RowwiseParallel(axis),
    "rowwise_rep": lambda axis: RowwiseParallel(axis),
    "rowwise_split_input": lambda axis: RowwiseParallel(axis, input_layouts=Replicate()),
    "embedding_rowwise": lambda axis: RowwiseParallel(axis),
    "embedding_colwise": lambda axis: ColwiseParallel(axis),
    "sequence_parallel": lambda axis: SequenceParallel(axis),
    "replicate": lambda axis: ReplicateParallel(axis),
    "replicated_with_grad_allreduce": lambda axis: ReplicateParallel(axis),
}


def style_of_string(name: str, axis_names: tuple[str, ...], where: str) -> Style:
    """The fd style of transformers' plan string ``name``, on the mesh's ``"tp"`` axis (or its
    one axis)."""
    if name not in TRANSFORMERS_STYLES:
        raise InputTypeError(
            explain(
                where,
                "a plan string names one of transformers' styles fd takes",
                expected=f"one of {sorted(TRANSFORMERS_STYLES)}",
                got=repr(name),
                fix="use an fd style for this module (packed and expert-parallel styles: shard the "
                "weights with fd.distribute_module)",
            )
        )
    if "tp" in axis_names:
        axis = "tp"
    elif len(axis_names) == 1:
        axis = axis_names[0]
    else:
        raise InputTypeError(
            explain(
                where,
                "a plan string shards over the mesh's tensor-parallel axis",
                expected='a mesh with a "tp" axis, or a mesh of one axis',
                got=f"axes {axis_names}",
                fix="name the mesh's axes (dp, tp), or write fd styles with axis=...",
            )
        )
    return TRANSFORMERS_STYLES[name](axis)
