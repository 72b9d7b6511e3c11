"""One round of a refit, two ways: batched (one ``batch_isend_irecv``; NCCL) and overlapped (gloo),
with packing, unpacking (verify checks) and the :class:`TransferError` of a failed wait.

Each function takes the bound :class:`~.resharder.Resharder` ``r`` (group, timeout, verify, rounds)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from .binding import Round
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


def pack(r, buf: torch.Tensor, pairs: list, m) -> None:
    """Copy every source view of message ``m`` into its staging view (+ checksums with verify)."""
    for j, (stage, s) in enumerate(pairs):
        stage.copy_(s)
        if r.verify:
            buf[m.nbytes + _CS_BYTES * j:m.nbytes + _CS_BYTES * (j + 1)].view(torch.int64).copy_(checksum(s))


def unpack(r, i: int, peer: int, buf: torch.Tensor, pairs: list, m, problems: list[str], bad_buffers: set) -> None:
    """Copy every staging view of a received message into its destination view (verify: check
    the staged and the unpacked bytes; a corrupt entry is skipped and its buffer marked bad)."""
    n = len(r.rounds)
    for j, (stage, d) in enumerate(pairs):
        c = m.entries[j]
        if r.verify:
            want = buf[m.nbytes + _CS_BYTES * j:m.nbytes + _CS_BYTES * (j + 1)].view(torch.int64)
            if not torch.equal(checksum(stage), want):
                problems.append(f"round {i + 1}/{n}: {c.tensor}{c.box} from rank {peer} arrived with a "
                                f"different checksum than rank {peer} sent (buffer {c.dst_buffer})")
                bad_buffers.add(c.dst_buffer)
                continue
        d.copy_(stage.reshape(d.shape))
        if r.verify and d.dtype == stage.dtype and not torch.equal(checksum(d), checksum(stage)):
            problems.append(f"round {i + 1}/{n}: {c.tensor}{c.box} from rank {peer} differs from what "
                            f"arrived after unpacking into buffer {c.dst_buffer}")
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
        f"destination buffers incomplete here: {sum(1 for x in r._buffer_version.values() if x is None)}; "
        f"cause: {type(e).__name__}: {str(e)[:300]}", version=v, round=i + 1, peers=peers)


def round_batched(r, v: int, i: int, rnd: Round, problems: list[str], bad_buffers: set) -> None:
    """Pack every send, post all sends and receives in ONE ``batch_isend_irecv`` (NCCL groups
    them: no deadlock whatever the order), wait for all, then unpack every receive."""
    for _, buf, pairs, m, _ in rnd.sends:
        pack(r, buf, pairs, m)
    ops = [dist.P2POp(dist.isend, buf, group=r.group, group_peer=peer) for peer, buf, *_ in rnd.sends]
    ops += [dist.P2POp(dist.irecv, buf, group=r.group, group_peer=peer) for peer, buf, *_ in rnd.recvs]
    labels = [f"sending to rank {peer}" for peer, *_ in rnd.sends] + [f"receiving from rank {peer}" for peer, *_ in rnd.recvs]
    if ops:
        t0 = time.monotonic()
        try:
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):
                labels = ["exchanging with ranks " + ",".join(map(str, sorted(set(rnd.send_peers) | set(rnd.recv_peers))))] * len(works)
            deadline = t0 + r.timeout_s
            for work, label in zip(works, labels):
                try:
                    bounded_wait(work, deadline - time.monotonic(), r.group)
                except Exception as e:  # noqa: BLE001
                    raise round_error(r, v, i, rnd, label, e, time.monotonic() - t0) from e
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 - posting failed (peer gone before the round)
            raise round_error(r, v, i, rnd, "posting the round", e, time.monotonic() - t0) from e
    for peer, buf, pairs, m, _ in rnd.recvs:
        unpack(r, i, peer, buf, pairs, m, problems, bad_buffers)


def round_overlapped(r, v: int, i: int, rnd: Round, problems: list[str], bad_buffers: set) -> None:
    """gloo only (:meth:`Resharder.overlapped`): packing, the wire and unpacking overlap.

    1. One ``batch_isend_irecv`` opens the round: every receive of the round (so peers' bytes
       can land at once) plus the first send, packed just before.
    2. Every further send is packed and posted (``isend``) right away, in the plan's order (the
       same order on both ends of every pair; gloo matches a pair's messages in order), so its
       bytes travel while the next one is packed.
    3. Receives are unpacked one by one as soon as each has arrived (first every one already
       complete, else the next in order is waited for), while the others still travel.
    4. Then the sends are waited for (their buffers are reused by the next round).

    A message goes as one or more operations (:func:`~.binding.parts`): its large entries one each, sent
    straight from a contiguous source view and received straight into a contiguous destination
    view (no pack / unpack copy; never with ``verify``).  Every wait is bounded by the round's deadline (its start + ``timeout``) and
    fails with the same :class:`TransferError` (round, peers, what it was waiting for) as the
    batched path."""
    t0 = time.monotonic()
    deadline = t0 + r.timeout_s

    def wait(work, label):
        try:
            bounded_wait(work, deadline - time.monotonic(), r.group)
        except Exception as e:  # noqa: BLE001
            raise round_error(r, v, i, rnd, label, e, time.monotonic() - t0) from e

    # one operation per part, in plan order: (peer, wire tensor, pairs, message)
    sends = [(peer, w, pp, m) for peer, _, _, m, parts in rnd.sends for w, pp in parts]
    recvs = [(peer, w, pp, m) for peer, _, _, m, parts in rnd.recvs for w, pp in parts]
    ops = [dist.P2POp(dist.irecv, w, group=r.group, group_peer=peer) for peer, w, *_ in recvs]
    if sends:
        peer, w, pairs, m = sends[0]
        pack(r, w, pairs, m)
        ops.append(dist.P2POp(dist.isend, w, group=r.group, group_peer=peer))
    if not ops:
        return
    label = "posting the round"
    try:
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            raise RuntimeError(f"batch_isend_irecv returned {len(works)} work(s) for {len(ops)} operation(s) "
                               "(a coalescing backend: use overlap=False)")
        recv_works = works[:len(recvs)]
        send_works = [(works[-1], f"sending to rank {sends[0][0]}")] if sends else []
        for peer, w, pairs, m in sends[1:]:
            pack(r, w, pairs, m)
            label = f"sending to rank {peer}"
            send_works.append((dist.isend(w, group=r.group, group_dst=peer), label))
    except TransferError:
        raise
    except Exception as e:  # noqa: BLE001 - posting failed (peer gone before or during the round)
        raise round_error(r, v, i, rnd, label, e, time.monotonic() - t0) from e
    pending = list(range(len(recvs)))
    while pending:
        done = [k for k in pending if recv_works[k].is_completed()] or pending[:1]
        for k in done:
            peer, w, pairs, m = recvs[k]
            wait(recv_works[k], f"receiving from rank {peer}")
            unpack(r, i, peer, w, pairs, m, problems, bad_buffers)
        pending = [k for k in pending if k not in done]
    for work, label in send_works:
        wait(work, label)
