"""Functions run inside spawned gloo processes by tests/core/executor/test_windowed.py: ranks 0-1 send
(``tp=2``), ranks 2-3 receive (``tp=1,dp=2``) through a windowed plan; every case in one launch."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_reshard.core.executor import ReshardError, WindowedResharder
from mcore_reshard.core.executor import handshake as hs
from mcore_reshard.core.planner import make_windowed_plan
from mcore_reshard.integrations.protocol import join_refit, rank_part
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import materialize, reference_tensor

WINDOW, BUDGET = 4096, 2048


class Arena:
    """A receiver's window memory: every window's tensors are views of one storage, freed between
    refits (``resize_(0)``) and given memory again before the next (a new address)."""

    def __init__(self, like: dict, rank: int):
        self.like, self.rank = like, rank
        self.storage = None
        self.views: list[dict] = []

    def tensors(self, windows) -> list[dict]:
        size = max([sum(self.like[n].numel() * self.like[n].element_size() for n in w.buffers.get(self.rank, ()))
                    for w in windows] + [0])
        self.storage = torch.empty(size, dtype=torch.uint8)
        self.views = []
        for w in windows:
            off, views = 0, {}
            for n in w.buffers.get(self.rank, ()):
                t = self.like[n]
                nb = t.numel() * t.element_size()
                views[n] = self.storage[off:off + nb].view(t.dtype).view(t.shape)
                off += nb
            self.views.append(views)
        return self.views

    def begin(self) -> None:
        self.storage.untyped_storage().resize_(self.storage.numel())

    def free(self) -> None:
        self.storage.untyped_storage().resize_(0)


def _count_exchanges(fn):
    """Run ``fn()`` counting this rank's control exchanges (all-gathers of control messages)."""
    n = [0]
    real = hs.exchange

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)
    hs.exchange = counted
    import mcore_reshard.core.executor.transfer as tr
    import mcore_reshard.core.executor.windowed as wd
    saved = (tr.exchange, wd.exchange)
    tr.exchange, wd.exchange = counted, counted
    try:
        out = fn()
    finally:
        hs.exchange = real
        tr.exchange, wd.exchange = saved
    return out, n[0]


def cases(rank: int, world: int) -> dict:
    src, dst = build_layouts("tp=2", "tp=1,dp=2", False)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    mine_src = rank_part(src, rank) if rank < 2 else None
    mine_dst = rank_part(dst, rank) if rank in dst.buffers else None
    S = materialize(src, rank, full)
    want = materialize(dst, rank, full)
    out: dict = {}
    receiver = rank in dst.buffers

    # 1. streamed through an arena freed between refits: bit-exact after each window's work, the
    #    arena's memory 0 between refits, one control exchange per window + 1 per refit
    D = materialize(dst, rank, full, fill=float("nan"))
    arena = Arena(D, rank)
    r = join_refit(None, src=mine_src, src_tensors=S if rank < 2 else {},
                   dst=mine_dst, dst_tensors=arena.tensors if receiver else {},
                   budget_bytes=BUDGET, window_bytes=WINDOW if receiver else None)
    arena.free() if receiver else None
    res = {"windows": len(r.windows), "staging": r.staging_bytes, "budget": r.plan.budget_bytes, "refits": []}
    for step in (1, 2):
        if receiver:
            arena.begin()
            for n in D:
                D[n].fill_(float("nan"))
        landed = []

        def after(i):
            for n, t in arena.views[i].items():
                D[n].copy_(t)
            landed.append(i)
        stats, exchanges = _count_exchanges(lambda: r.refit(step, after_window=after if receiver else None))
        held = arena.storage.untyped_storage().nbytes() if receiver else 0
        if receiver:
            arena.free()
        res["refits"].append({"version": stats["version"], "exchanges": exchanges, "landed": len(landed),
                              "bad": sorted(n for n in D if not torch.equal(D[n], want[n])) if receiver else [],
                              "held_during": held,
                              "held_after": arena.storage.untyped_storage().nbytes() if receiver else 0})
    res["state"] = r.state()["version"]
    out["stream"] = res

    # 2. the receiver's work fails after window 1 on rank 3: every rank raises (at window 2's start),
    #    nothing of window 2 moves, the state says which buffers hold which version
    arena.begin() if receiver else None

    def fail(i):
        if rank == 3 and i == 1:
            raise RuntimeError("processing failed")
    try:
        r.refit(3, after_window=fail)
        out["work_fails"] = {"error": None}
    except ReshardError as e:
        st = r.state()
        out["work_fails"] = {"error": str(e), "version": st["version"],
                             "window2_untouched": set(r.windows[2].state()["buffers"].values()) <= {2},
                             "window1_landed": set(r.windows[1].state()["buffers"].values()) <= {3}}

    # 3. the receiver's work fails after the LAST window on rank 2: every rank raises in the final exchange
    def fail_last(i):
        if rank == 2 and i == len(r.windows) - 1:
            raise RuntimeError("last processing failed")
    try:
        r.refit(4, after_window=fail_last)
        out["last_fails"] = {"error": None}
    except ReshardError as e:
        out["last_fails"] = {"error": str(e)}

    # 4. a refusal on rank 2: refused at the first window's start, before any byte moves
    try:
        r.refit(5, refusal=["a parameter was replaced"] if rank == 2 else None)
        out["refused"] = {"error": None}
    except ReshardError as e:
        out["refused"] = {"error": str(e)}
    arena.free() if receiver else None

    # 5. the receivers ask for different windows: every rank refuses before anything is planned
    try:
        join_refit(None, src=mine_src, src_tensors=S if rank < 2 else {},
                   dst=mine_dst, dst_tensors=want if receiver else {}, budget_bytes=BUDGET,
                   window_bytes={2: 4096, 3: 8192}.get(rank))
        out["mismatch"] = {"error": None}
    except ReshardError as e:
        out["mismatch"] = {"error": str(e)}

    # 6. windowed plans of different windows bound by hand: the first exchange (the whole plan's hash) refuses
    wp = make_windowed_plan(src, dst, window_bytes=4096 if rank != 0 else 8192, budget_bytes=BUDGET)
    try:
        WindowedResharder(wp, S if rank < 2 else {}, materialize(dst, rank, full) if receiver else {}, timeout=60)
        out["hash"] = {"error": None}
    except ReshardError as e:
        out["hash"] = {"error": str(e)}
    dist.barrier()
    return out
