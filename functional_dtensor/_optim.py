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

:func:`clip_grad_norm` scales gradients by their global norm (a reduction across shards: one
all-reduce over the mesh axes the gradients are split over, not one per parameter).

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

import math
import operator
import weakref
from typing import Any

import optree
import torch

from ._backend import backend_of
from ._cache import cached
from ._dtensor import DTensor, data_of, held_of, new_held, new_value, parts_of, storage_of, without_partial
from ._errors import InputTypeError, LayoutError, MeshError, ShapeError, explain
from ._layout import Layout
from ._placements import Partial, Replicate
from ._public import public
from ._redistribute import redistribute
from ._shard_map import NAMESPACE

__all__ = ["Optimizer", "clip_grad_norm", "ELEMENTWISE"]

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


def clip_grad_norm(grads, max_norm: float, norm_type: float = 2.0):
    """``(clipped, total_norm)``: ``grads`` (a pytree of ``fd.DTensor``) scaled so that their
    global ``norm_type``-norm is at most ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``),
    and that norm, a replicated scalar, both not differentiated (as torch's). Each device's
    shards are reduced by plain torch ops on the storage; the devices' parts are summed by one
    all-reduce over the mesh axes the gradients are split over."""
    where = "fd.clip_grad_norm"
    leaves, spec = optree.tree_flatten(grads, none_is_leaf=True, namespace=NAMESPACE)
    present = [g for g in leaves if g is not None]
    if any([type(g) is not DTensor for g in present]):
        paths = optree.tree_paths(grads, none_is_leaf=True, namespace=NAMESPACE)
    else:
        paths = ()
    for path, g in zip(paths, leaves):
        if g is not None and not isinstance(g, DTensor):
            raise InputTypeError(
                explain(
                    f"{where}(grads{''.join(f'[{p!r}]' for p in path)})",
                    "the gradients are fd.DTensor values",
                    expected="an fd.DTensor or None",
                    got=type(g).__name__,
                    fix="pass what torch.autograd.grad returned for fd.DTensor parameters",
                )
            )
    if not present:
        raise InputTypeError(
            explain(
                f"{where}(grads)",
                "there is no gradient to clip",
                expected="some fd.DTensor",
                got="none",
                fix="pass the gradients torch.autograd.grad returned for the parameters",
            )
        )
    mesh = present[0].device_mesh
    other = next((g for g in present if g.device_mesh is not mesh and g.device_mesh != mesh), None)
    if other is not None:
        raise MeshError(
            explain(
                f"{where}(grads)",
                "one global norm is summed over one mesh's devices",
                expected=f"every gradient on {mesh!r}",
                got=f"a gradient on {other.device_mesh!r}",
                fix="clip the gradients of each mesh apart, or redistribute them onto one mesh first",
            )
        )
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise InputTypeError(
            explain(
                f"{where}(norm_type)",
                "a p-norm",
                expected="p > 0 or math.inf",
                got=repr(norm_type),
                fix="use 2.0 (the default), 1.0 or math.inf",
            )
        )
    with torch.no_grad():  # as torch's (the gradients are the step's data, not differentiated)
        total = _total_norm(present, norm_type)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        backend = backend_of(total.device_mesh)
        one = backend.replica(storage_of(coef))  # the same on every device: one device's copy
        clipped = _scaled(leaves, one)
    return optree.tree_unflatten(spec, clipped), total


def _scaled(grads: list, coef: torch.Tensor) -> list:
    """Each of ``grads`` (or None) times the scalar ``coef``, held once where it is: one
    ``_foreach_mul`` per dtype, not a product per gradient."""
    out = list(grads)
    for dtype in {g.dtype for g in grads if g is not None}:
        indices = [i for i, g in enumerate(grads) if g is not None and g.dtype == dtype]
        data = [held_of(grads[i]) if held_of(grads[i]) is not None else storage_of(grads[i]) for i in indices]
        for i, product in zip(indices, torch._foreach_mul(data, coef.to(dtype))):
            g = grads[i]
            new = new_value if held_of(g) is None else new_held
            out[i] = new(product, g.sharding, g.shape)
    return out


def _total_norm(grads: list[DTensor], norm_type: float) -> DTensor:
    """The global ``norm_type``-norm of ``grads``, a replicated scalar: per gradient, the norm of
    each device's block by plain torch on the storage (of each distinct block, for a large
    gradient: a block replicated over an axis read once; small gradients split over the same
    axes side by side, one kernel for all of them); per set of mesh axes the gradients
    are split over, the norm of their blocks' norms on each device, to the power ``p`` (or their
    maximum), a Partial value over those axes; their sum (or maximum) all-reduced at once. As
    torch's ``clip_grad_norm_``, the norm of the norms. A Partial gradient is reduced first."""
    infinite = math.isinf(norm_type)
    mesh = grads[0].device_mesh
    backend = backend_of(mesh)
    lead = backend.block_dim(0)  # the storage's dims before a device's block
    norms: dict = {}  # the split axes -> the norms of their gradients' blocks, per device
    small: dict = {}  # (split axes, dtype) -> the blocks of small gradients, flat: one norm of all
    for g in grads:
        if g.sharding.has_partial:
            g = redistribute(g, without_partial(g.sharding))
        held = held_of(g)
        storage = storage_of(g) if held is None else held  # (held: one row per distinct block)
        split = _split_axes(g.sharding)
        if held is None and storage.numel() < _DISTINCT_FROM:  # every device's block, as it is
            flat = storage if storage.dim() == lead + 1 else storage.reshape(*storage.shape[:lead], -1)
            small.setdefault((split, storage.dtype), []).append(flat)
            continue
        if held is not None:
            blocks = backend.distinct_held(held, g.sharding)
        else:
            blocks = backend.distinct(storage, g.sharding)
        flat = blocks.reshape(*blocks.shape[: blocks.dim() - (storage.dim() - lead)], -1)
        norms.setdefault(split, []).append(backend.from_distinct(_row_norms(flat, norm_type), mesh))
    for (split, _), flats in small.items():  # (one kernel for them all: the norm of their norms)
        flat = flats[0] if len(flats) == 1 else torch.cat(flats, -1)
        norms.setdefault(split, []).append(_row_norms(flat, norm_type))
    # the parts of every set of split axes as parts over all of them (a part replicated over an
    # axis is Partial there too: held by the devices at its coordinate 0, or the same on each
    # for a maximum), combined on each device: one all-reduce for the whole norm; the norm of
    # gradients replicated everywhere joins after it (a replicated value meeting a Partial one
    # would be made Partial first)
    union = tuple([name for name in mesh.axis_names if any([name in split for split in norms])])
    replicated = (Replicate(),) * mesh.ndim
    combine = torch.maximum if infinite else operator.add
    total = None
    for split in sorted(norms, key=lambda split: not split):  # the replicated ones last
        stacked = torch.stack(norms[split])
        part = stacked.amax(0) if infinite else torch.linalg.vector_norm(stacked, norm_type, 0) ** norm_type
        value = new_value(part, _summed_over(mesh, split, infinite), torch.Size(()))
        if not split:
            total = value if total is None else combine(redistribute(total, replicated), value)
            continue
        if split != union:
            value = redistribute(value, _summed_over(mesh, union, infinite))
        total = value if total is None else combine(total, value)
    total = redistribute(total, replicated)
    return total if infinite else total ** (1.0 / norm_type)


def _row_norms(flat: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of each row of ``flat`` (along its last dim), in float32 or
    float64 (one pass, no ``|g|**p`` tensor)."""
    dtype = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
    if flat.shape[-1] == 0:  # empty shards
        return flat.new_zeros(flat.shape[:-1], dtype=dtype)
    if math.isinf(norm_type):
        return flat.abs().amax(-1).to(dtype)
    return torch.linalg.vector_norm(flat, norm_type, dim=-1, dtype=dtype)


@cached(1024)
def _summed_over(mesh, split: tuple[str, ...], infinite: bool) -> Layout:
    """The layout of the devices' parts of a norm over values split along the axes ``split``:
    Partial there (their maximum, for the infinity norm), Replicate elsewhere."""
    reduce = Partial("max" if infinite else "sum")
    return Layout(mesh, tuple([reduce if n in split else Replicate() for n in mesh.axis_names]))


@cached(1024)
def _split_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes ``layout`` splits a value over (its Shard axes)."""
    return tuple([name for name, p in zip(layout.mesh.axis_names, layout.placements) if p.is_shard()])


#: the elements (every device's) from which a gradient's norm reads its distinct blocks alone;
#: below, reading the replicas too costs less than the ops that leave them out
_DISTINCT_FROM = 1 << 16
