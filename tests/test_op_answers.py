"""Answers of global ops that once were silently wrong (or raw torch errors), against torch on
one device, on both backends: dims out of range, ``max``/``min`` along a dim of a value sharded
on another, every ``p`` of the norms, ``embedding``'s ``max_norm``, and views, losses and
lookups of uneven shards (a rank holding a short or an empty block).

Each test runs a table of calls (``name -> call``, each taking a value: a plain tensor or an
fd.DTensor) in one job per backend and mesh (one call of the gloo pool), and compares every
answer with the same call on the global tensor: equal values, or the library's error where
torch refuses the call.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from common import assert_close

import functional_dtensor as fd

INF = math.inf


def values(shape, seed=0, scale=1.0):
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def answer(call, *args):
    """What ``call(*args)`` gives: a tuple of global tensors, or ``("refused", error type)``;
    a raw torch error from an fd.DTensor call is ``("raw", message)``."""
    try:
        out = call(*args)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return tuple(o.full_tensor() if isinstance(o, fd.DTensor) else o for o in outs)
    except fd.FunctionalDTensorError as error:
        return ("refused", type(error).__name__)
    except Exception as error:  # a plain tensor's refusal, or a raw error of the library
        on_dtensor = any(isinstance(a, fd.DTensor) for a in args)
        return (
            ("raw", f"{type(error).__name__}: {error}") if on_dtensor else ("refused", type(error).__name__)
        )


def compare(got: dict, want: dict, where: str) -> None:
    """Every case's answer equals the reference's: the same tensors, or a refusal for one."""
    failures = []
    for name, expected in want.items():
        result = got[name]
        if expected[:1] == ("refused",):
            if result[:1] != ("refused",):
                failures.append(f"{name}: torch refuses it, fd answered")
            continue
        if result[:1] in (("refused",), ("raw",)):
            failures.append(f"{name}: {str(result)[:160]}")
            continue
        try:
            assert_close(tuple(result), tuple(expected))
        except AssertionError as error:
            failures.append(f"{name}: {str(error).splitlines()[0]}")
    assert not failures, f"{where}:\n" + "\n".join(failures)


def job_cases(mesh, table: str):
    """Every case of ``TABLES[table]`` on this mesh: ``name -> answer``."""
    out = {}
    for name, (shape, spec_of, call) in TABLES[table]().items():
        spec = spec_of(mesh.axis_names)
        x = fd.distribute_tensor(values(shape, 1), mesh, spec)
        out[name] = answer(call, x)
    return out


def expected_answers(table: str) -> dict:
    return {name: answer(call, values(shape, 1)) for name, (shape, _, call) in TABLES[table]().items()}


def check_table(backend, mesh, table: str) -> None:
    want = expected_answers(table)
    for rank, got in enumerate(backend.run(job_cases, mesh.shape, mesh.names, table)):
        compare(got, want, f"{backend.name} {mesh} rank {rank}")


def _rows(names):
    return fd.P(names)  # the first dim over every axis


def _cols(names):
    return fd.P(None, names)


def _last(names):
    return fd.P(None, None, names)


def _mixed(names):  # dims 0 and 2 on a 2-d mesh; the middle dim on a 1-d one
    return fd.P(names[0], None, names[-1]) if len(names) > 1 else fd.P(None, names)


def _whole(names):
    return fd.P()


# --- 1. dims out of range ----------------------------------------------------------------------


def dim_cases() -> dict:
    calls = {
        "F.softmax": lambda v, d: F.softmax(v, dim=d),
        "torch.softmax": lambda v, d: torch.softmax(v, d),
        "Tensor.softmax": lambda v, d: v.softmax(d),
        "F.log_softmax": lambda v, d: F.log_softmax(v, d),
        "cumsum": lambda v, d: torch.cumsum(v, d),
        "cumprod": lambda v, d: torch.cumprod(v, d),
        "logcumsumexp": lambda v, d: torch.logcumsumexp(v, d),
        "max": lambda v, d: torch.max(v, d),
        "amax": lambda v, d: torch.amax(v, d),
        "sum": lambda v, d: torch.sum(v, d),
        "transpose": lambda v, d: torch.transpose(v, 0, d),
        "gather": lambda v, d: torch.gather(v, d, torch.zeros_like(v, dtype=torch.long)),
        "cat": lambda v, d: torch.cat([v, v], d),
    }
    cases = {}
    for name, call in calls.items():
        for dim in (2, -3, 5, 1, -2):
            cases[f"{name} dim={dim}"] = ((8, 6), _rows, lambda v, call=call, dim=dim: call(v, dim))
    cases["0-d softmax dim=1"] = ((), _whole, lambda v: F.softmax(v, 1))
    cases["0-d softmax dim=-1"] = ((), _whole, lambda v: F.softmax(v, -1))
    return cases


@pytest.mark.meshes((4,))
def test_dims_out_of_range_are_refused(backend, mesh):
    """``F.softmax(x, dim=2)`` of a 2-d value once ran over dim 0 (``dim=-3`` over dim 1)."""
    check_table(backend, mesh, "dims")


# --- 2. max and min along a dim of a value sharded on another ----------------------------------


def along_cases() -> dict:
    calls = {
        "x.max(0)": lambda v: v.max(0),
        "x.min(0)": lambda v: v.min(0),
        "torch.max(x, 1)": lambda v: torch.max(v, 1),
        "torch.min(x, 1, keepdim)": lambda v: torch.min(v, 1, keepdim=True),
        "x.max(-1)": lambda v: v.max(-1),
        "x.max(dim=0, keepdim)": lambda v: v.max(dim=0, keepdim=True),
        "amax(0)": lambda v: torch.amax(v, 0),
        "amin(1, keepdim)": lambda v: torch.amin(v, 1, keepdim=True),
        "argmax(0)": lambda v: torch.argmax(v, 0),
        "argmin(1, keepdim)": lambda v: torch.argmin(v, 1, keepdim=True),
        "x.argmax()": lambda v: v.argmax(),
        "sort(0)": lambda v: torch.sort(v, 0),
        "x.sort(dim=1, descending)": lambda v: v.sort(dim=1, descending=True),
    }
    cases = {}
    for shape, specs in (((12, 8, 8), (_cols, _last, _mixed, _rows)), ((12, 8), (_cols, _rows))):
        for spec in specs:
            for name, call in calls.items():
                cases[f"{name} {shape} {spec.__name__}"] = (shape, spec, call)
    return cases


@pytest.mark.meshes((4,), (2, 2))
def test_max_and_min_along_a_dim_of_a_value_sharded_on_another(backend, mesh):
    """``x.max(0)[0]`` of ``randn(12, 8, 8)`` as ``Shard(1)`` was wrong in 48 of 64 elements
    (the output laid out ``Shard(1)``, as if the dim were kept); 2-d inputs and the (2, 2)
    mesh raised raw torch errors."""
    check_table(backend, mesh, "along")


def test_ops_along_a_dim_keep_another_dim_sharded_without_communication():
    """``max``/``min``/``argmax``/``argmin``/``sort`` along a whole dim run by their rule: the
    dim sharded stays sharded (moved down where the reduced dim goes), nothing is gathered."""
    mesh = fd.simulated_mesh((4,), ("x",))
    x = fd.distribute_tensor(values((12, 8, 8), 1), mesh, fd.P(None, "x"))
    with fd.CommDebugMode() as comm:
        outs = {
            "max(0)": (x.max(0).values, fd.Shard(0)),
            "min(0, keepdim)": (torch.min(x, 0, keepdim=True).indices, fd.Shard(1)),
            "argmax(2)": (torch.argmax(x, 2), fd.Shard(1)),
            "argmin(0)": (torch.argmin(x, 0), fd.Shard(0)),
            "sort(2)": (torch.sort(x, 2).values, fd.Shard(1)),
        }
    assert not comm.events, comm.events
    for name, (value, placement) in outs.items():
        assert value.placements == (placement,), name


# --- 3. every p of the norms -------------------------------------------------------------------

ORDS = (0, 1, 2, INF, -INF, 0.5, -1, 3)
MATRIX_ORDS = ("fro", "nuc", 1, -1, 2, -2, INF, -INF)


def norm_cases() -> dict:
    calls = {}
    for p in (*ORDS, "fro", "nuc"):
        calls[f"torch.norm(x, {p})"] = lambda v, p=p: torch.norm(v, p)
        calls[f"x.norm({p}, dim=1)"] = lambda v, p=p: v.norm(p, dim=1)
        calls[f"torch.norm(x, {p}, (0, 1), keepdim)"] = lambda v, p=p: torch.norm(v, p, (0, 1), True)
    for p in ORDS:
        calls[f"vector_norm(x, {p})"] = lambda v, p=p: torch.linalg.vector_norm(v, p)
        calls[f"vector_norm(x, {p}, -1, keepdim)"] = lambda v, p=p: torch.linalg.vector_norm(v, p, -1, True)
        calls[f"linalg.norm(x, {p}, dim=0)"] = lambda v, p=p: torch.linalg.norm(v, p, dim=0)
    for p in (None, *MATRIX_ORDS):
        calls[f"linalg.norm(x, {p})"] = lambda v, p=p: torch.linalg.norm(v, p)
        calls[f"matrix_norm(x, {p or 'fro'}, keepdim)"] = lambda v, p=p: torch.linalg.matrix_norm(
            v, p or "fro", keepdim=True
        )
    calls["matrix_norm(x, 'nuc', dim=(1, 0))"] = lambda v: torch.linalg.matrix_norm(v, "nuc", dim=(1, 0))
    calls["linalg.norm(x, 'fro', dim=1)"] = lambda v: torch.linalg.norm(v, "fro", dim=1)
    cases = {}
    for spec in (_rows, _cols, _whole):
        for name, call in calls.items():
            cases[f"{name} {spec.__name__}"] = ((8, 6), spec, call)
    batched = {  # a batch of matrices: a matrix norm over the last two dims, a 2-d one refused
        "matrix_norm(x, 'nuc')": lambda v: torch.linalg.matrix_norm(v, "nuc"),
        "matrix_norm(x, 1)": lambda v: torch.linalg.matrix_norm(v, 1),
        "torch.norm(x, 'nuc')": lambda v: torch.norm(v, "nuc"),
        "linalg.norm(x, 2)": lambda v: torch.linalg.norm(v, 2),
        "torch.norm(x, -inf, dim=2)": lambda v: torch.norm(v, -INF, dim=2),
    }
    for name, call in batched.items():
        cases[f"{name} (4, 6, 8) _mixed"] = ((4, 6, 8), _mixed, call)
    return cases


@pytest.mark.meshes((4,), (2, 2), slow=("gloo-4/2x2",))
def test_every_norm_order_equals_torch_or_is_refused(backend, mesh):
    """``torch.norm(x, -inf)`` was 1.0 (replicated too); ``p="nuc"`` and ``p=0`` raised raw
    torch errors."""
    check_table(backend, mesh, "norms")


# --- 4. embedding's max_norm ---------------------------------------------------------------------

INDICES = torch.tensor([[0, 3, 3], [9, 1, 0]])


def embedding_cases() -> dict:
    cases = {}
    for max_norm, norm_type in ((2.0, 2.0), (2.0, 1.0), (3.0, INF), (None, 2.0)):
        for spec in (_rows, _cols, _whole):
            name = f"embedding max_norm={max_norm} norm_type={norm_type} {spec.__name__}"
            cases[name] = ((10, 4), spec, lambda t, m=max_norm, n=norm_type: embed(t, m, n))
    return cases


def embed(table, max_norm, norm_type):
    """The lookup, and the table after it (torch renormalizes a plain table in place: its
    reference is a copy; an fd.DTensor's table is a value, never changed)."""
    if isinstance(table, fd.DTensor):
        indices = fd.distribute_tensor(INDICES, table.device_mesh, fd.P())
        return F.embedding(indices, table, max_norm=max_norm, norm_type=norm_type), table
    return F.embedding(INDICES, table.clone(), max_norm=max_norm, norm_type=norm_type), table


@pytest.mark.meshes((4,), (2, 2))
def test_embedding_renormalizes_the_rows_it_looks_up(backend, mesh):
    """``F.embedding(..., max_norm=2.0)`` ignored ``max_norm``."""
    check_table(backend, mesh, "embedding")


@pytest.mark.parametrize(
    "options", [{"max_norm": 2.0}, {"padding_idx": 3}, {"padding_idx": -1, "max_norm": 1.0}]
)
def test_embedding_gradient_is_torchs(options):
    """torch renormalizes the rows in place without autograd, so the table's gradient is the
    plain lookup's: fd's, the same; the row at ``padding_idx`` takes none (it once took its
    lookups')."""
    mesh = fd.simulated_mesh((4,), ("x",))
    for spec in (fd.P("x"), fd.P(None, "x"), fd.P()):
        weight = values((10, 4), 1).requires_grad_()
        table = fd.distribute_tensor(weight, mesh, spec)
        out = F.embedding(fd.distribute_tensor(INDICES, mesh, fd.P("x")), table, **options)
        out.square().sum().backward()
        plain = values((10, 4), 1).requires_grad_()
        want = F.embedding(INDICES, plain, **options)
        want.square().sum().backward()
        assert_close(out.full_tensor(), want)
        assert_close(weight.grad, plain.grad, msg=str(spec))


# --- 5. uneven shards: a rank holding a short or an empty block --------------------------------


def uneven_cases() -> dict:
    calls = {
        "unsqueeze(0)": lambda x: x.unsqueeze(0),
        "unsqueeze(1)": lambda x: x.unsqueeze(1),
        "unsqueeze(-1).squeeze(-1)": lambda x: x.unsqueeze(-1).squeeze(-1),
        "squeeze()": lambda x: x.unsqueeze(1).squeeze(),
        "view(n, 2, 2)": lambda x: x.view(x.shape[0], 2, 2),
        "reshape(n, 2, 2).flatten(1)": lambda x: x.reshape(x.shape[0], 2, 2).flatten(1),
        "flatten()": lambda x: x.flatten(),
        "reshape(-1)": lambda x: x.reshape(-1),
        "expand": lambda x: x.unsqueeze(1).expand(x.shape[0], 3, 4),
        "unflatten": lambda x: x.unflatten(1, (2, 2)),
        "reshape(()) of one element": lambda x: x[:1, :1].reshape(()),
        "cross_entropy mean": lambda x: F.cross_entropy(x, target(x)),
        "cross_entropy sum": lambda x: F.cross_entropy(x, target(x), reduction="sum"),
        "cross_entropy none": lambda x: F.cross_entropy(x, target(x), reduction="none", ignore_index=1),
        "embedding": lambda x: F.embedding(lookups(x), x),
        "embedding sharded indices": lambda x: F.embedding(target(x), x),
    }
    return {f"{name} rows={n}": ((n, 4), _rows, call) for n in (6, 7) for name, call in calls.items()}


def target(x):
    """Class indices, one per row of ``x``, laid out like its rows."""
    t = torch.arange(x.shape[0]) % x.shape[1]
    return (
        fd.distribute_tensor(t, x.device_mesh, fd.P(x.device_mesh.axis_names))
        if isinstance(x, fd.DTensor)
        else t
    )


def lookups(x):
    t = torch.tensor([0, x.shape[0] - 1, 3, 5, 1])
    return fd.distribute_tensor(t, x.device_mesh, fd.P()) if isinstance(x, fd.DTensor) else t


@pytest.mark.meshes((4,))
def test_uneven_shards_views_losses_and_lookups(backend, mesh):
    """6 or 7 rows over 4 ranks (blocks 2, 2, 2, 0 or 2, 2, 2, 1): the rank of a short or empty
    block failed in views, ``cross_entropy`` and ``embedding`` on gloo (local forms used the
    simulated storage's padded shapes)."""
    check_table(backend, mesh, "uneven")


TABLES = {
    "dims": dim_cases,
    "along": along_cases,
    "norms": norm_cases,
    "embedding": embedding_cases,
    "uneven": uneven_cases,
}


def job_gradients_at_edges(mesh) -> dict:
    """Gradients where the derivative needs care: a norm of zeros (torch's subgradient, 0), and
    a layer norm of uneven rows with a negative eps (the padding rows of a stacked shard would
    normalize to NaN and sum into the weight's gradient)."""
    name = mesh.axis_names[0]
    zeros = torch.zeros(5, requires_grad=True)
    torch.linalg.norm(fd.distribute_tensor(zeros, mesh, fd.P(name))).full_tensor().backward()
    x = torch.tensor([[0.0, 3.0, 6.0], [1.0, -4.0, 2.0]])
    weight = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    placed = fd.distribute_tensor(weight, mesh, fd.P())
    F.layer_norm(
        fd.distribute_tensor(x, mesh, fd.P(name)), (3,), placed, eps=-0.5
    ).full_tensor().sum().backward()
    orders = {}
    for order in (0.5, 1.5, 3, -1, -2):  # |x| ** order of a zero element, for every order
        leaf = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0], requires_grad=True)
        norm = torch.linalg.vector_norm(fd.distribute_tensor(leaf, mesh, fd.P(name)), order)
        norm.full_tensor().backward()
        orders[order] = (norm.full_tensor().detach(), leaf.grad)
    return {"norm of zeros": zeros.grad, "layer_norm weight": weight.grad, "orders": orders}


@pytest.mark.meshes((4,))
def test_gradients_at_the_edges_equal_torch(backend, mesh):
    zeros = torch.zeros(5, requires_grad=True)
    torch.linalg.norm(zeros).backward()
    weight = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x = torch.tensor([[0.0, 3.0, 6.0], [1.0, -4.0, 2.0]])
    F.layer_norm(x, (3,), weight, eps=-0.5).sum().backward()
    for got in backend.run(job_gradients_at_edges, mesh.shape, mesh.names):
        assert torch.equal(got["norm of zeros"], zeros.grad)
        assert_close(got["layer_norm weight"], weight.grad)
        for order, (value, grad) in got["orders"].items():
            leaf = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0], requires_grad=True)
            norm = torch.linalg.vector_norm(leaf, order)
            norm.backward()
            assert_close((value, grad), (norm.detach(), leaf.grad), msg=f"ord {order}")


def test_attention_dropout_is_refused_not_drawn_per_device():
    """F.scaled_dot_product_attention's dropout draws from torch's global generator: each device
    would draw its own mask (found by the op_db fuzz, a silent wrong answer): refused."""
    mesh = fd.simulated_mesh(2, "x")
    q = fd.distribute_tensor(torch.randn(4, 3, 8), mesh, fd.P("x"))
    with pytest.raises(fd.InputTypeError, match="fd.random.dropout"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert_close(
        F.scaled_dot_product_attention(q, q, q).full_tensor(),
        F.scaled_dot_product_attention(*[q.full_tensor()] * 3),
    )
