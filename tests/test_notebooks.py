"""The notebooks' committed outputs are current, the check that says so fails on a stale output
(and not on a timing, an address or a float's last digit), and the docs site shows the outputs.

The notebooks run through ``notebooks/execute.py`` (imported by path: ``notebooks/`` is not a
package). The notebooks of the selected tests execute once, in parallel, one kernel per CPU.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("notebooks_execute", ROOT / "notebooks" / "execute.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


nbx = _load_script()
NAMES = [path.stem for path in nbx.notebook_paths()]


def committed(name: str):
    return nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)


@pytest.fixture(scope="module")
def executed(request):
    """The notebooks whose ``test_committed_outputs_are_current`` runs in this session, executed
    together (in memory): name -> executed notebook, or the exception that stopped it."""
    selected = sorted(
        {
            item.callspec.params["name"]
            for item in request.session.items
            if getattr(item, "originalname", None) == "test_committed_outputs_are_current"
            and Path(item.path) == Path(__file__)
        }
    )
    return dict(zip(selected, nbx.execute_all(nbx.notebook_paths(selected)), strict=True))


@pytest.mark.slow  # six kernels: the slow tier (CI runs it); the checks of the check run by default
@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_are_current(name, executed):
    fresh = executed[name]
    if isinstance(fresh, BaseException):
        raise fresh
    differences = nbx.compare(committed(name), fresh, name)
    assert not differences, "stale outputs (python notebooks/execute.py rewrites them):\n" + "\n".join(
        map(str, differences)
    )


@pytest.mark.parametrize("name", NAMES)
def test_committed_file_is_what_the_script_writes(name):
    """Sequential execution counts, no timing metadata, nbformat's JSON: what execute.py writes."""
    path = ROOT / "notebooks" / f"{name}.ipynb"
    nb = nbx.normalize_notebook(nbformat.read(path, as_version=4))
    assert nbformat.writes(nb, version=4) + "\n" == path.read_text("utf-8")
    assert all(cell.execution_count for cell in nb.cells if cell.cell_type == "code")


# --- the check fails on a stale output -----------------------------------------------------------


def _outputs_with(nb, piece: str):
    """(cell index, output, key) of every output whose text holds ``piece``."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "stream" and piece in output.text:
                found.append((index, output, "text"))
            for mime, value in output.get("data", {}).items():
                if isinstance(value, str) and piece in value:
                    found.append((index, output, mime))
    return found


def edited(name: str, old: str, new: str, mime: str | None = None):
    """Notebook ``name`` as committed, and a copy with ``old`` replaced by ``new`` in the outputs
    of the first cell that shows it (of type ``mime`` only, if given); the index of that cell."""
    original = committed(name)
    changed = copy.deepcopy(original)
    hits = [hit for hit in _outputs_with(changed, old) if mime is None or hit[2] == mime]
    assert hits, f"{old!r} is in no output of {name}"
    hits = [hit for hit in hits if hit[0] == hits[0][0]]
    for _, output, key in hits:
        if key == "text":
            output.text = output.text.replace(old, new)
        else:
            output.data[key] = output.data[key].replace(old, new)
    return original, changed, hits[0][0]


STALE = [
    # (notebook, text in an output, its stale version, the output type it is in; None: all)
    pytest.param("02_shard_map", "grad x: (8, 16)", "grad x: (8, 15)", None, id="shape"),
    pytest.param("05_training", "(16, 32)  ", "(16, 64)  ", "text/html", id="shape-in-html-table"),
    pytest.param("03_redistribute", "S(0) -> S(1): 1 step", "S(0) -> R: 1 step", None, id="layout"),
    pytest.param("01_layouts", "S(0)[1]S(0)[0]", "S(0)[0]S(0)[1]", None, id="layout-order"),
    pytest.param("04_global_ops", "partial sums: [-9.2747", "partial sums: [-9.3747", None, id="float"),
    pytest.param("05_training", "last loss 2.", "last loss 3.", None, id="loss"),
    pytest.param("01_layouts", "5 -> [2, 2, 1, 0]", "5 -> [2, 2, 1, 1]", None, id="integer"),
    pytest.param("04_global_ops", "all_to_all x2", "all_to_all x3", "text/html", id="table-cell"),
    pytest.param("05_training", "44,800", "44,832", "text/plain", id="table-bytes"),
    pytest.param("03_redistribute", "18 catalogue cases", "17 catalogue cases", None, id="count"),
    pytest.param("02_shard_map", "'all_reduce'", "'all_gather'", None, id="collective-name"),
]


@pytest.mark.parametrize(("name", "old", "new", "mime"), STALE)
def test_check_reports_a_stale_output(name, old, new, mime):
    original, changed, cell = edited(name, old, new, mime)
    differences = nbx.compare(changed, original, name)
    assert differences, f"{old!r} -> {new!r} went unreported"
    assert {d.cell for d in differences} == {cell} and all(d.notebook == name for d in differences)
    assert nbx.compare(original, changed, name)  # either way round


def test_check_reports_missing_extra_and_error_outputs():
    original = committed("01_layouts")
    cell = next(i for i, c in enumerate(original.cells) if c.cell_type == "code" and c.outputs)

    missing = copy.deepcopy(original)
    missing.cells[cell].outputs.pop()
    (found,) = nbx.compare(missing, original, "01_layouts")
    assert found.cell == cell and "not committed" in found.what

    (found,) = nbx.compare(original, missing, "01_layouts")
    assert found.cell == cell and "missing now" in found.what

    failing = copy.deepcopy(original)
    error = nbformat.v4.new_output("error", ename="AssertionError", evalue="shapes differ", traceback=[])
    failing.cells[cell].outputs.append(error)
    found = nbx.compare(original, failing, "01_layouts")
    assert {d.cell for d in found} == {cell} and any("error output: AssertionError" in d.what for d in found)
    # an error committed and raised again is still reported (unless the cell is tagged raises-exception)
    assert nbx.compare(failing, failing, "01_layouts")
    failing.cells[cell].metadata["tags"] = ["raises-exception"]
    assert not nbx.compare(failing, failing, "01_layouts")


def test_check_reports_a_notebook_committed_without_outputs():
    original = committed("03_redistribute")
    bare = copy.deepcopy(original)
    for cell in bare.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    differences = nbx.compare(bare, original, "03_redistribute")
    code_cells = [i for i, c in enumerate(original.cells) if c.cell_type == "code"]
    assert {d.cell for d in differences} == set(code_cells)  # every cell: not executed
    assert "execution count None committed, expected 1" in str(differences[0])


def test_check_reports_an_image_changed_in_size_or_gone():
    original = committed("05_training")
    ((cell, output, _),) = _outputs_with(original, "<svg")
    resized = copy.deepcopy(original)
    (out,) = [o for o in resized.cells[cell].outputs if "image/svg+xml" in o.get("data", {})]
    out.data["image/svg+xml"] = out.data["image/svg+xml"].replace('width="560"', 'width="600"', 1)
    (found,) = nbx.compare(resized, original, "05_training")
    assert found.cell == cell and "560 260" in found.what and "600 260" in found.what
    del out.data["image/svg+xml"]
    (found,) = nbx.compare(resized, original, "05_training")
    assert "image/svg+xml now, not committed" in found.what


# --- ... and not on what varies from run to run ----------------------------------------------------


def _with_line(nb, cell: int, line: str):
    nb = copy.deepcopy(nb)
    (stream,) = [o for o in nb.cells[cell].outputs if o.output_type == "stream"]
    stream.text += line + "\n"
    return nb


@pytest.mark.parametrize(
    ("committed_line", "fresh_line"),
    [
        ("step took 12.3 ms", "step took 1.2 s"),
        ("step took 40 µs", "step took 7.25ms"),
        (
            "8.1 ms ± 120 µs per loop (mean ± std. dev. of 7 runs, 100 loops each)",
            "1.02 s ± 3 ms per loop (mean ± std. dev. of 3 runs, 1 loop each)",
        ),
        ("<function <lambda> at 0x7f3a2c1b9d40>", "<function <lambda> at 0x55d1e0a4c2b0>"),
        ("last loss 2.762547", "last loss 2.762548"),  # the last printed digit
        ("difference 2.8e-06", "difference 2.9e-06"),
        ("loss 4.4163", "loss 4.4181"),  # within 1e-3 relative
    ],
)
def test_check_ignores_timings_addresses_and_float_noise(committed_line, fresh_line):
    original = committed("01_layouts")
    cell = next(
        i
        for i, c in enumerate(original.cells)
        if any(o.output_type == "stream" for o in c.get("outputs", []))
    )
    old, new = _with_line(original, cell, committed_line), _with_line(original, cell, fresh_line)
    assert nbx.compare(old, new, "01_layouts") == []


def test_check_ignores_where_the_kernel_split_a_stream():
    original = committed("02_shard_map")
    split = copy.deepcopy(original)
    cell, output = next(
        (i, o) for i, c in enumerate(split.cells) for o in c.get("outputs", []) if o.output_type == "stream"
    )
    half = len(output.text) // 2
    second = copy.deepcopy(output)
    output.text, second.text = output.text[:half], output.text[half:]
    outputs = split.cells[cell].outputs
    outputs.insert(outputs.index(output) + 1, second)
    assert nbx.compare(original, split, "02_shard_map") == []


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("(8, 16)", "(8, 16)", True),
        ("(8, 16)", "(8, 17)", False),
        ("2048 B", "2049 B", False),  # integers are exact, however large
        ("1.000", "1.001", True),  # the last digit
        ("1.000", "1.002", False),
        ("123.4567", "123.5234", True),  # within 1e-3 relative
        ("123.4567", "123.7", False),
        ("S(0)S(1)", "S(1)S(0)", False),
        ("P('dp')", "P('tp')", False),
        ("took 3 s", "took 12 min", True),
        ("3 shards", "4 shards", False),  # not a timing
        ("at 0x7ffe12345678", "at 0x55aa87654321", True),
        ("0xff", "0xfe", False),  # not an address
    ],
)
def test_text_comparison(a, b, same):
    assert (nbx.text_difference(a, b) is None) is same


# --- the docs site shows the outputs ---------------------------------------------------------------


def test_docs_link_every_notebook():
    for path in nbx.notebook_paths():
        link = ROOT / "docs" / "notebooks" / path.name
        assert link.is_symlink() and link.resolve() == path.resolve(), f"docs/notebooks/{path.name}"
    assert all(f"notebooks/{name}.ipynb" in (ROOT / "mkdocs.yml").read_text("utf-8") for name in NAMES)


def test_docs_site_shows_the_outputs(built_site):
    """The site (conftest's build, the one tests/test_docs.py checks) renders every notebook
    with its committed outputs: printed text, rich's pictures and tables, the SVG loss curves."""
    tmp_path, output = built_site
    assert "WARNING" not in output, output
    pages = {name: (tmp_path / "notebooks" / name / "index.html").read_text("utf-8") for name in NAMES}
    home = (tmp_path / "index.html").read_text("utf-8")
    assert all(f'href="notebooks/{name}/"' in home for name in NAMES)  # in the nav

    assert "round trip ok for 7 layouts" in pages["01_layouts"]  # a printed line
    assert "(5, 6) as S(0)S(1) on [dp=2, tp=4]" in pages["01_layouts"]  # a sharding picture
    assert "18 catalogue cases: values kept, plans as explained" in pages["03_redistribute"]
    assert "44,800" in pages["05_training"]  # the memory table
    ((_, svg_output, _),) = _outputs_with(committed("05_training"), "<svg")
    svg = svg_output.data["image/svg+xml"]
    assert base64.b64encode(svg.encode())[:200].decode() in pages["05_training"]  # the loss curves
