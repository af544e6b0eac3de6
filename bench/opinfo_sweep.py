"""torch's OpInfo database on ``fd.DTensor`` beside torch's own DTensor: which ops work.

    python bench/opinfo_sweep.py                          # all of op_db, fd and torch's DTensor
    python bench/opinfo_sweep.py --ops add,mm,softmax     # some ops (names or name.variant)
    python bench/opinfo_sweep.py --fd-only --json sweep.json --samples 2

Each op runs float32 on CPU on up to ``--samples`` of its OpInfo sample inputs, every tensor of
a sample distributed under three layouts (Shard(0) and Replicate on a mesh of 4, Shard(0),
Shard(1) on a 2 x 2 mesh; op_db's sizes, so most shards are uneven), and is compared with plain
torch on values and gradients (``tests/opinfo_sweep.py``, the tests' comparison). fd runs on
``fd.simulated_mesh``; torch's DTensor on its in-process simulation (``LocalTensor`` shards under
``LocalTensorMode`` over a ``"fake"`` process group), on the same samples and layouts.

Prints the counts of ok / refused / raw error / wrong / random / skipped ops by family for both,
the ops that are wrong, the raw errors grouped by their first line (numbers folded), and the
time the sweep took; ``--json`` writes every op's status for both.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import opinfo_sweep as sweep  # noqa: E402  (tests/opinfo_sweep.py)

COLUMNS = ("ok", "refused", "raw error", "wrong", "random", "skipped")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ops", help="comma-separated op names (name or name.variant); default: all of op_db"
    )
    parser.add_argument("--samples", type=int, default=4, help="sample inputs per op (default 4)")
    parser.add_argument("--json", type=Path, help="write every op's status for both implementations here")
    parser.add_argument("--fd-only", action="store_true", help="leave torch's DTensor out (about 10x faster)")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per op case before it is an error"
    )
    parser.add_argument("--top", type=int, default=30, help="raw-error groups to print")
    parser.add_argument("--quiet", action="store_true", help="no per-op progress lines")
    return parser.parse_args()


def table(results: dict[str, dict[str, sweep.OpResult]], names: list[str]) -> str:
    """Counts by family, one block of columns per implementation."""
    counts = {name: defaultdict(Counter) for name in names}
    for per_side in results.values():
        for name in names:
            r = per_side[name]
            counts[name][r.family][r.status] += 1
            counts[name]["all"][r.status] += 1
    short = {
        "ok": "ok",
        "refused": "ref",
        "raw error": "raw",
        "wrong": "WRONG",
        "random": "rnd",
        "skipped": "skip",
    }
    head = f"{'family':<14}{'ops':>5} | " + " | ".join(
        " ".join(f"{short[c]:>5}" for c in COLUMNS) + f"  ({name})" for name in names
    )
    lines = [head, "-" * len(head)]
    for fam in (*sweep.FAMILIES, "all"):
        total = sum(counts[names[0]][fam].values())
        if not total:
            continue
        if fam == "all":
            lines.append("-" * len(head))
        cells = " | ".join(
            " ".join(f"{counts[name][fam][c]:>5}" for c in COLUMNS) + " " * (len(name) + 4) for name in names
        )
        lines.append(f"{fam:<14}{total:>5} | {cells}")
    return "\n".join(lines)


def error_groups(results, side: str, status: str = "raw error") -> list[tuple[str, list[str], str]]:
    """(first line with numbers folded to N, the ops, one full message), most ops first."""
    groups: dict[str, list[str]] = defaultdict(list)
    example: dict[str, str] = {}
    for op, per_side in results.items():
        r = per_side[side]
        if r.status != status:
            continue
        key = re.sub(r"\[at [^\]]*\]", "", r.message)
        key = re.sub(r"\d+", "N", key).strip()
        groups[key].append(op)
        example.setdefault(key, r.message)
    return sorted(((k, ops, example[k]) for k, ops in groups.items()), key=lambda g: (-len(g[1]), g[0]))


def main() -> None:
    args = parse()
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    ops = sweep.find_ops(args.ops.split(",")) if args.ops else sweep.op_db()
    sides = [sweep.FdDTensor()] + ([] if args.fd_only else [sweep.TorchDTensor()])
    names = [s.name for s in sides]
    print(
        f"op_db: {len(ops)} OpInfos, {args.samples} samples each, layouts: "
        f"{', '.join(layout[0] for layout in sweep.LAYOUTS)}; imported in {time.perf_counter() - t0:.1f} s"
    )
    results: dict[str, dict[str, sweep.OpResult]] = {}
    start = time.perf_counter()
    for i, op in enumerate(ops):
        t = time.perf_counter()
        per_side = sweep.sweep_op(op, sides, samples=args.samples, timeout=args.timeout)
        results[sweep.op_id(op)] = per_side
        if not args.quiet:
            marks = "  ".join(f"{n}: {per_side[n].status}" for n in names)
            print(
                f"[{i + 1}/{len(ops)}] {sweep.op_id(op):<45} {time.perf_counter() - t:6.2f} s  {marks}",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    seconds = {n: sum(r[n].seconds for r in results.values()) for n in names}

    print()
    print(table(results, names))
    print()
    print(
        f"sweep: {elapsed:.0f} s wall for {len(ops)} ops; time in the distributed calls: "
        + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items())
    )
    for name in names:
        wrong = [(op, r[name]) for op, r in results.items() if r[name].status == "wrong"]
        print(f"\n== {name}: {len(wrong)} wrong ops")
        for op, r in wrong:
            print(f"  {op}: {r.message}\n      at {r.where}")
        groups = error_groups(results, name)
        print(f"\n== {name}: raw errors grouped by first line ({len(groups)} groups, top {args.top})")
        for _key, group_ops, example in groups[: args.top]:
            shown = ", ".join(group_ops[:8]) + (
                f", ... (+{len(group_ops) - 8})" if len(group_ops) > 8 else ""
            )
            print(f"  {len(group_ops):>4}  {example[:240]}\n        ops: {shown}")
    if args.json:
        payload = {
            "samples": args.samples,
            "layouts": [layout[0] for layout in sweep.LAYOUTS],
            "seconds": round(elapsed, 1),
            "ops": {op: {n: r.as_dict() for n, r in per_side.items()} for op, per_side in results.items()},
        }
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
