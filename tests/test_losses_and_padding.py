"""Real model code's losses and padding on ``fd.DTensor`` (issue #26), on both backends, against
torch on the global tensor in float64, values and gradients:

- ``F.cross_entropy`` with every option torch has (class weights as a plain tensor or a value,
  class probabilities as the target, label smoothing, ``ignore_index``, each reduction), with
  the rows, the class dim (loss parallel) or both sharded, uneven blocks included;
- ``F.nll_loss`` with the same options;
- ``F.pad`` in every mode: the dims not padded keep their layout, with no communication (HF's
  ``F.pad(labels, (0, 1), value=-100)`` of labels sharded over the batch);
- HF transformers' causal-LM loss as shipped, and ``nn.MultiheadAttention`` with replicated
  parameters on inputs sharded over the batch.

Communication is counted with ``fd.CommDebugMode``: with the class dim sharded only per-row
maxima and sums cross devices, never the logits. On a simulated mesh a loss-parallel
cross-entropy of even blocks runs its per-row arithmetic on every device's block at once; its
layouts, each device's part, collectives and second derivatives are the ranks'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from backends import local_devices
from common import assert_close, check

import functional_dtensor as fd

C = 7  # classes of the tables' logits (uneven blocks over 4 devices; see the report on empty blocks)


def values(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def indices(shape, seed=0, ignored=(0,)):
    """Class indices in [0, C), with -100 (torch's ignore_index) at the flat positions ``ignored``."""
    t = torch.randint(0, C, shape, generator=torch.Generator().manual_seed(seed))
    flat = t.reshape(-1)
    for i in ignored:
        flat[i] = -100
    return t


def probabilities(shape, seed=0):
    return torch.softmax(values(shape, seed), dim=1 if len(shape) > 1 else 0)


WEIGHT = torch.rand(C, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5


# specs by the mesh's axis names
def _rows(names):
    return fd.P(names)  # dim 0 over every axis


def _classes(names):
    return fd.P(None, names)


def _grid(names):  # rows over the first axis, classes over the last (classes alone on a 1-d mesh)
    return fd.P(names[0], names[-1]) if len(names) > 1 else fd.P(None, names)


def _grid_rows(names):
    return fd.P(names[0]) if len(names) > 1 else fd.P()


def _last(names):
    return fd.P(None, None, names)


def _whole(names):
    return fd.P()


def laying(like):
    """``lay(t, spec_of)``: ``t`` on the mesh of ``like`` where it is an fd.DTensor, else ``t``
    (each rank's own ``t``, the same on every rank: no broadcast)."""
    if not isinstance(like, fd.DTensor):
        return lambda t, spec_of: t
    mesh = like.device_mesh
    return lambda t, spec_of: fd.distribute_tensor(t, mesh, spec_of(mesh.axis_names), src_data_rank=None)


# --- the tables: name -> (logits' shape, logits' spec, call(x, lay)) ------------------------------


def cross_entropy_cases() -> dict:
    t7, t5x3 = indices((7,), 1), indices((5, 3), 2, ignored=(0, 4))
    ce = F.cross_entropy
    return {
        "mean, rows": ((7, C), _rows, lambda x, lay: ce(x, lay(t7, _rows))),
        "sum, classes": ((7, C), _classes, lambda x, lay: ce(x, lay(t7, _whole), reduction="sum")),
        "none, ignore_index=2, classes": (
            (7, C),
            _classes,
            lambda x, lay: ce(x, lay(t7.clamp(0), _whole), ignore_index=2, reduction="none"),
        ),
        "plain weight, mean, classes": (
            (7, C),
            _classes,
            lambda x, lay: ce(x, lay(t7, _whole), weight=WEIGHT),
        ),
        "weight sharded, mean, classes": (
            (7, C),
            _classes,
            lambda x, lay: ce(x, lay(t7, _whole), weight=lay(WEIGHT, _rows)),
        ),
        "label smoothing, mean, rows": (
            (7, C),
            _rows,
            lambda x, lay: ce(x, lay(t7, _rows), label_smoothing=0.1),
        ),
        "smoothing, weight, none, rows and classes": (
            (7, C),
            _grid,
            lambda x, lay: ce(x, lay(t7, _grid_rows), weight=WEIGHT, label_smoothing=0.2, reduction="none"),
        ),
        "smoothing, weight sharded, sum, classes": (
            (7, C),
            _classes,
            lambda x, lay: ce(
                x, lay(t7, _whole), weight=lay(WEIGHT, _rows), label_smoothing=0.3, reduction="sum"
            ),
        ),
        "probabilities, mean, rows": (
            (7, C),
            _rows,
            lambda x, lay: ce(x, lay(probabilities((7, C), 4), _rows)),
        ),
        "probabilities, weight, smoothing, sum, classes": (
            (7, C),
            _classes,
            lambda x, lay: ce(
                x,
                lay(probabilities((7, C), 4), _classes),
                weight=lay(WEIGHT, _rows),
                label_smoothing=0.1,
                reduction="sum",
            ),
        ),
        "probabilities, none, rows and classes": (
            (7, C),
            _grid,
            lambda x, lay: ce(x, lay(probabilities((7, C), 4), _grid), reduction="none"),
        ),
        "(N, C, d), weight, smoothing, mean, classes": (
            (5, C, 3),
            _classes,
            lambda x, lay: ce(x, lay(t5x3, _whole), weight=WEIGHT, label_smoothing=0.2),
        ),
        "(C,) and a 0-d target, classes": ((C,), _rows, lambda x, lay: ce(x, lay(torch.tensor(4), _whole))),
        "legacy size_average=False": (
            (7, C),
            _rows,
            lambda x, lay: ce(x, lay(t7, _rows), size_average=False),
        ),
        "every target ignored, mean: nan": (
            (7, C),
            _classes,
            lambda x, lay: ce(x, lay(torch.full((7,), -100), _whole), weight=WEIGHT),
        ),
    }


def nll_loss_cases() -> dict:
    t7, t5x3 = indices((7,), 1), indices((5, 3), 2, ignored=(0, 4))
    nll = F.nll_loss
    return {
        "mean, rows": ((7, C), _rows, lambda x, lay: nll(x, lay(t7, _rows))),
        "sum, weight, classes": (
            (7, C),
            _classes,
            lambda x, lay: nll(x, lay(t7, _whole), weight=WEIGHT, reduction="sum"),
        ),
        "none, ignore_index=1, weight sharded, classes": (
            (7, C),
            _classes,
            lambda x, lay: nll(
                x, lay(t7.clamp(0), _whole), weight=lay(WEIGHT, _rows), ignore_index=1, reduction="none"
            ),
        ),
        "mean, weight, rows and classes": (
            (7, C),
            _grid,
            lambda x, lay: nll(x, lay(t7, _grid_rows), weight=WEIGHT),
        ),
        "(N, C, d), weight, mean, classes": (
            (5, C, 3),
            _classes,
            lambda x, lay: nll(x, lay(t5x3, _whole), weight=WEIGHT),
        ),
        "(C,) and a 0-d target, classes": ((C,), _rows, lambda x, lay: nll(x, lay(torch.tensor(2), _whole))),
    }


def pad_cases() -> dict:
    return {
        "constant, last dim; rows sharded": ((7, 3, 5), _rows, lambda x, lay: F.pad(x, (1, 2), value=1.5)),
        "constant, crop and pad; middle sharded": (
            (7, 3, 5),
            _classes,
            lambda x, lay: F.pad(x, (1, -2, 0, 0, 2, 1)),
        ),
        "reflect; rows sharded": ((7, 3, 5), _rows, lambda x, lay: F.pad(x, (2, 1), mode="reflect")),
        "replicate, 2 dims; rows sharded": (
            (7, 3, 5),
            _rows,
            lambda x, lay: F.pad(x, (2, 1, 1, 1), mode="replicate"),
        ),
        "circular; channels sharded": ((7, 3, 5), _classes, lambda x, lay: F.pad(x, [1, 2], "circular")),
        "constant of a sharded dim": ((7, 3, 5), _classes, lambda x, lay: F.pad(x, (0, 0, 1, 1), value=-1.0)),
        "reflect of (C, W), a sharded dim": (
            (7, 5),
            _classes,
            lambda x, lay: F.pad(x, (1, 1), mode="reflect"),
        ),
    }


TABLES = {"cross_entropy": cross_entropy_cases, "nll_loss": nll_loss_cases, "pad": pad_cases}


def _seed(out: torch.Tensor) -> torch.Tensor:
    """A scalar of ``out`` whose gradient weighs each element differently."""
    return (out * torch.arange(1.0, out.numel() + 1, dtype=out.dtype).reshape(out.shape)).sum()


def answer(call, leaf, x) -> tuple[torch.Tensor, torch.Tensor]:
    """``call`` of ``x`` (``leaf`` itself, or ``leaf`` laid out as a value): its global value and
    the gradient of ``leaf``."""
    out = call(x, laying(x))
    full = out.full_tensor() if isinstance(out, fd.DTensor) else out
    (grad,) = torch.autograd.grad(_seed(full), leaf)
    return full.detach(), grad


def job_table(mesh, table: str) -> dict:
    """Every case of ``TABLES[table]``: its global value and its input's gradient."""
    results = {}
    for name, (shape, spec_of, call) in TABLES[table]().items():
        leaf = values(shape, 1).requires_grad_()
        results[name] = answer(call, leaf, fd.distribute_tensor(leaf, mesh, spec_of(mesh.axis_names)))
    return results


def check_table(backend, mesh, table: str) -> None:
    want = {}
    for name, (shape, _, call) in TABLES[table]().items():
        leaf = values(shape, 1).requires_grad_()
        want[name] = answer(call, leaf, leaf)
    for rank, got in enumerate(backend.run(job_table, mesh.shape, mesh.names, table)):
        for name, expected in want.items():
            assert_close(
                got[name], expected, terms=C, msg=lambda m, n=name, r=rank: f"{table} {n} (rank {r}): {m}"
            )


@pytest.mark.meshes((4,), (2, 2))
@pytest.mark.filterwarnings("ignore:size_average and reduce args")  # torch's, for the legacy case
def test_cross_entropy_takes_every_option_of_torchs(backend, mesh):
    """Weights (plain or values), probabilities, label smoothing, ignore_index, each reduction,
    with the rows, the classes or both sharded (7 rows, 6 classes: uneven blocks)."""
    check_table(backend, mesh, "cross_entropy")


@pytest.mark.meshes((4,), (2, 2))
def test_nll_loss_takes_every_option_of_torchs(backend, mesh):
    check_table(backend, mesh, "nll_loss")


@pytest.mark.meshes((4,), (2, 2))
def test_pad_in_every_mode(backend, mesh):
    check_table(backend, mesh, "pad")


# --- communication: loss parallel, and padding that keeps the layout ----------------------------

TARGETS = torch.tensor([1, 39, 3, 0, -100, 5, 22, 17])
WEIGHT40 = torch.rand(40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

#: name -> (logits' spec, call(x, lay), collectives): logits (8, 40), class indices of 8 rows
LOSS_COMMUNICATION = {
    # with the class dim sharded: the per-row maxima and sums; each row's loss stays a Partial
    # sum of the devices' parts (the target's log-probability is on one device)
    "cross_entropy, classes sharded, mean": (
        _classes,
        lambda x, lay: F.cross_entropy(x, lay(TARGETS, _whole)),
        2,
    ),
    "cross_entropy, classes sharded, none": (
        _classes,
        lambda x, lay: F.cross_entropy(x, lay(TARGETS, _whole), reduction="none"),
        2,
    ),
    "cross_entropy, classes sharded, weight and smoothing": (
        _classes,
        lambda x, lay: F.cross_entropy(x, lay(TARGETS, _whole), weight=WEIGHT40, label_smoothing=0.1),
        2,
    ),
    "cross_entropy, classes sharded, weight sharded (gathered: 40 weights)": (
        _classes,
        lambda x, lay: F.cross_entropy(x, lay(TARGETS, _whole), weight=lay(WEIGHT40, _rows)),
        3,
    ),
    "cross_entropy, classes sharded, probabilities": (
        _classes,
        lambda x, lay: F.cross_entropy(x, lay(torch.softmax(values((8, 40), 5), 1), _classes)),
        2,
    ),
    # with the rows sharded: nothing but a mean's count of the rows not ignored
    "cross_entropy, rows sharded, mean": (_rows, lambda x, lay: F.cross_entropy(x, lay(TARGETS, _rows)), 1),
    "cross_entropy, rows sharded, sum": (
        _rows,
        lambda x, lay: F.cross_entropy(x, lay(TARGETS, _rows), reduction="sum"),
        0,
    ),
    "cross_entropy, rows sharded, weight and smoothing, none": (
        _rows,
        lambda x, lay: F.cross_entropy(
            x, lay(TARGETS, _rows), weight=WEIGHT40, label_smoothing=0.1, reduction="none"
        ),
        0,
    ),
    "cross_entropy, rows sharded, probabilities": (
        _rows,
        lambda x, lay: F.cross_entropy(x, lay(torch.softmax(values((8, 40), 5), 1), _rows)),
        0,
    ),
    "nll_loss, classes sharded, none": (
        _classes,
        lambda x, lay: F.nll_loss(x, lay(TARGETS, _whole), reduction="none"),
        0,
    ),
    "nll_loss, rows sharded, weight, sum": (
        _rows,
        lambda x, lay: F.nll_loss(x, lay(TARGETS, _rows), weight=WEIGHT40, reduction="sum"),
        0,
    ),
}


def job_loss_communication(mesh) -> dict:
    """Each case: its value, its logits' gradient, the collectives it ran and the largest."""
    results = {}
    for name, (spec_of, call, _) in LOSS_COMMUNICATION.items():
        leaf = values((8, 40), 1).requires_grad_()
        x = fd.distribute_tensor(leaf, mesh, spec_of(mesh.axis_names))
        lay = laying(x)
        with fd.CommDebugMode() as comm:
            out = call(x, lay)
        largest = max((e.nbytes for e in comm.events), default=0)
        full = out.full_tensor()
        (grad,) = torch.autograd.grad(_seed(full), leaf)
        results[name] = (full.detach(), grad, comm.get_total_counts(), largest)
    return results


@pytest.mark.meshes((4,), (2, 2))
def test_losses_move_per_row_values_never_the_logits(backend, mesh):
    """Loss parallel (the class dim sharded): the collectives are the per-row maxima and sums
    (and a sharded weight's gather; the rows' losses stay Partial sums), none a quarter of a device's block of
    the logits; with the rows sharded, none (but a mean's count of the rows it counts). Before,
    ``nll_loss`` gathered its input whole, and ``cross_entropy`` refused weights, label
    smoothing and probabilities."""
    for got in backend.run(job_loss_communication, mesh.shape, mesh.names):
        for name, (_, call, collectives) in LOSS_COMMUNICATION.items():
            leaf = values((8, 40), 1).requires_grad_()
            value, grad, count, largest = got[name]
            assert_close((value, grad), answer(call, leaf, leaf), terms=40, msg=lambda m, n=name: f"{n}: {m}")
            assert count == collectives, f"{name}: {count} collectives, expected {collectives}"
            block = 8 * 40 * 8 // mesh.size  # the bytes of a device's block of the logits
            assert largest < block / 4, f"{name}: a collective of {largest} B; a block is {block} B"


def job_pad_communication(mesh) -> dict:
    """HF's label padding and pads that keep the layout: the output's placements, the
    collectives, the value; a Partial sum padded with zeros (kept) and with ones (reduced)."""
    names = mesh.axis_names
    labels = fd.distribute_tensor(torch.arange(35).reshape(7, 5), mesh, fd.P(names))
    rows = fd.distribute_tensor(values((7, 3, 5), 2), mesh, fd.P(names))
    channels = fd.distribute_tensor(values((7, 3, 5), 2), mesh, fd.P(None, names))
    partial = torch.matmul(
        fd.distribute_tensor(values((4, 8), 3), mesh, fd.P(None, names)),
        fd.distribute_tensor(values((8, 6), 4), mesh, fd.P(names)),
    )
    calls = {
        "labels, (0, 1), value=-100": (labels, lambda v: F.pad(v, (0, 1), value=-100)),
        "rows: constant of the last two dims": (rows, lambda v: F.pad(v, (1, 2, 2, 0), value=0.5)),
        "channels: reflect": (channels, lambda v: F.pad(v, (2, 2), mode="reflect")),
        "channels: circular": (channels, lambda v: F.pad(v, (1, 0), mode="circular")),
        "Partial sum, zeros": (partial, lambda v: F.pad(v, (1, 1))),
        "Partial sum, ones (reduced first)": (partial, lambda v: F.pad(v, (1, 1), value=1.0)),
    }
    results = {}
    for name, (value, call) in calls.items():
        with fd.CommDebugMode() as comm:
            out = call(value)
        results[name] = (out.placements == value.placements, comm.get_total_counts(), out.full_tensor())
    return results


@pytest.mark.meshes((4,), (2, 2))
def test_pad_keeps_the_layout_of_the_dims_it_does_not_pad(backend, mesh):
    """Before, ``F.pad`` had no rule: it gathered every input (HF's label padding included)."""
    labels = torch.arange(35).reshape(7, 5)
    x = values((7, 3, 5), 2)
    partial = values((4, 8), 3) @ values((8, 6), 4)
    want = {
        "labels, (0, 1), value=-100": (True, 0, F.pad(labels, (0, 1), value=-100)),
        "rows: constant of the last two dims": (True, 0, F.pad(x, (1, 2, 2, 0), value=0.5)),
        "channels: reflect": (True, 0, F.pad(x, (2, 2), mode="reflect")),
        "channels: circular": (True, 0, F.pad(x, (1, 0), mode="circular")),
        "Partial sum, zeros": (True, 0, F.pad(partial, (1, 1))),
        "Partial sum, ones (reduced first)": (False, None, F.pad(partial, (1, 1), value=1.0)),
    }
    for got in backend.run(job_pad_communication, mesh.shape, mesh.names):
        for name, (same, count, value) in want.items():
            kept, collectives, out = got[name]
            assert kept == same, f"{name}: the layout {'changed' if same else 'kept'}"
            assert count is None and collectives > 0 or collectives == count, f"{name}: {collectives}"
            assert_close(out, value, terms=8, msg=lambda m, n=name: f"{n}: {m}")


def loss_parallel_parts(x, targets, mesh_shape, reduction: str) -> dict[int, torch.Tensor]:
    """Each device's part of a loss-parallel cross-entropy of ``x`` (rows over the first mesh
    axis of two, classes over the last), by its definition: per row, the log-sum-exp of the
    logits less the row's maximum in equal parts over the class axis, less the target's shifted
    logit on the device that holds its class; summed (``"sum"``), over the rows not ignored
    (``"mean"``), or per row (``"none"``)."""
    split, size = (mesh_shape[0], mesh_shape[-1]) if len(mesh_shape) > 1 else (1, mesh_shape[0])
    block_rows, block_classes = x.shape[0] // split, x.shape[1] // size
    keep = targets != -100
    safe = torch.where(keep, targets, 0)
    top = x.max(1).values
    log_total = (x - top[:, None]).exp().sum(1).log()
    picked = x.gather(1, safe[:, None])[:, 0] - top
    parts = {}
    for device in range(split * size):
        rows, at = slice(device // size * block_rows, (device // size + 1) * block_rows), device % size
        mine = (safe[rows] // block_classes) == at
        part = torch.where(keep[rows], log_total[rows] / size - torch.where(mine, picked[rows], 0.0), 0.0)
        count = keep.sum() if reduction == "mean" else 1
        parts[device] = part if reduction == "none" else part.sum() / count
    return parts


def job_loss_parallel_at_once(mesh) -> dict:
    """Per reduction: the layout, this process's devices' parts, the collectives, the value,
    and the first and second derivatives of the logits."""
    results = {}
    for reduction in ("mean", "sum", "none"):
        leaf = values((8, 40), 1).requires_grad_()
        x = fd.distribute_tensor(leaf, mesh, _grid(mesh.axis_names))
        target = fd.distribute_tensor(TARGETS, mesh, _grid_rows(mesh.axis_names), src_data_rank=None)
        with fd.CommDebugMode() as comm:
            out = F.cross_entropy(x, target, reduction=reduction)
        parts = dict(zip(local_devices(mesh), [s.detach() for s in out.local_shards()]))
        events = [(e.op, e.axes, e.nbytes) for e in comm.events]
        full = out.full_tensor()
        (grad,) = torch.autograd.grad(_seed(full), leaf, create_graph=True)
        (second,) = torch.autograd.grad(_seed(grad), leaf)
        results[reduction] = (out.placements, parts, events, full.detach(), grad.detach(), second)
    return results


@pytest.mark.meshes((4,), (2, 2))
def test_loss_parallel_cross_entropy_is_the_ranks_on_every_backend(backend, mesh):
    """Logits (8, 40), the classes split over the last axis, the rows over the first (if any):
    the simulated mesh computes the per-row maxima, sums and picked targets on every device's
    block at once, not as global ops; on both backends, the same layout, each device's part of
    the Partial sum, the same collectives (the per-row maxima and sums over the class axis, a
    mean's count over the rows' axis), and torch's values and gradients to second order."""
    names = mesh.names
    class_axis, row_rows = names[-1], 8 // (mesh.shape[0] if len(names) > 1 else 1)
    for got in backend.run(job_loss_parallel_at_once, mesh.shape, names):
        for reduction, (placements, parts, events, value, grad, second) in got.items():
            leaf = values((8, 40), 1).requires_grad_()
            want = F.cross_entropy(leaf, TARGETS, reduction=reduction)
            (want_grad,) = torch.autograd.grad(_seed(want), leaf, create_graph=True)
            (want_second,) = torch.autograd.grad(_seed(want_grad), leaf)
            msg = lambda m, r=reduction: f"{r}: {m}"  # noqa: E731
            want = (want.detach(), want_grad.detach(), want_second)
            assert_close((value, grad, second), want, terms=40, msg=msg)
            rows_split = len(names) > 1
            if reduction == "none":
                assert placements == ((fd.Shard(0),) if rows_split else ()) + (fd.Partial(),), reduction
            else:
                assert placements == (fd.Partial(),) * len(names), reduction
            expected = [("all_reduce", (class_axis,), row_rows * 8)] * 2
            if reduction == "mean" and rows_split:
                expected.append(("all_reduce", (names[0],), 8))  # the count of the rows not ignored
            assert events == expected, f"{reduction}: {events}"
            defined = loss_parallel_parts(leaf.detach(), TARGETS, mesh.shape, reduction)
            for device, part in parts.items():
                msg = lambda m, r=reduction, d=device: f"{r}, device {d}: {m}"  # noqa: E731
                assert_close(part, defined[device], terms=40, msg=msg)


# --- real model code: HF's causal-LM loss, nn.MultiheadAttention --------------------------------

#: name -> (logits' spec, labels' spec, keywords, collectives): logits (8, 5, 11), labels (8, 5)
CAUSAL_LM = {
    "batch sharded": (_rows, _rows, {}, 1),  # the mean's count of the labels not ignored
    "batch sharded, num_items_in_batch": (_rows, _rows, {"num_items_in_batch": torch.tensor(17)}, 0),
    "vocabulary sharded": (_last, _whole, {}, 2),  # the per-row maxima and sums (the loss: a Partial sum)
}


def causal_lm_labels() -> torch.Tensor:
    labels = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(6))
    labels[0, :2] = -100
    return labels


def job_causal_lm_loss(mesh) -> dict:
    """HF transformers' ``ForCausalLMLoss`` as shipped (labels padded with ``F.pad``, shifted,
    flattened; ``F.cross_entropy``) on values: the loss, its logits' gradient, the collectives."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    results = {}
    for name, (logits_spec, labels_spec, keywords, _) in CAUSAL_LM.items():
        leaf = values((8, 5, 11), 7).requires_grad_()
        logits = fd.distribute_tensor(leaf, mesh, logits_spec(mesh.axis_names))
        labels = fd.distribute_tensor(causal_lm_labels(), mesh, labels_spec(mesh.axis_names))
        with fd.CommDebugMode() as comm:
            loss = ForCausalLMLoss(logits, labels, 11, **keywords)
        full = loss.full_tensor()
        (grad,) = torch.autograd.grad(full, leaf)
        results[name] = (full.detach(), grad, comm.get_total_counts())
    return results


@pytest.mark.meshes((4,), (2, 2))
def test_hf_causal_lm_loss_runs_as_shipped(backend, mesh):
    """Before, its ``F.pad`` of the labels gathered them (no rule)."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    for got in backend.run(job_causal_lm_loss, mesh.shape, mesh.names):
        for name, (_, _, keywords, collectives) in CAUSAL_LM.items():
            leaf = values((8, 5, 11), 7).requires_grad_()
            loss = loss_utils.ForCausalLMLoss(leaf, causal_lm_labels(), 11, **keywords)
            (grad,) = torch.autograd.grad(loss, leaf)
            value, got_grad, count = got[name]
            assert_close(
                (value, got_grad), (loss.detach(), grad), terms=40, msg=lambda m, n=name: f"{n}: {m}"
            )
            assert count == collectives, f"{name}: {count} collectives, expected {collectives}"


def attention() -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)


def job_attention(mesh) -> tuple:
    """``nn.MultiheadAttention`` with its parameters replicated, on inputs of 6 sequences (an
    uneven batch) sharded over the batch dim: its output, attention weights and the gradients
    of its query and key-value inputs."""
    params, apply = fd.distribute_module(attention(), mesh)
    query, memory = values((6, 5, 16), 8).requires_grad_(), values((6, 3, 16), 9).requires_grad_()
    spec = fd.P(mesh.axis_names)
    q, kv = fd.distribute_tensor(query, mesh, spec), fd.distribute_tensor(memory, mesh, spec)
    out, weights = apply(params, q, kv, kv)
    out, weights = out.full_tensor(), weights.full_tensor()
    grads = torch.autograd.grad(_seed(out) + _seed(weights), (query, memory))
    return out.detach(), weights.detach(), grads


@pytest.mark.meshes((4,), (2, 2))
def test_multihead_attention_with_replicated_parameters(backend, mesh):
    """torch's module as shipped reads ``is_nested`` and the fast path's attributes, and runs
    ``F.multi_head_attention_forward`` (no rule: on replicated inputs, visibly)."""
    query, memory = values((6, 5, 16), 8).requires_grad_(), values((6, 3, 16), 9).requires_grad_()
    out, weights = attention()(query, memory, memory)
    grads = torch.autograd.grad(_seed(out) + _seed(weights), (query, memory))
    for got in backend.run(job_attention, mesh.shape, mesh.names):
        assert_close(got, (out.detach(), weights.detach(), grads), terms=16)


# --- arguments torch refuses are the library's errors -------------------------------------------


def refused_arguments(on_mesh: bool) -> dict:
    """The values the refused calls take: fd.DTensor values, or plain tensors."""
    plain = {
        "logits": values((5, C)),
        "target": torch.tensor([0, 1, 2, 3, -100]),
        "probs": probabilities((5, C)),
        "x": values((5, C, 3)),
    }
    if not on_mesh:
        return plain
    mesh = fd.simulated_mesh(4, "x")
    specs = {"logits": fd.P(None, "x"), "target": fd.P(), "probs": fd.P(), "x": fd.P("x")}
    return {k: fd.distribute_tensor(v, mesh, specs[k]) for k, v in plain.items()}


#: name -> (call(arguments), the library's error, what its message says)
REFUSALS = {
    "label_smoothing above 1": (
        lambda a: F.cross_entropy(a["logits"], a["target"], label_smoothing=1.5),
        fd.ShapeError,
        ["cross_entropy", "label_smoothing"],
    ),
    "a reduction torch lacks": (
        lambda a: F.nll_loss(a["logits"], a["target"], reduction="avg"),
        fd.ShapeError,
        ["nll_loss", "avg"],
    ),
    "fewer weights than classes": (
        lambda a: F.cross_entropy(a["logits"], a["target"], weight=torch.ones(C - 1, dtype=torch.float64)),
        fd.ShapeError,
        ["cross_entropy", "weight"],
    ),
    "probabilities take no ignore_index": (
        lambda a: F.cross_entropy(a["logits"], a["probs"], ignore_index=1),
        fd.ShapeError,
        ["ignore_index"],
    ),
    "class indices of int32": (
        lambda a: F.nll_loss(a["logits"], a["target"].int()),
        fd.InputTypeError,
        ["nll_loss", "torch.int32"],
    ),
    "weights of another dtype than the logits": (
        lambda a: F.cross_entropy(a["logits"], a["target"], weight=torch.ones(C)),
        fd.InputTypeError,
        ["weight", "torch.float64", "torch.float32"],
    ),
    "a target outside the classes": (
        lambda a: F.nll_loss(a["logits"], a["target"] + 100),
        fd.InputTypeError,
        ["nll_loss(target)", f"[0, {C})"],
    ),
    "reflect by more than the dim": (lambda a: F.pad(a["x"], (3, 3), mode="reflect"), fd.ShapeError, ["pad"]),
    "a pad of odd length": (lambda a: F.pad(a["x"], (1, 2, 3)), fd.ShapeError, ["pad"]),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_what_torch_refuses_is_the_librarys_error(name):
    call, error, fragments = REFUSALS[name]
    with pytest.raises(Exception):  # noqa: B017  (torch refuses it, each its own way)
        call(refused_arguments(on_mesh=False))
    builtin = ValueError if error is fd.ShapeError else TypeError
    check(error, builtin, lambda: call(refused_arguments(on_mesh=True)), *fragments)


def test_a_call_checked_once_never_hides_a_refusal():
    """torch's checks of a loss run once per shapes, dtypes and options: a refused call after
    accepted ones of the same shapes (another option, a mismatched target) is still refused."""
    a = refused_arguments(on_mesh=True)
    for _ in range(2):
        F.cross_entropy(a["logits"], a["target"], label_smoothing=0.5)
        F.nll_loss(a["logits"].log_softmax(-1), a["target"], reduction="sum")
    check(fd.ShapeError, ValueError, lambda: REFUSALS["label_smoothing above 1"][0](a), "label_smoothing")
    check(fd.ShapeError, ValueError, lambda: REFUSALS["a reduction torch lacks"][0](a), "avg")
    short = fd.distribute_tensor(torch.tensor([0, 1, 2, 3]), a["target"].device_mesh, fd.P())
    check(fd.ShapeError, ValueError, lambda: F.cross_entropy(a["logits"], short), "cross_entropy")


def test_a_plain_target_is_refused_with_the_fix():
    mesh = fd.simulated_mesh(2, "x")
    logits = fd.distribute_tensor(values((4, C)), mesh, fd.P("x"))
    check(
        fd.InputTypeError,
        TypeError,
        lambda: F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])),
        "cross_entropy(target)",
        "fd.distribute_tensor",
    )
