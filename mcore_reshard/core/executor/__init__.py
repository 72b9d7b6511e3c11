"""Executor (layer 4): the only package that moves bytes over ``torch.distributed``.

``Resharder(plan, src, dst, group)`` binds a plan to this rank's real tensors once; each
``refit()`` then moves the bytes: remote ones packed into one flat staging buffer per message
(entries of >= 256 KiB sent from / received into contiguous views directly) and exchanged round
by round, unpacked with ``copy_`` into the existing destination storage (addresses never change);
local ones copied directly while the first round's bytes travel.  On NCCL (any backend but gloo)
a round is a pipeline of grouped ``batch_isend_irecv`` calls, one per chunk of its messages (pack
chunk k+1 while chunk k is on the wire, unpack each as it lands); on gloo it is overlapped:
receives posted first, each send posted as soon as it is packed, each receive unpacked as soon as
it has arrived (:meth:`Resharder.overlapped`, :mod:`.rounds`).  Copies go in one
``torch._foreach_copy_`` per list (a bounded number of launches per message).

Construction is collective over ``group``: every rank checks its tensors and its part of the plan
(:func:`mcore_reshard.core.planner.validate_plan`), then all ranks exchange (plan hash, options, ok flag,
error text) so that any mismatch makes *every* rank raise the same :class:`ReshardError` before a
byte moves, instead of leaving peers waiting.

Failures during a transfer (a peer that dies, stalls or drops the connection) raise
:class:`TransferError` naming the refit version, the round and the peers, within ``timeout``
seconds of the round's start on the ranks that wait for the missing peer (gloo's ``wait(timeout)``
then closes the pairs, so their own peers fail at once).  The destination side records which
refit version every buffer fully holds (:meth:`Resharder.state`); an interrupted refit is reported
there, and the next ``refit()`` (after :meth:`Resharder.rebind` to a fresh group when the old one is
broken) rewrites every buffer.  ``verify=True`` sends a checksum of every copied box with its
message and checks the received and unpacked bytes against it.

Example (4 ranks, colocated): every rank builds the same plan from the same layouts, then::

    rank | src tensors               | dst tensors
    0    | {"w": w_tp0}              | {"w": w_full}
    1    | {"w": w_tp1}              | {}
    r = Resharder(plan, src, dst, group); r.refit()   # on every rank, after each training step
    r.state()  # {"version": 1, "interrupted": False, "buffers": {"w": 1}, ...} on rank 0

Units (no cycles; each imports only those above it):

* :mod:`.errors` -- :class:`ReshardError`, :class:`TransferError`, classifying gloo failures;
* :mod:`.common` -- dtype names, wire constants, the group's device, bounded waits;
* :mod:`.checksum` -- verify-mode checksums, :func:`digest_of`;
* :mod:`.handshake` -- :func:`agree`, the refit start, control messages (their :class:`~.handshake.Step`), :func:`all_gather_json`, the per-group guard;
* :mod:`.preflight` -- tensors vs plan, aliasing, the plan's own checks;
* :mod:`.binding` -- staging layout, views, per-round bookkeeping, :func:`staging_size`;
* :mod:`.owners` -- the tensor objects bound and their storage, checked at each refit (``param.data`` rebound);
* :mod:`.rounds` -- the batched (chunked, pipelined) and overlapped round paths, pack / unpack;
* :mod:`.transport` -- the :class:`~.transport.Transport` interface a refit moves each round through, and its two
  point-to-point transports (``Overlapped`` on gloo, ``Batched`` on NCCL);
* :mod:`.transfer` -- :class:`~.transfer.Refit`, the one object owning a binding's refit state (the binding, swapped
  whole; the group's :class:`~.transfer.Channel`; versions, interruption, pending operations), whose methods are a
  refit's steps: start, rounds with the local copies overlapped, confirmation;
* :mod:`.resharder` -- :class:`Resharder`: binding, rebind, state (delegating refits to its :class:`~.transfer.Refit`);
* :mod:`.windowed` -- :class:`WindowedResharder`: a windowed plan (one Resharder per window, one staging
  buffer), refit window after window with the caller's work between (streamed engine refits).
"""
from __future__ import annotations

from .binding import staging_size
from .checksum import digest_of
from .common import dtype_name, torch_dtype
from .errors import ReshardError, TransferError
from .handshake import GatherChecked, agree, all_gather_json, all_or_none
from .owners import kind_problem
from .resharder import Resharder
from .windowed import WindowedResharder

__all__ = ["GatherChecked", "Resharder", "ReshardError", "TransferError", "agree", "all_gather_json", "all_or_none", "digest_of", "dtype_name",
           "kind_problem",
           "staging_size", "torch_dtype", "WindowedResharder"]
