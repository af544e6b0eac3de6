"""Context parallelism: ``fd.ring_attention`` inside ``shard_map``, ``fd.context_parallel_attention``
and the ``fd.context_parallel`` context on ``fd.DTensor`` values.

The oracle is ``F.scaled_dot_product_attention`` on the global tensors, on one device: values and
the gradients of ``q``, ``k`` and ``v`` must equal it, causal or not, on meshes of 1, 2 and 4
devices along the sequence and on 2-d meshes whose other axis splits the batch or the heads; the
keys and values go round the ring in ``n - 1`` ppermutes each, and nothing else moves; gloo
ranks give what the simulated mesh gives.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from backends import Backend
from common import assert_close, check, in_float64
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import functional_dtensor as fd

#: (mesh shape, axis names, spec of q/k/v (batch, heads, seq, feature), the sequence's axes,
#: the devices splitting the batch, those splitting the heads)
CONFIGS = [
    ((1,), ("cp",), fd.P(None, None, "cp"), "cp", 1, 1),
    ((2,), ("cp",), fd.P(None, None, "cp"), "cp", 1, 1),
    ((4,), ("cp",), fd.P(None, None, "cp"), "cp", 1, 1),
    ((2, 2), ("dp", "cp"), fd.P("dp", None, "cp"), "cp", 2, 1),
    ((2, 2), ("cp", "tp"), fd.P(None, "tp", "cp"), "cp", 1, 2),
    ((2, 2), ("x", "y"), fd.P(None, None, ("x", "y")), ("x", "y"), 1, 1),
    ((2, 2), ("x", "y"), fd.P(None, None, ("y", "x")), ("y", "x"), 1, 1),
]


def qkv(shape_q, shape_kv, v_dim, seed, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=generator, dtype=dtype)
    k = torch.randn(shape_kv, generator=generator, dtype=dtype)
    v = torch.randn((*shape_kv[:-1], v_dim), generator=generator, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def zigzag_order(length: int, n: int) -> torch.Tensor:
    """The sequence positions in zigzag order: device i's block is chunks i and 2n - 1 - i."""
    chunks = torch.arange(length).view(2 * n, -1)
    return torch.cat([chunks[:n], chunks[n:].flip(0)], dim=1).flatten()


def reference(q, k, v, cotangent, causal, scale):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return out.detach(), torch.autograd.grad(out, (q, k, v), cotangent)


def ring(mesh, spec, axes, causal, scale, zigzag=False):
    def attend(q_block, k_block, v_block):
        return fd.ring_attention(q_block, k_block, v_block, axes, causal=causal, scale=scale, zigzag=zigzag)

    return fd.shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec)


@settings(max_examples=30)
@given(
    config=st.sampled_from(CONFIGS),
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    t_local=st.integers(1, 3),
    head_dim=st.integers(1, 5),
    v_dim=st.integers(1, 4),
    causal=st.booleans(),
    scale=st.none() | st.floats(0.05, 3.0),
    zigzag=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_values_and_gradients_equal_full_attention(
    config, batch, heads, t_local, head_dim, v_dim, causal, scale, zigzag, seed
):
    """Zigzag blocks: the sequence is put in zigzag order before the ring and back after it."""
    mesh_shape, names, spec, axes, batch_devices, head_devices = config
    mesh = fd.simulated_mesh(mesh_shape, names)
    n = mesh.axis_size((axes,) if isinstance(axes, str) else axes)
    length = t_local * n * (2 if zigzag else 1)
    shape = (batch * batch_devices, heads * head_devices, length, head_dim)
    q, k, v = qkv(shape, shape, v_dim, seed)
    cotangent = torch.randn((*shape[:-1], v_dim), dtype=torch.float64)
    order = zigzag_order(length, n) if zigzag else torch.arange(length)
    out = ring(mesh, spec, axes, causal, scale, zigzag)(q[..., order, :], k[..., order, :], v[..., order, :])
    assert out.sharding == fd.Layout.from_spec(mesh, spec)
    got = out.full_tensor()[..., order.argsort(), :]
    grads = torch.autograd.grad(got, (q, k, v), cotangent)
    expected, expected_grads = reference(q, k, v, cotangent, causal, scale)
    assert_close(got.detach(), expected)
    for name, g, e in zip("qkv", grads, expected_grads):
        assert_close(g, e, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_keys_and_queries_of_different_lengths(causal):
    """Cross attention: T_q != T_k, both split over the ring; causal is top-left aligned, as
    torch's is_causal (the first query sees the first key)."""
    mesh = fd.simulated_mesh(2, "cp")
    q, k, v = qkv((1, 2, 4, 3), (1, 2, 6, 3), 5, seed=3)
    cotangent = torch.randn(1, 2, 4, 5, dtype=torch.float64)
    got = ring(mesh, fd.P(None, None, "cp"), "cp", causal, None)(q, k, v).full_tensor()
    expected, expected_grads = reference(q, k, v, cotangent, causal, None)
    assert_close(got.detach(), expected)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), cotangent), expected_grads):
        assert_close(g, e)


def test_large_scores_stay_finite_and_exact():
    """Scores of size 1e4: the running maximum keeps exp() in range; a causal ring's first
    device sees only hidden keys in n - 1 of its blocks, without NaN in values or gradients."""
    mesh = fd.simulated_mesh(4, "cp")
    q, k, v = qkv((2, 1, 8, 4), (2, 1, 8, 4), 4, seed=7)
    q = (q.detach() * 100).requires_grad_()
    k = (k.detach() * 100).requires_grad_()
    cotangent = torch.randn(2, 1, 8, 4, dtype=torch.float64)
    got = ring(mesh, fd.P(None, None, "cp"), "cp", True, None)(q, k, v).full_tensor()
    expected, expected_grads = reference(q, k, v, cotangent, True, None)
    assert_close(got.detach(), expected)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), cotangent), expected_grads):
        assert torch.isfinite(g).all()
        assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_keeps_its_dtype(dtype):
    mesh = fd.simulated_mesh(4, "cp")
    q, k, v = (t.detach() for t in qkv((1, 2, 16, 8), (1, 2, 16, 8), 8, seed=1, dtype=dtype))
    got = ring(mesh, fd.P(None, None, "cp"), "cp", True, None)(q, k, v).full_tensor()
    assert got.dtype == dtype
    expected = F.scaled_dot_product_attention(*in_float64((q, k, v)), is_causal=True)
    assert_close(got, expected, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("n", [2, 4])
def test_zigzag_halves_the_causal_work(n):
    """Plain causal: n blocks of (2c, 2c) scores per device; zigzag: 3 chunk pairs of (c, c) at
    the first step and 2 at each other, so (2n + 1) / 4n of the matmul flops; the same
    ppermutes."""
    mesh = fd.simulated_mesh(n, "cp")
    q, k, v = (t.detach() for t in qkv((1, 2, 2 * n * 8, 16), (1, 2, 2 * n * 8, 16), 16, seed=n))
    flops, events = {}, {}
    for zigzag in (False, True):
        with FlopCounterMode(display=False) as counter, fd.CommDebugMode() as comm:
            ring(mesh, fd.P(None, None, "cp"), "cp", True, None, zigzag)(q, k, v)
        flops[zigzag], events[zigzag] = counter.get_total_flops(), [(e.op, e.nbytes) for e in comm.events]
    assert flops[True] * 4 * n == flops[False] * (2 * n + 1)
    assert events[True] == events[False] == [("ppermute", 2 * 8 * 2 * 8 * 16)] * (2 * (n - 1))


# --- communication ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_keys_and_values_go_round_the_ring_once(n, causal):
    """Forward: n - 1 ppermutes of the key block and n - 1 of the value block over the
    sequence axis, each moving one block per device, and nothing else; backward: their
    transposes, as many."""
    mesh = fd.simulated_mesh((2, n), ("dp", "cp"))
    q, k, v = qkv((2, 2, 3 * n, 4), (2, 2, 3 * n, 4), 4, seed=n)
    with fd.CommDebugMode() as forward:
        out = ring(mesh, fd.P("dp", None, "cp"), "cp", causal, None)(q, k, v)
    block_bytes = 1 * 2 * 3 * 4 * 8  # (batch / dp, heads, T / n, head_dim) float64
    assert [(e.op, tuple(e.axes), e.nbytes) for e in forward.events] == [
        ("ppermute", ("cp",), block_bytes)
    ] * (2 * (n - 1))
    total = out.full_tensor().sum()  # (its gather counted outside: the backward's traffic alone)
    with fd.CommDebugMode() as backward:
        torch.autograd.grad(total, (q, k, v))
    assert [(e.op, tuple(e.axes), e.nbytes) for e in backward.events] == [
        ("ppermute", ("cp",), block_bytes)
    ] * (2 * (n - 1))


# --- the global view ----------------------------------------------------------------------------


def distributed_qkv(mesh, spec, shape, seed, causal=True):
    q, k, v = qkv(shape, shape, shape[-1], seed)
    return (q, k, v), [fd.distribute_tensor(t, mesh, spec) for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True])
def test_context_parallel_runs_attention_on_dtensors_round_the_ring(causal):
    mesh = fd.simulated_mesh((2, 4), ("dp", "cp"))
    (q, k, v), (qd, kd, vd) = distributed_qkv(mesh, fd.P("dp", None, "cp"), (2, 3, 8, 4), seed=5)
    cotangent = torch.randn(2, 3, 8, 4, dtype=torch.float64)
    expected, expected_grads = reference(q, k, v, cotangent, causal, 0.5)
    with fd.context_parallel("cp"), fd.CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=0.5)
    assert [e.op for e in comm.events] == ["ppermute"] * 6
    assert out.sharding == qd.sharding
    assert_close(out.full_tensor().detach(), expected)
    for g, e in zip(torch.autograd.grad(out.full_tensor(), (q, k, v), cotangent), expected_grads):
        assert_close(g, e)

    # outside the context: the op's own rule, which gathers the sequence, with the same values
    with fd.CommDebugMode() as comm:
        plain = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=0.5)
    assert "ppermute" not in {e.op for e in comm.events} and comm.events
    assert_close(plain.full_tensor().detach(), expected)
    assert "scaled_dot_product_attention" in str(fd.explain(F.scaled_dot_product_attention, qd, kd, vd))


def test_context_parallel_leaves_other_values_and_ops_alone():
    mesh = fd.simulated_mesh((2, 2), ("dp", "cp"))
    (q, k, v), (qd, kd, vd) = distributed_qkv(mesh, fd.P("dp"), (2, 2, 4, 4), seed=2)
    outside = F.scaled_dot_product_attention(q, k, v).detach()
    with fd.context_parallel("cp"), fd.CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(qd, kd, vd)  # the sequence is whole: the op's own rule
        total = (qd * 2).sum()
        plain = F.scaled_dot_product_attention(q, k, v)  # torch tensors: torch's own op
    assert comm.events == []
    assert out.placements == (fd.Shard(0), fd.Replicate())
    assert_close(out.full_tensor().detach(), outside)
    assert_close(total.full_tensor().detach(), (q * 2).sum().detach())
    assert_close(plain.detach(), outside)


def test_contexts_nest_and_close_on_error():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    _, (qd, kd, vd) = distributed_qkv(mesh, fd.P(None, None, "y"), (1, 2, 4, 2), seed=4)
    with fd.context_parallel("x"):
        with fd.context_parallel("y"), fd.CommDebugMode() as comm:
            F.scaled_dot_product_attention(qd, kd, vd)
        assert {e.op for e in comm.events} == {"ppermute"}
        with fd.CommDebugMode() as comm:
            F.scaled_dot_product_attention(qd, kd, vd)  # split over y, the context names x
        assert "ppermute" not in {e.op for e in comm.events}
    with pytest.raises(RuntimeError), fd.context_parallel("y"):
        raise RuntimeError("inside")
    with fd.CommDebugMode() as comm:
        F.scaled_dot_product_attention(qd, kd, vd)
    assert "ppermute" not in {e.op for e in comm.events}


def test_contexts_are_per_thread():
    mesh = fd.simulated_mesh(2, "cp")
    _, (qd, kd, vd) = distributed_qkv(mesh, fd.P(None, None, "cp"), (1, 1, 4, 2), seed=6)
    seen = {}

    def other_thread():
        with fd.CommDebugMode() as comm:
            F.scaled_dot_product_attention(qd, kd, vd)
        seen["ops"] = {e.op for e in comm.events}

    with fd.context_parallel("cp"):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["ops"] and "ppermute" not in seen["ops"]


def test_function_form_redistributes_keys_and_values_to_the_queries_layout():
    mesh = fd.simulated_mesh((2, 2), ("dp", "cp"))
    q, k, v = qkv((2, 2, 8, 4), (2, 2, 8, 4), 3, seed=8)
    qd = fd.distribute_tensor(q, mesh, fd.P("dp", None, "cp"))
    kd = fd.distribute_tensor(k, mesh, fd.P(None, "cp"))
    vd = fd.distribute_tensor(v, mesh, fd.P())
    out = fd.context_parallel_attention(qd, kd, vd, "cp", causal=True)
    assert out.sharding == qd.sharding
    cotangent = torch.randn(2, 2, 8, 3, dtype=torch.float64)
    expected, expected_grads = reference(q, k, v, cotangent, True, None)
    assert_close(out.full_tensor().detach(), expected)
    for g, e in zip(torch.autograd.grad(out.full_tensor(), (q, k, v), cotangent), expected_grads):
        assert_close(g, e)


# --- on gloo ranks ------------------------------------------------------------------------------


def job_context_parallel(mesh, spec, axes, shape, causal: bool, seed: int) -> dict:
    q, k, v = qkv(shape, shape, shape[-1], seed)
    qd, kd, vd = (fd.distribute_tensor(t, mesh, spec) for t in (q, k, v))
    with fd.context_parallel(axes):
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
    full = out.full_tensor()
    cotangent = torch.randn(full.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(full, (q, k, v), cotangent)
    return {"out": full.detach(), "grads": grads, "layout": str(out.sharding)}


@pytest.mark.meshes((2,), (4,), (2, 2))
@pytest.mark.parametrize("causal", [False, True])
def test_gloo_ranks_give_the_simulated_result(backend, mesh, causal):
    if len(mesh.shape) == 2:
        spec, axes, shape = fd.P("x", None, "y"), "y", (2, 2, 6, 3)
    else:
        spec, axes, shape = fd.P(None, None, "x"), "x", (1, 2, 4 * mesh.size, 3)
    args = (spec, axes, shape, causal, 11)
    (simulated,) = Backend("simulated").run(job_context_parallel, mesh.shape, mesh.names, *args)
    q, k, v = qkv(shape, shape, shape[-1], 11)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal).detach()
    assert_close(simulated["out"], expected)
    for got in backend.run(job_context_parallel, mesh.shape, mesh.names, *args):
        assert got["layout"] == simulated["layout"]
        assert_close(got["out"], simulated["out"])
        for g, e in zip(got["grads"], simulated["grads"]):
            assert_close(g, e)


def job_zigzag(mesh, shape, seed: int) -> dict:
    n = mesh.size
    order = zigzag_order(shape[-2], n)
    q, k, v = qkv(shape, shape, shape[-1], seed)
    out = ring(mesh, fd.P(None, None, "x"), "x", True, None, zigzag=True)(
        q[..., order, :], k[..., order, :], v[..., order, :]
    )
    full = out.full_tensor()[..., order.argsort(), :]
    grads = torch.autograd.grad(full, (q, k, v), torch.ones_like(full))
    return {"out": full.detach(), "grads": grads}


@pytest.mark.meshes((2,), (4,))
def test_zigzag_on_gloo_ranks_gives_the_simulated_result(backend, mesh):
    shape = (1, 2, 4 * mesh.size, 3)
    (simulated,) = Backend("simulated").run(job_zigzag, mesh.shape, mesh.names, shape, 13)
    q, k, v = qkv(shape, shape, shape[-1], 13)
    assert_close(simulated["out"], F.scaled_dot_product_attention(q, k, v, is_causal=True).detach())
    for got in backend.run(job_zigzag, mesh.shape, mesh.names, shape, 13):
        assert_close(got["out"], simulated["out"])
        for g, e in zip(got["grads"], simulated["grads"]):
            assert_close(g, e)


# --- errors -------------------------------------------------------------------------------------


def test_errors_inside_shard_map():
    mesh = fd.simulated_mesh((2, 2), ("cp", "tp"))
    spec = fd.P(None, None, "cp")
    x = torch.randn(1, 2, 4, 3)

    def mapped(f, *args):
        return lambda: fd.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_rep=False)(*args)

    attend = lambda q, k, v: fd.ring_attention(q, k, v, "cp")
    check(
        fd.ShapeError, ValueError, mapped(attend, x, torch.randn(1, 3, 4, 3), x), "fd.ring_attention(q, k, v)"
    )
    check(fd.ShapeError, ValueError, mapped(attend, x, torch.randn(1, 2, 4, 2), x), "q (1, 2, 2, 3)")
    check(fd.ShapeError, ValueError, mapped(attend, x, x, torch.randn(1, 2, 2, 3)), "as many keys as values")
    check(fd.InputTypeError, TypeError, mapped(attend, x, x.double(), x), "torch.float32, torch.float64")
    check(fd.InputTypeError, TypeError, mapped(attend, x.long(), x.long(), x.long()), "floating")
    wrong_axis = lambda q, k, v: fd.ring_attention(q, k, v, "sp")
    check(fd.AxisNameError, NameError, mapped(wrong_axis, x, x, x), "fd.ring_attention(axis_name)", "'sp'")
    zigzag = lambda q, k, v: fd.ring_attention(q, k, v, "cp", causal=True, zigzag=True)
    odd_blocks = torch.randn(1, 2, 6, 3)
    check(
        fd.ShapeError, ValueError, mapped(zigzag, odd_blocks, odd_blocks, odd_blocks), "3 queries and 3 keys"
    )
    # the sequence does not split evenly over the ring: shard_map's own divisibility error
    odd = torch.randn(1, 2, 5, 3)
    check(fd.ShapeError, ValueError, mapped(attend, odd, odd, odd), "expected a multiple of 2")


def test_errors_outside_shard_map():
    x = torch.randn(1, 2, 4, 3)
    check(fd.AxisNameError, NameError, lambda: fd.ring_attention(x, x, x, "cp"), "no shard_map binds")
    mesh = fd.simulated_mesh(2, "cp")
    xd = fd.distribute_tensor(x, mesh, fd.P(None, None, "cp"))
    check(
        fd.InputTypeError,
        TypeError,
        lambda: fd.ring_attention(xd, xd, xd, "cp"),
        "fd.context_parallel_attention",
    )


def test_errors_of_the_global_view():
    mesh = fd.simulated_mesh((2, 2), ("dp", "cp"))
    x = torch.randn(2, 2, 8, 4)
    xd = fd.distribute_tensor(x, mesh, fd.P(None, None, "cp"))
    attention = fd.context_parallel_attention
    check(fd.InputTypeError, TypeError, lambda: attention(x, xd, xd, "cp"), "attention(q)", "got Tensor")
    check(fd.AxisNameError, NameError, lambda: attention(xd, xd, xd, "sp"), "attention(axis_name)", "'sp'")
    check(fd.InputTypeError, TypeError, lambda: attention(xd, xd, xd, 1), "not its position")
    check(fd.InputTypeError, TypeError, lambda: fd.context_parallel(1), "fd.context_parallel(axis_name)")
    other = fd.distribute_tensor(x, fd.simulated_mesh(4, "cp"), fd.P(None, None, "cp"))
    check(fd.MeshError, ValueError, lambda: attention(xd, other, xd, "cp"), "attention(k)")
    mixed = fd.distribute_tensor(x.double(), mesh, fd.P(None, None, "cp"))
    check(fd.InputTypeError, TypeError, lambda: attention(xd, xd, mixed, "cp"), "one floating dtype")
    heads = fd.distribute_tensor(torch.randn(2, 1, 8, 4), mesh, fd.P(None, None, "cp"))
    check(fd.ShapeError, ValueError, lambda: attention(xd, heads, heads, "cp"), "k (2, 1, 8, 4)")
    batch_split = fd.distribute_tensor(x, mesh, fd.P("cp"))
    check(fd.LayoutError, ValueError, lambda: attention(batch_split, xd, xd, "cp"), "fd.redistribute(q")
    features_split = fd.distribute_tensor(x, mesh, fd.P(None, None, "cp", "dp"))
    check(
        fd.LayoutError, ValueError, lambda: attention(features_split, xd, xd, "cp"), "feature dim (-1) whole"
    )
    uneven = fd.distribute_tensor(torch.randn(2, 2, 7, 4), mesh, fd.P(None, None, "cp"))
    check(fd.ShapeError, ValueError, lambda: attention(uneven, uneven, uneven, "cp"), "7 = 3 * 2 + 1", "pad")
    with fd.context_parallel("cp"):
        check(
            fd.InputTypeError,
            TypeError,
            lambda: F.scaled_dot_product_attention(xd, xd, xd, dropout_p=0.1),
            "dropout_p=0.1",
        )


# --- under torch.func and torch.compile ---------------------------------------------------------


def test_under_torch_func_grad():
    mesh = fd.simulated_mesh(4, "cp")
    q, k, v = (t.detach() for t in qkv((1, 2, 8, 4), (1, 2, 8, 4), 4, seed=9))
    attend = ring(mesh, fd.P(None, None, "cp"), "cp", True, None)
    got = torch.func.grad(lambda q, k, v: attend(q, k, v).full_tensor().square().sum(), argnums=(0, 1, 2))(
        q, k, v
    )
    expected = torch.func.grad(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum(),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, e in zip(got, expected):
        assert_close(g, e)


def test_under_torch_compile():
    mesh = fd.simulated_mesh(2, "cp")
    q, k, v = (t.detach() for t in qkv((1, 2, 4, 4), (1, 2, 4, 4), 4, seed=10))
    attend = ring(mesh, fd.P(None, None, "cp"), "cp", True, None)
    compiled = torch.compile(lambda q, k, v: attend(q, k, v).full_tensor(), fullgraph=True, backend="eager")
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(compiled(q, k, v), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_simulated_cuda_mesh():
    mesh = fd.simulated_mesh(4, "cp", device_type="cuda")
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv((2, 2, 16, 8), (2, 2, 16, 8), 8, seed=12))
    got = ring(mesh, fd.P(None, None, "cp"), "cp", True, None)(q, k, v).full_tensor()
    assert got.device.type == "cuda"
    cotangent = torch.randn_like(got)
    expected, expected_grads = reference(q, k, v, cotangent, True, None)
    assert_close(got.detach(), expected)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), cotangent), expected_grads):
        assert_close(g, e)
