"""Logging through the standard ``logging`` module: each area's logger logs its events once, in
one readable line; nothing is logged when off; ``FD_LOGS`` and ``fd.set_logs`` switch areas on.

Decisions, plans and process groups are cached for the whole session, so each test uses a mesh
of its own axis names, and shapes no other test uses: what it makes is new, and logged.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import functional_dtensor as fd
from functional_dtensor import _log

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def logs_off():
    """Every test starts and ends with nothing switched on (whatever FD_LOGS said at import)."""
    fd.set_logs()
    yield
    fd.set_logs()


def messages(caplog, area: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == f"functional_dtensor.{area}"]


def ours(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("functional_dtensor")]


# --- each area --------------------------------------------------------------------------------


def test_a_decision_is_logged_once_when_made(caplog):
    caplog.set_level(logging.INFO, logger="functional_dtensor.rules")
    mesh = fd.simulated_mesh((2, 2), ("ra", "rb"))
    a = fd.distribute_tensor(torch.randn(6, 4), mesh, fd.P(None, "ra"))
    b = fd.distribute_tensor(torch.randn(4, 10), mesh, fd.P("ra"))
    torch.matmul(a, b)
    assert messages(caplog, "rules") == ["matmul: S(1)R, S(0)R -> P(sum)R (no communication)"]
    caplog.clear()
    torch.matmul(a, b)  # the same decision, cached: not logged again
    a @ b
    assert messages(caplog, "rules") == []


def test_a_decision_that_redistributes_names_the_layouts_it_needs_and_the_bytes(caplog):
    caplog.set_level(logging.DEBUG, logger="functional_dtensor.rules")
    mesh = fd.simulated_mesh(2, "rc")
    a = fd.distribute_tensor(torch.randn(6, 10), mesh, fd.P("rc"))
    b = fd.distribute_tensor(torch.randn(6, 10), mesh, fd.P(None, "rc"))
    torch.add(a, b)
    first, *detail = messages(caplog, "rules")
    assert first.startswith("add: S(0), S(1) need ")
    assert first.endswith(" per device)") and "redistributes " in first
    assert detail[0] == "  add: shapes (6, 10), (6, 10) -> (6, 10) on simulated mesh [rc=2] on cpu"
    assert any("by all_to_all(rc)" in line for line in detail[1:]), detail


def test_a_plan_is_logged_once_with_its_steps_and_bytes(caplog):
    caplog.set_level(logging.INFO, logger="functional_dtensor.plans")
    mesh = fd.simulated_mesh((2, 2), ("pa", "pb"))
    x = fd.distribute_tensor(torch.randn(8, 6), mesh, fd.P("pa"))
    fd.redistribute(x, fd.P())
    assert messages(caplog, "plans") == [
        "S(0)R -> RR on (8, 6): all_gather(pa); 96 B per device",
        "RR -> S(0)R on (8, 6) (the gradient's way back): slice(pa); no communication",
    ]
    caplog.clear()
    fd.redistribute(x, fd.P())
    x.redistribute(fd.P())
    assert messages(caplog, "plans") == []


def test_a_plan_at_debug_lists_each_step(caplog):
    caplog.set_level(logging.DEBUG, logger="functional_dtensor.plans")
    mesh = fd.simulated_mesh((2, 2), ("pc", "pd"))
    x = fd.distribute_tensor(torch.randn(4, 14), mesh, fd.P("pc", "pd"))
    fd.redistribute(x, fd.P())
    assert messages(caplog, "plans") == [
        "S(0)S(1) -> RR on (4, 14): all_gather(pc, pd); 168 B per device",
        "  step 1 all_gather(pc, pd): S(0)S(1) -> RR, 168 B per device",
        "RR -> S(0)S(1) on (4, 14) (the gradient's way back): slice(pc), slice(pd); no communication",
        "  step 1 slice(pc): RR -> S(0)R, 0 B per device",
        "  step 2 slice(pd): S(0)R -> S(0)S(1), 0 B per device",
    ]


def test_a_shard_map_plan_is_logged_once_per_structure(caplog):
    caplog.set_level(logging.INFO, logger="functional_dtensor.shard_map")
    mesh = fd.simulated_mesh(2, "sa")

    def scale(x, w):
        return x * w

    f = fd.shard_map(scale, mesh=mesh, in_specs=(fd.P("sa"), fd.P()), out_specs=fd.P("sa"))
    f(torch.ones(4, 2), torch.ones(2))
    where = "on simulated mesh [sa=2] on cpu"
    assert messages(caplog, "shard_map") == [
        f"test_a_shard_map_plan_is_logged_once_per_structure.<locals>.scale: in_specs (P('sa'), P()) {where}",
        f"test_a_shard_map_plan_is_logged_once_per_structure.<locals>.scale: out_specs P('sa') {where}",
    ]
    caplog.clear()
    f(torch.zeros(4, 2), torch.zeros(2))
    assert messages(caplog, "shard_map") == []


def test_decisions_and_plans_made_while_dynamo_traces_are_logged(caplog):
    caplog.set_level(logging.INFO, logger="functional_dtensor.compile")
    mesh = fd.simulated_mesh(2, "ca")
    x = fd.distribute_tensor(torch.randn(6, 18), mesh, fd.P("ca"))

    def step(x):
        return fd.redistribute(torch.mul(x, 2.0), fd.P()).full_tensor()

    torch._dynamo.reset()
    torch.compile(step, backend="eager", fullgraph=True)(x)
    lines = messages(caplog, "compile")
    assert "mul: decision " in lines[0] and "made while Dynamo traces" in lines[0], lines
    assert "redistribute S(0) -> R on (6, 18) planned outside the graph: all_gather(ca)" in lines, lines


def test_nothing_is_logged_when_off(caplog):
    mesh = fd.simulated_mesh((2, 2), ("oa", "ob"))
    x = fd.distribute_tensor(torch.randn(10, 6), mesh, fd.P("oa"))
    torch.add(fd.redistribute(x, fd.P(None, "ob")), x)
    fd.shard_map(lambda v: v, mesh=mesh, in_specs=fd.P("oa"), out_specs=fd.P("oa"))(torch.ones(2))
    assert ours(caplog) == []
    for area in _log.AREAS:
        assert not logging.getLogger(f"functional_dtensor.{area}").isEnabledFor(logging.INFO), area
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("functional_dtensor").handlers)


# --- switching on -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "levels", "unknown"),
    [
        ("", {}, []),
        ("plans", {"plans": logging.INFO}, []),
        ("plans,rules", {"plans": logging.INFO, "rules": logging.INFO}, []),
        ("+rules", {"rules": logging.DEBUG}, []),
        ("+all", {"all": logging.DEBUG}, []),
        (" shard_map , +groups compile", {"shard_map": 20, "groups": 10, "compile": 20}, []),
        ("collectives", {"collectives": logging.INFO}, []),
        ("plans,dtensor,+nope", {"plans": logging.INFO}, ["dtensor", "+nope"]),
    ],
)
def test_fd_logs_values(value, levels, unknown):
    assert _log.parse(value) == (levels, unknown)


def test_set_logs_sets_levels_and_the_stderr_handler(capsys):
    fd.set_logs("plans", "+rules")
    package = logging.getLogger("functional_dtensor")
    assert logging.getLogger("functional_dtensor.plans").level == logging.INFO
    assert logging.getLogger("functional_dtensor.rules").level == logging.DEBUG
    assert not logging.getLogger("functional_dtensor.groups").isEnabledFor(logging.INFO)
    assert any(isinstance(h.formatter, _log.Formatter) for h in package.handlers)
    assert not package.propagate  # printed once, not again by the root logger's handlers
    mesh = fd.simulated_mesh(2, "ta")
    torch.mul(fd.distribute_tensor(torch.randn(2, 22), mesh, fd.P("ta")), 3)
    assert "[fd.rules] mul: S(0) -> S(0) (no communication)\n" in capsys.readouterr().err

    fd.set_logs(all=True)  # every area, the collectives' logger too (a child of the package's)
    assert logging.getLogger("functional_dtensor.collectives").isEnabledFor(logging.INFO)
    assert not logging.getLogger("functional_dtensor.plans").isEnabledFor(logging.DEBUG)
    fd.set_logs(rules=logging.DEBUG, plans=False)
    assert logging.getLogger("functional_dtensor.rules").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("functional_dtensor.plans").isEnabledFor(logging.INFO)

    fd.set_logs()
    assert package.propagate and package.level == logging.NOTSET
    assert not any(isinstance(h.formatter, _log.Formatter) for h in package.handlers)
    assert not logging.getLogger("functional_dtensor.rules").isEnabledFor(logging.INFO)


@pytest.mark.parametrize(
    ("args", "kwargs"), [(("plan",), {}), ((), {"dtensor": True}), ((), {"rules": "debug"})]
)
def test_set_logs_refuses_unknown_areas_and_levels(args, kwargs):
    with pytest.raises(fd.InputTypeError, match="fd.set_logs"):
        fd.set_logs(*args, **kwargs)


def test_formatter_writes_one_line_with_the_short_name():
    record = logging.LogRecord("functional_dtensor.plans", logging.INFO, __file__, 1, "a %s", ("b",), None)
    assert _log.Formatter().format(record) == "[fd.plans] a b"
    record = logging.LogRecord("functional_dtensor", logging.WARNING, __file__, 1, "careful", (), None)
    assert _log.Formatter().format(record) == "[fd] WARNING: careful"


def test_sizes():
    assert _log.size(96) == "96 B"
    assert _log.size(1536) == "1.50 KiB"
    from fractions import Fraction

    assert _log.size(Fraction(16, 3)) == "5.33 B"


def test_fd_logs_in_a_fresh_process():
    """The variable is read at import: known areas print to stderr, unknown ones are warned of."""
    program = (
        "import torch, functional_dtensor as fd\n"
        "mesh = fd.simulated_mesh((2, 2), ('x', 'y'))\n"
        "a = fd.distribute_tensor(torch.randn(8, 4), mesh, fd.P(None, 'x'))\n"
        "b = fd.distribute_tensor(torch.randn(4, 6), mesh, fd.P('x'))\n"
        "torch.matmul(a, b); torch.matmul(a, b)\n"
        "fd.redistribute(a, fd.P())\n"
    )
    env = {**os.environ, "FD_LOGS": "+rules,plans,bogus", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert err.count("[fd.rules] matmul: S(1)R, S(0)R -> P(sum)R (no communication)\n") == 1, err
    assert "[fd.rules]   matmul: shapes (8, 4), (4, 6) -> (8, 6) on simulated mesh [x=2, y=2] on cpu\n" in err
    assert "[fd.plans] S(1)R -> RR on (8, 4): all_gather(x); 64 B per device\n" in err, err
    assert "unknown log area(s) 'bogus' ignored; the areas are all, plans, rules, groups" in err, err


# --- process groups, on 2 gloo ranks ------------------------------------------------------------


def job_groups_logged(name: str) -> list[str]:
    """A mesh of a new axis name makes its process group; what the groups logger says of it."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("functional_dtensor.groups")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        fd.init_device_mesh("cpu", 2, name)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    return [_log.Formatter().format(r) for r in records]


@pytest.mark.distributed
def test_process_groups_are_logged_when_created(gloo):
    name = f"g{uuid.uuid4().hex[:8]}"
    for rank, lines in enumerate(gloo.run(2, job_groups_logged, name)):
        assert lines == [
            f"[fd.groups] process group over {name} of distributed mesh [{name}=2] on cpu: "
            f"ranks [0, 1] (this rank {rank})"
        ], (rank, lines)
