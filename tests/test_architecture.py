"""The package's layering, checked mechanically (see docs/architecture.md).

Read from the source with ``ast``, without importing anything: every module sits on a floor;
a module imports only from its own floor or lower ones, and the import graph has no cycle;
functorch's internals are imported in one module; only the backend interface asks which
backend a mesh has; no module reads another module's private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "functional_dtensor"

#: floor -> the modules on it, bottom to top (dotted names under the package; a trailing ".*"
#: stands for every module of a subpackage)
FLOORS = {
    "records": ["_public", "_cache", "_errors", "_log", "_placements", "_spec", "_mesh", "_layout"],
    "math": ["_sharding", "_blocks", "_plan", "_philox", "_philox_native", "_rules", "_functorch"],
    "backends": [
        "_simulated.*",
        "_distributed.*",
        "_varying",
        "_op_args",
        "_autograd",
        "_comm_log",
        "_backend",
    ],
    "collectives": ["_context", "_collectives"],
    "values": [
        "_layout_checks",
        "_global_storage",
        "_dtensor_core",
        "_dtensor",
        "_factories",
        "_random_draws",
        "random",
    ],
    "transformations": [
        "_tracking",
        "_input_guard",
        "_varied",
        "_shard_map",
        "_redistribute",
        "_gathered_linear",
        "_local_map",
        "_fallback",
        "_op_decisions",
        "_op_inputs",
        "_global_ops",
        "_folded_linear",
        "_user_rules",
        "ops.*",
        "_surface",
        "_styles",
        "_sharded_module",
        "_parallelize",
        "_optim",
        "_clip",
        "_ring_attention",
    ],
    "tools": [
        "_explain",
        "_visualize",
        "_comm_debug",
        "_checkpoint_leaves",
        "_checkpoint_processes",
        "_checkpoint_dcp",
        "_checkpoint_files",
        "checkpoint",
        "_interop",
        "testing.*",
        "_demo",
        "__init__",
        "__main__",
    ],
}
FUNCTORCH_HOME = "_functorch"
BACKEND_HOME = "_backend"


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        found[name] = ast.parse(path.read_text("utf-8"), str(path))
    return found


def floor_of(module: str) -> int:
    for level, (_, members) in enumerate(FLOORS.items()):
        for member in members:
            if module == member or (member.endswith(".*") and module.split(".")[0] == member[:-2]):
                return level
    raise AssertionError(f"{module} is on no floor: add it to FLOORS and to docs/architecture.md")


def internal_imports(module: str, tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` for every import of the package's own
    modules, at any depth (lazy imports in functions count too)."""
    package = module.split(".") if module in SUBPACKAGES else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif (node.module or "").startswith("functional_dtensor"):
                target = node.module.removeprefix("functional_dtensor").lstrip(".")
            else:
                continue
            names = []
            for alias in node.names:  # "from . import x" imports the module x
                submodule = f"{target}.{alias.name}".lstrip(".")
                if submodule in MODULES:
                    out.append((submodule, [], node.lineno))
                else:
                    names.append(alias.name)
            if names:
                out.append((target or "__init__", names, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("functional_dtensor."):
                    out.append((alias.name.removeprefix("functional_dtensor."), [], node.lineno))
                elif alias.name == "functional_dtensor":
                    out.append(("__init__", [], node.lineno))
    return out


MODULES = modules()
SUBPACKAGES = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_or_across_never_up(module):
    here = floor_of(module)
    for target, _, line in internal_imports(module, MODULES[module]):
        if target == module:
            continue
        assert floor_of(target) <= here, (
            f"{module}:{line} imports {target}, a floor up "
            f"({list(FLOORS)[floor_of(target)]} above {list(FLOORS)[here]}): invert the dependency "
            "(a higher module may install methods on a lower class)"
        )


def test_the_import_graph_is_acyclic():
    graph = {m: {t for t, _, _ in internal_imports(m, tree) if t != m} for m, tree in MODULES.items()}
    visiting, done = set(), set()

    def visit(node, path):
        if node in done:
            return
        assert node not in visiting, f"import cycle: {' -> '.join([*path, node])}"
        visiting.add(node)
        for target in sorted(graph.get(node, ())):
            visit(target, [*path, node])
        visiting.discard(node)
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_functorch_internals_are_imported_in_one_module():
    for module, tree in MODULES.items():
        if module == FUNCTORCH_HOME:
            continue
        source = ast.unparse(tree)
        for internal in ("torch._functorch", "torch._C._functorch", "_are_functorch_transforms_active"):
            assert internal not in source, (
                f"{module} uses functorch internals ({internal}): go through {FUNCTORCH_HOME}"
            )


def test_caches_go_through_the_one_compile_aware_cache():
    """``functools.lru_cache`` makes Dynamo warn of silent incorrectness while compiling;
    :mod:`functional_dtensor._cache` bypasses its caches then."""
    for module, tree in MODULES.items():
        if module == "_cache":
            continue
        source = ast.unparse(tree)
        for forbidden in ("lru_cache", "functools.cache"):
            assert forbidden not in source, f"{module} uses {forbidden}: use _cache.cached"


def _asks_the_backend(node: ast.AST) -> bool:
    """A comparison that tells the backends apart: with a backend's name or a mesh's
    ``backend`` field, or whether a frame has a device level at all (only a simulated mesh's
    vmap carries the devices)."""
    if not isinstance(node, ast.Compare):
        return False
    sides = (node.left, *node.comparators)
    for side in sides:
        if isinstance(side, ast.Constant) and side.value in ("simulated", "distributed"):
            return True
        if isinstance(side, ast.Attribute) and side.attr == "backend":
            return True
    levels = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "device_level"]
    return bool(levels) and any(isinstance(s, ast.Constant) and s.value is None for s in sides)


def test_only_the_backend_interface_asks_which_backend_a_mesh_has():
    for module, tree in MODULES.items():
        if module in (BACKEND_HOME, "_mesh"):  # the mesh validates its own field
            continue
        asking = [n.lineno for n in ast.walk(tree) if _asks_the_backend(n)]
        assert not asking, f"{module} asks which backend it runs on (lines {asking}): ask {BACKEND_HOME}"


#: what a backend's storage form is: whether values are stacked, the dims before a block's own
STORAGE_FORM = frozenset(["stacked", "lead", "_lead"])
#: the backends' floor: the only modules that read the storage form
BACKENDS_FLOOR = list(FLOORS).index("backends")


def test_only_the_backends_read_the_storage_form():
    """Above the backends floor, code is written for one device's block (a global op's local
    form) or asks the backend (``Backend.run_local``, ``block_dim``): it never reads whether
    storage is stacked, nor the dims before a block's own."""
    for module, tree in MODULES.items():
        if floor_of(module) <= BACKENDS_FLOOR:
            continue
        reading = [
            n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in STORAGE_FORM
        ]
        assert not reading, f"{module} reads the storage form (lines {reading}): ask the backend"


def test_only_the_backend_interface_imports_the_simulated_backend():
    """``_simulated/`` is reached through ``_backend`` alone (the distributed backend's public
    entry points, ``fd.init_device_mesh`` and ``fd.check_collectives``, are exported as they are)."""
    for module, tree in MODULES.items():
        if module == BACKEND_HOME or module.split(".")[0] == "_simulated":
            continue
        for target, _, line in internal_imports(module, tree):
            assert target.split(".")[0] != "_simulated", (
                f"{module}:{line} imports {target}: go through {BACKEND_HOME}"
            )


def _private_definitions(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, assigned names and attributes,
    dataclass fields and slots."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(
            getattr(node, "ctx", None), ast.Store
        ):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # __slots__ entries, object.__setattr__(self, "_x", ...)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_names():
    own = {m: _private_definitions(t) for m, t in MODULES.items()}
    everywhere = set().union(*own.values())
    for module, tree in MODULES.items():
        for target, names, line in internal_imports(module, tree):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not private, f"{module}:{line} imports private names {private} from {target}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr in everywhere
                and node.attr not in own[module]
            ):
                raise AssertionError(
                    f"{module}:{node.lineno} reads another module's private name .{node.attr}"
                )


#: module-level tables that grow as a program runs, each bounded by something other than the
#: program's inputs (reviewed: a new one is a cache, and goes through ``_cache``)
REGISTRIES = {
    "_cache._caches": "one per function decorated with cached",
    "_cache._tables": "one per Bounded table",
    "_op_decisions.HANDLERS": "one handler per torch function with a rule (torch's and users' ops)",
    "_op_decisions.FUNCS": "the same functions, by number",
    "_op_decisions.FUNC_IDS": "the same functions, by number",
    "_op_decisions.GENERIC": "the metadata rules, appended at import",
    "_distributed.kernels._OPTIONS": "one entry per reduce op",
    "_distributed.engine._calls": "the shard_map calls in progress (a stack, popped on return)",
    "_distributed.runtime._timeout": "one entry, read once",
    "_distributed.runtime._groups": "one process group per mesh and axes the program builds (as torch's)",
    "_distributed.runtime._torch_meshes": "one torch DeviceMesh per mesh the program builds (as torch's)",
    "_interop._simulated_torch_meshes": "one fake world per simulated mesh converted to torch's",
    "_varied.TABLE": "the values of one data-parallel forward, cleared when it ends",
    "_varied.PVARIED": "the values of one data-parallel forward, cleared when it ends",
}


def _module_tables(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to an empty dict, list or set."""
    names = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        empty = (
            isinstance(value, (ast.Dict, ast.List, ast.Set))
            and not getattr(value, "keys", getattr(value, "elts", None))
        ) or (isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("dict", "list", "set"))
        if empty:
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _grown_in_functions(tree: ast.Module, names: set[str]) -> set[str]:
    """Those of ``names`` that a function stores into (``t[k] = v``, ``t.append``, ...)."""
    grown = set()
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(function):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                target = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = (
                    node.func.value if node.func.attr in ("append", "add", "setdefault", "update") else None
                )
            else:
                continue
            if isinstance(target, ast.Name) and target.id in names:
                grown.add(target.id)
    return grown


def test_every_cache_is_bounded():
    """A table that grows with what a program does (a decision per call's shapes, a plan per
    layout pair) is a ``_cache.cached`` function or a ``_cache.Bounded`` table: a server
    feeding varied sequence lengths must not grow without bound."""
    grown = [
        f"{module}.{name}"
        for module, tree in MODULES.items()
        for name in sorted(_grown_in_functions(tree, _module_tables(tree)))
    ]
    unbounded = [name for name in grown if name not in REGISTRIES]
    assert not unbounded, (
        f"module-level tables that grow in a function: {unbounded}: make each a _cache.Bounded "
        "table or a _cache.cached function (or, if it is bounded by the program's code rather than "
        "its inputs, add it to REGISTRIES with the reason)"
    )


#: modules over the size limit, to be split (the list only shrinks)
OVERSIZED: set[str] = set()
MAX_LINES = 600


def test_no_module_grows_past_the_size_limit():
    sizes = {
        m: len((PACKAGE / (m.replace(".", "/") + ".py")).read_text("utf-8").splitlines())
        for m in MODULES
        if (PACKAGE / (m.replace(".", "/") + ".py")).exists()
    }
    over = {m for m, n in sizes.items() if n > MAX_LINES}
    assert over <= OVERSIZED, f"over {MAX_LINES} lines: {sorted(over - OVERSIZED)}; split them by job"
    assert OVERSIZED <= over, (
        f"now within {MAX_LINES} lines: remove {sorted(OVERSIZED - over)} from OVERSIZED"
    )
