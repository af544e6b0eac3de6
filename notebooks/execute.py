"""Execute the notebooks reproducibly and write their outputs, or check the committed outputs.

    python notebooks/execute.py                    # every notebook here, outputs written in place
    python notebooks/execute.py 03_redistribute    # one (or several) by name
    python notebooks/execute.py --check            # execute in memory, report stale outputs

Each notebook runs top to bottom in a fresh kernel of this interpreter (ipykernel), with its
directory as the working directory and a fixed environment (:data:`FIXED_ENV`: hash seed, one
thread, the width rich draws at; an empty IPython profile and hypothesis directory). The
written file holds nothing volatile: execution counts are 1, 2, 3, ..., cells carry no timing
metadata, the notebook's metadata is kept as it was (not the kernel's version details), adjacent
pieces of one stream are joined (the kernel splits printed text at random points in time), and
the JSON is nbformat's (indent 1, sorted keys, a trailing newline). Executing again without
changing the code rewrites the same bytes.

:func:`compare` (behind ``--check``, and ``tests/test_notebooks.py``) compares the outputs of a
fresh execution with the committed ones, cell by cell. Text (streams, ``text/plain``,
``text/html`` and other text types) is compared after :func:`normalize_text` replaces timings
(``12.3 ms``) and memory addresses (``0x7f...``): its non-number text must be equal, and its
numbers too, except that a number written with a decimal point or an exponent may differ by a
relative 1e-3 or by one unit of its last printed digit (the float printed on another CPU).
Images are compared by presence and size. Any error output is reported, committed or not,
unless its cell is tagged ``raises-exception``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import os
import re
import struct
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode

HERE = Path(__file__).resolve().parent

# The kernel's environment: these, plus the variables of PASSED_ENV found in ours (nothing else,
# so no FD_*, TORCH_*, COLUMNS or NO_COLOR of the caller's shell reaches the notebooks).
FIXED_ENV = {
    "PYTHONHASHSEED": "0",
    "PYTHONUTF8": "1",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "COLUMNS": "100",  # rich outside Jupyter
    "LINES": "50",
    "JUPYTER_COLUMNS": "100",  # rich in a Jupyter kernel (its default is 115)
    "JUPYTER_LINES": "50",
    "TERM": "xterm-256color",
}
PASSED_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "TMPDIR",
    "TEMP",
    "TMP",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
    "DYLD_LIBRARY_PATH",
    "CC",
    "XDG_CACHE_HOME",
    "SYSTEMROOT",  # Windows needs it to start a process
    "APPDATA",
    "LOCALAPPDATA",
    "USERPROFILE",
)
TIMEOUT_S = 600  # per cell

RTOL = 1e-3
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")
IGNORED_TYPES = ("application/vnd.jupyter.widget-view+json",)  # model ids change every run


def kernel_env(scratch: str) -> dict[str, str]:
    """The environment each notebook's kernel runs in; ``scratch``: an empty directory for
    IPython's profile (no startup files or configuration of the user's) and hypothesis's files
    (none written beside the notebooks)."""
    passed = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
    return {
        **passed,
        **FIXED_ENV,
        "IPYTHONDIR": os.path.join(scratch, "ipython"),
        "HYPOTHESIS_STORAGE_DIRECTORY": os.path.join(scratch, "hypothesis"),
    }


def notebook_paths(names: Sequence[str] = ()) -> list[Path]:
    """The notebooks named (``03_redistribute``, ``03_redistribute.ipynb`` or a path), or all."""
    if not names:
        return sorted(HERE.glob("*.ipynb"))
    paths = []
    for name in names:
        path = Path(name)
        if path.suffix != ".ipynb":
            path = path.with_name(path.name + ".ipynb")
        if not path.exists():
            path = HERE / path.name
        if not path.exists():
            known = ", ".join(p.stem for p in sorted(HERE.glob("*.ipynb")))
            raise SystemExit(f"no notebook {name!r} in {HERE} (there are: {known})")
        paths.append(path)
    return paths


# --- execution ---------------------------------------------------------------------------------


def _kernel_manager():
    """A kernel manager for ipykernel in this interpreter, whatever kernels are installed."""
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class ThisInterpreter(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            spec = get_kernel_dict()
            return KernelSpec(
                resource_dir=RESOURCES,
                **{k: spec[k] for k in ("argv", "display_name", "language") if k in spec},
            )

    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisInterpreter())


async def execute_async(path: Path, scratch: str) -> NotebookNode:
    """The notebook at ``path`` executed in a fresh kernel, normalized; the file is not written."""
    from nbclient import NotebookClient

    source = nbformat.read(path, as_version=4)
    nb = copy.deepcopy(source)
    client = NotebookClient(
        nb,
        km=_kernel_manager(),
        timeout=TIMEOUT_S,
        allow_errors=True,  # an error becomes an output that compare() reports
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
        extra_arguments=["--HistoryManager.enabled=False", "--log-level=ERROR"],
    )
    await client.async_execute(env=kernel_env(scratch), cleanup_kc=True)  # and shut the kernel down
    return normalize_notebook(nb, metadata=source.metadata)


async def _execute_all(paths: Sequence[Path], jobs: int) -> list[NotebookNode | BaseException]:
    gate = asyncio.Semaphore(max(1, jobs))

    with tempfile.TemporaryDirectory(prefix="ipython-") as scratch:

        async def one(path):
            async with gate:
                own = Path(scratch, path.stem)  # one for each kernel
                (own / "ipython").mkdir(parents=True)
                return await execute_async(path, str(own))

        return await asyncio.gather(*(one(p) for p in paths), return_exceptions=True)


def execute_all(paths: Sequence[Path], jobs: int | None = None) -> list[NotebookNode | BaseException]:
    """Execute the notebooks, ``jobs`` kernels at a time (default: one per CPU); for each, the
    executed notebook or the exception that stopped it."""
    jobs = jobs or os.cpu_count() or 1
    return asyncio.run(_execute_all(list(paths), jobs))


def execute(path: Path) -> NotebookNode:
    """The notebook at ``path`` executed and normalized (see :func:`execute_async`)."""
    (result,) = execute_all([path], jobs=1)
    if isinstance(result, BaseException):
        raise result
    return result


def join_streams(outputs: Iterable[NotebookNode]) -> list[NotebookNode]:
    """Adjacent stream outputs of the same stream joined into one (where the kernel splits
    printed text depends on time)."""
    joined: list[NotebookNode] = []
    for output in outputs:
        last = joined[-1] if joined else None
        if (
            output.output_type == "stream"
            and last is not None
            and last.output_type == "stream"
            and last.name == output.name
        ):
            last.text += output.text
        else:
            joined.append(copy.deepcopy(output))
    return joined


def normalize_notebook(nb: NotebookNode, metadata: dict | None = None) -> NotebookNode:
    """Nothing volatile left: sequential execution counts, no timing metadata, streams joined,
    the notebook's own metadata (``metadata``) instead of the kernel's details."""
    if metadata is not None:
        nb.metadata = copy.deepcopy(metadata)
    count = 0
    for cell in nb.cells:
        for key in ("execution", "ExecuteTime", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        cell.outputs = join_streams(cell.outputs)
        for output in cell.outputs:
            if output.output_type == "execute_result":
                output.execution_count = count
            output.pop("transient", None)
    return nb


def write(nb: NotebookNode, path: Path) -> bool:
    """Write ``nb`` to ``path`` in nbformat's stable JSON; whether the file changed."""
    text = nbformat.writes(nb, version=4)
    if not text.endswith("\n"):
        text += "\n"
    old = path.read_text(encoding="utf-8") if path.exists() else None
    if text != old:
        path.write_text(text, encoding="utf-8", newline="\n")
    return text != old


# --- comparison --------------------------------------------------------------------------------

_TIMING = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s?"
    r"(?:ns|[µμu]s|ms|s|sec|secs|seconds?|min|mins|minutes?)(?![\w])"
)
_TIMEIT_COUNTS = re.compile(r"of \d+ runs?, \d+ loops? each")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w)")


def normalize_text(text: str) -> str:
    """``text`` with timings (``12.3 ms``, ``1.2 s``, ``40 µs``) and memory addresses
    (``0x7f3a...``) replaced by placeholders."""
    text = _TIMEIT_COUNTS.sub("of <n> runs, <n> loops each", text)
    text = _TIMING.sub("<time>", text)
    return _ADDRESS.sub("0x<address>", text)


def _last_digit(number: str) -> float:
    """One unit of the last printed digit: 1e-6 for ``2.762547``, 1e-7 for ``2.8e-06``."""
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def numbers_match(a: str, b: str, rtol: float = RTOL) -> bool:
    """Two printed numbers: integers equal, floats within ``rtol`` or one unit of the last digit."""
    if a == b:
        return True
    if not any(c in a + b for c in ".eE"):
        return False  # integers: shapes, sizes, counts, device numbers
    x, y = float(a), float(b)
    return abs(x - y) <= max(rtol * max(abs(x), abs(y)), max(_last_digit(a), _last_digit(b)) * (1 + 1e-9))


def lines_match(a: str, b: str, rtol: float = RTOL) -> bool:
    """Two normalized lines: the same text between numbers, and numbers that match."""
    if a == b:
        return True
    a_parts, b_parts = _NUMBER.split(a), _NUMBER.split(b)
    a_numbers, b_numbers = _NUMBER.findall(a), _NUMBER.findall(b)
    return (
        a_parts == b_parts
        and len(a_numbers) == len(b_numbers)
        and all(numbers_match(x, y, rtol) for x, y in zip(a_numbers, b_numbers))
    )


def _short(line: str, width: int = 100) -> str:
    line = line.strip()
    return repr(line if len(line) <= width else line[: width - 3] + "...")


def text_difference(committed: str, fresh: str, rtol: float = RTOL) -> str | None:
    """Where two texts differ after normalization (None if they match): the first line that
    differs, or the line counts."""
    a, b = normalize_text(committed).splitlines(), normalize_text(fresh).splitlines()
    for number, (x, y) in enumerate(zip(a, b), start=1):
        if not lines_match(x, y, rtol):
            return f"line {number}: committed {_short(x)}, now {_short(y)}"
    if len(a) != len(b):
        extra = b[len(a)] if len(b) > len(a) else a[len(b)]
        return f"{len(a)} lines committed, {len(b)} now (first unmatched: {_short(extra)})"
    return None


def _as_text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def image_size(mime: str, data) -> tuple[int, int] | str | None:
    """An image's width and height (``svg``: its ``width``/``height`` attributes), or None."""
    text = _as_text(data)
    if mime == "image/svg+xml":
        match = re.search(r"<svg\b[^>]*>", text)
        tag = match.group(0) if match else ""
        size = [re.search(rf'\b{attr}="([^"]*)"', tag) for attr in ("width", "height", "viewBox")]
        return " ".join(m.group(1) if m else "-" for m in size)
    try:
        raw = base64.b64decode(text)
    except ValueError:
        return None
    if mime == "image/png" and raw[12:16] == b"IHDR":
        return struct.unpack(">II", raw[16:24])
    if mime == "image/gif" and raw[:4] == b"GIF8":
        return struct.unpack("<HH", raw[6:10])
    return None  # jpeg: compared by presence


@dataclass(frozen=True)
class Difference:
    """One stale output: the notebook, the cell (its index in the notebook) and what differs."""

    notebook: str
    cell: int
    what: str
    source: str = ""  # the cell's first line, to find it

    def __str__(self) -> str:
        where = self.notebook if self.cell < 0 else f"{self.notebook} cell {self.cell}"
        where += f" ({_short(self.source, 40)})" if self.source else ""
        return f"{where}: {self.what}"


def _describe(output: NotebookNode) -> str:
    if output.output_type == "stream":
        return f"{output.name} text {_short(_as_text(output.text), 60)}"
    if output.output_type == "error":
        return f"error {output.ename}: {_short(output.evalue, 60)}"
    data = output.get("data", {})
    return (
        f"{output.output_type} ({', '.join(sorted(data))}) {_short(_as_text(data.get('text/plain', '')), 60)}"
    )


def compare_output(committed: NotebookNode, fresh: NotebookNode, rtol: float = RTOL) -> list[str]:
    """What differs between two outputs of one cell."""
    if committed.output_type != fresh.output_type:
        return [f"{committed.output_type} committed, {fresh.output_type} now: {_describe(fresh)}"]
    kind = fresh.output_type
    if kind == "stream":
        if committed.name != fresh.name:
            return [f"{committed.name} committed, {fresh.name} now"]
        found = text_difference(_as_text(committed.text), _as_text(fresh.text), rtol)
        return [f"{fresh.name}: {found}"] if found else []
    if kind == "error":
        found = [f"{committed.ename} committed, {fresh.ename} now"] if committed.ename != fresh.ename else []
        message = text_difference(committed.evalue, fresh.evalue, rtol)
        return found + ([f"error message: {message}"] if message else [])
    differences = []
    old = {k: v for k, v in committed.get("data", {}).items() if k not in IGNORED_TYPES}
    new = {k: v for k, v in fresh.get("data", {}).items() if k not in IGNORED_TYPES}
    for mime in sorted(old.keys() - new.keys()):
        differences.append(f"{kind} {mime} committed, missing now")
    for mime in sorted(new.keys() - old.keys()):
        differences.append(f"{kind} {mime} now, not committed")
    for mime in sorted(old.keys() & new.keys()):
        if mime in IMAGE_TYPES:
            a, b = image_size(mime, old[mime]), image_size(mime, new[mime])
            if a != b:
                differences.append(f"{kind} {mime}: size {a} committed, {b} now")
        elif isinstance(old[mime], dict) or isinstance(new[mime], dict):  # application/json
            if old[mime] != new[mime]:
                differences.append(f"{kind} {mime} differs")
        elif mime.startswith(("text/", "application/")):
            found = text_difference(_as_text(old[mime]), _as_text(new[mime]), rtol)
            if found:
                differences.append(f"{kind} {mime}: {found}")
    return differences


def _errors(cell: NotebookNode) -> list[str]:
    if "raises-exception" in cell.metadata.get("tags", []):
        return []  # an error shown on purpose: compared as any other output
    return [f"error output: {o.ename}: {_short(o.evalue)}" for o in cell.outputs if o.output_type == "error"]


def errors(nb: NotebookNode, name: str = "") -> list[Difference]:
    """The error outputs of a notebook's cells (but those tagged ``raises-exception``)."""
    return [
        Difference(name or "notebook", index, what, _as_text(cell.source).strip().split("\n")[0])
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for what in _errors(cell)
    ]


def compare(
    committed: NotebookNode, fresh: NotebookNode, name: str = "", rtol: float = RTOL
) -> list[Difference]:
    """Every difference that matters between the committed outputs of a notebook and those of a
    fresh execution of it, cell by cell (empty: the committed outputs are current)."""
    name = name or "notebook"
    differences: list[Difference] = []
    if len(committed.cells) != len(fresh.cells):
        differences.append(
            Difference(name, -1, f"{len(committed.cells)} cells committed, {len(fresh.cells)} now")
        )
    count = 0
    for index, (old, new) in enumerate(zip(committed.cells, fresh.cells)):
        first_line = _as_text(new.source).strip().split("\n")[0]
        found = []
        if old.cell_type != new.cell_type:
            found.append(f"a {old.cell_type} cell committed, a {new.cell_type} cell now")
        elif new.cell_type == "code":
            count += 1
            if old.get("execution_count") != count:
                found.append(f"execution count {old.get('execution_count')} committed, expected {count}")
            found += _errors(new)
            a, b = join_streams(old.get("outputs", [])), join_streams(new.get("outputs", []))
            for position, (x, y) in enumerate(zip(a, b), start=1):
                found += [f"output {position} of {len(b)}: {what}" for what in compare_output(x, y, rtol)]
            found += [
                f"output {i} committed, missing now: {_describe(x)}"
                for i, x in enumerate(a[len(b) :], len(b) + 1)
            ]
            found += [
                f"output {i} now, not committed: {_describe(y)}"
                for i, y in enumerate(b[len(a) :], len(a) + 1)
            ]
        differences += [Difference(name, index, what, first_line) for what in found]
    return differences


def check(paths: Sequence[Path], jobs: int | None = None) -> list[Difference]:
    """Execute the notebooks in memory; every difference from their committed outputs."""
    differences = []
    for path, fresh in zip(paths, execute_all(paths, jobs)):
        if isinstance(fresh, BaseException):
            differences.append(
                Difference(path.stem, -1, f"execution failed: {type(fresh).__name__}: {fresh}")
            )
            continue
        differences += compare(nbformat.read(path, as_version=4), fresh, path.stem)
    return differences


# --- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks to execute (default: all in notebooks/)")
    parser.add_argument("--check", action="store_true", help="execute in memory and report stale outputs")
    parser.add_argument("--jobs", "-j", type=int, default=None, help="kernels at a time (default: CPUs)")
    args = parser.parse_args(argv)
    paths = notebook_paths(args.names)
    start = time.perf_counter()
    if args.check:
        differences = check(paths, args.jobs)
        for difference in differences:
            print(difference)
        took = time.perf_counter() - start
        if differences:
            print(f"{len(differences)} stale outputs; run python notebooks/execute.py to update them")
            return 1
        print(f"{len(paths)} notebooks: committed outputs are current ({took:.0f} s)")
        return 0
    failed = 0
    for path, fresh in zip(paths, execute_all(paths, args.jobs)):
        if isinstance(fresh, BaseException):
            print(f"{path.name}: execution failed: {type(fresh).__name__}: {fresh}")
            failed += 1
            continue
        failures = errors(fresh, path.stem)
        if failures:
            for failure in failures:
                print(failure)
            print(f"{path.name}: not written (an error output)")
            failed += 1
            continue
        print(f"{path.name}: {'written' if write(fresh, path) else 'unchanged'}")
    print(f"{len(paths)} notebooks in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
