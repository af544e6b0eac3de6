"""Failures of ``torch.distributed`` calls, translated: a collective that fails because a peer
died, hung past the process group's timeout or dropped its connection becomes a
:class:`CommunicationError` that names the collective and the group and tells where to look."""

from __future__ import annotations

import torch.distributed as dist

from .._errors import CommunicationError, explain

__all__ = ["c10d"]

_LOST_PEER = ("timed out", "timeout", "connection", "closed", "reset by peer", "broken pipe")


def c10d(collective, *args, group, **kwargs) -> None:
    """``collective(*args, group=group, **kwargs)``, a lost peer raised as CommunicationError."""
    try:
        collective(*args, group=group, **kwargs)
    except RuntimeError as error:
        if not isinstance(error, dist.DistBackendError) and not any(
            [word in str(error).lower() for word in _LOST_PEER]
        ):
            raise
        raise CommunicationError(
            explain(
                f"fd collective ({collective.__name__} over {dist.get_world_size(group)} ranks)",
                "the collective failed",
                expected="every rank of the group to join it",
                got=str(error).splitlines()[0],
                fix="check the other ranks' logs: a rank that died, or that skipped this "
                "collective, stops the others; the process group's timeout bounds the wait",
            )
        ) from error
