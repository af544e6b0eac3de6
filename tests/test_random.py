"""fd.random: Philox against its published answers, the fused CPU kernels against the tensor
ops bit for bit, sharding invariance for every mesh and layout, both backends alike, shard_map
streams and dropout, the statistics of large draws, and the errors of bad input.

The oracle of a sharded draw is the unsharded draw of the same key (itself checked against the
Philox answers and the statistics): every layout must hold exactly its values.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from backends import local_devices, per_device
from common import assert_close, check
from hypothesis import given
from hypothesis import strategies as st

import functional_dtensor as fd
from functional_dtensor import _philox, _philox_native, _random_draws
from functional_dtensor.testing import strategies as fds

KEY = fd.random.key(2026)
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

native = pytest.mark.skipif(not _philox_native.available(), reason="no C compiler: the tensor-op path only")


@pytest.fixture(params=["native", "tensor ops"])
def path(request, monkeypatch):
    """Run a test with the fused kernels and again with the tensor ops alone."""
    if request.param == "native":
        if not _philox_native.available():
            pytest.skip("no C compiler")
    else:
        monkeypatch.setattr(_philox_native, "_library", False)
    return request.param


def bits(x: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, so that equality is exact (NaN-safe, -0.0 distinct)."""
    if x.dtype == torch.bool:
        return x
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


# --- Philox and the two implementations -------------------------------------------------------


@pytest.mark.parametrize(
    "key, counter, expected",
    [  # Random123's known answers for Philox4x32-10
        ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0xA4093822, 0x299F31D0),
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(key, counter, expected):
    words = _philox.philox(*[torch.tensor(k) for k in key], *[torch.tensor(c) for c in counter])
    assert tuple(int(w) for w in words) == expected


def test_the_fused_kernels_build_wherever_a_compiler_is():
    """So that the tests of the fused kernels skip only where they cannot run."""
    import shutil

    if (shutil.which("cc") or shutil.which("gcc")) and os.environ.get("FD_NATIVE_RANDOM") != "0":
        assert _philox_native.available()


KINDS = [
    ("uniform", torch.float32),
    ("uniform", torch.float64),
    ("uniform", torch.bfloat16),
    ("uniform", torch.float16),
    ("normal", torch.float32),
    ("normal", torch.float64),
    ("bernoulli", torch.bool),
    ("randint", torch.int64),
]


def native_draw(kind, dtype, key, start, n, param):
    draw = _random_draws.Draw(kind, dtype, param)
    out = torch.empty(n, dtype=draw.buffer)
    k = tuple(int(w) for w in key.tolist())
    runs = (torch.tensor([start]), torch.tensor([0]), torch.tensor([n]))
    return draw.finish(_philox_native.fill(draw.native, k, *runs, out, *draw.extra))


@native
@pytest.mark.parametrize("kind, dtype", KINDS)
@pytest.mark.parametrize("start", [0, 2**32 - 1000, 3 * 2**40 + 7])
def test_fused_kernels_equal_the_tensor_ops_bit_for_bit(kind, dtype, start):
    """Over 2**18 elements (so every branch of the normal's polynomials is taken, and the kernel
    is split over threads), including counters past 2**32."""
    param = {"bernoulli": 0.3, "randint": (-7, 1000)}.get(kind)
    for key in (KEY, fd.random.key(2**64 - 1), fd.random.key(5)):
        n = 1 << 18
        got = native_draw(kind, dtype, key, start, n, param)
        expected = _philox.draw(key, start + torch.arange(n), kind, dtype, param)
        assert_identical(got, expected)


@native
def test_fused_kernels_split_runs_over_threads_as_one():
    n = 300_001
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_draw("normal", torch.float32, KEY, 11, n, None)
        torch.set_num_threads(3)
        three = native_draw("normal", torch.float32, KEY, 11, n, None)
    finally:
        torch.set_num_threads(threads)
    assert_identical(one, three)


# --- keys --------------------------------------------------------------------------------------


def test_keys_split_and_fold_in_are_pure_and_distinct():
    k = fd.random.key(7)
    assert k.dtype == torch.int64 and tuple(k.shape) == (2,)
    assert torch.equal(fd.random.key(7), k) and not torch.equal(fd.random.key(8), k)
    assert torch.equal(fd.random.key(2**64 + 7), k)  # modulo 2**64
    before = k.clone()
    keys = fd.random.split(k, 5)
    assert torch.equal(k, before) and tuple(keys.shape) == (5, 2)
    assert torch.equal(keys[:2], fd.random.split(k, 2))  # a prefix of a longer split
    folded = [fd.random.fold_in(k, i) for i in range(5)]
    candidates = [k, *keys, *folded, fd.random.fold_in(k, -1), fd.random.fold_in(k, 2**32)]
    assert len({tuple(c.tolist()) for c in candidates}) == len(candidates)
    assert torch.equal(fd.random.fold_in(k, 3), fd.random.fold_in(k, torch.tensor([3], dtype=torch.int32)))
    assert all(0 <= w < 2**32 for c in candidates for w in c.tolist())


@given(seeds=st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=2, unique=True))
def test_different_keys_draw_different_values(seeds):
    a, b = (fd.random.uniform(fd.random.key(s), (64,)) for s in seeds)
    assert not torch.equal(a, b)
    # and the same key the same values
    assert torch.equal(a, fd.random.uniform(fd.random.key(seeds[0]), (64,)))


def test_vmap_over_keys_draws_each_keys_values():
    keys = fd.random.split(KEY, 4)
    batched = torch.func.vmap(lambda k: fd.random.normal(k, (3, 5)))(keys)
    assert torch.equal(batched, torch.stack([fd.random.normal(k, (3, 5)) for k in keys]))
    folded = torch.func.vmap(lambda i: fd.random.fold_in(KEY, i))(torch.arange(4))
    assert torch.equal(folded, torch.stack([fd.random.fold_in(KEY, i) for i in range(4)]))


def test_compiled_draws_equal_eager():
    def f(key):
        return fd.random.normal(fd.random.fold_in(key, 3), (4, 6)) + fd.random.uniform(key, (4, 6))

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(KEY), f(KEY))


# --- sharding invariance -----------------------------------------------------------------------


@st.composite
def sharded_draws(draw):
    mesh = draw(fds.meshes(max_dims=3, max_devices=12))
    shape = draw(fds.global_shapes(0, 3, max_side=9, max_elements=400))
    layout = draw(fds.layouts(mesh, len(shape)))
    kind, dtype = draw(st.sampled_from(KINDS))
    return layout, shape, kind, dtype


def draw_with(kind, dtype, key, shape, **where):
    if kind in ("uniform", "normal"):
        return getattr(fd.random, kind)(key, shape, dtype, **where)
    if kind == "bernoulli":
        return fd.random.bernoulli(key, 0.3, shape, **where)
    return fd.random.randint(key, shape, -5, 12, dtype, **where)


@given(case=sharded_draws(), seed=st.integers(0, 2**64 - 1))
def test_a_sharded_draw_holds_the_unsharded_values_for_every_layout(path, case, seed):
    layout, shape, kind, dtype = case
    key = fd.random.key(seed)
    expected = draw_with(kind, dtype, key, shape)
    value = draw_with(kind, dtype, key, shape, mesh=layout.mesh, placements=layout)
    assert value.sharding == layout and tuple(value.shape) == shape
    assert_identical(value.full_tensor(), expected)


@given(case=sharded_draws())
def test_the_two_paths_draw_the_same_bits(case):
    layout, shape, kind, dtype = case
    fast = draw_with(kind, dtype, KEY, shape, mesh=layout.mesh, placements=layout)
    saved = _philox_native._library
    _philox_native._library = False
    try:
        slow = draw_with(kind, dtype, KEY, shape, mesh=layout.mesh, placements=layout)
    finally:
        _philox_native._library = saved
    for a, b in zip(fast.local_shards(), slow.local_shards()):
        assert_identical(a, b)


def test_a_partial_draw_sums_to_the_draw():
    mesh = fd.simulated_mesh((2, 3), ("x", "y"))
    value = fd.random.normal(KEY, (5, 4), mesh=mesh, placements=[fd.Partial(), fd.Shard(1)])
    assert torch.equal(value.full_tensor(), fd.random.normal(KEY, (5, 4)))


def test_factories_draw_from_a_key_or_from_torchs_seed():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    a = fd.randn(6, 3, mesh=mesh, placements=fd.P("x"), key=KEY)
    assert torch.equal(a.full_tensor(), fd.random.normal(KEY, (6, 3)))
    b = fd.rand((6, 3), mesh=mesh, placements=fd.P(None, "y"), key=KEY, dtype=torch.float64)
    assert torch.equal(b.full_tensor(), fd.random.uniform(KEY, (6, 3), torch.float64))
    torch.manual_seed(0)
    first = fd.randn(6, 3, mesh=mesh, placements=fd.P("x")).full_tensor()
    torch.manual_seed(0)
    again = fd.randn(6, 3, mesh=mesh, placements=fd.P("y", "x")).full_tensor()
    assert torch.equal(first, again)  # the seed decides, not the layout
    assert not torch.equal(first, fd.randn(6, 3, mesh=mesh, placements=fd.P("x")).full_tensor())
    c = fd.randn(6, 3, mesh=mesh, placements=fd.P("x"), key=KEY, requires_grad=True)
    assert c.requires_grad
    meta = fd.randn(6, 3, mesh=mesh, placements=fd.P("x"), key=KEY, device="meta")
    assert meta.is_meta and tuple(meta.shape) == (6, 3)


def test_uniform_and_normal_parameters():
    u = fd.random.uniform(KEY, (1000,), torch.float64, -3.0, 5.0)
    assert u.min() >= -3.0 and u.max() < 5.0
    assert torch.equal(u, fd.random.uniform(KEY, (1000,), torch.float64) * 8.0 + -3.0)
    z = fd.random.normal(KEY, (1000,), torch.float64, 2.0, 0.5)
    assert torch.equal(z, fd.random.normal(KEY, (1000,), torch.float64) * 0.5 + 2.0)
    b = fd.random.bernoulli(KEY, torch.tensor([0.0, 1.0]).expand(100, 2))
    assert b.shape == (100, 2) and not b[:, 0].any() and b[:, 1].all()
    r = fd.random.randint(KEY, (2000,), 3, 7, torch.int32)
    assert r.dtype == torch.int32 and set(r.tolist()) == {3, 4, 5, 6}


# --- statistics --------------------------------------------------------------------------------


def ks_distance(sample: torch.Tensor, cdf) -> float:
    """The Kolmogorov-Smirnov distance between a sample and a continuous distribution."""
    x, _ = torch.sort(sample.double().flatten())
    n = x.numel()
    f = cdf(x)
    upper = torch.arange(1, n + 1, dtype=torch.float64) / n - f
    lower = f - torch.arange(0, n, dtype=torch.float64) / n
    return float(torch.maximum(upper, lower).max())


@pytest.mark.parametrize("dtype", FLOATS)
def test_uniform_and_normal_statistics(dtype):
    """Mean, variance and a Kolmogorov-Smirnov bound (at 0.1%, 1.95 / sqrt(n)) on large draws;
    the coarse dtypes on fewer values, since their rounding alone moves the distance by about
    one ulp of the value."""
    n = 1 << (20 if dtype in (torch.float32, torch.float64) else 13)
    u = fd.random.uniform(KEY, (n,), dtype).double()
    z = fd.random.normal(KEY, (n,), dtype).double()
    se = 1 / math.sqrt(n)
    assert abs(float(u.mean()) - 0.5) < 5 * se * math.sqrt(1 / 12)
    assert abs(float(u.var()) - 1 / 12) < 5 * se * 0.075
    assert abs(float(z.mean())) < 5 * se
    assert abs(float(z.var()) - 1) < 5 * se * math.sqrt(2)
    bound = 1.95 / math.sqrt(n)
    assert ks_distance(u, lambda x: x.clamp(0, 1)) < bound
    assert ks_distance(z, lambda x: torch.special.ndtr(x)) < bound
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0


def test_bernoulli_dropout_and_randint_rates():
    n = 1 << 18
    assert abs(float(fd.random.bernoulli(KEY, 0.3, (n,)).double().mean()) - 0.3) < 5 * math.sqrt(0.21 / n)
    counts = torch.bincount(fd.random.randint(KEY, (n,), 0, 10), minlength=10).double()
    chi2 = float(((counts - n / 10) ** 2 / (n / 10)).sum())
    assert chi2 < 27.9  # chi-squared, 9 degrees of freedom, 0.1%
    x = torch.ones(n, requires_grad=True)
    y = fd.random.dropout(KEY, x, 0.25)
    kept = y != 0
    assert abs(float(kept.double().mean()) - 0.75) < 5 * math.sqrt(0.1875 / n)
    assert torch.equal(y[kept], torch.full_like(y[kept], 1 / 0.75))
    y.sum().backward()
    assert torch.equal(x.grad, kept * (1 / 0.75))
    assert torch.equal(fd.random.dropout(KEY, x, 1.0), torch.zeros(n))
    assert torch.equal(fd.random.dropout(KEY, x, 0.0), x)


# --- inside shard_map ----------------------------------------------------------------------------


def job_draws(mesh) -> dict:
    """Draws on ``mesh`` (this process's shards) and inside shard_map: per-device streams,
    dropout of a replicated and of a sharded value, and a global dropout."""
    names = mesh.axis_names
    specs = [fd.P(), fd.P(names[0]), fd.P(None, names[-1]), fd.P(tuple(reversed(names))), fd.P(*names[:2])]
    out = {}
    for i, spec in enumerate(specs):
        for kind, dtype in KINDS:
            value = draw_with(kind, dtype, fd.random.fold_in(KEY, i), (7, 5), mesh=mesh, placements=spec)
            out[f"{kind} {dtype} {spec}"] = list(value.local_shards())

    def per_device(x, y):
        stream = fd.random.normal(fd.random.fold_in(KEY, fd.axis_index(names)), (3,))
        return stream, fd.random.dropout(KEY, x, 0.5), fd.random.dropout(KEY, y, 0.5)

    x = fd.distribute_tensor(torch.ones(6, 4), mesh, fd.P())
    y = fd.distribute_tensor(torch.ones(4 * mesh.size, 4), mesh, fd.P(names))
    stream, kept_x, kept_y = fd.shard_map(
        per_device, mesh=mesh, in_specs=(fd.P(), fd.P(names)), out_specs=(fd.P(names), fd.P(), fd.P(names))
    )(x, y)
    out["stream"] = list(stream.local_shards())
    out["dropout replicated"] = list(kept_x.local_shards())
    out["dropout sharded"] = list(kept_y.local_shards())
    out["dropout global"] = list(fd.random.dropout(KEY, y, 0.5).local_shards())
    out["devices"] = local_devices(mesh)
    return out


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_draws_are_the_same_on_both_backends(backend, mesh):
    results = backend.run(job_draws, mesh.shape, mesh.names)
    (expected,) = [job_draws(mesh.simulated())]
    assert per_device(results, "devices") == list(range(mesh.size))
    for name in expected:
        if name == "devices":
            continue
        got = per_device(results, name)
        assert len(got) == mesh.size, name
        for a, b in zip(got, expected[name]):
            assert_identical(a, b)


def test_shard_map_streams_and_dropout_follow_what_varies():
    mesh = fd.simulated_mesh((2, 3), ("x", "y"))
    result = job_draws(mesh)
    streams = result["stream"]
    assert len({tuple(s.tolist()) for s in streams}) == mesh.size  # one stream per device
    # a replicated value is dropped alike on every device (the out_spec P() passed check_rep)
    replicated = result["dropout replicated"]
    assert all(torch.equal(r, replicated[0]) for r in replicated)
    # a sharded one independently per shard: here each device holds its own shard
    sharded = result["dropout sharded"]
    assert len({tuple(s.flatten().tolist()) for s in sharded}) == mesh.size
    # varying over x only: devices along y agree, devices along x differ
    x = fd.distribute_tensor(torch.ones(8, 16), mesh, fd.P("x"))
    dropped = fd.shard_map(
        lambda v: fd.random.dropout(KEY, v, 0.5), mesh=mesh, in_specs=fd.P("x"), out_specs=fd.P("x")
    )
    shards = dropped(x).local_shards()
    assert all(torch.equal(shards[3 * i], shards[3 * i + j]) for i in range(2) for j in range(3))
    assert not torch.equal(shards[0], shards[3])


def test_check_rep_knows_what_a_draw_varies_over():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    x = fd.distribute_tensor(torch.zeros(2), mesh, fd.P())
    same = fd.shard_map(
        lambda v: v + fd.random.normal(KEY, (2,)), mesh=mesh, in_specs=fd.P(), out_specs=fd.P()
    )
    assert torch.equal(same(x).full_tensor(), fd.random.normal(KEY, (2,)))
    per_x = fd.shard_map(
        lambda v: v + fd.random.normal(fd.random.fold_in(KEY, fd.axis_index("x")), (2,)),
        mesh=mesh,
        in_specs=fd.P(),
        out_specs=fd.P(),
    )
    with pytest.raises(fd.FunctionalDTensorError, match="x"):
        per_x(x)
    per_x_ok = fd.shard_map(
        lambda v: v + fd.random.normal(fd.random.fold_in(KEY, fd.axis_index("x")), (2,)),
        mesh=mesh,
        in_specs=fd.P(),
        out_specs=fd.P("x"),
    )
    assert tuple(per_x_ok(x).shape) == (4,)


def test_global_dropout_is_layout_invariant_and_differentiable():
    mesh = fd.simulated_mesh((2, 2), ("x", "y"))
    value = torch.randn(6, 5, dtype=torch.float64)
    expected = fd.random.dropout(KEY, value, 0.4)
    for placements in (
        [fd.Shard(0), fd.Shard(1)],
        [fd.Replicate(), fd.Shard(0)],
        [fd.Partial(), fd.Shard(1)],
    ):
        leaf = value.clone().requires_grad_()
        x = fd.distribute_tensor(leaf, mesh, placements)
        y = fd.random.dropout(KEY, x, 0.4)
        assert y.sharding == x.sharding
        assert_close(y.full_tensor(), expected)
        y.full_tensor().sum().backward()
        assert_close(leaf.grad, (expected != 0).double() / 0.6)


# --- bad input ---------------------------------------------------------------------------------


BAD = [
    (lambda: fd.random.key(1.5), fd.InputTypeError, ["fd.random.key(seed)", "int"]),
    (lambda: fd.random.normal(torch.tensor([1, 2, 3]), (2,)), fd.InputTypeError, ["(key)", "shape (2,)"]),
    (lambda: fd.random.normal(torch.tensor([1.0, 2.0]), (2,)), fd.InputTypeError, ["(key)", "int64"]),
    (lambda: fd.random.uniform(fd.random.split(KEY, 2), (2,)), fd.InputTypeError, ["keys[i]"]),
    (lambda: fd.random.split(KEY, -1), fd.InputTypeError, ["split(num)", "0 or more"]),
    (lambda: fd.random.fold_in(KEY, 1.5), fd.InputTypeError, ["fold_in(data)", "integer"]),
    (lambda: fd.random.fold_in(KEY, torch.arange(2)), fd.InputTypeError, ["fold_in(data)", "one element"]),
    (lambda: fd.random.normal(KEY, (2,), torch.int64), fd.InputTypeError, ["normal(dtype)", "floating"]),
    (lambda: fd.random.uniform(KEY, (2,), "float32"), fd.InputTypeError, ["uniform(dtype)", "torch.float32"]),
    (lambda: fd.random.uniform(KEY, (-1, 2)), fd.ShapeError, ["uniform(size)", "0 or more"]),
    (lambda: fd.random.bernoulli(KEY, 1.5, (2,)), fd.ShapeError, ["bernoulli(p)", "0 <= p <= 1"]),
    (lambda: fd.random.randint(KEY, (2,), 5, 5), fd.ShapeError, ["low < high"]),
    (lambda: fd.random.randint(KEY, (2,), 0, 5, torch.float32), fd.InputTypeError, ["integer dtype"]),
    (lambda: fd.random.randint(KEY, (2,), 0.5, 5), fd.InputTypeError, ["randint(low)"]),
    (
        lambda: fd.random.normal(KEY, (2,), placements=fd.P()),
        fd.InputTypeError,
        ["normal(placements)", "mesh"],
    ),
    (
        lambda: fd.random.normal(KEY, (2,), mesh=fd.simulated_mesh((2,), ("x",))),
        fd.InputTypeError,
        ["normal(placements)", "fd.P"],
    ),
    (lambda: fd.random.dropout(KEY, [1.0], 0.5), fd.InputTypeError, ["dropout(x)", "torch.Tensor"]),
    (lambda: fd.random.dropout(KEY, torch.ones(2), -0.1), fd.ShapeError, ["dropout(p)"]),
    (lambda: fd.random.normal(KEY, (2,), mean="0"), fd.InputTypeError, ["normal(mean)", "number"]),
]


@pytest.mark.parametrize("call, error, words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_gets_a_clear_error(call, error, words):
    check(error, TypeError if issubclass(error, TypeError) else ValueError, call, *words)
