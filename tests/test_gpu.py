"""The library on a CUDA device: the simulated mesh on one GPU and the distributed backend on NCCL.

Every test takes ``device``: ``"cpu"`` runs in the normal suite (so the test body is known to
run, and to fail where it should), ``"cuda"`` carries the ``gpu`` mark and is skipped without a
CUDA device. Each compares what runs on the device with the single-device reference in plain
torch, and with the same program on the CPU: the systematic ``shard_map`` catalogue, every
``fd.redistribute`` between the layouts of a 2 x 2 mesh, a catalogue of global ops, the
``fd.random`` draws (the same bits as the CPU's, whatever the mesh or layout), the example's
training (every step's loss and the final parameters equal to one device's), and the
distributed backend in a fresh process of world size 1 (NCCL on CUDA, gloo on the CPU).
``bench/gpu.py`` holds the GPU benchmarks.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from backends import Mesh, block, coordinates, events
from catalogue import cases, global_inputs, mapped, pick, reference
from common import assert_close, in_float64, op_catalogue

import functional_dtensor as fd
from functional_dtensor import _philox_native

ROOT = Path(__file__).resolve().parents[1]
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def on_cpu(tree):
    """Every tensor of a result moved to the CPU, for comparisons."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: on_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(on_cpu(v) for v in tree)
    return tree


def on_device(tree, device: str) -> None:
    """Every tensor of a result lives on ``device``."""
    for leaf in tree if isinstance(tree, (list, tuple)) else [tree]:
        assert leaf is None or leaf.device.type == device, (leaf.device, device)


def close(got, want, what: str) -> None:
    assert_close(got, want, msg=what)


# --- the systematic shard_map catalogue -----------------------------------------------------------

CATALOGUE_MESHES = [
    Mesh((4,), axes=("x",)),
    Mesh((2, 2), axes=("y",)),
    Mesh((2, 2), axes=("y", "x")),
    Mesh((2, 3, 2), axes=("z", "x")),
]
CASE_NAMES = [c.name for c in cases(fd.simulated_mesh(2, "x"), ("x",))]


def run_on(mesh: fd.DeviceMesh, axes, name: str, seed: int) -> dict:
    """One catalogue case with its inputs, and the cotangent of its output, on the mesh's
    device: the output's shards and global value, the inputs' gradients, the collectives."""
    device = mesh.device_type
    case = pick(mesh, axes, name)
    inputs = [t.to(device).requires_grad_() for t in global_inputs(case, seed=seed)]
    with fd.CommDebugMode() as forward:
        out = mapped(case, mesh)(*inputs)
    full = out.full_tensor()
    cotangent = torch.randn(full.shape, dtype=full.dtype, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(full, inputs, cotangent.to(device), allow_unused=True)
    on_device([full, *out.local_shards(), *grads], device)
    return {
        "full": full,
        "shards": list(out.local_shards()),
        "grads": [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads, strict=True)],
        "forward": events(forward),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mesh", CATALOGUE_MESHES, ids=str)
def test_the_catalogue_on_a_simulated_mesh_of_the_device(device, mesh):
    """Every catalogue case, values and gradients, on every device's block, as the plain-torch
    reference and as the same mesh on the CPU computes them, with the same collectives."""
    on_dev = fd.simulated_mesh(mesh.shape, mesh.names, device_type=device)
    on_host = fd.simulated_mesh(mesh.shape, mesh.names)
    for name in CASE_NAMES:
        got = run_on(on_dev, mesh.axes, name, seed=5)
        host = run_on(on_host, mesh.axes, name, seed=5)
        case = pick(on_host, mesh.axes, name)
        want = reference(case, seed=5)
        close(got["full"].cpu(), want["full"], f"{name} on {mesh}, {device}")
        for i, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            close(g.cpu(), w, f"{name} on {mesh}, {device}: gradient of input {i}")
        for d, coordinate in enumerate(coordinates(mesh.shape)):
            expected = block(want["full"], mesh.shape, mesh.names, case.out_specs, coordinate)
            close(got["shards"][d].cpu(), expected, f"{name} on {mesh}, {device}: device {d}")
            close(got["shards"][d].cpu(), host["shards"][d], f"{name} on {mesh}: device {d}, {device} vs cpu")
        assert got["forward"] == host["forward"], f"{name} on {mesh}: the collectives on {device}"
        assert Counter(op for op, _, _ in got["forward"]) == Counter(case.comm), name


def _square_sum(f, *args):
    out = f(*args)
    return (out.full_tensor() if isinstance(out, fd.DTensor) else out).square().sum()


@pytest.mark.parametrize("device", DEVICES)
def test_the_catalogue_under_torch_func_grad_and_vmap_on_the_device(device):
    sim = fd.simulated_mesh((2, 2), ("x", "y"), device_type=device)
    for case in cases(sim, ("y", "x")):
        inputs = [t.to(device) for t in global_inputs(case, seed=3)]
        argnums = tuple(range(len(inputs)))
        got = torch.func.grad(functools.partial(_square_sum, mapped(case, sim)), argnums=argnums)(*inputs)
        want = torch.func.grad(functools.partial(_square_sum, case.reference), argnums=argnums)(*inputs)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            on_device([g], device)
            close(g, w, f"{case.name}, {device}: torch.func.grad of input {i}")
        batch = [torch.stack([t, 2 * t]) for t in inputs]
        got = torch.func.vmap(lambda *a, case=case: mapped(case, sim)(*a).full_tensor())(*batch)
        close(got, torch.func.vmap(case.reference)(*batch), f"{case.name}, {device}: vmap")


# --- redistribute -----------------------------------------------------------------------------------

R, S, PARTIAL = fd.Replicate(), fd.Shard, fd.Partial()
LAYOUTS = [
    fd.P(),
    fd.P("x"),
    fd.P(None, "y"),
    fd.P("x", "y"),
    fd.P("y", "x"),
    fd.P(("x", "y")),
    fd.P(("y", "x")),
    fd.P(None, ("y", "x")),
    (PARTIAL, R),
    (S(1), PARTIAL),
    (PARTIAL, fd.Partial("max")),
]


def redistribute_all(device: str, shape) -> dict:
    """Every redistribute between two layouts of a 2 x 2 mesh of ``device``: the target's
    shards, the collectives, and the gradient of a loss in the source layout."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"), device_type=device)
    t = torch.arange(float(torch.tensor(shape).prod())).reshape(shape).to(device) / 7
    out = {}
    for a, b in itertools.permutations(range(len(LAYOUTS)), 2):
        x = fd.distribute_tensor(t, mesh, LAYOUTS[a])
        with fd.CommDebugMode() as comm:
            y = fd.redistribute(x, LAYOUTS[b])
        assert y.placements == fd.distribute_tensor(t, mesh, LAYOUTS[b]).placements, (a, b)
        on_device(list(y.local_shards()), device)
        out[a, b] = {"full": y.full_tensor(), "shards": list(y.local_shards()), "comm": events(comm)}
    for a, b in [(3, 4), (0, 5), (8, 1), (6, 2)]:  # the gradient flows back in the source layout
        leaf = t.clone().requires_grad_()
        y = fd.redistribute(fd.distribute_tensor(leaf, mesh, LAYOUTS[a]), LAYOUTS[b])
        (grad,) = torch.autograd.grad(y.full_tensor().square().sum(), leaf)
        out[a, b, "grad"] = grad
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(8, 8), (7, 5)], ids=["even", "uneven"])
def test_redistribute_on_the_device_equals_the_cpu(device, shape):
    got, host = redistribute_all(device, shape), redistribute_all("cpu", shape)
    t = torch.arange(float(torch.tensor(shape).prod())).reshape(shape) / 7
    for key, value in got.items():
        if key[-1] == "grad":
            close(value.cpu(), 2 * t, f"gradient of redistribute {key[:2]} on {device}")
            continue
        close(value["full"].cpu(), t, f"redistribute {LAYOUTS[key[0]]} -> {LAYOUTS[key[1]]} on {device}")
        for d, (a, b) in enumerate(zip(value["shards"], host[key]["shards"], strict=True)):
            close(a.cpu(), b, f"redistribute {key}: device {d}, {device} vs cpu")
        assert value["comm"] == host[key]["comm"], key


# --- global ops ---------------------------------------------------------------------------------------


def global_ops(device: str) -> dict:
    """A catalogue of global ops on several layouts of a 2 x 2 mesh of ``device``, and a small
    model's loss and gradients: every device's output shard."""
    mesh = fd.simulated_mesh((2, 2), ("x", "y"), device_type=device)
    g = torch.Generator().manual_seed(0)
    x, w = (
        torch.randn(8, 6, generator=g, dtype=torch.float64),
        torch.randn(6, 8, generator=g, dtype=torch.float64),
    )
    idx = torch.tensor([[0, 5], [7, 2], [3, 3], [1, 6]])
    out = {}
    for name, value in op_catalogue(mesh, x, w, idx).items():
        on_device(list(value.local_shards()), device)
        out[name] = list(value.local_shards())
    w1 = w.to(device).requires_grad_()
    h = torch.relu(fd.distribute_tensor(x, mesh, fd.P("x")) @ fd.distribute_tensor(w1, mesh, fd.P(None, "y")))
    loss = F.softmax(h, -1).square().sum()
    (out["w1 grad"],) = torch.autograd.grad(loss.full_tensor(), w1)
    out["loss"] = loss.full_tensor()
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_global_ops_on_the_device_equal_the_cpu(device):
    got, host = global_ops(device), global_ops("cpu")
    assert got.keys() == host.keys()
    for name, value in got.items():
        close(on_cpu(value), host[name], f"{name} on {device}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    w1 = torch.randn(6, 8, generator=g, dtype=torch.float64).requires_grad_()
    loss = F.softmax(torch.relu(x @ w1), -1).square().sum()
    close(got["loss"].cpu(), loss.detach(), "the model's loss against plain torch")
    close(got["w1 grad"].cpu(), torch.autograd.grad(loss, w1)[0], "the model's gradient against plain torch")


# --- random numbers ---------------------------------------------------------------------------------


def draws(key: torch.Tensor, mesh: fd.DeviceMesh) -> list[torch.Tensor]:
    """Draws of every kind and dtype on ``mesh``, in several layouts (uneven ones among them):
    their global values."""
    out = [
        fd.random.uniform(key, (9, 7), mesh=mesh, placements=fd.P("x", "y")),
        fd.random.uniform(key, (9, 7), torch.float64, mesh=mesh, placements=fd.P(("y", "x"))),
        fd.random.normal(key, (9, 7), torch.float64, mesh=mesh, placements=fd.P(None, ("y", "x"))),
        fd.random.normal(key, (9, 7), mesh=mesh, placements=fd.P("y")),
        fd.random.normal(key, (4, 6), torch.bfloat16, mesh=mesh, placements=fd.P("x")),
        fd.random.bernoulli(key, 0.3, (9, 7), mesh=mesh, placements=fd.P("x")),
        fd.random.randint(key, (9, 7), -3, 50, mesh=mesh, placements=fd.P("x")),
    ]
    return [d.full_tensor() for d in out]


@pytest.mark.parametrize("device", DEVICES)
def test_random_draws_on_the_device_are_the_cpus_bits(device, monkeypatch):
    """The CPU's draws (fused native kernels where a compiler is found) against the device's,
    which run the tensor-op path: on ``cpu`` the native kernels are turned off, so that the
    CPU runs the path a GPU runs."""
    key = fd.random.key(7)
    expected = draws(key, fd.simulated_mesh((2, 2), ("x", "y")))
    if device == "cpu":
        monkeypatch.setattr(_philox_native, "_library", False)
    for mesh in [
        fd.simulated_mesh((2, 2), ("x", "y"), device_type=device),
        fd.simulated_mesh((4, 1), ("x", "y"), device_type=device),
    ]:
        got = draws(key.to(device), mesh)
        on_device(got, device)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(a.cpu(), b), f"draw {i} on {mesh}"
    local = fd.random.normal(key.to(device), (5, 3))
    assert local.device.type == device and torch.equal(local.cpu(), fd.random.normal(key, (5, 3)))
    made_there = fd.random.normal(key, (5, 3), device=device)  # a CPU key, drawn on the device
    assert made_there.device.type == device and torch.equal(made_there.cpu(), local.cpu())


SHARDINGS = [
    ((1,), ("x",), fd.P()),
    ((8,), ("x",), fd.P("x")),
    ((2, 2), ("x", "y"), fd.P("y", "x")),
    ((2, 2), ("x", "y"), fd.P(None, ("y", "x"))),
    ((2, 3), ("x", "y"), fd.P(("x", "y"))),
    ((2, 2, 2), ("x", "y", "z"), fd.P("z", ("x", "y"))),
]


@pytest.mark.parametrize("device", DEVICES)
def test_random_draws_on_the_device_do_not_depend_on_the_sharding(device):
    key = fd.random.split(fd.random.key(3))[1].to(device)
    for shape, dtype in [((10, 9), torch.float32), ((6, 5), torch.float64)]:
        whole = fd.random.normal(key, shape, dtype)
        for mesh_shape, names, spec in SHARDINGS:
            mesh = fd.simulated_mesh(mesh_shape, names, device_type=device)
            x = fd.random.normal(key, shape, dtype, mesh=mesh, placements=spec)
            on_device(list(x.local_shards()), device)
            assert torch.equal(x.full_tensor(), whole), (mesh_shape, spec)


@pytest.mark.parametrize("device", DEVICES)
def test_per_device_draws_inside_shard_map_on_the_device(device):
    def per_device(key):
        return fd.random.uniform(fd.random.fold_in(key, fd.axis_index("x")), (3,))

    results = []
    for dev in ("cpu", device):
        mesh = fd.simulated_mesh(4, "x", device_type=dev)
        f = fd.shard_map(per_device, mesh=mesh, in_specs=fd.P(), out_specs=fd.P("x"))
        results.append(f(fd.random.key(11).to(dev)).full_tensor().cpu())
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0][:3], fd.random.uniform(fd.random.fold_in(fd.random.key(11), 0), (3,)))


# --- the training example ------------------------------------------------------------------------------

sys.path.insert(0, str(ROOT / "examples"))
import train_transformer as tt  # noqa: E402

SMALL = tt.Config(vocab=32, dim=16, heads=2, hidden=32, layers=1, seq=8, batch=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["tp", "sp+fsdp"])
def test_the_training_example_on_a_simulated_mesh_of_the_device(device, variant):
    """Three steps of the example's training on a 2 x 2 mesh of the device: every loss and the
    final parameters as on one device of that type (plain torch); the losses as on the CPU."""
    torch.manual_seed(0)
    model = tt.Transformer(SMALL)
    reference, trained = tt.train_single(model, SMALL, 3, device=device)
    reference64, trained64 = tt.train_single(in_float64(model), SMALL, 3, device=device)
    mesh = fd.simulated_mesh((2, 2), tt.axes_of(variant), device_type=device)
    losses, params, _, _ = tt.train_sharded(model, SMALL, mesh, variant, 3)
    for name, p in trained.named_parameters():
        on_device([p, *params[name].local_shards()], device)

    def run(losses, params, dtype):
        return {
            "losses": torch.tensor(losses, dtype=dtype),
            "params": {n: p.detach().cpu() for n, p in params},
        }

    want, want32 = (
        run(reference64, trained64.named_parameters(), torch.float64),
        run(reference, trained.named_parameters(), torch.float32),
    )
    got = run(losses, ((n, p.full_tensor()) for n, p in params.items()), torch.float32)
    assert_close(got, want, want32, msg=f"{variant} on {device}")
    on_host, _ = tt.train_single(model, SMALL, 3)  # the CPU's float32 training: as close as the device's own
    assert_close(torch.tensor(on_host), want["losses"], want32["losses"], msg=f"one {device} vs the CPU")
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("device", DEVICES)
def test_the_training_examples_command_on_the_device(device, capsys):
    """``python examples/train_transformer.py --device cuda``: it exits normally only if the
    sharded losses stay with the single-device ones."""
    tt.main(["--variant", "sp+fsdp", "--steps", "2", "--device", device])
    assert f"device_type='{device}'" in capsys.readouterr().out or device == "cpu"


# --- the distributed backend in a process of its own (NCCL on CUDA) -------------------------------------

WORLD_OF_ONE = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import functional_dtensor as fd

    device = sys.argv[1]
    mesh = fd.init_device_mesh(device, (1, 1), ("dp", "tp"))
    assert dist.get_backend() == ("nccl" if device == "cuda" else "gloo"), dist.get_backend()
    x = torch.arange(12.0).reshape(3, 4)
    f = fd.shard_map(lambda t: fd.psum(t, ("dp", "tp")) * 2, mesh=mesh, in_specs=fd.P("dp", "tp"),
                     out_specs=fd.P("dp", "tp"))
    y = f(x)
    assert y.to_local().device.type == device, y.to_local().device
    assert torch.equal(y.full_tensor().cpu(), 2 * x)
    z = fd.redistribute(fd.distribute_tensor(x, mesh, fd.P("tp")), fd.P(None, "dp"))
    assert torch.equal(z.full_tensor().cpu(), x)
    w = fd.from_local(x.to(device), mesh, fd.P("dp"), run_check=True)
    assert torch.equal(w.full_tensor().cpu(), x)
    key = fd.random.key(1)
    r = fd.random.normal(key, (5, 3), mesh=mesh, placements=fd.P("dp"))
    assert torch.equal(r.full_tensor().cpu(), fd.random.normal(key, (5, 3)))
    dist.destroy_process_group()
    print("world of one: ok")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.parametrize("device", DEVICES)
def test_the_distributed_backend_in_a_world_of_one(device):
    """``fd.init_device_mesh`` in a fresh process as torchrun starts it (world size 1): it
    creates the process group itself (NCCL on CUDA, gloo on the CPU) and runs a collective, a
    redistribute, a checked ``from_local`` and a random draw on the device."""
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", WORLD_OF_ONE, device], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "world of one: ok" in done.stdout


# --- the GPU benchmark ---------------------------------------------------------------------------------


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_the_gpu_benchmark_runs_on_the_cpu_at_small_sizes():
    """``bench/gpu.py --device cpu --quick``: every part runs and checks its values."""
    done = _bench("--device", "cpu", "--quick", "--reps", "2", "--compile-backend", "aot_eager")
    assert done.returncode == 0, done.stderr[-4000:]
    for title in (
        "bf16 TP MLP training step on cpu",
        "(compiled, aot_eager)",
        "fd.redistribute on a simulated",
    ):
        assert title in done.stdout, done.stdout
    assert "the example's training step" in done.stdout and "DIFFERENT" not in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_the_gpu_benchmark_without_a_gpu_says_so():
    done = _bench("--quick")
    assert done.returncode == 2
    assert "needs a CUDA device" in done.stderr and "--device cpu" in done.stderr


# --- tensors the library makes on the host (checked without a GPU) -----------------------------------

FACTORIES = {
    "tensor",
    "as_tensor",
    "arange",
    "zeros",
    "ones",
    "empty",
    "full",
    "eye",
    "rand",
    "randn",
    "randint",
}
HOST_ONLY_MODULES = {
    "_demo.py": "the demo's inputs, on CPU meshes",
    "_philox_native.py": "the CPU's C kernels",
}
#: (module, the call as ``ast.unparse`` writes it): why a tensor made without ``device=`` is right
HOST_TENSORS = {
    (
        "_blocks.py",
        "torch.tensor([len(info.shape), dtype, device, int(info.requires_grad), *shape], dtype=torch.int64)",
    ): "a shard's metadata, moved to the mesh's device before the all-gather",
    (
        "_distributed/runtime.py",
        "torch.tensor(group_ids(mesh), dtype=torch.int)",
    ): "rank ids for torch's DeviceMesh",
    ("_interop.py", "torch.arange(mesh.size, dtype=torch.int)"): "rank ids for torch's DeviceMesh",
    ("_explain.py", "torch.empty((), dtype=dtype)"): "an element size",
    ("_visualize.py", "torch.empty((), dtype=picture.dtype)"): "an element size",
    (
        "_shard_map.py",
        "torch.tensor(value)",
    ): "a number with spec P(), moved to the mesh's device with the other arguments",
    ("_simulated/engine.py", "torch.arange(size)"): "vmap's device count, dropped before the function runs",
    ("_random_draws.py", "torch.zeros(1, dtype=torch.int64)"): "runs of indices for the CPU's C kernels",
    (
        "_random_draws.py",
        "torch.full((1,), base, dtype=torch.int64)",
    ): "runs of indices for the CPU's C kernels",
    (
        "_random_draws.py",
        "torch.arange(local[d], dtype=torch.int64)",
    ): "runs of indices for the CPU's C kernels",
    (
        "random.py",
        "torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64)",
    ): "a seed, read into a Python int",
    ("_distributed/checks.py", "torch.empty(_SIZE, dtype=torch.uint8)"): "the collective checks' record, "
    "exchanged over their own gloo group (on the host whatever the mesh's device)",
}


def host_tensors() -> set[tuple[str, str]]:
    """Every ``torch.<factory>(...)`` call of the library without a ``device=`` argument."""
    import ast

    package = ROOT / "functional_dtensor"
    found = set()
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module in HOST_ONLY_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                found.add((module, ast.unparse(node)))
    return found


def test_the_library_makes_tensors_on_the_host_only_where_that_is_right():
    """A tensor made without ``device=`` lives on the CPU: next to CUDA tensors it is an error
    or a copy per call. Each such call is listed with its reason; a new one needs its own."""
    unexplained = host_tensors() - HOST_TENSORS.keys()
    assert not unexplained, f"tensors made on the host, next to the mesh's device: {sorted(unexplained)}"
