"""How a round's messages move between this rank and its peers: the :class:`Transport` interface and
the two point-to-point transports over a process group (:mod:`.rounds` does their work).

    transport     | chosen for                          | one round
    Overlapped    | gloo (default)                      | receives posted first, each send as soon as packed,
                  |                                     | each receive unpacked as soon as it landed
    Batched       | NCCL (every backend but gloo),      | one batch_isend_irecv per chunk index, pipelined
                  | gloo with overlap=False             | (pack chunk k+1 while chunk k is on the wire)

:func:`transport_for` chooses one per refit (the group's backend, ``overlap=``, ``MCORE_RESHARD_OVERLAP``).
Another way to move a round's bytes (RDMA, a host-staged path) is another subclass: the refit
(:class:`~.transfer.Refit`) calls nothing else of it.

Same-device memory (a colocated trainer and engine worker, :mod:`mcore_reshard.colocate`) needs no
round transport: the worker maps its device's trainer storages once
(:mod:`.shared_storage`) and holds them as its own source tensors, so the plan turns every
same-device byte into a local copy (:class:`~.transfer.LocalCopies`) and only cross-device bytes
reach a transport -- no byte is staged twice, and no message is sent to a process on one's own device."""
from __future__ import annotations

from abc import ABC, abstractmethod

from . import rounds


class Transport(ABC):
    """Moves one round of a refit: every message this rank sends and receives in it, unpacked
    into the destination views, each wait bounded by the refit's timeout (a failure raises
    :class:`~.errors.TransferError` naming the round and the peers)."""

    #: what the refit options carry (every rank must run the same transport)
    name: str = ""

    @abstractmethod
    def run_round(self, refit, version: int, index: int, rnd, problems: list[str], bad_buffers: set,
                  background=None) -> None:
        """Round ``index`` (0-based, of this rank's rounds) of refit ``version``: ``refit`` is the
        :class:`~.transfer.Refit` (group, timeout, binding); ``problems`` / ``bad_buffers`` collect
        verify failures; ``background()`` does one slice of other work (the local copies) whenever
        the round would otherwise wait, and returns False once there is none."""


class Overlapped(Transport):
    """gloo's independent ``isend`` / ``irecv`` (:func:`~.rounds.round_overlapped`)."""
    name = "overlapped"

    def run_round(self, refit, version, index, rnd, problems, bad_buffers, background=None) -> None:
        rounds.round_overlapped(refit, version, index, rnd, problems, bad_buffers, background=background)


class Batched(Transport):
    """Grouped ``batch_isend_irecv`` calls, one per chunk, pipelined (:func:`~.rounds.round_batched`):
    what NCCL needs (two ranks sending to each other outside a group can deadlock)."""
    name = "batched"

    def run_round(self, refit, version, index, rnd, problems, bad_buffers, background=None) -> None:
        rounds.round_batched(refit, version, index, rnd, problems, bad_buffers, background=background)


OVERLAPPED = Overlapped()
BATCHED = Batched()


def transport_for(group, overlap: bool | None) -> Transport:
    """The point-to-point transport of ``group`` (see :meth:`Resharder.overlapped`)."""
    return OVERLAPPED if rounds.use_overlap(group, overlap) else BATCHED
