"""A sweep of torch's OpInfo database (``op_db``) on global values, the way torch's
``test/distributed/tensor/test_dtensor_ops.py`` sweeps its DTensor: every sample of an op, its
tensors distributed on a simulated mesh, the op called on the distributed values, the result
gathered and compared with the op on the plain tensors (values, and gradients where the op
supports autograd). Used by ``tests/test_opinfo.py`` and ``bench/opinfo_sweep.py``.

Each op is run float32 on CPU, up to ``samples`` of its sample inputs, under each of
:data:`LAYOUTS` (every tensor of the sample - input, args, kwargs, pytrees of them - gets the
layout's placements for its number of dims). Sample sizes are op_db's own, so most shards are
uneven (``torch.chunk`` semantics). A sample is skipped where it holds no tensor or the plain
call fails on it; in-place variants are skipped. An op's status is the worst of its cases:

* ``"ok"``: every output (and every input's gradient) equals plain torch's - within float32's
  tolerance of plain torch's float32 result, or within :data:`common.ERROR_FACTOR` times plain
  torch's own float32 error of a float64 reference (``common.assert_close``);
* ``"refused"``: the library raised one of its own errors (``fd.FunctionalDTensorError``; for
  torch's DTensor: its "no sharding strategy" and "mixed torch.Tensor and DTensor" errors);
* ``"raw error"``: any other exception (an AttributeError or RuntimeError from inside torch),
  or an output of another structure than plain torch's;
* ``"wrong"``: a value, dtype, shape or gradient differs from plain torch's - never acceptable;
* ``"random"``: the op draws random numbers (``torch.Tag.nondeterministic_seeded`` on its aten
  overloads, a name like rand/dropout/bernoulli, or plain torch's result changes with the
  seed): not compared, as the values depend on the generator;
* ``"skipped"``: no sample could run (factories without tensor inputs, in-place variants).

The same cases run on torch's own DTensor (:class:`TorchDTensor`) in-process, on torch's
simulation: ``LocalTensor`` shards under ``LocalTensorMode`` over a ``"fake"`` process group,
as torch's ``LocalDTensorOpTestBase`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from common import assert_close, in_float64

import functional_dtensor as fd

__all__ = [
    "ALL_STATUSES",
    "FAMILIES",
    "LAYOUTS",
    "STATUSES",
    "FdDTensor",
    "OpResult",
    "TorchDTensor",
    "family",
    "find_ops",
    "is_random",
    "op_db",
    "op_id",
    "sweep_op",
]

#: statuses from the best to the worst (an op's status is the worst of its cases)
STATUSES = ("ok", "refused", "raw error", "wrong")
#: every status an op can have
ALL_STATUSES = (*STATUSES, "random", "skipped")
FAMILIES = (
    "elementwise",
    "reduction",
    "view/shape",
    "linalg",
    "nn.functional",
    "masked",
    "fft",
    "special",
    "other",
)

#: the layouts every sample runs under: (name, mesh key, placements for a tensor of ``ndim`` dims)
LAYOUTS: tuple[tuple[str, str, Callable[[int], tuple]], ...] = (
    ("x4 S(0)", "x4", lambda ndim: ("S0",) if ndim else ("R",)),
    ("x4 R", "x4", lambda ndim: ("R",)),
    ("2x2 S(0)S(1)", "2x2", lambda ndim: ("S0", "S1") if ndim >= 2 else ("S0", "R") if ndim else ("R", "R")),
)

_RANDOM_NAME = re.compile(
    r"(^|[._])(rand\w*|\w*dropout\w*|bernoulli|multinomial|normal|uniform|cauchy|exponential|"
    r"geometric|log_normal|rrelu|\w*lowrank)($|[._])"
)
#: ops whose outputs hold uninitialized memory: only their shapes and dtypes compare
_UNINITIALIZED = re.compile(r"empty")
_VIEW_NAMES = {
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "column_stack",
    "row_stack", "repeat", "tile", "roll", "flip", "fliplr", "flipud", "rot90", "chunk", "split",
    "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit", "unbind", "narrow",
    "narrow_copy", "flatten", "unflatten", "ravel", "reshape", "reshape_as", "view", "view_as",
    "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to", "broadcast_tensors", "expand",
    "expand_as", "squeeze", "unsqueeze", "movedim", "moveaxis", "swapaxes", "swapdims", "permute",
    "transpose", "t", "T", "H", "mT", "mH", "contiguous", "clone", "block_diag", "diag_embed",
    "diagonal", "diag", "tril", "triu", "index_select", "gather", "take", "take_along_dim",
    "__getitem__", "select", "unfold", "as_strided", "meshgrid", "pad", "constant_pad_nd",
}  # fmt: skip
_LINALG_NAMES = {
    "mm", "bmm", "matmul", "__rmatmul__", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv",
    "dot", "vdot", "inner", "outer", "ger", "einsum", "tensordot", "kron", "chain_matmul",
    "cholesky", "cholesky_inverse", "cholesky_solve", "lu", "lu_solve", "lu_unpack", "qr", "svd",
    "pinverse", "inverse", "det", "logdet", "slogdet", "matrix_exp", "trace", "geqrf", "ormqr",
    "triangular_solve", "cdist", "cross", "linalg_vecdot",
}  # fmt: skip


def op_db() -> list:
    """torch's OpInfo database (imported on first use: the import takes seconds). Importing it
    registers torch's own hypothesis profiles (one named "dev", as ours) and loads one (10 random
    examples): the profiles and the one loaded before are put back, so that the tests after it
    run as they did (hypothesis keeps both in class attributes, pinned with hypothesis)."""
    import hypothesis

    loaded, profiles = hypothesis.settings._current_profile, dict(hypothesis.settings._profiles)
    from torch.testing._internal.common_methods_invocations import op_db as db

    hypothesis.settings._profiles.clear()
    hypothesis.settings._profiles.update(profiles)
    if loaded is not None:
        hypothesis.settings.load_profile(loaded)
    return db


def op_id(op) -> str:
    """``name`` or ``name.variant``: the op's name in tables, JSON and test ids."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def find_ops(ids) -> list:
    """The OpInfos of ``ids`` (:func:`op_id` names, or a bare name for all its variants)."""
    ids = list(ids)
    found = [op for op in op_db() if op_id(op) in ids or op.name in ids]
    missing = set(ids) - {op_id(op) for op in found} - {op.name for op in found}
    if missing:
        raise KeyError(f"no OpInfo named {sorted(missing)} in op_db")
    return found


def _aten_tags(op) -> set:
    packet = getattr(torch.ops.aten, op.aten_name, None) if op.aten_name else None
    if packet is None:
        return set()
    return {tag for name in packet.overloads() for tag in getattr(packet, name).tags}


def _aten_returns_alias(op) -> bool:
    packet = getattr(torch.ops.aten, op.aten_name, None) if op.aten_name else None
    if packet is None:
        return False
    for name in packet.overloads():
        returns = getattr(packet, name)._schema.returns
        if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
            return True
    return False


def is_random(op) -> bool:
    """The op draws random numbers, by its aten overloads' tags or its name."""
    return torch.Tag.nondeterministic_seeded in _aten_tags(op) or bool(_RANDOM_NAME.search(op.name))


def family(op) -> str:
    """The op's family: by its name's namespace, then OpInfo type, then aten tags."""
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, ReductionOpInfo, UnaryUfuncInfo

    for prefix in ("nn.functional", "masked", "fft", "special", "linalg"):
        if op.name.startswith(prefix + "."):
            return prefix
    if isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo)):
        return "elementwise"
    if isinstance(op, ReductionOpInfo) or "reduction" in op.variant_test_name:
        return "reduction"
    if op.name in _LINALG_NAMES:
        return "linalg"
    if torch.Tag.pointwise in _aten_tags(op):
        return "elementwise"
    base = op.name.removesuffix("_copy")
    if base in _VIEW_NAMES or op.name in _VIEW_NAMES or _aten_returns_alias(op):
        return "view/shape"
    return "other"


def is_inplace(op) -> bool:
    return (op.name.endswith("_") and not op.name.startswith("__")) or op.variant_test_name == "in_place"


# --- the two implementations under test ----------------------------------------------------------


class FdDTensor:
    """``fd.DTensor`` on simulated meshes; the leaf given to ``fd.distribute_tensor`` gets the
    gradient."""

    name = "fd"

    def __init__(self, meshes: dict | None = None):
        """``meshes``: the mesh of 4 (``"x4"``) and the 2 x 2 one (``"2x2"``); simulated by
        default (a gloo job passes its own)."""
        self.meshes = meshes or {
            "x4": fd.simulated_mesh(4, "x"),
            "2x2": fd.simulated_mesh((2, 2), ("a", "b")),
        }

    def context(self):
        return contextlib.nullcontext()

    def distribute(self, tensor: torch.Tensor, mesh: str, placements: tuple, grad: bool):
        """``placements``: ``"R"``, ``"S<dim>"`` or ``"P<op>"`` (a Partial of that reduce op) per
        mesh axis."""
        leaf = tensor.detach().clone().requires_grad_(grad)
        kinds = [
            fd.Replicate() if p == "R" else fd.Shard(int(p[1:])) if p[0] == "S" else fd.Partial(p[1:])
            for p in placements
        ]
        return leaf, fd.distribute_tensor(leaf, self.meshes[mesh], kinds)

    def is_value(self, x) -> bool:
        return isinstance(x, fd.DTensor)

    def gather(self, x):
        return x.full_tensor() if isinstance(x, fd.DTensor) else x

    def plain(self, x, any_rank: bool = False):
        return x

    def grad(self, leaf):
        return leaf.grad

    def refused(self, error: BaseException) -> bool:
        return isinstance(error, fd.FunctionalDTensorError)


class TorchDTensor:
    """torch's DTensor in-process: ``LocalTensor`` shards under ``LocalTensorMode`` over a
    ``"fake"`` process group of 4 (as torch's ``LocalDTensorOpTestBase``). The DTensor made by
    ``distribute_tensor`` is the leaf (torch's ``distribute_tensor`` detaches its input)."""

    name = "torch DTensor"

    def __init__(self):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
        self.meshes = {
            "x4": init_device_mesh("cpu", (4,), mesh_dim_names=("x",)),
            "2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")),
        }

    def context(self):
        from torch.distributed._local_tensor import LocalTensorMode

        return LocalTensorMode(frozenset(range(4)))

    def distribute(self, tensor: torch.Tensor, mesh: str, placements: tuple, grad: bool):
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        kinds = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
        value = distribute_tensor(tensor.detach().clone(), self.meshes[mesh], [kinds[p] for p in placements])
        return value, value.requires_grad_(grad)

    def is_value(self, x) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(x, DTensor)

    def gather(self, x):
        return x.full_tensor() if self.is_value(x) else x

    def plain(self, x, any_rank: bool = False):
        """A plain tensor from a ``LocalTensor``: the ranks' common value (or any rank's, for
        uninitialized memory); :class:`_Wrong` where ranks disagree."""
        from torch.distributed._local_tensor import LocalTensor

        if not isinstance(x, LocalTensor):
            return x
        first, *others = (t.detach() for t in x._local_tensors.values())
        if not any_rank and any(_differs(first, other) for other in others):
            raise _Wrong("the ranks' copies of a replicated result differ")
        return first.clone().requires_grad_(x.requires_grad)

    def grad(self, leaf):
        return None if leaf.grad is None else self.gather(leaf.grad)

    def refused(self, error: BaseException) -> bool:
        text = str(error)
        return "sharding strategy" in text or "mixed torch.Tensor and DTensor" in text


# --- one op ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class OpResult:
    """An op's status on one implementation, the first message of that status and where."""

    op: str
    family: str
    status: str
    message: str = ""
    where: str = ""
    cases: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Wrong(Exception):
    """A value differs from plain torch's."""


class _Structure(Exception):
    """An output has another structure than plain torch's."""


class _Timeout(Exception):
    pass


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0].strip() if lines else ''}"[:300]


def _mismatch(error: AssertionError) -> str:
    """assert_close's verdict and its greatest difference, on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(line for line in lines if not line.startswith(("Expected", "Actual")))[:300]


def _library_frame(error: BaseException) -> str:
    """The deepest ``functional_dtensor`` frame of the traceback (``_file.py:line``), if any."""
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if "functional_dtensor" in frame.filename.replace("\\", "/").split("/tests/")[0]:
            found = f"{frame.filename.rsplit('functional_dtensor/', 1)[-1]}:{frame.lineno}"
    return found


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _call(op, args, kwargs):
    return op.op(*args, **kwargs)


def _sample_tree(sample):
    return ([sample.input, *sample.args], dict(sample.kwargs))


def _loss_leaves(sample, outputs) -> list[int]:
    """Indices of the processed outputs' leaves a gradient flows from (float, requiring grad)."""
    leaves = optree.tree_leaves(sample.output_process_fn_grad(outputs))
    return [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and x.requires_grad and (x.is_floating_point() or x.is_complex())
    ]


def _loss(sample, outputs, chosen: list[int]):
    leaves = optree.tree_leaves(sample.output_process_fn_grad(outputs))
    terms = [leaves[i].sum() for i in chosen if i < len(leaves) and isinstance(leaves[i], torch.Tensor)]
    terms = [t.real if t.is_complex() else t for t in terms if t.requires_grad]
    return sum(terms[1:], terms[0]) if terms else None


def _reference(op, sample, grad: bool, wide: bool = False):
    """Plain torch on the sample (in float64 if ``wide``): (outputs, grads of its float leaves,
    the loss's output leaves) with ``grads`` None where the op has no gradient here."""
    tree = _sample_tree(sample)
    tree = optree.tree_map(
        lambda x: (
            x.detach().clone().requires_grad_(x.requires_grad and grad) if isinstance(x, torch.Tensor) else x
        ),
        in_float64(tree) if wide else tree,
    )
    args, kwargs = tree
    outputs = _call(op, args, kwargs)
    grads, chosen = None, []
    if grad:
        leaves = [x for x in _tensors(tree) if x.requires_grad]
        chosen = _loss_leaves(sample, outputs)
        loss = _loss(sample, outputs, chosen)
        if leaves and loss is not None:
            try:
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
            except RuntimeError:
                grads, chosen = None, []
    detached = optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, outputs)
    return detached, grads, chosen


def _as_comparable(x):
    if isinstance(x, (bool, int, float, complex)):
        return torch.as_tensor(x)
    if isinstance(x, torch.Tensor) and x.layout != torch.strided:
        return x.to_dense()
    return x


def _compare(what: str, got, want, want_wide, uninitialized: bool) -> None:
    """Raise :class:`_Wrong` or :class:`_Structure` where ``got`` differs from ``want``."""
    got_leaves, got_tree = optree.tree_flatten(got, none_is_leaf=True)
    want_leaves, want_tree = optree.tree_flatten(want, none_is_leaf=True)
    if got_tree != want_tree:
        if len(got_leaves) != len(want_leaves):
            raise _Structure(f"{what}: got {got_tree}, plain torch gives {want_tree}")
        raise _Structure(f"{what}: a {type(got).__name__}, plain torch gives a {type(want).__name__}")
    wide_leaves = None
    if want_wide is not None:
        wide_leaves, wide_tree = optree.tree_flatten(want_wide, none_is_leaf=True)
        if wide_tree != want_tree:
            wide_leaves = None
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = _as_comparable(g), _as_comparable(w)
        where = f"{what}[{i}]" if len(want_leaves) > 1 else what
        if not isinstance(w, torch.Tensor):
            if g != w:
                raise _Wrong(f"{where}: got {g!r}, want {w!r}")
            continue
        if not isinstance(g, torch.Tensor):
            raise _Structure(f"{where}: a {type(g).__name__}, plain torch gives a tensor")
        if g.shape != w.shape or g.dtype != w.dtype:
            raise _Wrong(f"{where}: got {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}")
        if uninitialized:
            continue
        try:
            assert_close(g.detach(), w)
        except AssertionError as error:
            wide = None if wide_leaves is None else _as_comparable(wide_leaves[i])
            if not isinstance(wide, torch.Tensor):
                raise _Wrong(f"{where}: {_mismatch(error)}") from None
            try:
                assert_close(g.detach(), wide, w)
            except AssertionError:
                raise _Wrong(f"{where}: {_mismatch(error)}") from None


def _run_case(side, op, sample, layout, want, want_wide, grad: bool, uninitialized: bool) -> None:
    """One sample under one layout on ``side``: raises where it differs from plain torch."""
    _, mesh, placements_for = layout
    want_out, want_grads, chosen = want
    wide_out, wide_grads = want_wide if want_wide is not None else (None, None)
    pairs = []

    def distribute(x):
        if not isinstance(x, torch.Tensor):
            return x
        needs = grad and want_grads is not None and x.requires_grad
        leaf, value = side.distribute(x, mesh, placements_for(x.dim()), needs)
        if needs:
            pairs.append(leaf)
        return value

    with side.context():
        args, kwargs = optree.tree_map(distribute, _sample_tree(sample))
        outputs = _call(op, args, kwargs)
        full = optree.tree_map(side.gather, outputs, is_leaf=side.is_value, none_is_leaf=True)
        grads = None
        if grad and want_grads is not None:
            loss = _loss(sample, full, chosen)
            if loss is not None:
                loss.backward()
            grads = [side.grad(leaf) for leaf in pairs]
    got = optree.tree_map(lambda x: side.plain(x, any_rank=uninitialized), full, none_is_leaf=True)
    _compare("output", got, want_out, wide_out, uninitialized)
    if grads is not None:
        if len(grads) != len(want_grads):
            raise _Structure(f"gradient: {len(grads)} leaves get one, plain torch gives {len(want_grads)}")
        got_grads = [torch.zeros_like(w) if g is None else side.plain(g) for g, w in zip(grads, want_grads)]
        _compare("gradient", got_grads, want_grads, wide_grads, False)


def _differs(a, b) -> bool:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    if len(la) != len(lb):
        return True
    for x, y in zip(la, lb):
        x, y = _as_comparable(x), _as_comparable(y)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            try:
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
            except AssertionError:
                return True
        elif not isinstance(x, torch.Tensor) and x != y:
            return True
    return False


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise :class:`_Timeout` after ``seconds`` (SIGALRM: the main thread only)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _Timeout(f"over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _usable_samples(op, samples: int, grad: bool) -> Iterator:
    """Up to ``samples`` of the op's float32 CPU samples that hold a tensor."""
    torch.manual_seed(0)
    found = 0
    for sample in itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=grad), 8 * samples):
        if found >= samples:
            return
        if not _tensors(_sample_tree(sample)):
            continue
        found += 1
        yield sample


def sweep_op(op, sides, *, samples: int = 4, grad: bool | None = None, timeout: float | None = None) -> dict:
    """Run ``op`` on each of ``sides`` (:class:`FdDTensor`, :class:`TorchDTensor`): ``{side.name:
    OpResult}``. ``grad`` (default: ``op.supports_autograd``) compares gradients too."""
    name, fam = op_id(op), family(op)
    if is_inplace(op):
        return {s.name: OpResult(name, fam, "skipped", "an in-place variant") for s in sides}
    if is_random(op):
        return {s.name: OpResult(name, fam, "random", "draws random numbers") for s in sides}
    grad = op.supports_autograd if grad is None else grad
    uninitialized = bool(_UNINITIALIZED.search(op.name))
    worst = {s.name: OpResult(name, fam, "skipped", "no sample ran") for s in sides}
    drawn = 0  # samples that draw random numbers
    start = {s.name: 0.0 for s in sides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with _time_limit(timeout):
                sample_list = list(_usable_samples(op, samples, grad))
        except Exception as error:  # noqa: BLE001  (an op whose samples fail is skipped)
            return {s.name: OpResult(name, fam, "skipped", f"samples: {_first_line(error)}") for s in sides}
        for k, sample in enumerate(sample_list):
            answers = _references(op, sample, grad, uninitialized)
            if answers is None or answers == "random":  # the plain call fails, or it draws
                drawn += answers == "random"
                continue
            want, want_wide = answers
            for layout in LAYOUTS:
                for side in sides:
                    result = worst[side.name]
                    t0 = time.perf_counter()
                    status, message = "ok", ""
                    try:
                        with _time_limit(timeout):
                            torch.manual_seed(1)
                            _run_case(side, op, sample, layout, want, want_wide, grad, uninitialized)
                    except _Wrong as error:
                        status, message = "wrong", str(error)
                    except _Structure as error:
                        status, message = "raw error", f"output structure: {error}"
                    except _Timeout as error:
                        status, message = "raw error", f"timeout: {error}"
                    except Exception as error:  # noqa: BLE001  (classified, not raised)
                        status = "refused" if side.refused(error) else "raw error"
                        message = _first_line(error)
                        frame = _library_frame(error)
                        if frame and status == "raw error":
                            message = f"{message} [at {frame}]"
                    start[side.name] += time.perf_counter() - t0
                    result.cases += 1
                    rank = STATUSES.index(status)
                    if result.status == "skipped" or rank > STATUSES.index(result.status):
                        result.status, result.message = status, message
                        result.where = f"sample {k} {_describe(sample)}, {layout[0]}" if rank else ""
    for side in sides:
        worst[side.name].seconds = start[side.name]
        if worst[side.name].status == "skipped" and drawn:
            worst[side.name] = OpResult(name, fam, "random", "results change with the seed")
    return worst


def _describe(sample) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"T{list(x.shape)}" if x.is_floating_point() else f"T{list(x.shape)}:{str(x.dtype)[6:]}"
        return repr(x) if not isinstance(x, (list, tuple)) or len(x) < 6 else f"[{len(x)} items]"

    parts = [
        one(sample.input)
        if not isinstance(sample.input, (list, tuple))
        else "[" + ", ".join(one(t) for t in sample.input) + "]"
    ]
    parts += [one(a) for a in sample.args]
    parts += [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    text = f"({', '.join(parts)})"
    return text if len(text) < 160 else text[:157] + "..."


def _references(op, sample, grad: bool, uninitialized: bool):
    """Plain torch's answers to ``sample`` (see :func:`_reference`), in its dtype and in float64
    (None where there is no float64 one): None where the plain call fails, ``"random"`` where
    its results change with the seed (it draws random numbers)."""
    try:
        torch.manual_seed(1)
        want = _reference(op, sample, grad)
    except Exception:  # noqa: BLE001  (the plain call fails on this sample)
        return None
    if not uninitialized:
        torch.manual_seed(2)
        try:
            again = _reference(op, sample, False)[0]
        except Exception:  # noqa: BLE001
            again = want[0]
        try:
            if _differs(want[0], again):
                return "random"
        except Exception:  # noqa: BLE001  (outputs that do not compare: not random)
            pass
    try:
        wide = _reference(op, sample, grad, wide=True)
        return want, (wide[0], wide[1])
    except Exception:  # noqa: BLE001  (no float64 reference: plain float32 only)
        return want, None


def check_case(side, op, sample, mesh: str, placements_for: Callable[[int], tuple]) -> None:
    """``op`` on one ``sample``, each tensor of ``ndim`` dims laid out by ``placements_for(ndim)``
    on the side's mesh ``mesh``: raises ``AssertionError`` where the outputs or the gradients
    differ from plain torch's (any other error of the op is raised as it is); a sample whose
    plain call fails is skipped."""
    grad, uninitialized = op.supports_autograd, bool(_UNINITIALIZED.search(op.name))
    answers = _references(op, sample, grad, uninitialized)
    if answers is None or answers == "random":
        return
    want, want_wide = answers
    torch.manual_seed(1)
    layout = ("drawn", mesh, placements_for)
    try:
        _run_case(side, op, sample, layout, want, want_wide, grad, uninitialized)
    except (_Wrong, _Structure) as error:
        raise AssertionError(f"{op_id(op)} {_describe(sample)}: {error}") from None


def samples_of(op, count: int) -> list:
    """Up to ``count`` of the op's float32 CPU samples that hold a tensor (as the sweep takes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(_usable_samples(op, count, op.supports_autograd))
