"""Optimizer steps on sharded parameters: a stock ``torch.optim`` optimizer, functionally.

:class:`Optimizer` wraps an elementwise ``torch.optim`` optimizer (SGD, Adam, AdamW, ...). A
step takes the parameters and their gradients (pytrees of ``fd.DTensor``, as
:func:`fd.parallelize_module` and ``torch.autograd.grad`` give them) and returns **new**
parameters: each device updates only the shards it holds, with no communication, and the
optimizer's state (momenta, second moments) is held beside them, laid out the same way. The
values passed in are not changed. On the simulated backend a block replicated over a mesh axis
is updated once, not once per device.

It is a ``torch.optim.Optimizer`` whose ``param_groups`` are those of the optimizer it holds, so
``torch.optim.lr_scheduler`` schedulers drive it as they drive that optimizer: a scheduler's
``step()`` sets ``param_groups[i]["lr"]``, which the next ``step(params, grads)`` uses.

>>> import torch, functional_dtensor as fd
>>> mesh = fd.simulated_mesh(2, "x")
>>> w = fd.ones(4, 2, mesh=mesh, placements=fd.P("x"), requires_grad=True)
>>> opt = fd.Optimizer(torch.optim.SGD, {"w": w}, lr=0.5)
>>> loss = (w * w).sum()
>>> (g,) = torch.autograd.grad(loss, [w])
>>> new = opt.step({"w": w}, {"w": g})
>>> new["w"].full_tensor()[0].tolist(), w.full_tensor()[0].tolist()  # w is unchanged
([0.0, 0.0], [1.0, 1.0])
"""

from __future__ import annotations

import weakref
from typing import Any

import optree
import torch

from ._backend import backend_of
from ._dtensor import DTensor, data_of, held_of, new_held, new_value, parts_of, storage_of
from ._errors import InputTypeError, LayoutError, ShapeError, explain
from ._placements import Partial
from ._public import public
from ._redistribute import redistribute
from ._shard_map import NAMESPACE

__all__ = ["Optimizer", "ELEMENTWISE"]

#: the torch.optim optimizers whose update of an element reads only that element's state
ELEMENTWISE = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "Rprop",
    "ASGD",
)


@torch.compiler.disable  # Dynamo cannot read optree's C comparison; torch's step breaks the graph anyway
def _same_structure(a, b) -> bool:
    return a == b


@public
class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer over a pytree of ``fd.DTensor`` parameters, functionally:
    ``new_params = opt.step(params, grads)``.

    ``optimizer`` is the class (``torch.optim.AdamW``), ``options`` its keyword arguments
    (``lr=1e-3``, ``weight_decay=0.1``). Its update must be elementwise (:data:`ELEMENTWISE`;
    another optimizer is an error, as its update would differ on shards, unless
    ``elementwise=True`` says it is). ``state_dict()`` gives the state as ``fd.DTensor`` laid
    out like the parameters (for :mod:`fd.checkpoint`), ``load_state_dict`` takes it back
    (redistributed to this optimizer's layouts).

    It is a ``torch.optim.Optimizer``: ``param_groups``, ``state`` and ``defaults`` are those of
    the stock optimizer it holds over the shards (``param_groups[0]["params"]`` are the blocks
    this process updates), so a ``torch.optim.lr_scheduler`` scheduler drives it as it drives a
    torch optimizer, and step hooks see each ``step(params, grads)``:

    >>> import torch, functional_dtensor as fd
    >>> mesh = fd.simulated_mesh(2, "x")
    >>> params = {"w": fd.ones(4, mesh=mesh, placements=fd.P("x"))}
    >>> opt = fd.Optimizer(torch.optim.SGD, params, lr=1.0)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> grads = {"w": fd.ones(4, mesh=mesh, placements=fd.P())}
    >>> for _ in range(2):
    ...     params = opt.step(params, grads)
    ...     sched.step()
    >>> params["w"].full_tensor().tolist(), opt.param_groups[0]["lr"]  # 1 - 1.0 - 0.5
    ([-0.5, -0.5, -0.5, -0.5], 0.25)
    """

    def __init__(self, optimizer: type, params, /, *, elementwise: bool | None = None, **options) -> None:
        where = "fd.Optimizer"
        if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
            raise InputTypeError(
                explain(
                    f"{where}(optimizer)",
                    "the optimizer is a torch.optim class, made here over the shards",
                    expected="a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW",
                    got=repr(optimizer),
                    fix="pass the class and its options: fd.Optimizer(torch.optim.AdamW, params, lr=1e-3)",
                )
            )
        if elementwise is None:
            elementwise = optimizer.__name__ in ELEMENTWISE and optimizer.__module__.startswith("torch.optim")
        if not elementwise:
            raise InputTypeError(
                explain(
                    f"{where}(optimizer)",
                    "each device updates only its shards, so the update must be elementwise",
                    expected=f"one of torch.optim.{{{', '.join(ELEMENTWISE)}}}",
                    got=f"{optimizer.__module__}.{optimizer.__name__}",
                    fix="use an elementwise optimizer, or pass elementwise=True if this one is",
                )
            )
        leaves, self._tree = optree.tree_flatten(params, none_is_leaf=True, namespace=NAMESPACE)
        paths = optree.tree_paths(params, none_is_leaf=True, namespace=NAMESPACE)
        self._paths = ["".join(f"[{p!r}]" for p in path) for path in paths]
        for path, leaf in zip(self._paths, leaves):
            if not isinstance(leaf, DTensor):
                raise InputTypeError(
                    explain(
                        f"{where}(params{path})",
                        "the parameters are fd.DTensor values",
                        expected="an fd.DTensor",
                        got=type(leaf).__name__,
                        fix="lay it out with fd.distribute_tensor, or use fd.parallelize_module(...).params",
                    )
                )
            if any(isinstance(p, Partial) for p in leaf.placements):
                raise LayoutError(
                    explain(
                        f"{where}(params{path})",
                        "a parameter is a value, not a sum still to be taken",
                        expected="Shard or Replicate placements",
                        got=str(leaf.sharding),
                        fix="redistribute it to Replicate first",
                    )
                )
        self._layouts = [(leaf.sharding, leaf.shape, leaf.dtype) for leaf in leaves]
        # every block the optimizer updates, its gradient and its state row-major: torch's fused
        # kernels read the three in one run of memory each (a transposed or gapped one would pair
        # the wrong elements), whichever implementation a loaded state's groups name
        self._tensors = [_row_major_copy(self._distinct(leaf)) for leaf in leaves]
        self._options = _with_implementation(optimizer, options, self._tensors)
        # the storages the last step returned, where they share no memory with the tensors the
        # optimizer updates: given back, their distinct blocks are those tensors already
        self._returned: list[weakref.ref | None] = [None] * len(leaves)
        self.optimizer = optimizer(self._tensors, **self._options)
        # torch.optim.Optimizer's own set-up, which unpickling an optimizer runs too: its hooks and
        # its profiled step (whose calls a scheduler counts); param_groups, state and defaults
        # are the held optimizer's (the properties below)
        torch.optim.Optimizer.__setstate__(self, {})

    def __repr__(self) -> str:
        return f"fd.Optimizer({type(self.optimizer).__name__}, {len(self._tensors)} parameters)"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The held optimizer's parameter groups: ``"lr"`` and the other options each step
        reads (a scheduler sets them here), and the blocks this process updates."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        """The held optimizer's state, keyed by the blocks it updates (:meth:`state_dict` gives
        it as values laid out like the parameters)."""
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The held optimizer's default options (``lr``, ``betas``, ...)."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def __getstate__(self) -> dict[str, Any]:
        # everything (torch.optim.Optimizer keeps only its groups and state), less the record
        # of the storages the last step returned: a copy starts without it
        return {**self.__dict__, "_returned": [None] * len(self._returned)}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the parameters are the pytree the optimizer was made with."""
        raise InputTypeError(
            explain(
                "fd.Optimizer.add_param_group(param_group)",
                "a step takes and returns the pytree of parameters the optimizer was made with",
                expected="the parameters given to fd.Optimizer",
                got="another parameter group",
                fix="make an fd.Optimizer over the whole pytree (another one for parameters with "
                "other options)",
            )
        )

    @staticmethod
    def _distinct(value: DTensor) -> torch.Tensor:
        backend, held = backend_of(value.device_mesh), held_of(value)
        if held is not None:
            return backend.distinct_held(held, value.sharding)
        return backend.distinct(storage_of(value), value.sharding)

    @staticmethod
    def _gradient(grad: DTensor, dtype: torch.dtype) -> torch.Tensor:
        """The distinct blocks of ``grad`` in ``dtype``, row-major as the parameter's (the
        elementwise update reads both in one order)."""
        blocks = Optimizer._distinct(grad)
        if blocks.requires_grad:  # (a gradient taken with create_graph)
            blocks = blocks.detach()
        if blocks.dtype != dtype:
            blocks = blocks.to(dtype)
        return blocks.contiguous()

    @staticmethod
    def _updated(distinct: torch.Tensor, layout, shape, requires_grad: bool) -> DTensor:
        """The value whose distinct blocks are ``distinct``: held once where the backend keeps
        it so (the simulated mesh: each block once, not a copy per replica), else its storage."""
        backend = backend_of(layout.mesh)
        if backend.holds_leaf(layout, tuple(shape)):
            held = distinct.reshape(-1, *distinct.shape[layout.mesh.ndim :])
            return new_held(held.requires_grad_(requires_grad), layout, shape)
        return new_value(
            Optimizer._storage(distinct, layout, shape).requires_grad_(requires_grad), layout, shape
        )

    @staticmethod
    def _storage(distinct: torch.Tensor, layout, shape) -> torch.Tensor:
        """The storage of the value whose distinct blocks are ``distinct`` (padding zeroed)."""
        return backend_of(layout.mesh).materialize(layout, tuple(shape), lambda _shape, _shard: distinct)

    def _checked(self, tree, what: str, *, allow_none: bool) -> list:
        where = f"fd.Optimizer.step({what})"
        leaves, tree_spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
        if not _same_structure(tree_spec, self._tree):
            raise InputTypeError(
                explain(
                    where,
                    f"{what} has the structure of the parameters the optimizer was made with",
                    expected=str(self._tree),
                    got=str(tree_spec),
                    fix="pass the same pytree (the step's result is one)",
                )
            )
        out = []
        for path, leaf, (layout, shape, _) in zip(self._paths, leaves, self._layouts):
            if type(leaf) is DTensor:
                _, own, own_shape = parts_of(leaf)
                # (the common case: as made, or a gradient laid out like its parameter)
                if own_shape == shape and (own is layout or own == layout):
                    out.append(leaf)
                    continue
            if leaf is None and allow_none:
                out.append(None)
                continue
            if not isinstance(leaf, DTensor):
                raise InputTypeError(
                    explain(
                        f"{where}{path}",
                        f"{what} are fd.DTensor values",
                        expected="an fd.DTensor" + (" or None" if allow_none else ""),
                        got=type(leaf).__name__,
                        fix="pass what torch.autograd.grad returns for the parameters",
                    )
                )
            if leaf.shape != shape or leaf.device_mesh != layout.mesh:
                raise ShapeError(
                    explain(
                        f"{where}{path}",
                        f"{what} must match the parameters the optimizer was made with",
                        expected=f"shape {tuple(shape)} on {layout.mesh!r}",
                        got=f"shape {tuple(leaf.shape)} on {leaf.device_mesh!r}",
                        fix="pass the parameters (and their gradients) of this model",
                    )
                )
            if leaf.sharding != layout:
                leaf = redistribute(leaf, layout)
            out.append(leaf)
        return out

    def step(self, params, grads):
        """The parameters after one step with ``grads`` (a pytree like ``params``; a ``None``
        leaf: no gradient, as an unused parameter). ``params`` is not changed."""
        values = self._checked(params, "params", allow_none=False)
        gradients = self._checked(grads, "grads", allow_none=True)
        with torch.no_grad():
            for tensor, value, grad, returned in zip(self._tensors, values, gradients, self._returned):
                if returned is None or returned() is not data_of(value):
                    # fresh memory: the values returned by an earlier step keep theirs
                    tensor.data = _row_major_copy(self._distinct(value))
                tensor.grad = None if grad is None else self._gradient(grad, tensor.dtype)
            self.optimizer.step()
            out = []
            for i, (tensor, value, (layout, shape, _)) in enumerate(
                zip(self._tensors, values, self._layouts)
            ):
                tensor.grad = None
                updated = self._updated(tensor.data, layout, shape, value.requires_grad)
                data = data_of(updated)
                shared = data.untyped_storage().data_ptr() == tensor.data.untyped_storage().data_ptr()
                self._returned[i] = None if shared else weakref.ref(data)
                out.append(updated)
        return optree.tree_unflatten(self._tree, out)

    def state_dict(self) -> dict:
        """The optimizer's state: ``{"state": {parameter path: {name: fd.DTensor or
        tensor}}, "param_groups": [...]}``, each state tensor shaped like its parameter laid
        out like it (a scalar such as ``step`` as a plain tensor)."""
        return self._as_values(self.optimizer.state_dict())

    def state_template(self) -> dict:
        """A state of this optimizer's structure and layouts, as :meth:`state_dict` gives it
        after a step (its values placeholders): the ``like`` of a saved state for
        :func:`fd.checkpoint.load`, before this optimizer has stepped."""
        probe = type(self.optimizer)([t.detach().clone() for t in self._tensors], **self._options)
        with torch.no_grad():
            for tensor in probe.param_groups[0]["params"]:
                tensor.grad = torch.zeros_like(tensor)
            probe.step()
        # this optimizer's groups, as a scheduler left them (its "initial_lr" included)
        groups = self.optimizer.state_dict()["param_groups"]
        return self._as_values({"state": probe.state_dict()["state"], "param_groups": groups})

    def _as_values(self, inner: dict) -> dict:
        state = {}
        for index, entries in inner["state"].items():
            layout, shape, _ = self._layouts[index]
            tensor = self._tensors[index]
            state[self._paths[index]] = {
                key: new_value(self._storage(v.detach().clone(), layout, shape), layout, shape)
                if isinstance(v, torch.Tensor) and v.shape == tensor.shape and v.dim() > 0
                else v.detach().clone()  # a fresh step counter: the optimizer counts in place
                if isinstance(v, torch.Tensor)
                else v
                for key, v in entries.items()
            }
        return {"state": state, "param_groups": inner["param_groups"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take back a :meth:`state_dict` (from this or another layout of the same model)."""
        where = "fd.Optimizer.load_state_dict(state_dict)"
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise InputTypeError(
                explain(
                    where,
                    "an optimizer state is the dict fd.Optimizer.state_dict() gives",
                    expected='a dict with "state" and "param_groups"',
                    got=repr(type(state_dict).__name__)
                    if not isinstance(state_dict, dict)
                    else f"keys {sorted(state_dict)}",
                    fix="pass opt.state_dict() (or what fd.checkpoint.load gave back for it)",
                )
            )
        index_of = {path: i for i, path in enumerate(self._paths)}
        state = {}
        for path, entries in state_dict["state"].items():
            if path not in index_of:
                raise InputTypeError(
                    explain(
                        f"{where}['state'][{path!r}]",
                        "the state names a parameter this optimizer does not have",
                        expected=f"one of {self._paths[:4]}{'...' if len(self._paths) > 4 else ''}",
                        got=repr(path),
                        fix="load the state of an optimizer over the same parameters",
                    )
                )
            index = index_of[path]
            layout, shape, _ = self._layouts[index]
            converted = {}
            for key, v in entries.items():
                if isinstance(v, DTensor):
                    if v.shape != shape:
                        raise ShapeError(
                            explain(
                                f"{where}['state'][{path!r}][{key!r}]",
                                "a state tensor is shaped like its parameter",
                                expected=str(tuple(shape)),
                                got=str(tuple(v.shape)),
                                fix="load the state of the same model",
                            )
                        )
                    v = _row_major_copy(
                        self._distinct(v if v.sharding == layout else redistribute(v, layout))
                    )
                elif isinstance(v, torch.Tensor):
                    v = v.detach().clone()  # torch keeps a step counter as given, and counts in place
                converted[key] = v
            state[index] = converted
        self.optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})


def _row_major_copy(blocks: torch.Tensor) -> torch.Tensor:
    """A copy of ``blocks``, detached, in row-major memory order."""
    return blocks.detach().clone(memory_format=torch.contiguous_format)


#: the stock optimizers whose fused form (one kernel per tensor for the whole update) torch has
#: on the CPU and CUDA, for every option
_FUSED = ("Adam", "AdamW")


def _with_implementation(
    optimizer: type, options: dict[str, Any], tensors: list[torch.Tensor]
) -> dict[str, Any]:
    """``options`` with torch's quickest form of a stock ``torch.optim`` optimizer where it
    would choose its implementation itself (on the CPU, a Python loop of ops per tensor): its
    tensors are the blocks of every parameter, often small. Adam and AdamW over float32 or
    float64 blocks on the CPU or CUDA take ``fused=True`` (one kernel per block: about a
    quarter of the foreach form's time for a small model's 29 blocks; its values are the
    loop's to rounding, as torch's own fused form); every other stock optimizer takes
    ``foreach=True`` (one call of each op over all the blocks: the loop's values exactly)."""
    chosen = "foreach" in options or options.get("fused") or options.get("differentiable")
    if chosen or optimizer.__name__ not in ELEMENTWISE or not optimizer.__module__.startswith("torch.optim"):
        return options
    fused = (
        optimizer.__name__ in _FUSED
        and "fused" not in options
        and not options.get("capturable")
        and all(
            [t.dtype in (torch.float32, torch.float64) and t.device.type in ("cpu", "cuda") for t in tensors]
        )
    )
    return {**options, "fused": True} if fused else {**options, "foreach": True}
