"""Every test can fail: its body asserts, expects an error, or calls (or hands to a runner) a
function of the tests that does. A test that only calls the library passes whatever it returns."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
#: calls that decide pass or fail themselves (pytest's and torch's)
DECIDING = {"raises", "warns", "fail", "assert_close", "equal", "check"}


def _functions() -> dict[str, list[ast.AST]]:
    """Every function defined in the test files and their helpers, by name (nested ones too)."""
    found: dict[str, list[ast.AST]] = {}
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append(node)
    return found


def _names_used(node: ast.AST) -> set[str]:
    """The names a function calls or hands on (a job given to ``backend.run``)."""
    used = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            used.add(n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", ""))
            used.update(a.id for a in n.args if isinstance(a, ast.Name))
    return used


def _asserts_itself(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Assert):
            return True
        if isinstance(n, ast.Raise) and "AssertionError" in ast.unparse(n.exc or ast.Constant(None)):
            return True
    return bool(_names_used(node) & DECIDING)


def _deciding_functions(functions: dict[str, list[ast.AST]]) -> set[str]:
    """The names of the functions that assert, directly or through others (a fixpoint)."""
    deciding = {name for name, nodes in functions.items() if any(_asserts_itself(n) for n in nodes)}
    changed = True
    while changed:
        changed = False
        for name, nodes in functions.items():
            if name not in deciding and any(_names_used(n) & deciding for n in nodes):
                deciding.add(name)
                changed = True
    return deciding


FUNCTIONS = _functions()
DECIDING_FUNCTIONS = _deciding_functions(FUNCTIONS)
TEST_NAMES = sorted(name for name in FUNCTIONS if name.startswith("test_"))


@pytest.mark.parametrize("name", TEST_NAMES)
def test_every_test_can_fail(name):
    assert name in DECIDING_FUNCTIONS, f"{name} asserts nothing: it passes whatever the library does"


def test_the_check_finds_a_test_without_an_assertion():
    tree = ast.parse("def helper(x):\n    return x\n\ndef test_calls_only(x):\n    helper(x)\n")
    functions = {n.name: [n] for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "test_calls_only" not in _deciding_functions(functions)
    tree = ast.parse("def helper(x):\n    assert x\n\ndef test_calls_a_check(x):\n    helper(x)\n")
    functions = {n.name: [n] for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "test_calls_a_check" in _deciding_functions(functions)
