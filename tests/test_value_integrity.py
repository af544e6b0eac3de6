"""Values stay what they are, on both backends: a global value read out is the caller's to
change, replicas agree whatever each rank passed in, and a decision made without gradients is
not reused with them."""

from __future__ import annotations

import pytest
import torch
from common import assert_close

import functional_dtensor as fd


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def job_full_tensor_is_a_copy(mesh) -> list[bool]:
    """Changing the tensor full_tensor() returns leaves the value as it was, for every layout
    kind (replicated, even and uneven shards)."""
    kept = []
    for spec, n in ((fd.P(), 8), (fd.P(mesh.axis_names[0]), 8), (fd.P(mesh.axis_names[0]), 7)):
        x = fd.distribute_tensor(torch.arange(float(n)), mesh, spec)
        read = x.full_tensor()
        read.add_(100.0)
        kept.append(torch.equal(x.full_tensor(), torch.arange(float(n))))
    return kept


@pytest.mark.meshes((2,), (4,))
def test_full_tensor_never_aliases_the_value(backend, mesh):
    for p, kept in enumerate(backend.run(job_full_tensor_is_a_copy, mesh.shape, mesh.names)):
        assert kept == [True, True, True], p


def job_distribute_from_rank_0(mesh) -> dict:
    """Every rank passes its own tensor (its rank in every element): the value is rank 0's, as
    torch's src_data_rank=0; src_data_rank=None keeps each rank's own data (no communication)."""
    mine = torch.full((4, 4), float(_rank()))
    name = mesh.axis_names[0]
    replicated = fd.distribute_tensor(mine, mesh, fd.P())
    sharded = fd.distribute_tensor(mine, mesh, fd.P(name))
    own = fd.distribute_tensor(mine, mesh, fd.P(), src_data_rank=None)
    return {
        "replicated": replicated.local_shards()[0].tolist(),
        "sharded": sharded.local_shards()[0].tolist(),
        "full": sharded.full_tensor().tolist(),
        "own": own.local_shards()[0].tolist(),
        "rank": _rank(),
    }


@pytest.mark.meshes((2,), (4,), (2, 2))
def test_distribute_tensor_takes_rank_0s_data(backend, mesh):
    for got in backend.run(job_distribute_from_rank_0, mesh.shape, mesh.names):
        zeros = torch.zeros(4, 4)
        assert torch.equal(torch.tensor(got["replicated"]), zeros)
        assert torch.equal(torch.tensor(got["full"]), zeros)
        assert torch.equal(torch.tensor(got["sharded"]), zeros[: len(got["sharded"])])
        assert torch.equal(torch.tensor(got["own"]), torch.full((4, 4), float(got["rank"])))


def test_src_data_rank_is_checked():
    mesh = fd.simulated_mesh(2, "x")
    with pytest.raises(fd.InputTypeError, match="src_data_rank"):
        fd.distribute_tensor(torch.ones(2), mesh, fd.P(), src_data_rank=5)


def job_max_without_then_with_gradients(mesh) -> list:
    """torch.max / amax / amin of a sharded value, first without gradients, then with: the
    gradient is torch's (the one maximum's element alone), not every device's local maximum's."""
    t = torch.tensor([3.0, 9.0, 1.0, 7.0, 2.0, 8.0, 5.0, 4.0])
    name = mesh.axis_names[0]
    grads = []
    for op in (torch.max, torch.amax, torch.amin, torch.min):
        with torch.no_grad():
            op(fd.distribute_tensor(t, mesh, fd.P(name)))
        leaf = t.clone().requires_grad_()
        op(fd.distribute_tensor(leaf, mesh, fd.P(name))).full_tensor().backward()
        grads.append(leaf.grad)
    return grads


@pytest.mark.meshes((2,), (4,))
def test_a_decision_without_gradients_is_not_reused_with_them(backend, mesh):
    t = torch.tensor([3.0, 9.0, 1.0, 7.0, 2.0, 8.0, 5.0, 4.0])
    want = []
    for op in (torch.max, torch.amax, torch.amin, torch.min):
        leaf = t.clone().requires_grad_()
        op(leaf).backward()
        want.append(leaf.grad)
    for got in backend.run(job_max_without_then_with_gradients, mesh.shape, mesh.names):
        assert_close(got, want)
