"""One round of a refit, two ways: batched (grouped ``batch_isend_irecv`` calls, chunked and
pipelined; NCCL) and overlapped (gloo), with packing, unpacking (verify checks) and the
:class:`TransferError` of a failed wait.

Both take ``background``: a callable that does one slice of other work (the refit's local copies,
:class:`~.transfer.LocalCopies`) and returns False once there is none; a round calls it whenever
its bytes are on the wire and it would otherwise wait, so the wire never idles behind local
copies.  The time spent in it extends the round's deadline (a wait is never cut short by it).

Each function takes the refit's :class:`~.transfer.Refit` ``r`` and only reads it (group, timeout,
verify, its binding's rounds; the batched path keeps its chunk groups in the binding's ``schedules``).
:mod:`.transport` puts them behind the :class:`~.transport.Transport` interface."""
from __future__ import annotations

import os
import time
from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import common
from .binding import BoundMessage, Round, Trailer
from .checksum import checksum
from .common import _CS_BYTES, bounded_wait
from .errors import TransferError, is_closed, is_timeout


def use_overlap(group, overlap: bool | None) -> bool:
    """Whether rounds run overlapped on ``group`` (``overlap=None``: by backend and the
    ``MCORE_RESHARD_OVERLAP`` environment variable; see :meth:`Resharder.overlapped`)."""
    backend = dist.get_backend(group)
    want = overlap
    if want is None:
        env = os.environ.get("MCORE_RESHARD_OVERLAP", "").strip()
        want = backend == "gloo" if env not in ("0", "1") else env == "1"
    return bool(want) and backend == "gloo"


def copy_all(dsts: list, srcs: list) -> None:
    """``dsts[k].copy_(srcs[k])`` for every k in ONE ``torch._foreach_copy_`` (a bounded number of
    launches per list on a GPU: multi-tensor kernels instead of one launch per copy; on CPU it
    costs ~40% less per small copy than a Python loop of ``copy_``, BENCHMARKS.md C.3)."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def pack(r, buf: torch.Tensor, pairs: list, m, idx=None) -> None:
    """Copy the source views of message ``m`` into their staging views (+ checksums with verify):
    every pair, or the entries ``idx`` of the message's full ``pairs``."""
    if isinstance(pairs, Trailer):      # an unstaged message's checksums: of its source views
        for check in pairs:
            check.slot.copy_(checksum(check.tensor))
        return
    sel = range(len(pairs)) if idx is None else idx
    copy_all([pairs[j].stage for j in sel], [pairs[j].tensor for j in sel])
    if r.verify:
        for j in sel:
            buf[m.nbytes + _CS_BYTES * j:m.nbytes + _CS_BYTES * (j + 1)].view(torch.int64).copy_(checksum(pairs[j].tensor))


def unpack(r, i: int, peer: int, buf: torch.Tensor, pairs: list, m, problems: list[str], bad_buffers: set,
           idx=None) -> None:
    """Copy the staging views of a received message into their destination views: every pair, or
    the entries ``idx`` of the message's full ``pairs`` (verify: check the staged and the unpacked
    bytes; a corrupt entry is skipped and its buffer marked bad)."""
    if isinstance(pairs, Trailer):      # checked once the round's receives have landed: check_unstaged
        return
    n = len(r.rounds)
    sel = range(len(pairs)) if idx is None else idx
    if not r.verify:
        copy_all([pairs[j].tensor for j in sel], [pairs[j].stage.view(pairs[j].tensor.shape) for j in sel])
        return
    for j in sel:
        stage, d = pairs[j].stage, pairs[j].tensor
        c = m.entries[j]
        want = buf[m.nbytes + _CS_BYTES * j:m.nbytes + _CS_BYTES * (j + 1)].view(torch.int64)
        if not torch.equal(checksum(stage), want):
            problems.append(f"round {i + 1}/{n}: {c.tensor}{c.box} from rank {peer} arrived with a "
                            f"different checksum than rank {peer} sent (buffer {c.dst_buffer})")
            bad_buffers.add(c.dst_buffer)
            continue
        d.copy_(stage.reshape(d.shape))
        if d.dtype == stage.dtype and not torch.equal(checksum(d), checksum(stage)):
            problems.append(f"round {i + 1}/{n}: {c.tensor}{c.box} from rank {peer} differs from what "
                            f"arrived after unpacking into buffer {c.dst_buffer}")
            bad_buffers.add(c.dst_buffer)


def check_unstaged(r, i: int, rnd: Round, problems: list[str], bad_buffers: set) -> None:
    """With ``verify``, after every receive of round ``i`` landed: each entry of an unstaged message
    (received straight into its destination view) against the checksum its sender computed from
    the source view (the message's :class:`~.binding.Trailer`); a mismatch marks the buffer bad."""
    if not r.verify:
        return
    for recv in rnd.recvs:
        m, peer = recv.message, recv.peer
        if not m.unstaged:
            continue
        for c, check in zip(m.entries, recv.parts[-1].pairs):
            if not torch.equal(checksum(check.tensor), check.slot):
                problems.append(f"round {i + 1}/{len(r.rounds)}: {c.tensor}{c.box} from rank {peer} (unstaged, "
                                f"received straight into buffer {c.dst_buffer}) differs from what rank {peer} sent")
                bad_buffers.add(c.dst_buffer)


def round_error(r, v: int, i: int, rnd: Round, label: str, e: BaseException, waited: float) -> TransferError:
    """The TransferError of round ``i`` of refit ``v`` that failed ``label`` after ``waited`` s."""
    peers = sorted(set(rnd.send_peers) | set(rnd.recv_peers))
    if is_timeout(e):
        what = f"timed out after {waited:.1f} s (timeout {r.timeout_s} s) {label}"
    elif is_closed(e):
        what = f"failed after {waited:.1f} s {label} (a peer died or closed its connection)"
    else:
        what = f"failed after {waited:.1f} s {label}"
    return TransferError(
        f"refit {v}: round {i + 1}/{len(r.rounds)} of this rank (plan round {r.round_numbers[i]}) on rank "
        f"{r.rank} {what}; this round sends to ranks {rnd.send_peers} and receives from ranks {rnd.recv_peers}; "
        f"destination buffers incomplete here: {sum(1 for x in r.buffer_version.values() if x is None)}; "
        f"cause: {type(e).__name__}: {str(e)[:300]}", version=v, round=i + 1, peers=peers)


class _Clock:
    """A round's deadline: its start + ``timeout``, pushed back by the time spent in background work
    (``r``: the :class:`~.transfer.Refit`)."""

    def __init__(self, r, v, i, rnd, background):
        self.r, self.v, self.i, self.rnd, self.bg = r, v, i, rnd, background
        self.t0 = time.monotonic()
        self.extra = 0.0

    def idle(self) -> bool:
        """One slice of background work (True: there was some)."""
        if self.bg is None:
            return False
        t = time.monotonic()
        more = self.bg()
        self.extra += time.monotonic() - t
        if not more:
            self.bg = None
        return more

    def idle_until(self, works) -> None:
        """Background work while any of ``works`` is still in flight."""
        while self.bg is not None and not all(w.is_completed() for w in works):
            self.idle()

    def wait(self, work, label: str) -> None:
        try:
            bounded_wait(work, self.t0 + self.extra + self.r.timeout_s - time.monotonic(), self.r.group,
                         self.r.waits_block)
        except Exception as e:  # noqa: BLE001
            raise self.error(label, e) from e

    def error(self, label: str, e: BaseException) -> TransferError:
        return round_error(self.r, self.v, self.i, self.rnd, label, e, time.monotonic() - self.t0 - self.extra)


def windows(n: int) -> list[tuple[int, int]]:
    """The byte windows ``[lo, hi)`` that chunk a message of ``n`` bytes on the batched path:
    ``_CHUNK_MIN``, then doubling up to ``_CHUNK_MAX`` (the first chunk is small so the wire starts
    early; later ones large so operations stay few: <= 5 + n / _CHUNK_MAX windows with the
    defaults 1 / 16 MiB).  A function of ``n`` alone: both ends of a message derive the same ones."""
    out, lo, size = [], 0, common._CHUNK_MIN
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo += size
        size = min(2 * size, common._CHUNK_MAX)
    return out or [(0, 0)]


class Chunk(NamedTuple):
    """One operation of a message on the batched path: the tensor on the wire and what it packs /
    unpacks: ``kind`` "pairs" (``what``: :class:`~.binding.Pair` list of its own) or "idx" (``what``:
    indices of entries of the message's full pairs)."""
    wire: torch.Tensor
    kind: str
    what: list


class ChunkOp(NamedTuple):
    """A :class:`Chunk` of a send or receive of the round, as one operation of a group."""
    is_send: bool
    peer: int
    wire: torch.Tensor
    msg: BoundMessage
    kind: str
    what: list


def chunk_ops(m, buf: torch.Tensor, parts: list, recv: bool, verify: bool) -> list[list[Chunk]]:
    """Message ``m``'s operations on the batched path, grouped by window (:func:`windows`): one
    list of :class:`Chunk` per group (group k of every message of the round goes in the round's
    k-th ``batch_isend_irecv``).

    Split into :func:`~.binding.parts` (entries >= ``_DIRECT_MIN`` their own operation, straight from
    / into a contiguous view when this end's view allows it; the pairs of a part are what it packs /
    unpacks): each part goes in the window its first byte falls in.  Whole-message staging
    (``verify``, entries out of order): byte slices of the staging slice, one per window; before a
    slice is sent every entry that starts in it is packed, after it arrives every entry that ends
    in it is unpacked (``verify``: all of them after the last slice, which carries the checksum
    trailer).  Sizes come from the plan alone, so both ends post matching operations in matching
    groups."""
    if m.unstaged:      # one operation per entry, in the window of its offset; the trailer with the last
        wins, k = windows(m.nbytes), 0
        out = [[] for _ in wins]
        for c, part in zip(m.entries, parts):
            while k + 1 < len(wins) and c.offset >= wins[k][1]:
                k += 1
            out[k].append(Chunk(part.wire, "pairs", part.pairs))
        out[k] += [Chunk(part.wire, "pairs", part.pairs) for part in parts[len(m.entries):]]
        return [g for g in out if g]
    wins = windows(buf.numel())
    if not verify and not (len(parts) == 1 and parts[0].wire is buf):
        out: list[list] = [[] for _ in wins]
        at, k = 0, 0
        for part in parts:
            while k + 1 < len(wins) and at >= wins[k][1]:
                k += 1
            out[k].append(Chunk(part.wire, "pairs", part.pairs))
            at += part.wire.numel()
        return [g for g in out if g]
    order = sorted(range(len(m.entries)), key=lambda j: m.entries[j].offset)
    out, done = [], 0
    for n, (lo, hi) in enumerate(wins):
        last = n == len(wins) - 1
        if last:
            sel = order[done:]
        elif recv:
            sel = [] if verify else [j for j in order[done:] if m.entries[j].offset + m.entries[j].nbytes <= hi]
        else:
            sel = [j for j in order[done:] if m.entries[j].offset < hi]
        done += len(sel)
        out.append([Chunk(buf[lo:hi], "idx", sel)])
    return out


def chunk_schedule(rnd: Round, verify: bool) -> list[list[ChunkOp]]:
    """The groups of a round on the batched path: each a list of :class:`ChunkOp`, receives first."""
    groups: list[list] = []
    for is_send, side in ((True, rnd.sends), (False, rnd.recvs)):
        for msg in side:
            for k, g in enumerate(chunk_ops(msg.message, msg.buf, msg.parts, not is_send, verify)):
                while len(groups) <= k:
                    groups.append([])
                groups[k] += [ChunkOp(is_send, msg.peer, c.wire, msg, c.kind, c.what) for c in g]
    for g in groups:
        g.sort(key=lambda op: op.is_send)
    return groups


def _schedule(r, i: int, rnd: Round) -> list[list[ChunkOp]]:
    """:func:`chunk_schedule` of round ``i``, kept per round and verify in the binding's ``schedules``
    (views of the storage it bound: a new binding starts without them)."""
    key = (i, r.verify)
    memo = r.binding.schedules
    groups = memo.get(key)
    if groups is None:
        groups = memo[key] = chunk_schedule(rnd, r.verify)
    return groups


def _prepare(r, op: ChunkOp) -> None:
    """Pack what a send operation carries (nothing for a receive or a direct part)."""
    if op.is_send and op.what:
        msg = op.msg
        if op.kind == "idx":
            pack(r, msg.buf, msg.pairs, msg.message, op.what)
        else:
            pack(r, msg.buf, op.what, msg.message)


def _land(r, i: int, op: ChunkOp, problems: list[str], bad_buffers: set) -> None:
    """Unpack what a received operation carried."""
    if not op.is_send and op.what:
        msg = op.msg
        if op.kind == "idx":
            unpack(r, i, op.peer, msg.buf, msg.pairs, msg.message, problems, bad_buffers, op.what)
        else:
            unpack(r, i, op.peer, op.wire, op.what, msg.message, problems, bad_buffers)


def round_batched(r, v: int, i: int, rnd: Round, problems: list[str], bad_buffers: set, background=None) -> None:
    """The round as grouped ``batch_isend_irecv`` calls, one per chunk (:func:`chunk_ops`), pipelined:
    pack group k+1 while group k is on the wire, unpack each receive of group k once it landed.

    Loop: pack group k -> post it (one ``batch_isend_irecv``) -> background work while group k-1
    is in flight -> wait for group k-1 and unpack it -> k+1.  At most two groups are in flight.  NCCL (the reason for groups: two
    ranks sending to each other outside a group can deadlock): group k of a rank holds exactly
    the k-th chunks of its messages of the round, and the chunking of a message is a function of
    the plan alone, so the peer's group k holds the matching operations; every rank posts its
    groups in increasing k and waits for group k only after posting k+1, never on anything of a
    later group, so by induction on k every group completes (and operations between one pair
    are issued in the same order on both ends, which NCCL and gloo match in order).  On NCCL the
    packing kernels of group k+1 run on the current stream while group k's transfer runs on
    NCCL's stream (posting makes NCCL's stream wait for the current one)."""
    groups = _schedule(r, i, rnd)
    if not groups:
        return
    clock = _Clock(r, v, i, rnd, background)
    ids = sorted(set(rnd.send_peers) | set(rnd.recv_peers))

    def post(g):
        for op in g:
            _prepare(r, op)
        label = "posting the round"
        try:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.is_send else dist.irecv, op.wire, group=r.group,
                                                       group_peer=op.peer) for op in g])
        except Exception as e:  # noqa: BLE001 - posting failed (peer gone before or during the round)
            raise clock.error(label, e) from e
        return g, works

    def finish(g, works):
        if len(works) == len(g):
            for op, work in zip(g, works):
                clock.wait(work, f"{'sending to' if op.is_send else 'receiving from'} rank {op.peer}")
                _land(r, i, op, problems, bad_buffers)
            return
        for work in works:   # a coalescing backend (NCCL): one work for the group
            clock.wait(work, "exchanging with ranks " + ",".join(map(str, ids)))
        for op in g:
            _land(r, i, op, problems, bad_buffers)

    prev = None
    for g in groups:
        cur = post(g)
        if prev is not None:
            clock.idle_until(prev[1])
            finish(*prev)
        prev = cur
    clock.idle_until(prev[1])
    finish(*prev)
    check_unstaged(r, i, rnd, problems, bad_buffers)


class PartOp(NamedTuple):
    """One operation of the overlapped path: a :class:`~.binding.Part` of a message to / from ``peer``."""
    peer: int
    wire: torch.Tensor
    pairs: list
    message: object


def round_overlapped(r, v: int, i: int, rnd: Round, problems: list[str], bad_buffers: set, background=None) -> None:
    """gloo only (:meth:`Resharder.overlapped`): packing, the wire and unpacking overlap.

    1. One ``batch_isend_irecv`` opens the round: every receive of the round (so peers' bytes
       can land at once) plus the first send, packed just before.
    2. Every further send is packed and posted (``isend``) right away, in the plan's order (the
       same order on both ends of every pair; gloo matches a pair's messages in order), so its
       bytes travel while the next one is packed.
    3. Receives are unpacked one by one as soon as each has arrived (first every one already
       complete, else background work -- the local copies -- else the next in order is waited for),
       while the others still travel.  Only the oldest pending receive of each peer is polled (a
       pair's receives complete in the order they were posted): O(peers) per step, not O(receives).
    4. Then the sends are waited for (their buffers are reused by the next round).

    A message goes as one or more operations (:func:`~.binding.parts`): its large entries one each, sent
    straight from a contiguous source view and received straight into a contiguous destination
    view (no pack / unpack copy; never with ``verify``).  Every wait is bounded by the round's deadline
    (its start + ``timeout`` + the time spent in background work) and fails with the same
    :class:`TransferError` (round, peers, what it was waiting for) as the batched path."""
    clock = _Clock(r, v, i, rnd, background)
    # one operation per part, in plan order
    sends = [PartOp(x.peer, p.wire, p.pairs, x.message) for x in rnd.sends for p in x.parts]
    recvs = [PartOp(x.peer, p.wire, p.pairs, x.message) for x in rnd.recvs for p in x.parts]
    ops = [dist.P2POp(dist.irecv, op.wire, group=r.group, group_peer=op.peer) for op in recvs]
    if sends:
        op = sends[0]
        pack(r, op.wire, op.pairs, op.message)
        ops.append(dist.P2POp(dist.isend, op.wire, group=r.group, group_peer=op.peer))
    if not ops:
        return
    label = "posting the round"
    try:
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            raise RuntimeError(f"batch_isend_irecv returned {len(works)} work(s) for {len(ops)} operation(s) "
                               "(a coalescing backend: use overlap=False)")
        recv_works = works[:len(recvs)]
        send_works = [(works[-1], f"sending to rank {sends[0].peer}")] if sends else []
        for op in sends[1:]:
            pack(r, op.wire, op.pairs, op.message)
            label = f"sending to rank {op.peer}"
            send_works.append((dist.isend(op.wire, group=r.group, group_dst=op.peer), label))
    except TransferError:
        raise
    except Exception as e:  # noqa: BLE001 - posting failed (peer gone before or during the round)
        raise clock.error(label, e) from e
    # a peer's receives complete in the order they were posted (gloo matches a pair's messages in
    # order), so only the oldest pending receive of each peer is polled
    queues: dict[int, deque] = {}
    for k, op in enumerate(recvs):
        queues.setdefault(op.peer, deque()).append(k)
    while any(queues.values()):
        batch = []
        for q in queues.values():
            while q and recv_works[q[0]].is_completed():
                batch.append(q.popleft())
        if not batch:
            if clock.idle():
                continue
            k = min(q[0] for q in queues.values() if q)     # nothing has arrived: wait for the next in plan order
            batch = [queues[recvs[k].peer].popleft()]
        for k in sorted(batch):
            op = recvs[k]
            clock.wait(recv_works[k], f"receiving from rank {op.peer}")
            unpack(r, i, op.peer, op.wire, op.pairs, op.message, problems, bad_buffers)
    check_unstaged(r, i, rnd, problems, bad_buffers)
    while clock.idle():
        pass
    for work, label in send_works:
        clock.wait(work, label)
