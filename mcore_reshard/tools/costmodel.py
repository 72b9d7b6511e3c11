"""A link-level cost model of a refit plan: how long would it take on a real GPU cluster?

Pure Python, no torch.  A :class:`Hardware` says how fast each GPU's links are and how large an
NVLink domain is (its :attr:`~Hardware.topology`: the planner's own
:class:`~mcore_reshard.core.planner.Topology`, the one rank -> domain map); :func:`predict` takes a plan round by round, from
its traffic totals (:func:`~mcore_reshard.core.planner.plan_traffic`: a templated plan's copies are never made; summed
per (round, rank) with numpy where it imports, :func:`round_times`)::

    round time = max over ranks r of ( max(NIC out_r, NIC in_r) / nic_bw,
                                       max(NVLink out_r, NVLink in_r) / nvlink_bw )   (links overlap)
                 + per-message latency * messages posted by r
                 + (pack + unpack bytes of r) / (hbm_bw / 2)    (read + write; none for unstaged messages)
                 + round_latency
    refit time = local-copy time + sum of the round times

(:func:`paced`: each rank at its own pace instead, as the executor runs, with no barrier between rounds.)

A message goes over NVLink when source and destination rank lie in the same NVLink domain
(``rank // gpus_per_domain``), else over the NIC.  :func:`link_bound` is the floor for the same
placement (the same sender for every byte): every rank's total bytes per link class divided by the
link's bandwidth, all rounds merged, no latency.  :func:`hierarchical` models topology
exploitation without touching the planner: when several receivers in one NVLink domain need the
same box from outside the domain, it crosses the network once (to the receiver with the least NIC
traffic so far) and is fanned out over NVLink inside the domain.  :func:`gather_broadcast_time`
models the baseline the benchmarks compare against (see ``BENCHMARKS.md``).

Example (DGX H100: 8 GPUs per NVLink domain, 450 GB/s NVLink and 50 GB/s NIC per GPU): a round in
which rank 0 sends 1 GB to rank 1 (same node) and 1 GB to rank 8 (next node) takes
``max(1/50, 1/450) s = 20 ms`` plus two message latencies; the link bound is the same 20 ms.

Numbers are peak link rates (``efficiency=1.0``): predictions are optimistic floors, not
measurements.  Presets cite the vendor spec sheets in their docstrings.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Iterable, Mapping, NamedTuple

from ..core.gcpause import paused_gc
from ..core.planner.topology import Topology as PlannerTopology
from ..core.planner.traffic import PlanTraffic, plan_traffic

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """Per-GPU link speeds (bytes/s, one direction) and NVLink domain size."""
    name: str
    gpus_per_domain: int
    nvlink_bw: float
    nic_bw: float
    hbm_bw: float
    msg_latency_s: float = 10e-6     # per message posted by a rank (launch + RDMA/NVLink setup)
    round_latency_s: float = 50e-6   # per staging round (group start/end, stream sync)
    efficiency: float = 1.0          # achievable fraction of the peak link rates
    note: str = ""

    @cached_property
    def topology(self) -> PlannerTopology:
        """The rank -> NVLink domain map, as the planner takes it (``make_plan(..., topology=)``)."""
        return PlannerTopology(domain_size=self.gpus_per_domain)

    def domain(self, rank: int) -> int:
        return self.topology.domain(rank)

    def same_domain(self, a: int, b: int) -> bool:
        return self.domain(a) == self.domain(b)

    def with_(self, **kw) -> "Hardware":
        return replace(self, **kw)


def dgx_h100() -> Hardware:
    """NVIDIA DGX H100: 8 H100 SXM per node behind 4 NVSwitch chips; NVLink 4 gives every GPU
    900 GB/s of GPU-to-GPU bandwidth (450 GB/s per direction); 8 single-port ConnectX-7 400 Gb/s
    adapters for the compute fabric, one per GPU (400 Gb/s = 50 GB/s per direction); HBM3 at
    3.35 TB/s per GPU.  Sources: "NVIDIA DGX H100 User Guide -- Introduction to the NVIDIA DGX H100
    System" (https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html) and the
    "NVIDIA H100 Tensor Core GPU" datasheet (https://www.nvidia.com/en-us/data-center/h100/,
    H100 SXM: 3.35 TB/s memory bandwidth, NVLink 900 GB/s)."""
    return Hardware("DGX H100", 8, 450 * GB, 50 * GB, 3.35e12,
                    note="8 GPUs/NVLink domain, NVLink4 450 GB/s/dir/GPU, ConnectX-7 400 Gb/s per GPU")


def gb200_nvl72(nic_gbit: int = 400) -> Hardware:
    """NVIDIA GB200 NVL72: one NVLink domain of 72 Blackwell GPUs; fifth-generation NVLink gives
    every GPU 1.8 TB/s (900 GB/s per direction; 130 TB/s for the rack); HBM3e at 8 TB/s per GPU;
    one ConnectX-7 (400 Gb/s) or ConnectX-8 SuperNIC (800 Gb/s) per GPU for the scale-out fabric.
    Sources: "NVIDIA GB200 NVL72" product page and spec table
    (https://www.nvidia.com/en-us/data-center/gb200-nvl72/), "NVIDIA DGX GB200" datasheet
    (https://www.nvidia.com/en-us/data-center/dgx-gb200/) and "NVIDIA ConnectX-8 SuperNIC"
    (https://www.nvidia.com/en-us/networking/products/ethernet/supernic/)."""
    if nic_gbit not in (400, 800):
        raise ValueError("GB200 NVL72 NIC per GPU is 400 (ConnectX-7) or 800 (ConnectX-8) Gb/s")
    return Hardware(f"GB200 NVL72 ({nic_gbit}G NIC)", 72, 900 * GB, nic_gbit / 8 * GB, 8e12,
                    note=f"72 GPUs/NVLink domain, NVLink5 900 GB/s/dir/GPU, {nic_gbit} Gb/s NIC per GPU")


PRESETS = {"dgx_h100": dgx_h100, "gb200_nvl72": lambda: gb200_nvl72(400),
           "gb200_nvl72_800g": lambda: gb200_nvl72(800)}


def preset(name: str) -> Hardware:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; presets: {', '.join(sorted(PRESETS))}") from None


# ----------------------------------------------------------------------------------- traffic

@dataclass
class Traffic:
    """Bytes per rank per link class (NIC / NVLink, out / in), messages per rank, pack/unpack bytes."""
    nic_out: dict = None
    nic_in: dict = None
    nvl_out: dict = None
    nvl_in: dict = None
    msgs: dict = None
    packed: dict = None

    def __post_init__(self):
        for f in ("nic_out", "nic_in", "nvl_out", "nvl_in", "msgs", "packed"):
            if getattr(self, f) is None:
                setattr(self, f, defaultdict(int))

    def add(self, topo: Hardware, src: int, dst: int, nbytes: int, messages: int = 1, staged: bool = True) -> None:
        if topo.same_domain(src, dst):
            self.nvl_out[src] += nbytes
            self.nvl_in[dst] += nbytes
        else:
            self.nic_out[src] += nbytes
            self.nic_in[dst] += nbytes
        self.msgs[src] += messages
        if staged:      # an unstaged message (Message.unstaged) goes straight from / into the tensors
            self.packed[src] += nbytes
            self.packed[dst] += nbytes

    def link_time(self, topo: Hardware) -> float:
        """max over ranks of the busiest link (NIC and NVLink run concurrently)."""
        nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
        ranks = set(self.nic_out) | set(self.nic_in) | set(self.nvl_out) | set(self.nvl_in)
        return max((max(max(self.nic_out.get(r, 0), self.nic_in.get(r, 0)) / nic,
                        max(self.nvl_out.get(r, 0), self.nvl_in.get(r, 0)) / nvl) for r in ranks), default=0.0)

    def time(self, topo: Hardware) -> float:
        """Link time plus each rank's message latencies and pack/unpack copies (worst rank)."""
        nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
        ranks = set(self.nic_out) | set(self.nic_in) | set(self.nvl_out) | set(self.nvl_in)
        worst = 0.0
        for r in ranks:
            t = max(max(self.nic_out.get(r, 0), self.nic_in.get(r, 0)) / nic,
                    max(self.nvl_out.get(r, 0), self.nvl_in.get(r, 0)) / nvl)
            t += topo.msg_latency_s * self.msgs.get(r, 0) + 2 * self.packed.get(r, 0) / topo.hbm_bw
            worst = max(worst, t)
        return worst

    def summary(self) -> dict:
        def mx(d):
            return max(d.values(), default=0)
        return {"nic_bytes": sum(self.nic_out.values()), "nvlink_bytes": sum(self.nvl_out.values()),
                "max_nic_out": mx(self.nic_out), "max_nic_in": mx(self.nic_in),
                "max_nvlink_out": mx(self.nvl_out), "max_nvlink_in": mx(self.nvl_in),
                "max_messages_per_rank": mx(self.msgs)}


def _payload(m) -> int:
    return sum(c.nbytes for c in m.entries)


def _local_time(traffic: PlanTraffic, topo: Hardware) -> float:
    """The slowest rank's local copies (read + write at HBM speed)."""
    local: dict[int, int] = defaultdict(int)
    for (_, d), n in traffic.local_bytes.items():
        local[d] += n
    return max((2 * b / topo.hbm_bw for b in local.values()), default=0.0)


#: the executor's batched-path byte windows (``core.executor.common._CHUNK_MIN`` / ``_CHUNK_MAX``):
#: a message goes as CHUNK_MIN bytes, then windows doubling up to CHUNK_MAX
CHUNK_MIN = 1 << 20
CHUNK_MAX = 16 << 20


def edge_windows(n: int) -> tuple[int, int]:
    """(first, last) window sizes of an ``n``-byte message on the executor's batched path."""
    lo, size = 0, CHUNK_MIN
    while lo + size < n:
        lo += size
        size = min(2 * size, CHUNK_MAX)
    return min(n, CHUNK_MIN), n - lo


def paced(plan, topo: Hardware, pipelined: bool = True) -> float:
    """Predicted refit time with each rank at its own pace, as the executor runs: no barrier between
    rounds, a rank starts round k when its own round k-1 is done, and a message of round k starts
    when both its ranks have started round k (:func:`predict`'s sum of round maxima assumes every
    rank waits for the slowest of each round).  Per round, messages in order of their start; each
    (rank, link class, direction) is a queue: a message ends when both its sender's out-queue and its
    receiver's in-queue have carried its bytes; a rank's round ends at its last message's end, plus
    its message latencies and the round latency.  Packing and unpacking are pipelined with the
    wire as the executor's batched path does (each message in byte windows, window k+1 packed
    while window k travels, each received window unpacked as it lands): a rank's round lasts at
    least its pack/unpack copies, and the copies of the first window of each message it sends and of
    the last window of each it receives are not hidden (:data:`CHUNK_MIN` / :data:`CHUNK_MAX`, the
    executor's windows; ``pipelined=False``: every copy after the wire, the model before session 8).
    Local copies first.

    Example (DGX H100, no latencies): round 0 has 0 -> 8 (1 GB, 20 ms on the NIC) and 16 -> 24
    (0.1 GB, 2 ms), round 1 has 16 -> 24 (1 GB): round by round 40 ms, paced 22 ms (ranks 16 and 24
    do not wait for 0 -> 8)."""
    nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
    clock: dict[int, float] = defaultdict(float)
    for c in plan.local_copies:
        clock[c.dst] += 2 * c.nbytes / topo.hbm_bw
    by_round: dict[int, list] = defaultdict(list)
    for m in plan.messages:
        by_round[m.round].append(m)
    for k in sorted(by_round):
        starts = sorted((max(clock[m.src], clock[m.dst]), m.src, m.dst, _payload(m), not getattr(m, "unstaged", False))
                        for m in by_round[k])
        free: dict[tuple, float] = defaultdict(float)        # (rank, NVLink?, out?) -> queue free at
        end: dict[int, float] = {}
        posted: dict[int, int] = defaultdict(int)
        packed: dict[int, int] = defaultdict(int)
        exposed: dict[int, int] = defaultdict(int)     # window bytes whose copy the wire cannot hide
        for t0, s, d, n, staged in starts:
            link = topo.same_domain(s, d)
            dt = n / (nvl if link else nic)
            a = free[(s, link, True)] = max(free[(s, link, True)], t0) + dt
            b = free[(d, link, False)] = max(free[(d, link, False)], t0) + dt
            e = max(a, b)
            end[s] = max(end.get(s, clock[s]), e)
            end[d] = max(end.get(d, clock[d]), e)
            posted[s] += 1
            if staged:              # unstaged messages are neither packed nor unpacked
                packed[s] += n
                packed[d] += n
                first, last = edge_windows(n)
                exposed[s] += first
                exposed[d] += last
        for r, e in end.items():
            if pipelined:
                e = max(e, clock[r] + 2 * packed[r] / topo.hbm_bw) + 2 * exposed[r] / topo.hbm_bw
            else:
                e += 2 * packed[r] / topo.hbm_bw
            clock[r] = e + topo.msg_latency_s * posted[r] + topo.round_latency_s
    return max(clock.values(), default=0.0)


#: parts below which the loop beats importing numpy (~0.2 s CPU) and vectorising; the numbers are the same
PYTHON_PARTS = 200_000


def _numpy_pays(tr: PlanTraffic) -> bool:
    """Vectorise ``tr``: numpy is already imported, or the plan has more parts than :data:`PYTHON_PARTS`."""
    import sys
    return "numpy" in sys.modules or sum(len(g.src) * len(g.copies) for g in tr.groups) > PYTHON_PARTS


def predict(plan, topo: Hardware, *, traffic: PlanTraffic | None = None, with_paced: bool = True,
            vectorised: bool | None = None) -> dict:
    """Predicted refit time of ``plan`` executed as planned (direct point-to-point, round by round),
    from its traffic totals (:func:`~mcore_reshard.core.planner.plan_traffic`, or ``traffic`` when
    given: a templated plan's copies are never made); ``paced_s`` (``with_paced``): the same with
    each rank at its own pace (:func:`paced`, which walks the plan's messages and local copies).
    ``vectorised``: as :func:`round_times` (False: no numpy; None: numpy where it pays,
    :func:`_numpy_pays`; the same numbers either way)."""
    tr = plan_traffic(plan) if traffic is None else traffic
    if vectorised is None and not _numpy_pays(tr):
        vectorised = False
    parts = None if vectorised is False else parts_arrays(tr)
    times, posted = round_times(tr, topo, vectorised=vectorised, parts=parts)
    per_round = [t + topo.round_latency_s for t in times]
    local_s = _local_time(tr, topo)
    out = {"topology": topo.name, "seconds": local_s + sum(per_round)}
    if with_paced:
        out["paced_s"] = paced(plan, topo)
    totals = _totals(tr, topo, posted, parts)
    return {**out, "local_s": local_s, "rounds": len(per_round), "round_s": per_round,
            "link_bound_s": totals.link_time(topo), **totals.summary()}


#: (round, rank) cells :func:`round_times` sums at once (more rounds go in windows)
ROUND_CELLS = 1 << 22


class Parts(NamedTuple):
    """A plan's message parts as numpy arrays (:func:`parts_arrays`): per part its round, sender,
    receiver, bytes on the wire and unstaged flag."""
    rounds: Any
    src: Any
    dst: Any
    payload: Any
    unstaged: Any


def parts_arrays(tr: PlanTraffic) -> Parts | None:
    """``tr``'s parts as numpy arrays, group by group (the instances of one template side by side:
    rank lookups and rounds as 2-D arrays; nothing per part in Python); None without numpy."""
    try:
        import numpy as np
    except ImportError:
        return None
    cols: list[list] = [[], [], [], [], []]
    for g in tr.groups:
        if not g.copies:
            continue
        src, dst = np.asarray(g.src, dtype=np.int64), np.asarray(g.dst, dtype=np.int64)
        pay, unstaged = np.asarray(g.payload, dtype=np.int64), np.asarray(g.unstaged, dtype=bool)
        by_len: dict[int, list] = defaultdict(list)
        for ranks, rounds in g.copies:
            by_len[len(ranks)].append((ranks, rounds))
        for copies in by_len.values():
            ranks = np.array([r for r, _ in copies], dtype=np.int64).reshape(len(copies), -1)
            rounds = np.array([k for _, k in copies], dtype=np.int64).reshape(len(copies), len(src))
            cols[0].append(rounds.ravel())
            cols[1].append(ranks[:, src].ravel())
            cols[2].append(ranks[:, dst].ravel())
            cols[3].append(np.tile(pay, len(copies)))
            cols[4].append(np.tile(unstaged, len(copies)))
    types = (np.int64, np.int64, np.int64, np.int64, bool)
    return Parts(*(np.concatenate(c) if c else np.zeros(0, dtype=t) for c, t in zip(cols, types)))


def _summed(np, index, weights, mask, cells: int):
    """Per cell, the sum of ``weights`` of the masked entries at ``index`` (int64, exact: float
    weights only where every partial sum is an exact float64)."""
    if not mask.any():
        return np.zeros(cells, dtype=np.int64)
    if int(weights[mask].sum()) < 1 << 53:
        return np.bincount(index[mask], weights=weights[mask], minlength=cells).astype(np.int64)
    acc = np.zeros(cells, dtype=np.int64)
    np.add.at(acc, index[mask], weights[mask])
    return acc


def round_times(tr: PlanTraffic, topo: Hardware, *, vectorised: bool | None = None,
                parts: Parts | None = None) -> tuple[list[float], dict]:
    """Per round with messages, in round order, :meth:`Traffic.time` of its messages (no round
    latency), and the messages each rank posts in all; from the per-(round, rank) totals of the
    parts (integers: exact in any order).  Vectorised with numpy (:func:`parts_arrays`; the same
    floats, operation for operation) where it pays (:func:`_numpy_pays`) or ``vectorised=True``;
    else (or without numpy) a loop over the parts."""
    if vectorised is None and parts is None and not _numpy_pays(tr):
        vectorised = False
    if vectorised is not False and parts is None:
        parts = parts_arrays(tr)
    if vectorised is False or parts is None:
        return _round_times_python(tr, topo)
    return _round_times_numpy(tr, topo, parts)


@paused_gc()
def _round_times_python(tr: PlanTraffic, topo: Hardware) -> tuple[list[float], dict]:
    """What :meth:`Traffic.add` of every part into its round's :class:`Traffic`, then
    :meth:`Traffic.time`, give, in one loop over the parts: per round a row of per-rank integer
    totals (the same sums), then per touched rank the same float expression."""
    span, merged = tr.span, tr.merged
    dom = [topo.domain(r) for r in range(span)]
    rows: dict[int, list] = {}           # round -> [nic out, nic in, NVLink out, NVLink in, messages, packed, touched]
    seen: set = set()
    for g in tr.groups:
        cols = list(zip(g.src, g.dst, g.payload, g.unstaged))
        for ranks, ks in g.copies:
            for k, (si, di, n, unstaged) in zip(ks, cols):
                s, d = ranks[si], ranks[di]
                row = rows.get(k)
                if row is None:
                    row = rows[k] = [[0] * span for _ in range(6)] + [set()]
                link = 2 if dom[s] == dom[d] else 0
                row[link][s] += n
                row[link + 1][d] += n
                row[6].add(s)
                row[6].add(d)
                if not merged:
                    row[4][s] += 1
                elif (k, s, d) not in seen:         # the first part of a message counts it
                    seen.add((k, s, d))
                    row[4][s] += 1
                if not unstaged:
                    row[5][s] += n
                    row[5][d] += n
    nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
    lat, hbm = topo.msg_latency_s, topo.hbm_bw
    times: list[float] = []
    posted: dict[int, int] = defaultdict(int)
    for k in sorted(rows):
        no, ni, vo, vi, msgs, packed, touched = rows[k]
        worst = 0.0
        for r in touched:
            t = max(max(no[r], ni[r]) / nic, max(vo[r], vi[r]) / nvl)
            t += lat * msgs[r] + 2 * packed[r] / hbm
            worst = max(worst, t)
            if msgs[r]:
                posted[r] += msgs[r]
        times.append(worst)
    return times, dict(posted)


def _round_times_numpy(tr: PlanTraffic, topo: Hardware, parts: Parts) -> tuple[list[float], dict]:
    import numpy as np
    k, s, d, n, unstaged = parts.rounds, parts.src, parts.dst, parts.payload, parts.unstaged
    span = tr.span
    if not len(k):
        return [], {}
    seen = np.bincount(k) > 0
    present = np.flatnonzero(seen)                       # the rounds with messages, in order
    ridx = (np.cumsum(seen) - 1)[k]                      # each part's position among them
    dom = np.array([topo.domain(r) for r in range(span)])
    nvlink = dom[s] == dom[d]
    nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
    lat, hbm = topo.msg_latency_s, topo.hbm_bw
    step = max(1, ROUND_CELLS // span)
    out: list[float] = []
    posted_by_rank = np.zeros(span, dtype=np.int64)
    for first in range(0, len(present), step):
        rows = min(step, len(present) - first)
        cells = rows * span
        inside = np.ones(len(k), dtype=bool) if rows == len(present) else (ridx >= first) & (ridx < first + rows)
        cs, cd = (ridx - first) * span + s, (ridx - first) * span + d       # cell of the sender / receiver
        over, under = inside & nvlink, inside & ~nvlink
        vo, vi = _summed(np, cs, n, over, cells), _summed(np, cd, n, over, cells)
        no, ni = _summed(np, cs, n, under, cells), _summed(np, cd, n, under, cells)
        packed = (no + ni + vo + vi - _summed(np, cs, n, inside & unstaged, cells)
                  - _summed(np, cd, n, inside & unstaged, cells))
        if tr.merged:       # one message per (round, sender, receiver)
            keys = np.sort(cs[inside] * span + d[inside])
            first_of = np.ones(len(keys), dtype=bool)
            first_of[1:] = keys[1:] != keys[:-1]
            messages = keys[first_of] // span
        else:
            messages = cs[inside]
        posted = np.bincount(messages, minlength=cells)
        posted_by_rank += posted.reshape(rows, span).sum(axis=0)
        t = np.maximum(np.maximum(no, ni) / nic, np.maximum(vo, vi) / nvl) + (lat * posted + 2 * packed / hbm)
        out += t.reshape(rows, span).max(axis=1).tolist()
    return out, {r: int(c) for r, c in enumerate(posted_by_rank.tolist()) if c}


def _totals(tr: PlanTraffic, topo: Hardware, posted: dict | None = None, parts: Parts | None = None) -> Traffic:
    """All rounds merged: bytes per rank and link class (from ``parts``, else
    :meth:`PlanTraffic.pair_bytes`), messages each rank posts (``posted``: rank -> messages, from
    :func:`round_times`), no pack / unpack."""
    t = Traffic()
    if parts is None:
        for (s, d), n in tr.pair_bytes().items():
            t.add(topo, s, d, n, messages=0, staged=False)
    elif len(parts.src):
        import numpy as np
        dom = np.array([topo.domain(r) for r in range(tr.span)])
        nvlink = dom[parts.src] == dom[parts.dst]
        for mask, out, into in ((nvlink, t.nvl_out, t.nvl_in), (~nvlink, t.nic_out, t.nic_in)):
            for totals, index in ((out, parts.src), (into, parts.dst)):
                sums = _summed(np, index, parts.payload, mask, tr.span).tolist()
                for r in np.flatnonzero(np.bincount(index[mask], minlength=tr.span)).tolist():
                    totals[r] = sums[r]
    for r, count in (posted or {}).items():
        t.msgs[r] += count
    return t


def link_bound(plan, topo: Hardware, *, traffic: PlanTraffic | None = None) -> float:
    """Floor for the same placement: every rank's total bytes per link class / bandwidth, no
    rounds, no latency, no pack/unpack (from the per-rank totals, ``traffic`` when given)."""
    tr = plan_traffic(plan) if traffic is None else traffic
    return _totals(tr, topo, None, parts_arrays(tr)).link_time(topo)


def hierarchical(plan, topo: Hardware) -> dict:
    """Hardware exploitation, modelled on the plan: every box that several receivers of one NVLink
    domain need from outside the domain crosses the network once, to the receiver with the least
    NIC traffic so far, which forwards it to the others over NVLink.  Returns the predicted time
    (link time of the new traffic + latencies of the distinct (sender, receiver) pairs + the plan's
    round overheads + local copies), its link bound and how many network bytes it saves."""
    direct = Traffic()
    pairs: set[tuple[int, int]] = set()
    by_tensor: dict[str, list] = defaultdict(list)   # cross-domain copies, grouped tensor by tensor
    for m in plan.messages:
        for c in m.entries:
            if topo.same_domain(c.src, c.dst):
                direct.add(topo, c.src, c.dst, c.nbytes, messages=0)
                pairs.add((c.src, c.dst))
            else:
                by_tensor[c.tensor].append(c)
    saved = 0
    # one tensor at a time (bounded memory on plans with millions of copies), largest boxes first
    for tensor in sorted(by_tensor):
        groups: dict[tuple, list] = defaultdict(list)    # (dst domain, box) -> copies from outside
        for c in by_tensor.pop(tensor):
            groups[(topo.domain(c.dst), c.box)].append(c)
        for key in sorted(groups, key=lambda k: (-groups[k][0].nbytes, k)):
            copies = groups[key]
            leader = min(copies, key=lambda c: (direct.nic_in.get(c.dst, 0), c.dst))
            direct.add(topo, leader.src, leader.dst, leader.nbytes, messages=0)
            pairs.add((leader.src, leader.dst))
            for c in copies:
                if c is leader:
                    continue
                saved += c.nbytes
                if c.dst != leader.dst:     # (the same box twice on one rank: a local copy there)
                    direct.add(topo, leader.dst, c.dst, c.nbytes, messages=0)
                    pairs.add((leader.dst, c.dst))
    for s, _ in pairs:
        direct.msgs[s] += 1
    rounds = max(plan.rounds, 1)
    local = PlanTraffic(local_bytes=defaultdict(int))      # (the messages were walked above)
    for c in plan.local_copies:
        local.local_bytes[(c.src, c.dst)] += c.nbytes
    return {"seconds": _local_time(local, topo) + direct.time(topo) + rounds * topo.round_latency_s,
            "link_bound_s": direct.link_time(topo), "nic_bytes_saved": saved, **direct.summary()}


def gather_broadcast_time(tensors: Iterable[Mapping], topo: Hardware) -> dict:
    """Modelled time of the gather + broadcast baseline, one tensor after another (as Megatron-Bridge
    style exports run): per tensor, the holders send their shards to the root concurrently
    (busiest link of the gather), then the root broadcasts the full tensor to every receiver as a
    pipelined ring (``nbytes / bandwidth`` of the slowest link in the ring, NIC as soon as the
    receivers span more than one domain), plus one message latency per step.

    ``tensors``: dicts with ``nbytes``, ``root``, ``gather`` ({holder rank: bytes sent to root})
    and ``receivers`` (ranks other than the root), as :func:`mcore_reshard.tools.bench.baselines.gather_broadcast`
    returns them."""
    nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
    total = gather_s = bcast_s = 0.0
    for t in tensors:
        g = 0.0
        into_root_nic = into_root_nvl = 0
        for holder, n in t["gather"].items():
            if topo.same_domain(holder, t["root"]):
                into_root_nvl += n
                g = max(g, n / nvl)
            else:
                into_root_nic += n
                g = max(g, n / nic)
        g = max(g, into_root_nic / nic, into_root_nvl / nvl)
        if t["gather"]:
            g += topo.msg_latency_s
        recv = t["receivers"]
        b = 0.0
        if recv:
            cross = any(not topo.same_domain(r, t["root"]) for r in recv)
            b = t["nbytes"] / (nic if cross else nvl) + topo.msg_latency_s
        gather_s += g
        bcast_s += b
        total += g + b
    return {"seconds": total, "gather_s": gather_s, "broadcast_s": bcast_s}


__all__ = ["GB", "PRESETS", "Hardware", "Traffic", "dgx_h100", "gather_broadcast_time", "gb200_nvl72",
           "hierarchical", "link_bound", "paced", "predict", "preset"]
