"""A checkpoint's directory (:mod:`functional_dtensor.checkpoint`): files, checksums and the
manifest that records them, the atomic move into place, and the check of every file against
the manifest before a load; a directory ``torch.distributed.checkpoint`` wrote without the
manifest, read from DCP's own metadata."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ._checkpoint_processes import gathered, rank_and_world
from ._errors import CheckpointError, explain

__all__ = [
    "MANIFEST",
    "FORMAT",
    "VERSION",
    "digest",
    "checksum",
    "remove",
    "siblings",
    "check_target",
    "move_into_place",
    "write_json",
    "read_manifest",
    "verify_files",
    "DCP_METADATA",
    "dcp_entries",
    "verify_dcp_files",
]

#: the manifest's file name inside a checkpoint directory
MANIFEST = "fd_checkpoint.json"
FORMAT = "functional_dtensor.checkpoint"
VERSION = 1
#: DCP's index of a checkpoint directory: every value's key, shape, dtype and where its blocks lie
DCP_METADATA = ".metadata"


def digest(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def checksum(manifest: dict) -> str:
    """The SHA-256 of a manifest's content (its own checksum left out)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd_ = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors
        return
    try:
        os.fsync(fd_)
    finally:
        os.close(fd_)


def siblings(path: Path) -> tuple[Path, Path]:
    """The temporary directory a save writes into, and where the previous checkpoint waits
    while the new one moves into place."""
    return path.parent / f".{path.name}.saving", path.parent / f".{path.name}.previous"


def check_target(path: Path, api: str) -> None:
    """Refuse to replace something that is not a checkpoint (a file, a directory of other files)."""
    if not path.exists() or (path.is_dir() and ((path / MANIFEST).exists() or not any(path.iterdir()))):
        return
    raise CheckpointError(
        explain(
            f"{api}(path={str(path)!r})",
            "the path holds something that is not a checkpoint",
            expected="a new path, an empty directory or a checkpoint to replace",
            got="a file" if not path.is_dir() else "a directory without " + MANIFEST,
            fix="choose another path, or remove what is there",
        )
    )


def move_into_place(tmp: Path, path: Path) -> None:
    """``tmp`` becomes ``path``; the checkpoint there before is removed once it has."""
    _, previous = siblings(path)
    remove(previous)
    if path.exists():
        os.replace(path, previous)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    remove(previous)


def write_json(file: Path, content: dict) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: Path, api: str) -> dict | None:
    """The manifest of the checkpoint at ``path``; None for a directory DCP wrote without it
    (``torch.distributed.checkpoint.save``'s: read it with :func:`dcp_entries`)."""
    where = f"{api}({str(path)!r})"
    file = path / MANIFEST
    if not file.is_file():
        if (path / DCP_METADATA).is_file():
            return None
        _, previous = siblings(path)
        if not path.exists():
            what, got = "no checkpoint at this path", "nothing there"
            fix = "check the path"
            if previous.exists():
                got += f", but {previous.name} beside it"
                fix = f"a save was interrupted while replacing the checkpoint: load {previous}"
        else:
            what = f"the checkpoint has no manifest ({MANIFEST}) and no DCP metadata ({DCP_METADATA})"
            got = "a directory without them"
            fix = (
                "load a checkpoint written by fd.checkpoint.save or torch.distributed.checkpoint.save "
                "(each writes its index last: a save that did not finish has none)"
            )
        expected = f"a directory with {MANIFEST} (or DCP's {DCP_METADATA})"
        raise CheckpointError(explain(where, what, expected=expected, got=got, fix=fix))
    try:
        manifest = json.loads(file.read_text("utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
        if manifest.get("checksum") != checksum(manifest):
            raise ValueError("its SHA-256 differs from the one written")
        return manifest
    except (ValueError, AttributeError) as error:
        raise CheckpointError(
            explain(
                where,
                f"the manifest {file} is not readable",
                expected=f"the JSON manifest of fd.checkpoint (format {FORMAT!r})",
                got=f"{type(error).__name__}: {error}",
                fix="the checkpoint is corrupted: load an older one",
            )
        ) from None


def _file_problem(path: Path, name: str, expected: dict) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        state = "truncated" if size < expected["bytes"] else "longer than written"
        return f"{file} is {state}: {size} bytes, written {expected['bytes']}"
    if digest(file) != expected["sha256"]:
        return f"{file} is corrupted: its SHA-256 differs from the one written"
    return None


def verify_files(path: Path, manifest: dict, collective: bool, api: str) -> None:
    """Every file the manifest lists, checked (split over the ranks)."""
    rank, world = rank_and_world(collective)
    names = sorted(manifest["files"])
    mine = [p for n in names[rank::world] if (p := _file_problem(path, n, manifest["files"][n]))]
    problems = [p for part in gathered(mine, collective) for p in part]
    if problems:
        raise CheckpointError(
            explain(
                f"{api}({str(path)!r})",
                problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                expected="every file as the manifest records it (size and SHA-256)",
                got="; ".join(problems),
                fix="the checkpoint is damaged: load an older one, or save again",
            )
        )


# --- directories torch.distributed.checkpoint wrote ---------------------------------------------


def dcp_entries(path: Path, api: str) -> tuple[dict, Any]:
    """The leaves of a directory DCP wrote without the manifest (``torch.distributed.checkpoint
    .save``'s), by key as the manifest records them (a leaf's path from DCP's record of the
    nested state dict, where it kept one), and DCP's metadata."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # DCP unpickles its metadata: a damaged file fails in many ways
        raise CheckpointError(
            explain(
                f"{api}({str(path)!r})",
                f"DCP's metadata {path / DCP_METADATA} is not readable",
                expected="the metadata torch.distributed.checkpoint.save writes",
                got=f"{type(error).__name__}: {error}",
                fix="the checkpoint is damaged: load an older one",
            )
        ) from None
    routes = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    entries = {}
    for key, item in metadata.state_dict_metadata.items():
        route = routes.get(key)
        route = route if isinstance(route, tuple) else (key,)
        tensor = isinstance(item, TensorStorageMetadata)
        entries[key] = {
            "key": key,
            "path": "state" + "".join(f"[{entry!r}]" for entry in route),
            "kind": "tensor" if tensor else "object",
            "shape": list(item.size) if tensor else None,
            "dtype": str(item.properties.dtype) if tensor else None,
        }
    return entries, metadata


def verify_dcp_files(path: Path, metadata: Any, collective: bool, api: str, *, crc: bool) -> None:
    """Every file DCP's metadata names is there and holds the bytes it records; with ``crc``,
    each item (a ``torch.save`` archive) also matches the CRC-32 of its archive entries (the
    work split over the ranks). DCP keeps no checksum of its own: the archives' are checked."""
    items = sorted(
        (
            info.relative_path,
            int(info.offset),
            int(info.length),
            not getattr(info, "transform_descriptors", None),
        )
        for info in (metadata.storage_data or {}).values()
        if isinstance(getattr(info, "relative_path", None), str)
    )
    ends: dict[str, int] = {}
    for name, offset, length, _ in items:
        ends[name] = max(ends.get(name, 0), offset + length)
    mine = []
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            mine.append(f"{file} is missing")
        elif (size := file.stat().st_size) < end:
            mine.append(f"{file} is truncated: {size} bytes, DCP's metadata records {end}")
    if crc and not mine:
        rank, world = rank_and_world(collective)
        mine = [p for item in items[rank::world] if (p := _archive_problem(path, *item))]
    # every rank sees every problem (and raises with the others)
    problems = list(dict.fromkeys(p for part in gathered(mine, collective) for p in part))
    if problems:
        raise CheckpointError(
            explain(
                f"{api}({str(path)!r})",
                problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                expected=f"every file {DCP_METADATA} names, as long as it records, each item as written "
                "(CRC-32)",
                got="; ".join(problems),
                fix="the checkpoint is damaged: load an older one, or save again",
            )
        )


def _archive_problem(path: Path, name: str, offset: int, length: int, plain: bool) -> str | None:
    """What is wrong with DCP's item at ``offset`` of file ``name``, a ``torch.save`` archive
    (where no transform such as compression was applied), if it does not read back with the
    CRC-32s it was written with (an entry recorded without one, 0, is not checked); else None."""
    if not plain:
        return None
    with open(path / name, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            for entry in archive.infolist():
                if entry.CRC:
                    with archive.open(entry) as data:
                        while data.read(1 << 22):
                            pass
    except Exception as error:  # zipfile reports damage in many ways (bad CRC, headers, names)
        return f"{path / name} is corrupted at bytes {offset}..{offset + length}: {error}"
    return None
