"""Invalid inputs: each raises the library's own exception, which is also the fitting builtin,
and whose message names the API and argument, says what was expected and what was got, and
ends with the fix."""

# ruff: noqa: E501  (the table keeps one invalid input per line)
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import functional_dtensor as fd

MESH = fd.simulated_mesh((2, 2), ("x", "y"))
MESH_1D = fd.simulated_mesh(4, "x")
T = torch.arange(12.0).reshape(3, 4)


def _distributed(placements, shape=(4, 4), mesh=MESH):
    return fd.distribute_tensor(torch.zeros(shape), mesh, placements)


def _strictly(op, *args):
    with fd.strict_ops():
        return op(*args)


# (id, call, library error, builtin, text the message must contain: the argument, the values)
# fmt: off
CASES = [
    # --- placements
    ("shard-dim-str", lambda: fd.Shard("0"), fd.InputTypeError, TypeError, ["fd.Shard(dim)", "'0'"]),
    ("shard-dim-float", lambda: fd.Shard(1.0), fd.InputTypeError, TypeError, ["fd.Shard(dim)", "1.0"]),
    ("shard-dim-bool", lambda: fd.Shard(True), fd.InputTypeError, TypeError, ["fd.Shard(dim)", "True"]),
    ("partial-op", lambda: fd.Partial("prod"), fd.LayoutError, ValueError, ["fd.Partial(op)", "'prod'", "'sum'"]),
    # --- P
    ("spec-entry-type", lambda: fd.P(0), fd.InputTypeError, TypeError, ["fd.P(entries[0])", "0"]),
    ("spec-entry-names", lambda: fd.P(None, ("x", 1)), fd.InputTypeError, TypeError, ["entries[1]", "('x', 1)"]),
    ("spec-axis-twice", lambda: fd.P("x", "x"), fd.LayoutError, ValueError, ["entries[1]", "'x'", "entries[0]"]),
    ("spec-axis-twice-tuple", lambda: fd.P(("x", "y"), None, "y"), fd.LayoutError, ValueError, ["entries[2]", "'y'"]),
    # --- meshes
    ("mesh-names-mismatch", lambda: fd.simulated_mesh((2, 2), ("x",)), fd.MeshError, ValueError, ["axis_names", "2 names", "('x',)"]),
    ("mesh-repeated-names", lambda: fd.simulated_mesh((2, 2), ("x", "x")), fd.MeshError, ValueError, ["axis_names", "('x', 'x')"]),
    ("mesh-zero-size", lambda: fd.simulated_mesh((2, 0), ("x", "y")), fd.MeshError, ValueError, ["fd.DeviceMesh(shape)", "(2, 0)"]),
    ("mesh-empty-shape", lambda: fd.DeviceMesh((), ()), fd.MeshError, ValueError, ["fd.DeviceMesh(shape)", "()"]),
    ("mesh-size-type", lambda: fd.simulated_mesh((2.0,), ("x",)), fd.InputTypeError, TypeError, ["fd.DeviceMesh(shape)", "2.0"]),
    ("mesh-name-type", lambda: fd.simulated_mesh((2,), (3,)), fd.InputTypeError, TypeError, ["axis_names", "(3,)"]),
    ("mesh-name-identifier", lambda: fd.simulated_mesh((2,), ("a b",)), fd.InputTypeError, TypeError, ["axis_names", "'a b'"]),
    ("mesh-size-float", lambda: fd.simulated_mesh(4.0, "x"), fd.InputTypeError, TypeError, ["fd.DeviceMesh(shape)", "4.0"]),
    ("mesh-device-type-gpu", lambda: fd.simulated_mesh(2, "x", device_type="gpu"), fd.MeshError, ValueError, ["fd.simulated_mesh(device_type)", "'gpu'", "'cuda'"]),
    ("mesh-device-type-int", lambda: fd.simulated_mesh(2, "x", device_type=0), fd.MeshError, ValueError, ["fd.simulated_mesh(device_type)", "0"]),
    ("mesh-backend", lambda: fd.DeviceMesh((2,), ("x",), backend="nope"), fd.MeshError, ValueError, ["fd.DeviceMesh(backend)", "'nope'", "'simulated'"]),
    ("mesh-device-ids", lambda: fd.DeviceMesh((2,), ("x",), device_ids=(0, 0)), fd.MeshError, ValueError, ["device_ids", "(0, 0)"]),
    ("mesh-unknown-axis", lambda: MESH["z"], fd.MeshError, ValueError, ["'z'", "('x', 'y')"]),
    ("mesh-axis-size", lambda: MESH.axis_size("z"), fd.MeshError, ValueError, ["'z'", "('x', 'y')"]),
    # --- layouts
    ("layout-mesh-type", lambda: fd.Layout("mesh", (fd.Shard(0),)), fd.InputTypeError, TypeError, ["fd.Layout(mesh)", "str"]),
    ("layout-placement-type", lambda: fd.Layout(MESH, (fd.Shard(0), "R")), fd.InputTypeError, TypeError, ["placements[1]", "'R'"]),
    ("layout-count", lambda: fd.Layout(MESH, (fd.Shard(0),)), fd.LayoutError, ValueError, ["fd.Layout(placements)", "2 for mesh axes", "1: S(0)"]),
    ("from-spec-type", lambda: fd.Layout.from_spec(MESH, ("x",)), fd.InputTypeError, TypeError, ["from_spec(spec)", "('x',)"]),
    ("spec-of-partial", lambda: fd.Layout(MESH, (fd.Partial(), fd.Shard(0))).spec, fd.LayoutError, ValueError, ["fd.Layout.spec", "'x'", "P(sum)S(0)"]),
    ("spec-of-negative-dim", lambda: fd.Layout(MESH_1D, (fd.Shard(-1),)).spec, fd.LayoutError, ValueError, ["fd.Layout.spec", "S(-1)"]),
    ("shard-order-repeats-an-axis", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((0, (0, 0)),)), fd.LayoutError, ValueError, ["fd.Layout(shard_order)", "a permutation of (0, 1)", "(0, 0)"]),
    ("shard-order-misses-an-axis", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((0, (1,)),)), fd.LayoutError, ValueError, ["fd.Layout(shard_order)", "a permutation of (0, 1)", "(1,)"]),
    ("shard-order-of-an-unsplit-dim", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((1, (1, 0)),)), fd.LayoutError, ValueError, ["order of dim 1", "a permutation of ()"]),
    ("shard-order-dim-twice", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), ((0, (1, 0)), (0, (1, 0)))), fd.LayoutError, ValueError, ["one entry per dim", "each dim at most once"]),
    ("shard-order-type", lambda: fd.Layout(MESH, (fd.Shard(0), fd.Shard(0)), "yx"), fd.InputTypeError, TypeError, ["fd.Layout(shard_order)", "(dim, axes) pairs", "'yx'"]),
    ("normalized-out-of-range", lambda: fd.Layout(MESH_1D, (fd.Shard(2),)).normalized(2), fd.LayoutError, ValueError, ["placements[0]", "[-2, 2)", "2"]),
    # --- distribute_tensor
    ("distribute-unknown-axis", lambda: fd.distribute_tensor(T, MESH, fd.P("z")), fd.LayoutError, ValueError, ["fd.distribute_tensor(placements)(spec[0])", "'z'", "('x', 'y')"]),
    ("distribute-shard-dim", lambda: fd.distribute_tensor(T, MESH, [fd.Shard(2), fd.Replicate()]), fd.LayoutError, ValueError, ["fd.distribute_tensor(placements[0])", "2-d", "[-2, 2)"]),
    ("distribute-shard-negative-dim", lambda: fd.distribute_tensor(T, MESH, [fd.Shard(-3), fd.Replicate()]), fd.LayoutError, ValueError, ["placements[0]", "-3"]),
    ("distribute-0d-shard", lambda: fd.distribute_tensor(torch.tensor(1.0), MESH_1D, [fd.Shard(0)]), fd.LayoutError, ValueError, ["placements[0]", "0-d", "replicated or partial"]),
    ("distribute-count", lambda: fd.distribute_tensor(T, MESH, [fd.Shard(0)]), fd.LayoutError, ValueError, ["fd.distribute_tensor(placements)", "2 for mesh axes", "1: S(0)"]),
    ("distribute-meta", lambda: fd.distribute_tensor(torch.empty(4, 2, device="meta"), MESH_1D, fd.P("x")), fd.InputTypeError, TypeError, ["fd.distribute_tensor(tensor)", "meta tensor", "to_empty"]),
    ("distribute-placement-type", lambda: fd.distribute_tensor(T, MESH, ["S0", fd.Replicate()]), fd.InputTypeError, TypeError, ["fd.distribute_tensor(placements[0])", "'S0'"]),
    ("distribute-placements-type", lambda: fd.distribute_tensor(T, MESH, "x"), fd.InputTypeError, TypeError, ["fd.distribute_tensor(placements)", "str"]),
    ("distribute-list", lambda: fd.distribute_tensor([1.0, 2.0], MESH_1D, fd.P()), fd.InputTypeError, TypeError, ["fd.distribute_tensor(tensor)", "list", "torch.as_tensor"]),
    ("distribute-dtensor", lambda: fd.distribute_tensor(_distributed(fd.P()), MESH, fd.P()), fd.InputTypeError, TypeError, ["fd.distribute_tensor(tensor)", "DTensor(", "fd.redistribute"]),
    ("distribute-spec-too-long", lambda: fd.distribute_tensor(T, MESH, fd.P("x", "y", None)), fd.LayoutError, ValueError, ["fd.distribute_tensor(placements)", "3 entries", "2-d", "at most 2"]),
    ("distribute-mesh-type", lambda: fd.distribute_tensor(T, (2, 2), fd.P()), fd.InputTypeError, TypeError, ["device_mesh", "tuple"]),
    ("distribute-layout-other-mesh", lambda: fd.distribute_tensor(T, MESH, fd.Layout(MESH_1D, (fd.Shard(0),))), fd.MeshError, ValueError, ["fd.distribute_tensor(placements)", "another mesh", repr(MESH_1D), repr(MESH)]),
    # --- from_local
    ("from-local-type", lambda: fd.from_local("shard", MESH, fd.P()), fd.InputTypeError, TypeError, ["fd.from_local(local_tensor)", "str"]),
    ("from-local-element-type", lambda: fd.from_local([T, T, T, [1]], MESH, fd.P()), fd.InputTypeError, TypeError, ["local_tensor[3]", "list"]),
    ("from-local-count", lambda: fd.from_local([T, T], MESH, fd.P()), fd.ShapeError, ValueError, ["fd.from_local(local_tensor)", "4 tensors", "2"]),
    ("from-local-shape", lambda: fd.from_local(torch.zeros(2, 2), MESH_1D, fd.P("x"), shape=(9, 2)), fd.ShapeError, ValueError, ["fd.from_local(local_tensor)", "(3, 2)", "(2, 2)", "shape="]),
    ("from-local-shard-shape", lambda: fd.from_local([torch.zeros(2)] * 4, MESH_1D, fd.P("x"), shape=(7,)), fd.ShapeError, ValueError, ["device 3", "(1,)", "(2,)"]),
    ("from-local-rank", lambda: fd.from_local(torch.zeros(2, 2), MESH_1D, fd.P("x"), shape=(8,)), fd.ShapeError, ValueError, ["fd.from_local(shape)", "2 sizes", "(8,)"]),
    ("from-local-uneven-single", lambda: fd.from_local(torch.zeros(2), MESH_1D, fd.P("x"), shape=(7,)), fd.ShapeError, ValueError, ["fd.from_local(local_tensor)", "unevenly", "list"]),
    ("from-local-replicas", lambda: fd.from_local([torch.zeros(2)] * 3 + [torch.ones(2)], MESH_1D, fd.P(), run_check=True), fd.LayoutError, ValueError, ["fd.from_local(local_tensor)", "'x'", "Replicate"]),
    ("from-local-unknown-axis", lambda: fd.from_local(T, MESH, fd.P("z")), fd.LayoutError, ValueError, ["fd.from_local(placements)(spec[0])", "'z'"]),
    ("from-local-fd-dtensor", lambda: fd.from_local(_distributed(fd.P("x")), MESH, fd.P("x")), fd.InputTypeError, TypeError, ["fd.from_local(local_tensor)", "already an fd.DTensor", "fd.redistribute", "local_shards()"]),
    ("from-local-fd-dtensor-in-list", lambda: fd.from_local([T, _distributed(fd.P())], MESH, fd.P()), fd.InputTypeError, TypeError, ["local_tensor[1]", "already an fd.DTensor"]),
    ("from-local-shape-rank", lambda: fd.from_local(torch.zeros(2), MESH_1D, fd.P("x"), shape=(8, 1), run_check=True), fd.ShapeError, ValueError, ["fd.from_local(shape)", "1 sizes", "(8, 1)"]),
    ("from-local-mesh-type", lambda: fd.from_local(T, "mesh", fd.P()), fd.InputTypeError, TypeError, ["fd.from_local(device_mesh)", "str"]),
    # --- DTensor
    ("to-local-no-device", lambda: _distributed(fd.P("x")).to_local(), fd.InputTypeError, TypeError, ["fd.DTensor.to_local(device)", "None", "local_shards()"]),
    ("to-local-bad-index", lambda: _distributed(fd.P("x")).to_local(device=4), fd.InputTypeError, TypeError, ["to_local(device)", "[0, 4)", "4"]),
    ("to-local-bad-coordinate", lambda: _distributed(fd.P("x")).to_local(device=(0, 2)), fd.InputTypeError, TypeError, ["to_local(device)", "(2, 2)", "(0, 2)"]),
    # --- factories
    ("zeros-unknown-axis", lambda: fd.zeros(4, 4, mesh=MESH, placements=fd.P("z")), fd.LayoutError, ValueError, ["fd.zeros(placements)", "'z'"]),
    ("ones-shard-dim", lambda: fd.ones((4,), mesh=MESH_1D, placements=[fd.Shard(1)]), fd.LayoutError, ValueError, ["fd.ones(placements[0])", "1-d"]),
    ("full-count", lambda: fd.full((4,), 1.0, mesh=MESH, placements=[fd.Shard(0)]), fd.LayoutError, ValueError, ["fd.full(placements)", "2 for mesh axes"]),
    ("full-size-type", lambda: fd.full("8", 1.0, mesh=MESH_1D, placements=fd.P()), fd.InputTypeError, TypeError, ["fd.full(size)", "'8'"]),
    ("zeros-size-type", lambda: fd.zeros(4, 2.5, mesh=MESH_1D, placements=fd.P()), fd.InputTypeError, TypeError, ["fd.zeros(size)", "(4, 2.5)"]),
    ("zeros-negative-size", lambda: fd.zeros(-1, 4, mesh=MESH_1D, placements=fd.P()), fd.ShapeError, ValueError, ["fd.zeros(size)", "(-1, 4)", "0 or more"]),
    ("ones-negative-size-tuple", lambda: fd.ones((4, -2), mesh=MESH_1D, placements=fd.P()), fd.ShapeError, ValueError, ["fd.ones(size)", "(4, -2)"]),
    ("zeros-dtype-str", lambda: fd.zeros(4, mesh=MESH_1D, placements=fd.P(), dtype="float32"), fd.InputTypeError, TypeError, ["fd.zeros(dtype)", "'float32'", "torch.float32"]),
    ("full-dtype-str", lambda: fd.full((4,), 1, mesh=MESH_1D, placements=fd.P(), dtype="int64"), fd.InputTypeError, TypeError, ["fd.full(dtype)", "'int64'", "torch.int64"]),
    ("rand-mesh-type", lambda: fd.rand(4, mesh=None, placements=fd.P()), fd.InputTypeError, TypeError, ["fd.rand(device_mesh)", "NoneType"]),
    # --- collectives and the per-device function
    ("psum-axis-position", lambda: _map_1d(lambda v: fd.psum(v, 0)), fd.InputTypeError, TypeError, ["fd.psum(axis_name)", "got 0", "name"]),
    ("all-gather-axis-none", lambda: _map_1d(lambda v: fd.all_gather(v, None)), fd.InputTypeError, TypeError, ["fd.all_gather(axis_name)", "None"]),
    ("ppermute-destinations", lambda: _map_1d(lambda v: fd.ppermute(v, "x", [1, 2, 3, 0])), fd.InputTypeError, TypeError, ["fd.ppermute(perm)", "[1, 2, 3, 0]", "pairs"]),
    ("ppermute-dict", lambda: _map_1d(lambda v: fd.ppermute(v, "x", {0: 1, 1: 2, 2: 3, 3: 0})), fd.InputTypeError, TypeError, ["fd.ppermute(perm)", "{0: 1", "pairs"]),
    ("ppermute-iterator", lambda: _map_1d(lambda v: fd.ppermute(v, "x", iter([(0, 1), (1, 0)]))), fd.InputTypeError, TypeError, ["fd.ppermute(perm)", "iterator", "list"]),
    ("ppermute-triples", lambda: _map_1d(lambda v: fd.ppermute(v, "x", [(0, 1, 2)])), fd.InputTypeError, TypeError, ["fd.ppermute(perm)", "(0, 1, 2)"]),
    ("item-in-f", lambda: _map_1d(lambda v: v * v.sum().item()), fd.BatchedFunctionError, RuntimeError, ["fd.shard_map(f)", ".item()", "batched", "torch.where"]),
    ("if-on-a-value-in-f", lambda: _map_1d(lambda v: v if v.sum() > 0 else -v), fd.BatchedFunctionError, RuntimeError, ["fd.shard_map(f)", "if or while", "torch.where"]),
    ("shard-map-kwargs", lambda: _map_1d(lambda v, w=None: v, w=torch.ones(4)), fd.InputTypeError, TypeError, ["fd.shard_map(f)(**kwargs)", "w", "functools.partial"]),
    ("shard-map-scalar-sharded", lambda: fd.shard_map(lambda v: v, mesh=MESH_1D, in_specs=fd.P("x"), out_specs=fd.P())(2.0), fd.InputTypeError, TypeError, ["fd.shard_map(args[0])", "P('x')", "float"]),
    # --- global operations
    ("global-op-mixed-tensor", lambda: _distributed(fd.P("x")) + torch.ones(4, 4), fd.InputTypeError, TypeError, ["torch.Tensor", "fd.distribute_tensor"]),
    ("global-op-no-rule-strict", lambda: _strictly(torch.fft.fft, _distributed(fd.P("x"))), fd.FunctionalDTensorError, Exception, ["fft", "strict", "fd.local_map", "fd.register_sharding"]),
    ("global-op-draws-random", lambda: torch.bernoulli(_distributed(fd.P("x"))), fd.FunctionalDTensorError, Exception, ["bernoulli", "global generator", "fd.random.bernoulli"]),
    ("tensor-attribute-not-global", lambda: _distributed(fd.P("x")).stride(), fd.UnsupportedAttributeError, AttributeError, ["stride", "to_local"]),
    ("global-op-shapes", lambda: _distributed(fd.P("x")) @ _distributed(fd.P(), shape=(3, 4)), fd.ShapeError, ValueError, ["matmul", "(4, 4)", "(3, 4)"]),
    ("global-op-two-meshes", lambda: _distributed(fd.P("x")) + _distributed(fd.P("x"), mesh=MESH_1D), fd.MeshError, ValueError, ["mesh"]),
    ("cross-entropy-target-outside", lambda: F.cross_entropy(_distributed(fd.P(None, "x")), fd.distribute_tensor(torch.tensor([0, 1, 2, 4]), MESH, fd.P())), fd.InputTypeError, TypeError, ["cross_entropy(target)", "[0, 4)", "[4]"]),
    ("cross-entropy-target-shape", lambda: F.cross_entropy(_distributed(fd.P(None, "x")), fd.distribute_tensor(torch.tensor([0, 1, 2]), MESH, fd.P())), fd.ShapeError, ValueError, ["cross_entropy(target)", "(4,)", "(3,)"]),
    ("gather-sparse-grad", lambda: _distributed(fd.P("x")).gather(1, fd.distribute_tensor(torch.zeros(4, 1, dtype=torch.long), MESH, fd.P()), sparse_grad=True), fd.InputTypeError, TypeError, ["torch.gather(sparse_grad)", "dense"]),
    ("gather-index-outside", lambda: torch.gather(_distributed(fd.P(None, "x")), 1, fd.distribute_tensor(torch.tensor([[0], [9], [1], [2]]), MESH, fd.P())), fd.InputTypeError, TypeError, ["torch.gather(index)", "[0, 4)", "9"]),
    ("matmul-scalar", lambda: _distributed(fd.P("x")) @ _distributed(fd.P(), shape=()), fd.ShapeError, ValueError, ["torch.matmul", "()", "torch.mul"]),
    ("in-place-method", lambda: _distributed(fd.P("x")).add_(1), fd.ImmutableError, Exception, ["add_", "x.add(...)"]),
    ("setitem", lambda: _distributed(fd.P("x")).__setitem__(0, 1.0), fd.ImmutableError, Exception, ["fd.DTensor.__setitem__", "immutable"]),
    # --- module sharding, the optimizer, clipping
    ("plan-not-a-dict", lambda: fd.parallelize_module(torch.nn.Linear(4, 4), MESH, [("", fd.ColwiseParallel("x"))]), fd.InputTypeError, TypeError, ["parallelize_plan", "dict"]),
    ("plan-no-module", lambda: fd.parallelize_module(torch.nn.Linear(4, 4), MESH, {"nope": fd.ColwiseParallel("x")}), fd.LayoutError, ValueError, ["parallelize_plan['nope']", "matches no module"]),
    ("plan-unknown-string", lambda: fd.parallelize_module(torch.nn.Linear(4, 4), MESH, {"": "colwize"}), fd.InputTypeError, TypeError, ["parallelize_plan['']", "'colwize'", "'colwise'"]),
    ("plan-string-without-tp", lambda: fd.parallelize_module(torch.nn.Linear(4, 4), MESH, {"": "colwise"}), fd.InputTypeError, TypeError, ["parallelize_plan['']", '"tp" axis', "('x', 'y')"]),
    ("prepare-input-arity", lambda: fd.PrepareModuleInput(input_layouts=(fd.Replicate(), fd.Replicate()), desired_input_layouts=(fd.Shard(0),)), fd.InputTypeError, TypeError, ["desired_input_layouts", "2 desired layouts"]),
    ("plan-unknown-axis", lambda: fd.parallelize_module(torch.nn.Linear(4, 4), MESH, {"": fd.ColwiseParallel("tp")}), fd.LayoutError, ValueError, ["'tp'", "('x', 'y')"]),
    ("plan-colwise-conv", lambda: fd.parallelize_module(torch.nn.Conv1d(1, 1, 1), MESH, {"": fd.ColwiseParallel("x")}), fd.InputTypeError, TypeError, ["ColwiseParallel", "Conv1d", "distribute_module"]),
    ("module-not-a-module", lambda: fd.parallelize_module(lambda x: x, MESH, {}), fd.InputTypeError, TypeError, ["fd.parallelize_module(module)", "function"]),
    ("apply-missing-params", lambda: fd.parallelize_module(torch.nn.Linear(4, 4), MESH, {}).apply({}, T), fd.InputTypeError, TypeError, ["missing ['bias', 'weight']"]),
    ("optimizer-not-elementwise", lambda: fd.Optimizer(torch.optim.LBFGS, {"w": _distributed(fd.P("x"))}), fd.InputTypeError, TypeError, ["elementwise", "LBFGS"]),
    ("optimizer-instance", lambda: fd.Optimizer(torch.optim.SGD([torch.zeros(1)], lr=1.0), {"w": _distributed(fd.P("x"))}), fd.InputTypeError, TypeError, ["fd.Optimizer(optimizer)", "torch.optim.AdamW"]),
    ("optimizer-tensor-param", lambda: fd.Optimizer(torch.optim.SGD, {"w": torch.ones(2)}, lr=1.0), fd.InputTypeError, TypeError, ["params['w']", "Tensor"]),
    ("optimizer-partial-param", lambda: fd.Optimizer(torch.optim.SGD, {"w": _distributed((fd.Partial(), fd.Replicate()))}, lr=1.0), fd.LayoutError, ValueError, ["params['w']", "P(sum)"]),
    ("optimizer-step-structure", lambda: fd.Optimizer(torch.optim.SGD, {"w": _distributed(fd.P("x"))}, lr=1.0).step({"w": _distributed(fd.P("x"))}, {"v": _distributed(fd.P("x"))}), fd.InputTypeError, TypeError, ["grads", "structure"]),
    ("clip-tensor", lambda: fd.clip_grad_norm({"w": torch.ones(2)}, 1.0), fd.InputTypeError, TypeError, ["fd.clip_grad_norm(grads['w'])", "Tensor"]),
    ("clip-norm-type", lambda: fd.clip_grad_norm({"w": _distributed(fd.P("x"))}, 1.0, norm_type=0), fd.InputTypeError, TypeError, ["norm_type", "0.0"]),
    # --- random numbers, visualizing, interop, attention
    ("random-not-a-key", lambda: fd.random.normal(torch.tensor([1, 2, 3]), (4,)), fd.InputTypeError, TypeError, ["key"]),
    ("visualize-layout-no-shape", lambda: fd.visualize_sharding(fd.Layout(MESH, fd.P("x"))), fd.InputTypeError, TypeError, ["shape"]),
    ("visualize-not-a-value", lambda: fd.visualize_sharding(torch.ones(2)), fd.InputTypeError, TypeError, ["fd.sharding_picture(x)", "Tensor"]),
    ("to-torch-tensor", lambda: fd.to_torch(torch.ones(2)), fd.InputTypeError, TypeError, ["fd.to_torch", "Tensor"]),
    ("from-torch-tensor", lambda: fd.from_torch(torch.ones(2)), fd.InputTypeError, TypeError, ["fd.from_torch", "Tensor"]),
    ("ring-attention-outside", lambda: fd.ring_attention(torch.ones(1, 2, 4, 2), torch.ones(1, 2, 4, 2), torch.ones(1, 2, 4, 2), "x"), fd.AxisNameError, Exception, ["fd.ring_attention", "shard_map"]),
    ("layout-spec-and-order", lambda: fd.Layout(MESH, fd.P(("x", "y")), ((0, (1, 0)),)), fd.LayoutError, ValueError, ["fd.Layout(shard_order)", "fd.P(('tp', 'dp'))"]),
    ("set-logs-unknown", lambda: fd.set_logs("nothing"), fd.InputTypeError, TypeError, ["nothing"]),
    ("checkpoint-missing", lambda: fd.checkpoint.load("/nonexistent/ckpt", {"w": 0}), fd.CheckpointError, ValueError, ["/nonexistent/ckpt"]),
    ("checkpoint-torch-module", lambda: fd.checkpoint.save("/tmp/never", {"m": torch.nn.Linear(2, 2)}), fd.InputTypeError, TypeError, ["Linear"]),
    ("optimizer-load-unknown", lambda: fd.Optimizer(torch.optim.SGD, {"w": _distributed(fd.P("x"))}, lr=1.0).load_state_dict({"state": {"['v']": {}}, "param_groups": []}), fd.InputTypeError, TypeError, ["['v']"]),
    ("optimizer-load-not-a-state", lambda: fd.Optimizer(torch.optim.SGD, {"w": _distributed(fd.P("x"))}, lr=1.0).load_state_dict([]), fd.InputTypeError, TypeError, ["state_dict"]),
    ("distribute-module-partition", lambda: fd.distribute_module(torch.nn.Linear(4, 4), MESH, lambda name, m, mesh: {"nope": [fd.Shard(0), fd.Replicate()]}), fd.LayoutError, ValueError, ["'nope'", "['bias', 'weight']"]),
    ("distribute-module-partition-type", lambda: fd.distribute_module(torch.nn.Linear(4, 4), MESH, lambda name, m, mesh: [fd.Shard(0)]), fd.InputTypeError, TypeError, ["partition_fn", "list"]),
    ("context-parallel-uneven", lambda: fd.context_parallel_attention(*[fd.distribute_tensor(torch.ones(1, 2, 6, 4), MESH_1D, fd.P(None, None, "x")) for _ in range(3)], "x"), fd.ShapeError, ValueError, ["6"]),
    ("context-parallel-axis", lambda: fd.context_parallel_attention(*[fd.distribute_tensor(torch.ones(1, 2, 8, 4), MESH_1D, fd.P(None, None, "x")) for _ in range(3)], "nope"), fd.AxisNameError, Exception, ["'nope'"]),
    ("explain-not-an-op-input", lambda: fd.explain(torch.add, torch.ones(2), torch.ones(2)), fd.InputTypeError, TypeError, ["fd.DTensor"]),
    ("autograd-grad-no-grad", lambda: torch.autograd.grad(_distributed(fd.P("x")).sum(), [_distributed(fd.P("x"))]), fd.InputTypeError, TypeError, ["torch.autograd.grad(inputs[0])", "requires_grad=False", "requires_grad_()"]),
    ("redistribute-plain-tensor", lambda: fd.redistribute(torch.ones(2), fd.P()), fd.InputTypeError, TypeError, ["fd.redistribute(x)", "fd.distribute_tensor"]),
]
# fmt: on


def _map_1d(f, *args, **kwargs):
    """``f`` mapped over ``MESH_1D`` on rows, called on ``torch.arange(4.0)`` (and ``args``)."""
    return fd.shard_map(f, mesh=MESH_1D, in_specs=fd.P("x"), out_specs=fd.P("x"))(
        torch.arange(4.0), *args, **kwargs
    )


@pytest.mark.parametrize("call, error, builtin, mentions", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_input_raises_a_teaching_error(call, error, builtin, mentions):
    with pytest.raises(fd.FunctionalDTensorError) as info:
        call()
    exc = info.value
    assert type(exc) is error, f"raised {type(exc).__name__}, expected {error.__name__}"
    assert isinstance(exc, builtin) and issubclass(error, builtin)
    assert not isinstance(exc, AssertionError)
    message = str(exc)
    assert message.startswith(("fd.", "torch.")), message  # names the API (a torch op on fd.DTensor)
    assert ": expected " in message and ", got " in message, message
    assert ". Fix: " in message and not message.rstrip().endswith("Fix:"), message
    for text in mentions:
        assert text in message, f"{text!r} not in {message!r}"


def test_every_error_class_is_also_a_builtin():
    pairs = {
        fd.LayoutError: ValueError,
        fd.MeshError: ValueError,
        fd.SpecError: ValueError,
        fd.ShapeError: ValueError,
        fd.InputTypeError: TypeError,
        fd.AxisNameError: NameError,
        fd.CommunicationError: RuntimeError,
        fd.CollectiveMismatchError: RuntimeError,
    }
    for error, builtin in pairs.items():
        assert issubclass(error, fd.FunctionalDTensorError) and issubclass(error, builtin)
    assert issubclass(fd.CollectiveMismatchError, fd.CommunicationError)


# ---------------------------------------------------------------------------------------------
# Inputs that look odd but are valid.


def test_negative_shard_dims_are_normalized():
    x = fd.distribute_tensor(T, MESH, [fd.Shard(-1), fd.Shard(-2)])
    assert x.placements == (fd.Shard(1), fd.Shard(0))
    assert x.sharding == fd.Layout(MESH, (fd.Shard(1), fd.Shard(0)))
    assert torch.equal(x.full_tensor(), T)
    y = fd.from_local([s for s in x.local_shards()], MESH, [fd.Shard(-1), fd.Shard(0)], shape=(3, 4))
    assert y.placements == x.placements and torch.equal(y.full_tensor(), T)
    assert fd.zeros(3, 4, mesh=MESH, placements=[fd.Shard(-1), fd.Replicate()]).placements[0] == fd.Shard(1)


def test_single_placement_and_lists_are_accepted():
    a = fd.distribute_tensor(T, MESH_1D, fd.Shard(0))
    b = fd.distribute_tensor(T, MESH_1D, [fd.Shard(0)])
    c = fd.distribute_tensor(T, MESH_1D, fd.P("x"))
    d = fd.distribute_tensor(T, MESH_1D, fd.Layout(MESH_1D, (fd.Shard(0),)))
    assert a.sharding == b.sharding == c.sharding == d.sharding


def test_error_messages_read_in_one_form():
    with pytest.raises(fd.LayoutError) as info:
        fd.distribute_tensor(T, MESH, fd.P(("z", "x")))
    assert str(info.value) == (
        "fd.distribute_tensor(placements)(spec[0]): unknown mesh axis 'z': expected an axis of the "
        "mesh, one of ('x', 'y'), got 'z'. Fix: use the mesh's axis names, or build the mesh with "
        "this axis"
    )


# ---------------------------------------------------------------------------------------------
# The same errors on both backends, raised in every process before any collective runs


def _shard_map(mesh, f, in_specs, out_specs):
    return fd.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


# (call on a 2-device mesh 'x' or a 2 x 2 mesh ('x', 'y'), library error, text of the message)
BOTH_BACKENDS = [
    (
        lambda m: _shard_map(m, lambda v: v, fd.P("x"), fd.P("x"))(torch.ones(5)),
        fd.ShapeError,
        "5 = 2 * 2 + 1",
    ),
    (lambda m: _shard_map(m, lambda v: v, fd.P("x"), fd.P())(torch.ones(4)), fd.SpecError, "check_rep=False"),
    (
        lambda m: _shard_map(m, lambda v: fd.psum(v, "z"), fd.P("x"), fd.P())(torch.ones(4)),
        fd.AxisNameError,
        "'z'",
    ),
    (
        lambda m: _shard_map(m, lambda v: v, fd.P("x"), fd.P("x"))(
            fd.distribute_tensor(torch.ones(4), m, fd.P())
        ),
        fd.SpecError,
        "fd.redistribute",
    ),
    (lambda m: fd.from_local(torch.ones(3), m, fd.P("x"), shape=(4,)), fd.ShapeError, "(2,)"),
    (lambda m: fd.distribute_tensor(T, m, fd.P("q")), fd.LayoutError, "'q'"),
    (lambda m: fd.redistribute(torch.ones(2), fd.P()), fd.InputTypeError, "fd.distribute_tensor"),
    (
        lambda m: _shard_map(m, lambda v: fd.psum(v, 0), fd.P("x"), fd.P())(torch.ones(4)),
        fd.InputTypeError,
        "got 0",
    ),
    (
        lambda m: _shard_map(m, lambda v: fd.ppermute(v, "x", [1, 0]), fd.P("x"), fd.P("x"))(torch.ones(4)),
        fd.InputTypeError,
        "pairs",
    ),
    (
        lambda m: _shard_map(m, lambda v, w: v, fd.P("x"), fd.P("x"))(torch.ones(4), w=1),
        fd.InputTypeError,
        "w",
    ),
    (lambda m: fd.distribute_tensor(torch.ones(4), m, fd.P("x", None)), fd.LayoutError, "2 entries"),
    (lambda m: fd.zeros(-2, mesh=m, placements=fd.P()), fd.ShapeError, "(-2,)"),
    (
        lambda m: fd.from_local(torch.ones(2), m, fd.P("x"), shape=(4, 1), run_check=True),
        fd.ShapeError,
        "(4, 1)",
    ),
]
BOTH_BACKENDS_2D = [  # a dim's axes in another order than the mesh's
    (
        lambda m: _shard_map(m, lambda v: v, fd.P(("y", "x")), fd.P(("y", "x")))(torch.ones(6)),
        fd.ShapeError,
        "('y', 'x')",
    ),
    (
        lambda m: _shard_map(m, lambda v: v, fd.P(("x", "y")), fd.P(("x", "y")))(
            fd.distribute_tensor(torch.ones(8), m, fd.P(("y", "x")))
        ),
        fd.SpecError,
        "fd.redistribute",
    ),
    (lambda m: fd.P(("y", "x"), "x"), fd.LayoutError, "'x'"),
]


def job_raised(mesh, table: str) -> list[str]:
    """The error each call of the table raises here (each before any collective runs)."""
    out = []
    for call, _, _ in {"1d": BOTH_BACKENDS, "2d": BOTH_BACKENDS_2D}[table]:
        try:
            call(mesh)
            out.append("no error")
        except fd.FunctionalDTensorError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.meshes((2,), (2, 2))
def test_errors_are_the_same_on_every_backend(backend, mesh):
    table = "1d" if len(mesh.shape) == 1 else "2d"
    rows = {"1d": BOTH_BACKENDS, "2d": BOTH_BACKENDS_2D}[table]
    want = job_raised(mesh.simulated(), table)
    for p, got in enumerate(backend.run(job_raised, mesh.shape, mesh.names, table)):
        for (_, error, text), g, w in zip(rows, got, want, strict=True):
            assert g.startswith(f"{error.__name__}: fd.") and text in g, (p, g)
            assert g.split(":")[:2] == w.split(":")[:2], (p, g, w)  # the class and the API's argument


def job_device_types(mesh) -> list[str]:
    """A mesh of each unusable device type, built as this backend builds meshes."""
    build = (
        (lambda t: fd.simulated_mesh(mesh.shape, mesh.axis_names, device_type=t))
        if mesh.backend == "simulated"
        else (lambda t: fd.init_device_mesh(t, mesh.shape, mesh.axis_names))
    )
    unusable = ["gpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda"])
    out = []
    for device_type in unusable:
        try:
            build(device_type)
            out.append("no error")
        except fd.FunctionalDTensorError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.meshes((2,))
def test_unusable_device_types_are_refused_on_every_backend(backend, mesh):
    """Regression: device_type="gpu", and "cuda" without CUDA, built meshes that failed later
    in torch (or never, on the simulated backend)."""
    for p, got in enumerate(backend.run(job_device_types, mesh.shape, mesh.names)):
        for message in got:
            api = "fd.simulated_mesh" if backend.is_simulated else "fd.init_device_mesh"
            assert message.startswith(f"MeshError: {api}(device_type)"), (p, message)
        assert "unknown device type" in got[0] and "'gpu'" in got[0]
        if len(got) == 3:
            assert "no cuda device" in got[2], got[2]


def test_a_bare_int_size_is_a_shape_for_every_factory():
    """``fd.full(8, 1.0)`` as ``fd.zeros(8)`` (it raised a raw TypeError)."""
    x = fd.full(8, 1.5, mesh=MESH_1D, placements=fd.P("x"))
    assert x.shape == (8,) and torch.equal(x.full_tensor(), torch.full((8,), 1.5))
    assert (
        fd.zeros(8, mesh=MESH_1D, placements=fd.P("x")).shape
        == fd.zeros((8,), mesh=MESH_1D, placements=fd.P()).shape
    )
    assert fd.ones(torch.Size([2, 4]), mesh=MESH_1D, placements=fd.P(None, "x")).shape == (2, 4)
    assert fd.zeros(0, 4, mesh=MESH_1D, placements=fd.P()).shape == (0, 4)


# --- the error guide (docs/errors.md), generated from CASES -----------------------------------

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
_PARTS = re.compile(
    r"^(?P<where>.*?): (?P<what>.*): expected (?P<expected>.*?), got (?P<got>.*)\. Fix: (?P<fix>.*)$", re.S
)


def _cell(text: str) -> str:
    text = re.sub(r" at 0x[0-9a-f]+", "", text)  # object reprs: no addresses in the page
    text = " ".join(text.split())
    for special in "|[]*_<":  # table cells, links, emphasis, HTML: shown as written
        text = text.replace(special, "\\" + special)
    return text


def guide() -> str:
    """The error guide: every case of the table, run, its message cut into the API, what went
    wrong, what was expected and got, and the fix; one table per exception class."""
    rows: dict[type, list[str]] = {}
    for case_id, call, error, _builtin, _mentions in CASES:
        try:
            call()
        except fd.FunctionalDTensorError as exc:
            parts = _PARTS.match(str(exc))
            assert parts is not None, str(exc)
            cells = [
                f"`{case_id}`",
                *(_cell(parts[name]) for name in ("where", "what", "expected", "got", "fix")),
            ]
            rows.setdefault(error, []).append("| " + " | ".join(cells) + " |")
    lines = [
        "# Errors",
        "",
        "Every error the library raises is an `fd.FunctionalDTensorError` and also the fitting builtin",
        "exception (`fd.ShapeError` is a `ValueError`, `fd.InputTypeError` a `TypeError`, ...). Its",
        "message names the API and argument, says what was wrong, what was expected and what was got,",
        "and ends with the fix. The tables below are generated from the invalid inputs that",
        f"`tests/test_errors.py` checks ({len(CASES)} of them; `python tests/test_errors.py` writes this",
        "page again), so every message here is one the library gives.",
        "",
    ]
    for error in sorted(rows, key=lambda e: e.__name__):
        builtin = next(b.__name__ for b in error.__mro__[1:] if b.__module__ == "builtins")
        lines += [
            f"## `fd.{error.__name__}` ({builtin})",
            "",
            (error.__doc__ or "").strip().splitlines()[0],
            "",
            "| case | where | what | expected | got | fix |",
            "|---|---|---|---|---|---|",
            *rows[error],
            "",
        ]
    return "\n".join(lines)


def test_the_error_guide_is_generated_from_this_table():
    assert GUIDE.read_text("utf-8") == guide(), "docs/errors.md is stale: run python tests/test_errors.py"


if __name__ == "__main__":
    GUIDE.write_text(guide(), "utf-8")
