"""Two-level plans: NVLink domains, and forwarding inside a domain what crosses the network once.

A :class:`Topology` says which NVLink domain each rank lies in (a domain size, or an explicit
rank -> domain list).  With one, :func:`~mcore_reshard.core.planner.make_plan` plans in two levels:

* a region that a holder inside the receiver's domain has is sent by such a holder (NVLink);
* a region no rank of the receiver's domain holds crosses the network (NIC).  Where several
  receivers of one domain need the same elements of one source box, those elements cross the
  network once, to the receiver with the least NIC load so far (ties: lowest rank), the *carrier*,
  which forwards them to the others over NVLink in a later round: a *forwarded* message
  (``Message.forward``) reads from the carrier's destination tensor, written in an earlier round.

So the NIC bytes equal the hierarchical lower bound: per domain, the union of the elements its
receivers need from outside the domain, counted once (:attr:`Plan.stats` ``hierarchical_bound_bytes``).
Where receivers' regions overlap partly, the shared parts are split into disjoint atoms, each
carried once.  Not forwarded (sent directly, over the NIC; the bound is then missed by those bytes):
tensors cast on the receiver (``src_dtype != dst_dtype``: the carrier holds other bytes than the
wire format) and two destination pieces of one rank needing the same elements (a rank cannot
message itself).  Pure Python.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from math import prod

from ..box import Box, split_box, unchecked_box
from .index import _disjoint, atoms
from .matching import ToLocal
from .plan import ALIGN, PlanError, contiguous
from .records import CarrierKey, ForwardCopy, PendingCopy, Region


@dataclass(frozen=True)
class Topology:
    """Which NVLink domain each rank lies in: ``domain_size`` (rank // domain_size) or an explicit
    ``domains`` list (``domains[rank]`` = the domain id of ``rank``; every plan rank must be in it)."""
    domain_size: int | None = None
    domains: tuple[int, ...] | None = None

    def __post_init__(self):
        if (self.domain_size is None) == (self.domains is None):
            raise PlanError("Topology: give exactly one of domain_size and domains")
        if self.domain_size is not None and (type(self.domain_size) is not int or self.domain_size < 1):
            raise PlanError(f"Topology: domain_size={self.domain_size!r} must be a positive integer")
        if self.domains is not None:
            object.__setattr__(self, "domains", tuple(self.domains))
            if any(type(d) is not int for d in self.domains):
                raise PlanError(f"Topology: domains must be integers, got {list(self.domains)[:8]}")

    def domain(self, rank: int) -> int:
        if self.domain_size is not None:
            return rank // self.domain_size
        if not 0 <= rank < len(self.domains):
            raise PlanError(f"Topology: rank {rank} is not in the rank -> domain list of {len(self.domains)} rank(s)")
        return self.domains[rank]

    def to_json(self) -> dict:
        return {"domain_size": self.domain_size} if self.domain_size is not None else {"domains": list(self.domains)}

    @staticmethod
    def of(x) -> "Topology | None":
        """``None``, a Topology, a domain size (int) or a rank -> domain list (a cost-model
        preset gives its own: ``mcore_reshard.tools.costmodel.Hardware.topology``)."""
        if x is None or isinstance(x, Topology):
            return x
        if isinstance(x, bool):
            raise PlanError(f"topology={x!r}: a Topology, a domain size or a rank -> domain list")
        if isinstance(x, int):
            return Topology(domain_size=x)
        if isinstance(x, (list, tuple)):
            return Topology(domains=tuple(x))
        raise PlanError(f"topology={x!r}: a Topology, a domain size or a rank -> domain list")


def plan_forwarding(remote: list[Region], topo: Topology, tensors: dict, budget: int,
                    to_local: ToLocal, shape_of=None) -> tuple[list[Region], list[ForwardCopy], int]:
    """(remote regions for :func:`~.senders.choose_senders`, forwarded copies, NIC lower bound in bytes).

    ``remote`` are :func:`~.matching.match`'s regions (:class:`~.records.Region`).  Regions with a holder in the receiver's domain keep only those holders;
    the rest are grouped per (source box, receiver domain) and each element needed by several
    receivers is kept for one carrier only; the others get forwarded copies
    (:class:`~.records.ForwardCopy`: from the carrier's destination buffer), split to fit the budget exactly as the carrier's copy is.  ``shape_of(rank, dst
    buffer)``: the buffer's local shape; a forwarded copy contiguous in both destination buffers
    (:func:`~.plan.contiguous`) is *unstaged* (:attr:`~.plan.Message.unstaged`): it goes straight
    from the carrier's tensor into the receiver's, no staging (None: every copy staged)."""
    dmap: dict[int, int] = {}          # rank -> domain, looked up once per rank
    topo_domain = topo.domain

    def dom(r: int) -> int:
        d = dmap.get(r)
        if d is None:
            d = dmap[r] = topo_domain(r)
        return d

    out: list[Region] = []
    inside: dict[tuple, list] = {}         # (id(holders), domain) -> holders in that domain
    groups: dict[tuple, list] = {}         # (id(holders), domain) -> NIC regions
    forwardable = {n: t["src_dtype"] == t["dst_dtype"] for n, t in tensors.items()}
    append = out.append
    for x in remote:
        r = x.dst
        d = dmap.get(r)
        if d is None:
            d = dom(r)
        holders = x.holders
        hk = (id(holders), d)
        hin = inside.get(hk)
        if hin is None:
            hin = inside[hk] = [h for h in holders if dom(h.rank) == d]
        if hin:
            append(x if len(hin) == len(holders) else x._replace(holders=hin))
        else:
            g = groups.get(hk)
            if g is None:
                groups[hk] = [x]
            else:
                g.append(x)
    seq = [len(remote)]
    load: dict[int, int] = defaultdict(int)    # NIC bytes each rank receives so far
    units: list[list[Region]] = []              # sets of regions of one box, several receivers each
    bound = 0
    for group in groups.values():
        if len(group) == 1:             # one receiver of this source box in the domain: nothing to share
            (x,) = group
            bound -= x.neg_nbytes
            append(x)
            if forwardable[x.tensor]:
                load[x.dst] -= x.neg_nbytes
            continue
        by_box: dict[tuple, list] = {}
        for x in group:
            by_box.setdefault((x.offsets, x.sizes), []).append(x)
        keys = sorted(by_box)
        head = group[0]
        direct = not forwardable[head.tensor]
        if len(keys) > 1 and not _disjoint(keys):
            if direct:      # the bound only: the regions go as they are
                bound += sum(a.numel for a, _ in atoms([Box(o, s) for o, s in keys])) * head.itemsize
                out.extend(group)
                continue
            by_box = _atomize(by_box, keys, seq, to_local)
        for xs in by_box.values():
            first = xs[0]
            bound += -first.neg_nbytes
            if direct:
                out.extend(xs)
            elif len(xs) == 1:
                out.append(first)
                load[first.dst] += -first.neg_nbytes
            else:
                units.append(xs)
    forwards: list[ForwardCopy] = []
    units.sort(key=lambda xs: (xs[0].neg_nbytes, xs[0].seq))        # largest first, then destination order
    for xs in units:
        carrier = min(xs, key=lambda x: (load[x.dst], x.dst, x.dst_buffer, x.seq))
        load[carrier.dst] += -carrier.neg_nbytes
        out.append(carrier)
        for x in xs:
            if x is carrier:
                continue
            if x.dst == carrier.dst:            # the same rank twice: no message to itself, sent directly
                out.append(x)
                continue
            forwards.extend(_forward_copies(carrier, x, budget, to_local, seq, shape_of))
    return out, forwards, bound


def _atomize(by_box: dict, keys: list, seq: list, to_local: ToLocal) -> dict:
    """Regions of partly overlapping boxes, cut into disjoint atoms: atom box -> the regions (one
    per receiver piece) restricted to it."""
    boxes = [Box(o, s) for o, s in keys]
    out: dict[tuple, list] = {}
    for atom, idx in atoms(boxes):
        ao, asz = atom.offsets, atom.sizes
        for i in idx:
            for x in by_box[keys[i]]:
                isz = x.itemsize
                dlo, dls = to_local(x.dst_piece, ao, asz)
                n = seq[0]
                seq[0] += 1
                out.setdefault((ao, asz), []).append(Region(-atom.numel * isz, x.tensor, ao, asz, x.dst, x.dst_buffer,
                                                            n, x.holders, x.dst_piece, isz, atom, dlo, dls,
                                                            unchecked_box(dlo, dls)))
    return out


def _forward_copies(carrier: Region, x: Region, budget: int, to_local: ToLocal, seq: list,
                    shape_of=None) -> list[ForwardCopy]:
    """The forwarded copies of region ``x`` from ``carrier`` (same box), split as the carrier's copy
    is; each unstaged where contiguous in both destination buffers (``shape_of`` given)."""
    isz = x.itemsize
    limit = max(1, (budget - ALIGN) // isz) * isz
    boxes = [x.box] if -x.neg_nbytes <= limit else split_box(x.box, limit // isz)
    cshape = shape_of(carrier.dst, carrier.dst_buffer) if shape_of is not None else None
    dshape = shape_of(x.dst, x.dst_buffer) if shape_of is not None else None
    out = []
    for b in boxes:
        o, s = b.offsets, b.sizes
        clo, cls = to_local(carrier.dst_piece, o, s)
        dlo, dls = to_local(x.dst_piece, o, s)
        n = seq[0]
        seq[0] += 1
        direct = cshape is not None and contiguous(cls, cshape) and contiguous(dls, dshape)
        out.append(ForwardCopy(-prod(s) * isz, carrier.dst, x.dst, x.tensor, o, s, n, carrier.dst_buffer,
                               unchecked_box(clo, cls), x.dst_buffer, dlo, dls, b, unchecked_box(dlo, dls),
                               CarrierKey(carrier.dst, carrier.dst_buffer, x.tensor, o, s), direct))
    return out


def link_stats(messages, topo: Topology) -> dict:
    """NIC / NVLink / forwarded / unstaged bytes of a plan's messages under ``topo``."""
    nic = nvl = fwd = direct = 0
    dom = topo.domain
    for m in messages:
        payload = sum(c.nbytes for c in m.entries)
        if dom(m.src) == dom(m.dst):
            nvl += payload
        else:
            nic += payload
        if m.forward:
            fwd += payload
        if m.unstaged:
            direct += payload
    return {"nic_bytes": nic, "nvlink_bytes": nvl, "forwarded_bytes": fwd, "unstaged_bytes": direct}


def split_unstaged(copies: list[PendingCopy], topo: Topology, tensors: dict, src_shape, dst_shape) -> tuple[list, list]:
    """(staged copies, unstaged copies) of :func:`~.senders.choose_senders`' copies: a copy inside
    one NVLink domain, of a tensor not cast, contiguous in its source and its destination buffer
    (:func:`~.plan.contiguous`; ``src_shape`` / ``dst_shape``: (rank, buffer) -> local shape) goes
    straight from tensor to tensor (:attr:`~.plan.Message.unstaged`) and takes no staging.  NIC
    copies stay staged: the budget paces them, round by round, on the slower link."""
    dom = topo.domain
    same = {n: t["src_dtype"] == t["dst_dtype"] for n, t in tensors.items()}
    shapes: dict[tuple, tuple] = {}
    staged, direct = [], []
    for c in copies:
        s, d = c.src, c.dst
        if not same[c.tensor] or dom(s) != dom(d):
            staged.append(c)
            continue
        ks, kd = (0, s, c.src_buffer), (1, d, c.dst_buffer)
        ss = shapes.get(ks)
        if ss is None:
            ss = shapes[ks] = tuple(src_shape(s, c.src_buffer))
        ds = shapes.get(kd)
        if ds is None:
            ds = shapes[kd] = tuple(dst_shape(d, c.dst_buffer))
        (direct if contiguous(c.src_local.sizes, ss) and contiguous(c.dst_local_sizes, ds) else staged).append(c)
    return staged, direct


def place_unstaged(direct: list[PendingCopy], rounds: int, placed: dict) -> int:
    """Unstaged copies (no staging, no budget) spread over the ``rounds`` the staged copies take:
    first fit (largest first) under a per-rank cap of the busiest rank's unstaged bytes (sent +
    received) / ``rounds``, so that each round carries about its share next to its staged bytes
    instead of all of them at once; into ``placed`` under (round, src, dst, 3).  Returns the rounds used."""
    direct.sort()
    need: dict[int, int] = defaultdict(int)
    for c in direct:
        need[c.src] -= c.neg_nbytes
        need[c.dst] -= c.neg_nbytes
    if not direct:
        return 0
    cap = max(-(-max(need.values()) // max(rounds, 1)), -direct[0].neg_nbytes)
    used: dict[int, list[int]] = defaultdict(list)
    first: dict[int, int] = defaultdict(int)      # rank -> rounds before this one are full (to the cap)
    out = 0
    for c in direct:
        n, s, d = -c.neg_nbytes, c.src, c.dst
        us, ud = used[s], used[d]
        k = max(first[s], first[d])
        while True:
            a = us[k] if k < len(us) else 0
            b = ud[k] if k < len(ud) else 0
            if a + n <= cap and b + n <= cap:
                break
            k += 1
        for u, r in ((us, s), (ud, d)):
            if len(u) <= k:
                u.extend([0] * (k + 1 - len(u)))
            u[k] += n
            while first[r] < len(u) and u[first[r]] >= cap:
                first[r] += 1
        placed.setdefault((k, s, d, 3), []).append(c)
        if k >= out:
            out = k + 1
    return out


#: two-level plans: a rank's NIC bytes per round and direction are at most NIC_PACE x the busiest
#: NIC rank's average over the fewest rounds (:func:`pack_busiest_first`)
NIC_PACE = 1.05
#: two-level plans cut copies to at most budget / COPY_SHARE bytes (flat plans: the whole budget),
#: so that a rank's sends and receives can share each round's budget (:func:`pack_busiest_first`):
#: a copy of nearly the whole budget leaves no room beside it for the other direction
COPY_SHARE = 4


def pack_busiest_first(copies: list[PendingCopy], budget: int, domain=None) -> tuple[dict, dict[int, list[int]], int]:
    """Round packing of two-level plans' staged copies: round by round, the copies of the ranks with
    the most staged bytes left go first.  (placed: (round, src, dst) -> copies, per-rank staged
    bytes per round, rounds.)

    Each round splits every rank's budget between what it stages to send and what it stages to
    receive, in proportion to the bytes it has left of each (a rank that only sends keeps the whole
    budget for sending), and caps what any rank moves over the NIC in one direction per round:
    ``NIC_PACE`` x the busiest NIC rank's bytes / the fewest rounds the staged bytes need, never
    below the largest NIC copy (a cumulative pace that lets a rank behind catch up was tried: the
    catch-up rounds set the pace, ``train1024`` 1.20 -> 1.25x the link bound).  The (src, dst) pairs are taken by the larger of their two ranks'
    bytes still to place (ties: the pair), each pair's copies largest first, every copy that fits
    the sender's send room and the receiver's receive room (and NIC room); what does not fit waits
    for the next round.  So a critical rank (the busiest NIC sender or receiver) fills every round
    until its bytes run out; a rank that sends and receives (colocated refits) does both in every
    round, as its full-duplex NIC can, instead of rounds of sends only followed by rounds of
    receives only; and a less busy rank does not set a round's pace above the critical rank's (a
    round lasts as long as its slowest NIC).  A first fit over all copies largest first
    (:func:`~.rounds._pack_rounds`, flat plans) fills early rounds with whatever is largest and
    leaves the critical ranks' peers short in them.  On the full-size configurations this is what
    brings the cost model's paced time near the link bound (BENCHMARKS.md A.3).  A round
    that places nothing this way places the first pair's largest copy alone (every copy fits an
    empty budget), so every round places something.

    Example, budget 1024, one domain: rank 0 sends 768 B to rank 1 and receives 768 B from it (256 B
    copies): each round gives rank 0 512 B to send and 512 B to receive, so round 0 carries 512 B
    each way and round 1 the last 256 B each way."""
    out_left: dict[int, int] = defaultdict(int)      # staged bytes still to send, per rank
    in_left: dict[int, int] = defaultdict(int)       # ... and to receive
    pairs: dict[tuple[int, int], list] = defaultdict(list)
    nic_out: dict[int, int] = defaultdict(int)
    nic_in: dict[int, int] = defaultdict(int)
    nic: dict[tuple, bool] = {}        # pair -> across domains
    biggest = 0                         # the largest NIC copy
    for c in sorted(copies):            # largest first (then the sequence order), per pair
        s, d = c.src, c.dst
        n = (-c.neg_nbytes + ALIGN - 1) // ALIGN * ALIGN
        out_left[s] += n
        in_left[d] += n
        p = (s, d)
        x = nic.get(p)
        if x is None:
            x = nic[p] = domain is not None and domain(s) != domain(d)
        if x:
            nic_out[s] += n
            nic_in[d] += n
            biggest = max(biggest, n)
        pairs[p].append((n, c))
    # NIC pace: no rank moves more NIC bytes in one direction per round than the busiest NIC rank
    # must on average over the fewest rounds the staged bytes need (+ NIC_PACE's slack)
    fewest = -(-max((out_left[r] + in_left[r] for r in out_left.keys() | in_left.keys()), default=0) // budget)
    busiest = max(max(nic_out.values(), default=0), max(nic_in.values(), default=0))
    cap = max(int(busiest / max(fewest, 1) * NIC_PACE), biggest)
    placed: dict = defaultdict(list)
    used: dict[int, list[int]] = defaultdict(list)
    k = 0
    while pairs:
        order = sorted(pairs, key=lambda p: (-max(out_left[p[0]] + in_left[p[0]], out_left[p[1]] + in_left[p[1]]), p))
        send_room: dict[int, int] = {}
        recv_room: dict[int, int] = {}
        staged: dict[int, int] = defaultdict(int)
        nsend: dict[int, int] = defaultdict(lambda: cap)      # NIC room this round, to send
        nrecv: dict[int, int] = defaultdict(lambda: cap)      # ... and to receive

        def rooms(r: int) -> None:
            o, i = out_left[r], in_left[r]
            send_room[r] = budget * o // (o + i)
            recv_room[r] = budget - send_room[r]

        for p in order:
            s, d = p
            if s not in send_room:
                rooms(s)
            if d not in recv_room:
                rooms(d)
            lim = min(send_room[s], recv_room[d])
            if nic[p]:
                lim = min(lim, nsend[s], nrecv[d])
            items = pairs[p]
            if lim < items[-1][0]:      # not even the pair's smallest copy fits
                continue
            keep, got = [], 0
            for n, c in items:
                if n <= lim - got:
                    got += n
                    placed[(k, s, d)].append(c)
                else:
                    keep.append((n, c))
            if got:
                _take(s, d, got, send_room, recv_room, staged, out_left, in_left)
                if nic[p]:
                    nsend[s] -= got
                    nrecv[d] -= got
            if keep:
                pairs[p] = keep
            else:
                del pairs[p]
        if not staged:                  # nothing fitted the split rooms: the first pair's largest copy
            p = order[0]
            n, c = pairs[p].pop(0)
            placed[(k, p[0], p[1])].append(c)
            _take(p[0], p[1], n, send_room, recv_room, staged, out_left, in_left)
            if not pairs[p]:
                del pairs[p]
        for r, x in staged.items():
            u = used[r]
            if len(u) < k:
                u.extend([0] * (k - len(u)))
            u.append(x)
        k += 1
    return placed, used, k


def _take(s: int, d: int, n: int, send_room: dict, recv_room: dict, staged: dict, out_left: dict,
          in_left: dict) -> None:
    """``n`` staged bytes from ``s`` to ``d`` placed in this round: rooms, staged bytes, bytes left."""
    send_room[s] -= n
    recv_room[d] -= n
    staged[s] += n
    staged[d] += n
    out_left[s] -= n
    in_left[d] -= n
