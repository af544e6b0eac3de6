"""The leaves of a checkpoint's state (:mod:`functional_dtensor.checkpoint`): each leaf's
checkpoint key and pytree path, the checks of what a checkpoint can keep, and the check that a
``like`` names saved leaves (all of them or some), with their shapes and dtypes."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ._backend import is_transformed
from ._dtensor import DTensor, check_tensor, storage_of
from ._errors import CheckpointError, InputTypeError, explain
from ._shard_map import NAMESPACE

__all__ = ["Leaf", "leaves_of", "plain_tensor", "check_leaf", "check_like"]

#: the Python values a checkpoint keeps as leaves (besides tensors and fd.DTensor values)
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


class Leaf:
    """One leaf of a state: its DCP key, its pytree path as code, the value and its kind."""

    __slots__ = ("key", "where", "value", "kind")

    def __init__(self, key: str, where: str, value: Any) -> None:
        self.key, self.where, self.value = key, where, value
        if isinstance(value, DTensor):
            self.kind = "dtensor"
        elif isinstance(value, torch.Tensor):
            self.kind = "tensor"
        else:
            self.kind = "object"

    @property
    def shape(self) -> list[int] | None:
        return None if self.kind == "object" else list(self.value.shape)

    @property
    def dtype(self) -> str | None:
        return None if self.kind == "object" else str(self.value.dtype)


def leaves_of(state, root: str, api: str) -> tuple[list[Leaf], str]:
    """The leaves of ``state`` (named from ``root``, as ``state['params']['w']``) and its
    structure as text. Keys join the path with dots, as a module's state dict does."""
    accessors, values, spec = optree.tree_flatten_with_accessor(state, none_is_leaf=True, namespace=NAMESPACE)
    leaves, seen = [], {}
    for value, accessor in zip(values, accessors):
        where = accessor.codify(root)
        key = ".".join(str(getattr(entry, "entry", entry)) for entry in accessor) or "_"
        if key in seen:
            raise CheckpointError(
                explain(
                    f"{api}({where})",
                    f"two leaves have the same checkpoint key {key!r}",
                    expected="paths that stay distinct when joined with dots",
                    got=f"{seen[key]} and {where}",
                    fix="rename a key so that no path joined with dots equals another",
                )
            )
        seen[key] = where
        leaves.append(Leaf(key, where, value))
    return leaves, str(spec)


def plain_tensor(leaf: Leaf, api: str) -> torch.Tensor:
    """A tensor leaf, refused if it is a torch DTensor (not a value of this library)."""
    fix = (
        "make it an fd.DTensor with fd.from_torch(x), "
        "or checkpoint torch DTensors with torch.distributed.checkpoint itself"
    )
    return check_tensor(leaf.value, f"{api}({leaf.where})", torch_dtensor_fix=fix)


def check_leaf(leaf: Leaf, api: str) -> None:
    """Raise unless ``leaf`` can be saved: a value outside every transform, with memory."""
    value = leaf.value
    if leaf.kind == "object" and not isinstance(value, _SCALARS):
        raise InputTypeError(
            explain(
                f"{api}({leaf.where})",
                "a checkpoint keeps fd.DTensor values, tensors and Python scalars",
                expected="an fd.DTensor, a torch.Tensor, a number, a string, bytes or None",
                got=type(value).__name__,
                fix="convert it to one of those (a module's state: module.state_dict())",
            )
        )
    if leaf.kind == "object":
        return
    tensor = storage_of(value) if leaf.kind == "dtensor" else plain_tensor(leaf, api)
    if tensor.is_meta:
        raise InputTypeError(
            explain(
                f"{api}({leaf.where})",
                "a meta value has no data to save",
                expected="a value with memory",
                got=repr(value),
                fix="materialize it first (a factory without device='meta'), or leave it out",
            )
        )
    if is_transformed(tensor) or torch.compiler.is_compiling():
        raise InputTypeError(
            explain(
                f"{api}({leaf.where})",
                "a value inside a torch.func transform or torch.compile exists only while it runs",
                expected="a value outside every transform",
                got=repr(value),
                fix="save the values the transformed function returns, outside the transform",
            )
        )


def _mismatch(api: str, where: str, what: str, expected: str, got: str) -> CheckpointError:
    return CheckpointError(
        explain(
            f"{api}({where})",
            what,
            expected=expected,
            got=got,
            fix="pass a like with the structure, shapes and dtypes of the saved state "
            "(its layouts and meshes may differ)",
        )
    )


def check_like(saved: dict, structure: str, leaves: list[Leaf], like_structure: str, api: str) -> None:
    """Raise unless each of ``like``'s leaves is a saved one (at its pytree path, where
    ``structure`` records the saved state's), of its kind, shape and dtype. A ``like`` may name
    some of the saved leaves; one that names them all has the saved containers."""
    for leaf in leaves:
        if leaf.key not in saved:
            whole = [e for k, e in saved.items() if leaf.key.startswith(f"{k}.") and e["kind"] == "object"]
            if whole:  # torch's DCP keeps a list or tuple of Python values as one value
                raise CheckpointError(
                    explain(
                        f"{api}({leaf.where})",
                        f"the checkpoint holds {whole[0]['path']} whole, as one Python value",
                        expected="one leaf of like for it",
                        got=f"a leaf inside it, {leaf.where}",
                        fix="put one leaf (None, say) where the checkpoint has that value: it loads whole",
                    )
                )
            raise _mismatch(
                api,
                leaf.where,
                "the checkpoint has no such leaf",
                "one of the saved leaves " + ", ".join(e["path"] for e in saved.values()),
                f"{leaf.where}",
            )
        path = saved[leaf.key]["path"]  # from the root "state" (save's), like's from "like"
        if structure and path.removeprefix("state") != leaf.where.removeprefix("like"):
            raise _mismatch(
                api, leaf.where, "the checkpoint keeps this leaf at another path", path, leaf.where
            )
    if structure and len(leaves) == len(saved) and structure != like_structure:
        raise _mismatch(api, "like", "the containers differ", structure, like_structure)
    for leaf in leaves:
        entry = saved[leaf.key]
        is_tensor, saved_tensor = leaf.kind != "object", entry["kind"] != "object"
        if is_tensor != saved_tensor:
            raise _mismatch(
                api,
                leaf.where,
                "a tensor where the checkpoint has a Python value, or the reverse",
                "a tensor" if saved_tensor else "a Python value",
                "a tensor" if is_tensor else type(leaf.value).__name__,
            )
        if is_tensor and entry["shape"] != leaf.shape:
            raise _mismatch(
                api, leaf.where, "the shape differs", f"shape {tuple(entry['shape'])}", f"{tuple(leaf.shape)}"
            )
        if is_tensor and entry["dtype"] != leaf.dtype:
            raise _mismatch(api, leaf.where, "the dtype differs", entry["dtype"], leaf.dtype)
