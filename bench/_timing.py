"""Timing helpers shared by the benchmarks: interleaved repetitions, medians, rich tables.

The project's machines have 2 cores shared with other jobs, so absolute times drift by 2x
within a minute. Every benchmark therefore runs all its variants in the same loop, in a
shuffled order each repetition, and reports medians and ratios of medians from that one run.
Each call is timed twice: wall-clock time, and the CPU time of this process (which does not
count the time spent waiting for a core that another job holds; the simulated benchmarks run
single-threaded, so it is the work done). Ratios of CPU-time medians are far more stable on a
loaded machine; both are printed.
"""

from __future__ import annotations

import ctypes
import random
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

from rich import box
from rich.console import Console
from rich.table import Table

__all__ = [
    "Samples",
    "interleaved",
    "median_ms",
    "table",
    "print_table",
    "verdict",
    "steady_malloc",
    "host_split",
]


class Samples(NamedTuple):
    wall: list[float]  # seconds per call
    cpu: list[float]  # CPU seconds of this process per call


def interleaved(
    steps: dict[str, Callable[[], object]],
    *,
    reps: int,
    warmup: int,
    seed: int = 0,
    before_each: Callable[[], object] | None = None,
    calls: int = 1,
) -> dict[str, Samples]:
    """Seconds per call of each step, the steps run in a fresh shuffled order each repetition.

    ``seed`` fixes the orders, so that every rank of a distributed run agrees on them;
    ``before_each`` runs untimed before every sample (a barrier, for instance); a sample is
    ``calls`` back-to-back calls of the step, and records their mean.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    order = list(steps)
    rng = random.Random(seed)
    times = {name: Samples([], []) for name in steps}
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            if before_each is not None:
                before_each()
            step = steps[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                step()
            cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
            times[name].wall.append(wall / calls)
            times[name].cpu.append(cpu / calls)
    return times


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def verdict(value: float, target: float) -> str:
    return f"[green]<= {target:g}[/green]" if value <= target else f"[red]> {target:g}[/red]"


def table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    out = Table(title=title, box=box.SIMPLE_HEAD)
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


def print_table(title: str, columns: list[str], rows: list[list[str]], caption: str = "") -> None:
    console = Console(width=max(130, Console().width))
    console.print(table(title, columns, rows))
    if caption:
        console.print(caption)


def steady_malloc() -> None:
    """Fix glibc malloc's thresholds. By default it returns freed multi-MiB buffers to the system
    and page-faults them back in on the next call, by thresholds that move with what the process
    freed before: a step whose memory rises and falls by more than the moving trim threshold
    pays about 0.5 ms per MiB it takes back (this machine). Fixed, every variant reuses its
    buffers, as a long training loop under ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:
    glibc.malloc.trim_threshold=268435456`` does. Nothing where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: malloc, not mmap, below 32 MiB
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep up to 256 MiB of free heap
    except (OSError, AttributeError):  # not glibc
        pass


def host_split(steps: dict[str, Callable[[], object]], reps: int) -> dict[str, tuple[float, float, float]]:
    """Where each step's time goes, by ``torch.profiler`` over ``reps`` interleaved calls: per
    step, the medians (us) of the whole call, of the time inside aten ops (each op's own time,
    counted once: the kernels and torch's dispatch into them) and of the rest (the host's work
    around them: Python, the autograd engine's bookkeeping). The profiler's own cost is in the
    figures: read them side by side, not against timed runs."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    for step in steps.values():  # warm
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            for name, step in steps.items():
                with record_function(f"step: {name}"):
                    step()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for event in prof.events():
        name = event.name.removeprefix("step: ")
        if event.name.startswith("step: ") and name in samples:
            samples[name].append((event.cpu_time_total, _in_aten(event)))
    return {
        name: (
            statistics.median([whole for whole, _ in got]),
            statistics.median([aten for _, aten in got]),
            statistics.median([whole - aten for whole, aten in got]),
        )
        for name, got in samples.items()
    }


def phase_split(
    losses: dict[str, Callable[..., object]], args: tuple, wrt: tuple, reps: int, warmup: int = 3
) -> dict[str, tuple[float, float]]:
    """Per loss function, the medians (us) of its forward, ``loss_of(*args)``, and of its
    backward, ``torch.autograd.grad`` of that loss with respect to ``wrt``, each timed by the
    thread's CPU time, the losses in a fresh shuffled order each repetition (no profiler)."""
    import torch

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in losses}
    order, rng = list(losses), random.Random(0)
    for rep in range(warmup + reps):
        rng.shuffle(order)
        for name in order:
            start = time.thread_time()
            loss = losses[name](*args)
            middle = time.thread_time()
            torch.autograd.grad(loss, wrt)
            end = time.thread_time()
            if rep >= warmup:
                samples[name].append(((middle - start) * 1e6, (end - middle) * 1e6))
    return {
        name: (statistics.median([f for f, _ in got]), statistics.median([b for _, b in got]))
        for name, got in samples.items()
    }


def _in_aten(event) -> float:
    """The time (us) spent in aten ops under ``event``: their own time, each counted once."""
    pending, total = list(event.cpu_children), 0.0
    while pending:
        child = pending.pop()
        total += child.self_cpu_time_total if child.name.startswith("aten::") else 0.0
        pending.extend(child.cpu_children)
    return total
