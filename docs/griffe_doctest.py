"""A griffe extension for the API reference: read the library's docstrings as Markdown.

The docstrings hold doctests (``>>>`` lines followed by their output) in running text rather
than in a Google-style ``Examples:`` section, and name other objects with Sphinx roles
(``:func:`shard_map```). Markdown would read ``>>>`` as nested block quotes and print the roles
verbatim, so before a docstring is parsed this extension wraps each doctest block in a
``pycon`` fence and writes each role as inline code. The source files are not touched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")


def to_markdown(text: str) -> str:
    """``text`` with its doctest blocks fenced and its Sphinx roles written as inline code.

    A doctest block starts at a ``>>>`` line and ends at the next blank line. Lines inside
    existing fences are kept as they are, so the rewrite is idempotent.
    """
    out: list[str] = []
    in_doctest = in_fence = False
    for line in text.split("\n"):
        stripped = line.strip()
        if in_doctest and not stripped:
            out.append("```")
            in_doctest = False
        elif stripped.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and not in_doctest and stripped.startswith(">>>"):
            out.append("```pycon")
            in_doctest = True
        out.append(line if in_fence or in_doctest else _ROLE.sub(_role_to_code, line))
    if in_doctest:
        out.append("```")
    return "\n".join(out)


def _role_to_code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class MarkdownDocstrings(griffe.Extension):
    """Rewrite the docstring of every module, class, function and attribute."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        _rewrite(obj)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite(pkg)


def _rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = to_markdown(obj.docstring.value)
