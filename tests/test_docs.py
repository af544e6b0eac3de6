"""The docs site builds without warnings, its examples run, and the API page is complete."""

from __future__ import annotations

import ast
import doctest
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    page
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    if "```pycon" in page.read_text("utf-8")
]


def pycon_source(text: str) -> str:
    """The page with every line outside ``pycon`` fences blanked, so line numbers still match."""
    lines, inside = [], False
    for line in text.split("\n"):
        fence = line.strip().startswith("```")
        lines.append(line if inside and not fence else "")
        if fence:
            inside = not inside and line.strip() == "```pycon"
    return "\n".join(lines)


def test_mkdocs_build_strict(built_site):
    site, output = built_site  # conftest: built once, --strict
    assert "WARNING" not in output, f"mkdocs build warned:\n{output}"
    assert (site / "index.html").exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples(page):
    """Every ``pycon`` block of a page (or the README) runs as a doctest, top to bottom in one
    namespace."""
    source = pycon_source(page.read_text("utf-8"))
    test = doctest.DocTestParser().get_doctest(source, {}, page.stem, str(page), 0)
    runner = doctest.DocTestRunner(verbose=False, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda message: pytest.fail(message, pytrace=False))
    assert runner.summarize(verbose=False).attempted > 0


def test_api_page_lists_every_public_name():
    """Each name in ``functional_dtensor.__all__`` has an entry (or, for the factories that
    share one signature, a mention) on the API page. ``__all__`` is read without importing."""
    tree = ast.parse((ROOT / "functional_dtensor" / "__init__.py").read_text("utf-8"))
    (public,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    api = (ROOT / "docs" / "api.md").read_text("utf-8")
    missing = [n for n in public if f"::: functional_dtensor.{n}\n" not in api and f"`fd.{n}`" not in api]
    assert not missing, f"add these public names to docs/api.md: {missing}"
