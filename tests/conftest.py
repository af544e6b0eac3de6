"""Hypothesis profiles, and the ``backend`` fixture: every test that takes it runs on the
simulated backend and on real gloo ranks (2 and 4, from the session-long pools of
:mod:`conftest_pool`), through :mod:`backends`.

A test that takes ``backend`` alone runs once per backend. A test that also takes ``mesh`` runs
once per (backend, mesh) pair the backend can run: on the meshes of its
``@pytest.mark.meshes(...)`` marker (shapes, or :class:`backends.Mesh` values), by default
:data:`backends.DEFAULT_MESHES`. Gloo runs one rank per device, so ``gloo-2`` runs 2-device
meshes and ``gloo-4`` 4-device ones; the simulated backend runs them all (3-d and uneven
ones too). Gloo cases carry the ``distributed`` mark (``-m "not distributed"`` leaves them out,
and then no rank process starts).

Tests marked ``breaks_pool`` (a rank killed or stuck on purpose) run last, so that the session
pools are replaced at most once.
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

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


def pytest_configure(config):
    config.addinivalue_line("markers", "meshes(*shapes): the meshes a test taking `mesh` runs on")
    config.addinivalue_line("markers", "breaks_pool: leaves a gloo pool broken on purpose; runs last")


def _param(name: str, *values, id: str):
    marks = [pytest.mark.distributed] if backends.BACKENDS[name] else []
    return pytest.param(*values, id=id, marks=marks)


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    if "mesh" not in metafunc.fixturenames:
        metafunc.parametrize("backend", [_param(n, n, id=n) for n in backends.BACKENDS], indirect=True)
        return
    marker = metafunc.definition.get_closest_marker("meshes")
    meshes = [backends.as_mesh(m) for m in (marker.args if marker else backends.DEFAULT_MESHES)]
    params = [
        _param(name, name, mesh, id=f"{name}/{mesh}")
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
