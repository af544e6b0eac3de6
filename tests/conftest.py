"""Hypothesis profiles, and the ``backend`` fixture: every test that takes it runs on the
simulated backend and on real gloo ranks (2 and 4, from the session-long pools of
:mod:`conftest_pool`), through :mod:`backends`.

A test that takes ``backend`` alone runs once per backend. A test that also takes ``mesh`` runs
once per (backend, mesh) pair the backend can run: on the meshes of its
``@pytest.mark.meshes(...)`` marker (shapes, or :class:`backends.Mesh` values), by default
:data:`backends.DEFAULT_MESHES`. Gloo runs one rank per device, so ``gloo-2`` runs 2-device
meshes and ``gloo-4`` 4-device ones; the simulated backend runs them all (3-d and uneven
ones too). Gloo cases carry the ``distributed`` mark (``-m "not distributed"`` leaves them out,
and then no rank process starts). ``@pytest.mark.meshes(..., slow=("gloo-4", "simulated/2x2"))``
puts the cases of those backends, or backend/mesh ids, in the slow tier (``-m slow``).

Tests marked ``breaks_pool`` (a rank killed or stuck on purpose) run last, so that the session
pools are replaced at most once.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, register_random, settings

sys.path.insert(0, str(Path(__file__).parent))  # the catalogue, the backends, the gloo pool

import backends  # noqa: E402
from conftest_pool import gloo  # noqa: E402, F401  (the session fixture behind the gloo backends)

# the fixtures given to property tests (backend, mesh) are plain values: no state to reset
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("dev", max_examples=100, deadline=None, suppress_health_check=SUPPRESSED)
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, suppress_health_check=SUPPRESSED
)
# a long, randomized run of the property tests: FD_PROFILE=long python -m pytest ...
# (docs/concepts/redistribute.md); FD_PROFILE=dev draws fresh random examples at the usual count
settings.register_profile(
    "long", max_examples=5000, deadline=None, derandomize=False, suppress_health_check=SUPPRESSED
)
# the fuzz suite's long run, over 10,000 drawn examples in all (docs/concepts/redistribute.md):
# FD_PROFILE=fuzz python -m pytest tests/test_fuzz.py -m "not distributed"
settings.register_profile(
    "fuzz", max_examples=2100, deadline=None, derandomize=False, suppress_health_check=SUPPRESSED
)
settings.load_profile(os.environ.get("FD_PROFILE") or "ci")  # by default the same examples on every run


class TorchGlobalRandom:
    """torch's global generator in the shape hypothesis seeds and restores around every example
    (as it does ``random``'s and numpy's): a test drawing from ``torch.randn`` without a generator
    gets the same numbers for the same example, whatever ran before it."""

    seed = staticmethod(torch.manual_seed)
    getstate = staticmethod(torch.random.get_rng_state)
    setstate = staticmethod(torch.random.set_rng_state)


TORCH_GLOBAL_RANDOM = TorchGlobalRandom()  # hypothesis keeps a weak reference: this one holds it
register_random(TORCH_GLOBAL_RANDOM)


@pytest.fixture(autouse=True)
def _torch_seeded():
    """Each test starts from the same torch random state, wherever it runs in the session (a
    test run alone, or after others, draws the same tensors)."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> tuple[Path, str]:
    """The docs site, built once a session with ``mkdocs build --strict``: its folder and what
    mkdocs printed (the docs tests and the notebooks' rendering test read the same build)."""
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    return site, output


def pytest_configure(config):
    config.addinivalue_line("markers", "meshes(*shapes): the meshes a test taking `mesh` runs on")
    config.addinivalue_line("markers", "breaks_pool: leaves a gloo pool broken on purpose; runs last")


def _param(name: str, *values, id: str, slow: bool = False):
    marks = [pytest.mark.distributed] if backends.BACKENDS[name] else []
    return pytest.param(*values, id=id, marks=[*marks, pytest.mark.slow] if slow else marks)


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    if "mesh" not in metafunc.fixturenames:
        metafunc.parametrize("backend", [_param(n, n, id=n) for n in backends.BACKENDS], indirect=True)
        return
    marker = metafunc.definition.get_closest_marker("meshes")
    meshes = [backends.as_mesh(m) for m in (marker.args if marker else backends.DEFAULT_MESHES)]
    slow = set(marker.kwargs.get("slow", ())) if marker else set()
    params = [
        _param(name, name, mesh, id=f"{name}/{mesh}", slow=bool({name, f"{name}/{mesh}"} & slow))
        for name in backends.BACKENDS
        for mesh in meshes
        if backends.Backend(name).runs(mesh.shape)
    ]
    metafunc.parametrize(("backend", "mesh"), params, indirect=["backend"])


@pytest.fixture
def backend(request) -> backends.Backend:
    name = request.param
    pools = request.getfixturevalue("gloo") if backends.BACKENDS[name] else None
    return backends.Backend(name, pools)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("breaks_pool") is not None)  # stable
