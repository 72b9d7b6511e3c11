"""The executor's two exceptions (raised on every rank together) and how a gloo failure is classified."""
from __future__ import annotations


class ReshardError(RuntimeError):
    """Raised on every rank together when any rank finds the plan or its tensors inconsistent."""


class TransferError(ReshardError):
    """A refit failed while moving bytes (peer died or stalled, connection closed, checksum
    mismatch).  ``version``, ``round`` (1-based, 0 for the local/confirm stages) and ``peers`` say
    where; the destination buffers it left incomplete are listed by :meth:`Resharder.state`."""

    def __init__(self, message: str, *, version: int, round: int | None = None, peers: list[int] | None = None):
        super().__init__(message)
        self.version = version
        self.round = round
        self.peers = list(peers or [])


def is_timeout(e: BaseException) -> bool:
    """Whether a torch.distributed error reports a timed-out wait."""
    text = str(e)
    return "imed out" in text or "timeout caused" in text


def is_closed(e: BaseException) -> bool:
    """Whether a torch.distributed error reports a peer that died or closed its connection."""
    text = str(e).lower()
    return any(k in text for k in ("closed", "reset by peer", "broken pipe", "connection refused"))
