"""Soak test: 10,000 mixed collectives and redistributes on 4 gloo ranks.

    python bench/soak.py                       # spawns 4 gloo ranks on loopback (--ops, --json)
    torchrun --standalone --nproc-per-node 4 bench/soak.py

On ``fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))`` the run calls, in a shuffled order
that every rank draws alike from one seed, a mix of operations on a global ``(8, 12)`` float32
value: ``fd.shard_map`` programs running ``psum``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ppermute`` and ``pmax``, a tensor-parallel MLP's forward and backward, a
``shard_map`` built afresh for each call (a new function object every time: the caches must
not keep them), ``fd.redistribute`` between two layouts drawn from ten (Shard, strided
Shard, Replicate and Partial ones), and global ops (``+``, ``@``, ``.sum()``). Every 50th
operation's result is compared with its single-device value (outside the timing).

Each chunk of 1,000 operations holds the same mix. After each chunk (and after a warm-up
that runs every kind once) the run records, on every rank: the median and the total time of
an operation, the resident set size (``/proc/self/statm``), the number of ``torch.distributed``
process groups (``_world.pg_map``), the library's cache entries (``fd._cache.cache_sizes``),
its per-mesh group tables and the number of Python objects (after ``gc.collect()``). Rank 0
prints a table and the ratio of the last chunk's median to the first's (a slowdown shows as a
ratio above 1). ``tests/test_soak.py`` runs a shortened version on the test pool's ranks.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

import functional_dtensor as fd
from functional_dtensor import _cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checks import assert_close, in_float64  # noqa: E402  (the tests' comparison)

WORLD = 4
CHUNK = 1000
CHECK_EVERY = 50
SHAPE = (8, 12)


class Op(NamedTuple):
    kind: str
    run: Callable[[], object]  # the operation, timed
    check: Callable[[object], None]  # compares its result with the single-device value


def _close(got: torch.Tensor, want: torch.Tensor, what: str, want_in_dtype=None) -> None:
    assert_close(got, want, want_in_dtype, msg=lambda m: f"soak, {what}: {m}")


def _full(kind: str, want: torch.Tensor, placements=None, want_in_dtype=None) -> Callable[[object], None]:
    def check(out) -> None:
        if placements is not None:
            assert out.placements == placements, f"soak, {kind}: {out.placements} != {placements}"
        _close(out.full_tensor(), want, kind, want_in_dtype)

    return check


def build_ops(mesh: fd.DeviceMesh, seed: int = 0) -> dict[str, list[Op]]:
    """Every kind of operation, by kind (redistribute: one per drawn pair of layouts)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    w = torch.randn(SHAPE[1], 5, generator=g)
    w1, w2 = torch.randn(SHAPE[1], 16, generator=g), torch.randn(16, SHAPE[1], generator=g)
    P = fd.P
    x_2d = fd.distribute_tensor(x, mesh, P("dp", "tp"))

    def mapped(f, in_specs, out_specs, check_rep=True):
        return fd.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_rep)

    psum = mapped(lambda t: fd.psum(t, "tp"), (P("dp", "tp"),), P("dp"))
    gather = mapped(  # a gathered value is not tracked as replicated: check_rep off, as in JAX
        lambda t: fd.all_gather(t, "dp", axis=0, tiled=True), (P("dp", "tp"),), P(None, "tp"), False
    )
    scatter = mapped(
        lambda t: fd.psum_scatter(t, ("dp", "tp"), scatter_dimension=0, tiled=True), (P(),), P(("dp", "tp"))
    )
    to_all = mapped(
        lambda t: fd.all_to_all(t, "tp", split_axis=0, concat_axis=1, tiled=True),
        (P("dp", "tp"),),
        P(("dp", "tp")),
    )
    swap = mapped(lambda t: fd.ppermute(t, "tp", [(0, 1), (1, 0)]), (P("dp", "tp"),), P("dp", "tp"))
    pmax = mapped(lambda t: fd.pmax(t, "dp"), (P("dp", "tp"),), P(None, "tp"))
    mlp = mapped(
        lambda t, a, b: fd.psum(torch.tanh(t @ a) @ b, "tp"), (P("dp"), P(None, "tp"), P("tp")), P("dp")
    )

    def one_device_grads(*tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        x_leaf, w1_leaf, w2_leaf = leaves
        return torch.autograd.grad((torch.tanh(x_leaf @ w1_leaf) @ w2_leaf).square().sum(), leaves)

    want_grads, want_grads32 = one_device_grads(*in_float64((x, w1, w2))), one_device_grads(x, w1, w2)

    def mlp_step():
        inputs = [t.clone().requires_grad_() for t in (x, w1, w2)]
        loss = mlp(*inputs).full_tensor().square().sum()
        return torch.autograd.grad(loss, inputs)

    def check_grads(grads) -> None:
        for i, (got, want, want32) in enumerate(zip(grads, want_grads, want_grads32, strict=True)):
            _close(got, want, f"mlp gradient {i}", want32)

    def fresh():  # a new function object each call: nothing may be cached per function
        return mapped(lambda t: fd.psum(t, "dp") * 1.0, (P("dp", "tp"),), P(None, "tp"))(x_2d)

    halves = x[:, :6] + x[:, 6:]
    ops = {
        "psum": [Op("psum", lambda: psum(x_2d), _full("psum", halves))],
        "all_gather": [Op("all_gather", lambda: gather(x_2d), _full("all_gather", x))],
        "psum_scatter": [Op("psum_scatter", lambda: scatter(x), _full("psum_scatter", 4 * x))],
        "all_to_all": [Op("all_to_all", lambda: to_all(x_2d), _full("all_to_all", x))],
        "ppermute": [
            Op("ppermute", lambda: swap(x_2d), _full("ppermute", torch.cat([x[:, 6:], x[:, :6]], 1)))
        ],
        "pmax": [Op("pmax", lambda: pmax(x_2d), _full("pmax", torch.maximum(x[:4], x[4:])))],
        "mlp fwd+bwd": [Op("mlp fwd+bwd", mlp_step, check_grads)],
        "fresh shard_map": [Op("fresh shard_map", fresh, _full("fresh shard_map", x[:4] + x[4:]))],
    }
    layouts = [
        P(),
        P("dp"),
        P("tp"),
        P("dp", "tp"),
        P("tp", "dp"),
        P(("dp", "tp")),
        P(("tp", "dp")),
        P(None, ("tp", "dp")),
        (fd.Partial(), fd.Replicate()),
        (fd.Shard(0), fd.Partial()),
    ]
    sources = [fd.distribute_tensor(x, mesh, layout) for layout in layouts]
    pairs = [(a, b) for a in range(len(layouts)) for b in range(len(layouts)) if a != b]
    ops["redistribute"] = [
        Op(
            "redistribute",
            lambda a=a, b=b: fd.redistribute(sources[a], layouts[b]),
            _full(
                f"redistribute {layouts[a]} -> {layouts[b]}",
                x,
                fd.distribute_tensor(x, mesh, layouts[b]).placements,
            ),
        )
        for a, b in pairs
    ]
    y_2d = fd.distribute_tensor(2 * x, mesh, P("dp", "tp"))
    x_rows, w_rep = fd.distribute_tensor(x, mesh, P("dp")), fd.distribute_tensor(w, mesh, P())
    ops["global +"] = [Op("global +", lambda: x_2d + y_2d, _full("global +", 3 * x))]
    x64, w64 = in_float64((x, w))
    ops["global @"] = [Op("global @", lambda: x_rows @ w_rep, _full("global @", x64 @ w64, None, x @ w))]
    ops["global sum"] = [Op("global sum", lambda: x_2d.sum(), _full("global sum", x64.sum(), None, x.sum()))]
    return ops


# the share of each kind in a chunk (redistribute: four times the others)
WEIGHTS = {"redistribute": 4}


def schedule(kinds: list[str], ops: int, seed: int) -> list[str]:
    """``ops`` kinds, each chunk of :data:`CHUNK` the same mix in a shuffled order."""
    slots = [k for k in kinds for _ in range(WEIGHTS.get(k, 1))]
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < ops:
        chunk = [slots[i % len(slots)] for i in range(min(CHUNK, ops - len(out)))]
        rng.shuffle(chunk)
        out += chunk
    return out


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _containers(value) -> int:
    """The objects of ``value`` (a record of dicts, lists and numbers) that ``gc`` tracks."""
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return gc.is_tracked(value) + sum(_containers(v) for v in inner)


def snapshot(record: dict | None = None) -> dict:
    """What must not grow: memory, process groups, cache entries, Python objects (less those
    of the run's own ``record``)."""
    from functional_dtensor._distributed import runtime

    gc.collect()
    sizes = _cache.cache_sizes()
    return {
        "rss_mb": rss_mb(),
        "process_groups": process_groups(),
        "cache_entries": sum(n for n, _ in sizes.values()),
        "caches_full": sorted(name for name, (n, bound) in sizes.items() if bound is not None and n >= bound),
        "mesh_tables": len(runtime._groups) + len(runtime._torch_meshes),
        "objects": len(gc.get_objects()) - (0 if record is None else _containers(record)),
    }


def run_soak(ops: int = 10_000, *, seed: int = 0, check_every: int = CHECK_EVERY) -> dict:
    """Run the soak on this rank (every rank of a 4-rank group calls it alike); this rank's
    record: per-chunk timings and snapshots, and the checks made."""
    torch.set_num_threads(1)
    mesh = fd.init_device_mesh("cpu", (2, 2), ("dp", "tp"))
    table = build_ops(mesh, seed)
    rng = random.Random(seed + 1)
    for variants in table.values():  # warm-up: every kind (every redistribute pair) once, checked
        for op in variants:
            op.check(op.run())
    dist.barrier()
    record = {"rank": dist.get_rank(), "start": snapshot(), "chunks": [], "checks": 0}
    times: list[float] = []
    cpu_times: list[float] = []
    kinds: list[str] = []
    started = time.perf_counter()
    for i, kind in enumerate(schedule(list(table), ops, seed)):
        op = rng.choice(table[kind])
        t0, c0 = time.perf_counter(), time.process_time()
        out = op.run()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        kinds.append(kind)
        if i % check_every == 0:
            op.check(out)
            record["checks"] += 1
        del out
        if len(times) == CHUNK or i == ops - 1:
            per_kind = {}
            for k, t in zip(kinds, times):
                per_kind.setdefault(k, []).append(t)
            record["chunks"].append(
                {
                    "ops": len(times),
                    "total_s": sum(times),
                    "median_ms": 1e3 * statistics.median(times),
                    "cpu_median_ms": 1e3 * statistics.median(cpu_times),
                    "kind_median_ms": {k: 1e3 * statistics.median(v) for k, v in per_kind.items()},
                    **snapshot(record),
                }
            )
            times, cpu_times, kinds = [], [], []
    record["wall_s"] = time.perf_counter() - started
    dist.barrier()
    return record


def summary(records: list[dict]) -> dict:
    """The figures of a run: totals, the last/first chunk median ratio (slowest rank), memory,
    process groups and cache entries from start to end (largest over ranks)."""
    first = max(r["chunks"][0]["median_ms"] for r in records)
    last = max(r["chunks"][-1]["median_ms"] for r in records)
    kinds = records[0]["chunks"][0]["kind_median_ms"]
    kind_ratios = {
        k: max(r["chunks"][-1]["kind_median_ms"][k] for r in records)
        / max(r["chunks"][0]["kind_median_ms"][k] for r in records)
        for k in kinds
    }
    return {
        "ops": sum(c["ops"] for c in records[0]["chunks"]),
        "wall_s": max(r["wall_s"] for r in records),
        "checks": records[0]["checks"],
        "first_median_ms": first,
        "last_median_ms": last,
        "last_over_first": last / first,
        "cpu_last_over_first": max(r["chunks"][-1]["cpu_median_ms"] for r in records)
        / max(r["chunks"][0]["cpu_median_ms"] for r in records),
        "kind_last_over_first": kind_ratios,
        "rss_start_mb": max(r["start"]["rss_mb"] for r in records),
        "rss_after_first_chunk_mb": max(r["chunks"][0]["rss_mb"] for r in records),
        "rss_end_mb": max(r["chunks"][-1]["rss_mb"] for r in records),
        "process_groups_start": max(r["start"]["process_groups"] for r in records),
        "process_groups_end": max(r["chunks"][-1]["process_groups"] for r in records),
        "cache_entries_start": max(r["start"]["cache_entries"] for r in records),
        "cache_entries_end": max(r["chunks"][-1]["cache_entries"] for r in records),
        "objects_start": max(r["start"]["objects"] for r in records),
        "objects_end": max(r["chunks"][-1]["objects"] for r in records),
    }


def print_report(records: list[dict]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"soak: {WORLD} gloo ranks, mesh (2, 2), chunks of {CHUNK} mixed operations (slowest rank)",
        box=box.SIMPLE_HEAD,
    )
    for column in (
        "chunk",
        "median ms",
        "CPU median ms",
        "total s",
        "RSS MB",
        "process groups",
        "cache entries",
        "objects",
    ):
        t.add_column(column, justify="right")
    start = records[0]["start"]
    t.add_row(
        "start",
        "",
        "",
        "",
        f"{max(r['start']['rss_mb'] for r in records):.1f}",
        str(start["process_groups"]),
        str(start["cache_entries"]),
        str(start["objects"]),
    )
    for i in range(len(records[0]["chunks"])):
        rows = [r["chunks"][i] for r in records]
        t.add_row(
            str(i + 1),
            f"{max(c['median_ms'] for c in rows):.3f}",
            f"{max(c['cpu_median_ms'] for c in rows):.3f}",
            f"{max(c['total_s'] for c in rows):.2f}",
            f"{max(c['rss_mb'] for c in rows):.1f}",
            str(max(c["process_groups"] for c in rows)),
            str(max(c["cache_entries"] for c in rows)),
            str(max(c["objects"] for c in rows)),
        )
    Console(width=120).print(t)
    s = summary(records)
    print(
        f"{s['ops']} operations in {s['wall_s']:.1f} s ({s['checks']} checked); "
        f"last/first chunk median: {s['last_over_first']:.2f} "
        f"({s['first_median_ms']:.3f} -> {s['last_median_ms']:.3f} ms; "
        f"CPU time: {s['cpu_last_over_first']:.2f}); "
        f"RSS {s['rss_start_mb']:.1f} -> {s['rss_after_first_chunk_mb']:.1f} (chunk 1) "
        f"-> {s['rss_end_mb']:.1f} MB; "
        f"process groups {s['process_groups_start']} -> {s['process_groups_end']}; "
        f"cache entries {s['cache_entries_start']} -> {s['cache_entries_end']}"
    )
    print(
        "per kind, last/first chunk median: "
        + ", ".join(f"{k} {v:.2f}" for k, v in s["kind_last_over_first"].items())
    )


def _rank_main(rank: int, args: argparse.Namespace, port: int | None) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if port is not None:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=120),
        )
    record = run_soak(args.ops, seed=args.seed)
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        print_report(records)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"summary": summary(records), "records": records}, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the summary and every rank's record here")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        if int(os.environ["WORLD_SIZE"]) != WORLD:
            sys.exit(f"bench/soak.py runs on {WORLD} ranks: torchrun --standalone --nproc-per-node {WORLD}")
        _rank_main(int(os.environ["RANK"]), args, None)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_main, args=(args, port), nprocs=WORLD)


if __name__ == "__main__":
    main()
