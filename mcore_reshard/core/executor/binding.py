"""Binding a plan to one rank's tensors: the one staging buffer, the views every round packs from
and unpacks into, and the stage at which each destination buffer is first / last written."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import torch

from ..planner import Plan
from . import common
from .common import _CS_BYTES, torch_dtype


class Pair(NamedTuple):
    """A copy's two views on one end of a message: ``stage`` in the staging slice (an unstaged
    message: the wire bytes of ``tensor`` itself) and ``tensor`` in this rank's tensor."""
    stage: torch.Tensor
    tensor: torch.Tensor


class Part(NamedTuple):
    """One point-to-point operation of a message (:func:`parts`): the tensor on the wire and the
    pairs it packs / unpacks (none: it goes straight from / into the tensor; a :class:`Trailer`:
    an unstaged message's checksums)."""
    wire: torch.Tensor
    pairs: list


class BoundMessage(NamedTuple):
    """A send or receive of a :class:`Round`: the plan's ``message`` bound to this rank's staging
    slice ``buf`` and tensor views (``pairs``, one per entry), moved as ``parts``; ``peer``: the
    other end."""
    peer: int
    buf: torch.Tensor
    pairs: list          # [Pair], one per entry of the message
    message: object      # the plan's Message
    parts: list          # [Part]


class LocalCopy(NamedTuple):
    """A copy whose both ends are on this rank: ``dst.copy_(src)`` (views) for the plan's ``copy``."""
    dst: torch.Tensor
    src: torch.Tensor
    copy: object


class Padding(NamedTuple):
    """A region of destination buffer ``buffer`` that no copy writes (zeroed every refit)."""
    view: torch.Tensor
    buffer: str


@dataclass(slots=True, eq=False)
class Round:
    """One round of one rank: its sends and receives (:class:`BoundMessage`) and the peers it
    sends to / receives from."""
    sends: list
    recvs: list
    send_peers: list = field(default_factory=list)
    recv_peers: list = field(default_factory=list)


@dataclass(frozen=True, slots=True, eq=False)
class Binding:
    """This rank's part of a plan bound to its tensors: everything :meth:`Resharder.refit` touches,
    fixed when made (addresses never change).  Never edited: a followed owner (``param.data``
    rebound) gets a whole new Binding, swapped in by :meth:`~.transfer.Refit.swap`."""
    src: dict            # buffer name -> the source tensor bound (a detached view of the owner's storage)
    dst: dict            # buffer name -> the destination tensor bound
    local: list          # LocalCopy
    padding: list        # Padding
    staging: torch.Tensor
    rounds: list         # Round, in plan-round order (only rounds this rank takes part in)
    round_numbers: list  # the plan round number of each
    first_stage: dict    # stage (-1: local copies and padding, i: round i) -> buffers first written there
    last_stage: dict     # stage -> buffers last written there
    # what a transport derives from this binding once and reuses every refit (the batched path's
    # chunk groups per round); dropped with the binding
    schedules: dict = field(default_factory=dict)


def per_round(plan: Plan, rank: int) -> dict[int, tuple[list, list]]:
    """``{plan round: (messages rank sends, messages rank receives)}``."""
    out: dict[int, tuple[list, list]] = {}
    for m in plan.messages:
        if m.src == rank:
            out.setdefault(m.round, ([], []))[0].append(m)
        if m.dst == rank:
            out.setdefault(m.round, ([], []))[1].append(m)
    return out


def staged_bytes(m, verify: bool) -> int:
    """Staging bytes of message ``m``: its entries (none for an unstaged message, whose entries go
    straight from / into their tensors), + a 16-byte checksum per entry with ``verify``."""
    return (0 if m.unstaged else m.nbytes) + (_CS_BYTES * len(m.entries) if verify else 0)


def staging_size(plan: Plan, rank: int, verify: bool = False) -> int:
    """Bytes of the one staging buffer a :class:`Resharder` of ``plan`` needs on ``rank``: the most
    it stages to send plus receive in any round (+ a checksum per entry with ``verify``; an
    unstaged message stages nothing but those).  Resharders that never run at the same time may
    share one buffer of the largest size (``staging=``), as the FP8 refit's per-group plans do."""
    return max((sum(staged_bytes(m, verify) for m in sends + recvs)
                for sends, recvs in per_round(plan, rank).values()), default=0)


class Trailer(list):
    """The verify checksums of an unstaged message (:attr:`Message.unstaged`), its last operation:
    ``[(int64[2] slot in the staging slice, tensor view)]`` per entry.  The sender fills the slots
    with its source views' checksums (:func:`~.rounds.pack`); the receiver compares them with its
    destination views' once the round's receives have all landed (:func:`~.rounds.check_unstaged`):
    the entries themselves went straight into the tensors, so they are checked where they landed."""


class Check(NamedTuple):
    """One entry of a :class:`Trailer`: its checksum ``slot`` and the tensor view it sums."""
    slot: torch.Tensor
    tensor: torch.Tensor


def unstaged_parts(m, buf: torch.Tensor, views: list, verify: bool) -> tuple[list, list]:
    """(pairs, parts) of an unstaged message: one operation per entry, straight from / into its
    (contiguous, checked at bind) tensor view, then with ``verify`` the checksum trailer
    (:class:`Trailer`) in the message's staging slice ``buf``."""
    wires = [t.reshape(-1).view(torch.uint8) for t in views]
    pairs = [Pair(w, t) for w, t in zip(wires, views)]
    parts = [Part(w, []) for w in wires]
    if verify:
        parts.append(Part(buf, Trailer(Check(buf[_CS_BYTES * j:_CS_BYTES * (j + 1)].view(torch.int64), t)
                                       for j, t in enumerate(views))))
    return pairs, parts


def bool_bytes(plan: Plan, name: str) -> bool:
    """Whether tensor ``name`` is bool at both ends: its copies then move as uint8 (the bytes, not
    the values: a bool byte other than 0 / 1 is legal in memory and must land unchanged)."""
    meta = plan.tensors[name]
    return meta["src_dtype"] == meta["dst_dtype"] == "bool"


def region(plan: Plan, t: torch.Tensor, c, local) -> torch.Tensor:
    """The view of ``t`` that copy ``c`` reads or writes (``local``: its box there); a bool copy as
    its bytes (:func:`bool_bytes`)."""
    v = t[local.slices()]
    return v.view(torch.uint8) if v.dtype == torch.bool and bool_bytes(plan, c.tensor) else v


def staging_view(plan: Plan, staging: torch.Tensor, c) -> torch.Tensor:
    """The part of a message's staging slice that carries copy ``c``, as its source dtype and box
    (a bool copy as uint8, :func:`bool_bytes`)."""
    dtype = torch.uint8 if bool_bytes(plan, c.tensor) else torch_dtype(plan.tensors[c.tensor]["src_dtype"])
    return staging[c.offset:c.offset + c.nbytes].view(dtype).view(c.src_local.sizes)


def parts(m, buf: torch.Tensor, pairs: list, verify: bool) -> list:
    """How the overlapped path moves message ``m``: ``[(wire tensor, pairs to pack / unpack)]``,
    one point-to-point operation each, in entry order.  Both ends derive the SAME split from
    the plan alone (entry sizes), so their operations match one to one: every entry of at
    least ``_DIRECT_MIN`` bytes is its own operation, consecutive smaller entries share one.
    Then each end decides alone, from its own tensors, whether an own-operation entry goes
    straight from the source / into the destination (its view is contiguous, of the staged
    dtype: wire tensor = the view's bytes, nothing to pack / unpack) or through its staging
    view as usual.  Staging stays reserved for every entry (staging accounting unchanged;
    direct entries just leave theirs untouched).  With ``verify`` (checksum trailer) or
    entries not laid out in order: the whole message as one staged operation."""
    whole = [Part(buf, pairs)]
    if verify or not pairs:
        return whole
    at = 0
    for c in m.entries:
        if c.offset != at:
            return whole
        at += c.nbytes
    if at != m.nbytes:
        return whole
    out, group = [], []

    def flush():
        if group:
            lo = group[0][0].offset
            hi = group[-1][0].offset + group[-1][0].nbytes
            out.append(Part(buf[lo:hi], [p for _, p in group]))
            group.clear()

    direct_min = common._DIRECT_MIN
    for c, pair in zip(m.entries, pairs):
        if c.nbytes < direct_min:
            group.append((c, pair))
            continue
        flush()
        t = pair.tensor
        if t.is_contiguous() and t.dtype == pair.stage.dtype and t.numel() * t.element_size() == c.nbytes:
            out.append(Part(t.reshape(-1).view(torch.uint8), []))
        else:
            out.append(Part(buf[c.offset:c.offset + c.nbytes], [pair]))
    flush()
    return out


def _entry(plan: Plan, peer: int, m, buf: torch.Tensor, views: list, verify: bool) -> BoundMessage:
    """A send or receive of :class:`Round`: message ``m`` whose entries are ``views`` of this
    rank's tensors, bound to the staging slice ``buf``."""
    if m.unstaged:
        pairs, ps = unstaged_parts(m, buf, views, verify)
    else:
        pairs = [Pair(staging_view(plan, buf, c), t) for c, t in zip(m.entries, views)]
        ps = parts(m, buf, pairs, verify)
    return BoundMessage(peer, buf, pairs, m, ps)


def bind(plan: Plan, rank: int, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor], *,
         verify: bool, staging: torch.Tensor | None, device: torch.device, dst_names) -> Binding:
    """Views, staging and stage bookkeeping of ``plan`` on ``rank`` (tensors already validated).
    ``staging``: a shared uint8 buffer used when large enough; ``dst_names``: this rank's buffers."""
    local = [LocalCopy(region(plan, dst[c.dst_buffer], c, c.dst_local), region(plan, src[c.src_buffer], c, c.src_local), c)
             for c in plan.local_copies if c.dst == rank]
    padding = [Padding(dst[b][box.slices()], b) for rr, b, box in plan.padding if rr == rank]
    rounds_of = per_round(plan, rank)
    # ONE staging buffer per rank: in each round its front holds the messages this rank sends,
    # the rest the messages it receives (the plan keeps send + receive <= budget per round)
    size = staging_size(plan, rank, verify)
    if staging is not None and staging.numel() >= size:
        buffer = staging[:size]
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
    rounds: list[Round] = []
    numbers: list[int] = []
    # stage at which each destination buffer is first / last written (-1: local copies and padding)
    first: dict[str, int] = {}
    last: dict[str, int] = {}

    def touch(name: str, stage: int) -> None:
        first.setdefault(name, stage)
        last[name] = stage

    for pad in padding:
        touch(pad.buffer, -1)
    for lc in local:
        touch(lc.copy.dst_buffer, -1)
    for k in sorted(rounds_of):
        sends, recvs = rounds_of[k]
        rnd = Round([], [])
        base = 0
        for m in sends:
            n = staged_bytes(m, verify)
            buf = buffer[base:base + n]
            # a forwarded message (two-level plans) reads this rank's destination buffers, written
            # in an earlier round (validate_plan checks it; rounds run in order)
            have = dst if m.forward else src
            views = [region(plan, have[c.src_buffer], c, c.src_local) for c in m.entries]
            rnd.sends.append(_entry(plan, m.dst, m, buf, views, verify))
            base += n
        for m in recvs:             # right after this round's sends, in the same buffer
            n = staged_bytes(m, verify)
            buf = buffer[base:base + n]
            views = [region(plan, dst[c.dst_buffer], c, c.dst_local) for c in m.entries]
            rnd.recvs.append(_entry(plan, m.src, m, buf, views, verify))
            base += n
            for c in m.entries:
                touch(c.dst_buffer, len(rounds))
        rnd.send_peers = sorted({m.dst for m in sends})
        rnd.recv_peers = sorted({m.src for m in recvs})
        rounds.append(rnd)
        numbers.append(k)
    for name in dst_names:
        if name not in first:
            touch(name, -1)   # buffers nothing writes (empty) are complete after the local stage
    return Binding(dict(src), dict(dst), local, padding, buffer, rounds, numbers,
                   {s: sorted(n for n, f in first.items() if f == s) for s in set(first.values())},
                   {s: sorted(n for n, l in last.items() if l == s) for s in set(last.values())})
