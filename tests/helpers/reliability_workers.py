"""Functions run inside spawned gloo processes by the reliability tests (must be importable).

Every function returns JSON-able facts; the tests assert on them.  Failures are injected from the
outside only: a wrapped ``torch.distributed.batch_isend_irecv`` (kill, stall, raise or corrupt a
received staging buffer at a given round); the library carries no test hooks.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import time

import torch
import torch.distributed as dist

from mcore_reshard.core.executor import Resharder, ReshardError, TransferError, all_gather_json, digest_of
from mcore_reshard.core.planner import make_plan
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import materialize, reference_tensor

# ---------------------------------------------------------------------------------------- helpers


def _full(layout, step: int = 0):
    return {n: reference_tensor(n, m.shape, step=step) for n, m in layout.tensors.items()}


def _exact(layout, rank: int, full, D) -> list[str]:
    want = materialize(layout, rank, full)
    return [n for n in D if not torch.equal(want[n], D[n])]


def _setup(rank: int, specs=("tp=2", "tp=1", False), budget: int = 2048, step: int = 0):
    src, dst = build_layouts(*specs)
    # copy-by-copy plan: the failure tests name the round at which a peer stalls or dies, which
    # assumes its round structure (a templated plan orders a rank's rounds by layer instance)
    plan = make_plan(src, dst, budget_bytes=budget, templates=False)
    full = _full(src, step)
    S = materialize(src, rank, full)
    D = materialize(dst, rank, full, fill=float("nan"))
    return src, dst, plan, S, D


def _load_step(src, rank: int, S, step: int):
    full = _full(src, step)
    fresh = materialize(src, rank, full)
    for n, t in S.items():
        t.copy_(fresh[n])
    return full


@contextlib.contextmanager
def patched_p2p(hook):
    """Wrap ``dist.batch_isend_irecv``: ``hook(call_index, ops, post)`` decides what happens
    (``post(ops)`` posts for real and returns the works)."""
    orig = dist.batch_isend_irecv
    calls = [0]

    def wrapper(ops):
        calls[0] += 1
        return hook(calls[0], ops, orig)

    dist.batch_isend_irecv = wrapper
    try:
        yield calls
    finally:
        dist.batch_isend_irecv = orig


class _CorruptingWork:
    """A work whose wait() flips one byte of a receive buffer once the bytes have landed."""

    def __init__(self, work, buf):
        self.work, self.buf = work, buf

    def wait(self, *args):
        out = self.work.wait(*args)
        if self.buf is not None and self.buf.numel():
            self.buf[0] ^= 0x5A
        return out

    def is_completed(self):
        return self.work.is_completed()


# ---------------------------------------------------------------------------- validation (world 2)


def validation_refusals(rank: int, world: int) -> list:
    """Every case must make every rank raise ReshardError before a byte moves: [(case, type,
    message, dst untouched, src untouched)]; then a clean reshard on the same group works."""
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = _full(src)
    good = make_plan(src, dst)
    out = []

    def attempt(case, plan, S, D, **kw):
        before_d = {n: t.clone() for n, t in D.items()}
        before_s = digest_of(S)
        try:
            Resharder(plan, S, D, **kw).refit()
            out.append([case, "no error", "", True, True])
        except ReshardError as e:
            out.append([case, type(e).__name__, str(e),
                        all(torch.equal(before_d[n], D[n]) for n in D), digest_of(S) == before_s])
        dist.barrier()

    def fresh():
        return materialize(src, rank, full), materialize(dst, rank, full, fill=7.0)

    # plan hashes differ (rank 1 planned with another staging budget)
    S, D = fresh()
    attempt("hash", make_plan(src, dst, budget_bytes=4096) if rank == 1 else good, S, D)
    # destination tensor of the wrong shape on one rank
    S, D = fresh()
    if rank == 0:
        D["model.norm.weight"] = torch.zeros(3)
    attempt("dst shape", good, S, D)
    # destination dtype differs from the plan's (no cast planned)
    S = materialize(src, rank, full)
    attempt("dst dtype", good, S, materialize(dst, rank, full, fill=7.0, dtype=torch.bfloat16))
    # source dtype differs on one rank
    S, D = fresh()
    if rank == 1:
        S = {n: t.to(torch.bfloat16) for n, t in S.items()}
    attempt("src dtype", good, S, D)
    # a destination tensor missing on one rank
    S, D = fresh()
    if rank == 1:
        del D["model.norm.weight"]
    attempt("dst missing", good, S, D)
    # a source tensor missing on one rank
    S, D = fresh()
    if rank == 0:
        del S["lm_head.weight"]
    attempt("src missing", good, S, D)
    # an extra destination tensor the plan never writes
    S, D = fresh()
    if rank == 0:
        D["extra.weight"] = torch.zeros(4)
    attempt("dst extra", good, S, D)
    # plan built for 4 ranks (disaggregated) run on a group of 2
    s4, d4 = build_layouts("tp=2", "tp=1,dp=2", False)
    p4 = make_plan(s4, d4)
    attempt("ranks outside group", p4, materialize(s4, rank, _full(s4)), materialize(d4, rank, _full(s4)))
    # the destination aliases the source (would overwrite the training weights)
    S, D = fresh()
    if rank == 0:
        D["odd.weight"] = S["odd.weight"]
    attempt("dst aliases src", good, S, D)
    # non-contiguous destination
    S, D = fresh()
    if rank == 1:
        t = torch.zeros(tuple(reversed(D["model.norm.weight"].shape)) + (2,))[..., 0]
        D["model.norm.weight"] = t
    attempt("dst non-contiguous", good, S, D)
    # tampered plan (same on every rank): two pieces claiming the same destination region
    dup = make_plan(src, dst)
    dup.local_copies.append(dup.local_copies[0])
    S, D = fresh()
    attempt("double write", dup, S, D)
    # tampered plan: a destination region nothing writes
    hole = make_plan(src, dst)
    hole.local_copies.pop(0)
    S, D = fresh()
    attempt("hole", hole, S, D)
    # verify on one rank only (message sizes would differ)
    S, D = fresh()
    attempt("options differ", good, S, D, verify=(rank == 0))
    # after all refusals the group is healthy: a clean reshard works
    S, D = fresh()
    r = Resharder(good, S, D, timeout=30)
    r.refit()
    out.append(["clean", "ok", "", not _exact(dst, rank, full, D), True])
    return out


# ------------------------------------------------------------------- dead / stalled peers (world 3)


def _stamp(path: str, what: str) -> None:
    with open(path, "w") as f:
        f.write(f"{what} {time.time()!r}")


def peer_failure(rank: int, world: int, mode: str, victim: int, at_call: int, timeout: float, stamp: str) -> dict:
    """Disaggregated tp=2 (ranks 0-1) -> tp=1 (rank 2), 2 KiB budget (dozens of rounds).  One refit
    succeeds, then ``victim`` dies (``os._exit``) or stalls for 3 x timeout at its ``at_call``-th
    round of the next refit (``at_call=1``, mode "die": dies between refits, before posting
    anything).  Every other rank must raise TransferError; reports when and what."""
    src, dst, plan, S, D = _setup(rank)
    r = Resharder(plan, S, D, timeout=timeout)
    first = r.refit()
    ok_first = not _exact(dst, rank, _full(src), D)
    full = _load_step(src, rank, S, 1)
    src_before = digest_of(S)

    def hook(call, ops, post):
        if rank == victim and call == at_call:
            if mode == "die":
                _stamp(stamp, "died")
                os._exit(17)
            _stamp(stamp, "stalled")
            time.sleep(3 * timeout)
        return post(ops)

    info = {"rank": rank, "first_ok": ok_first, "first_version": first["version"], "rounds": len(r.rounds)}
    dist.barrier()
    t0 = time.time()
    with patched_p2p(hook):
        try:
            r.refit()
            info.update(error=None, type=None)
        except ReshardError as e:
            info.update(error=str(e), type=type(e).__name__, round=getattr(e, "round", None),
                        peers=getattr(e, "peers", None))
    info["raised_at"] = time.time()
    info["refit_started_at"] = t0
    info["state"] = r.state()
    info["src_untouched"] = digest_of(S) == src_before
    info["exact_buffers"] = [n for n in D if n not in _exact(dst, rank, full, D)]
    return info


# --------------------------------------------------- interrupted refit, retry, verify (world 3)


def interrupt_and_retry(rank: int, world: int, timeout: float) -> dict:
    """1. refit 1 completes.  2. refit 2: rank 2 (the destination) raises half-way, before a round;
    every rank must raise, rank 2's state must show the interrupted refit and which buffers hold
    which version.  3. rebind to a fresh group and refit again: bit-exact, state clean.
    4. verify=True: a clean refit passes; one corrupted staging byte on rank 2 makes every rank
    raise, naming the tensor on rank 2; the retry on the same group repairs it."""
    src, dst, plan, S, D = _setup(rank)
    g1 = dist.new_group(list(range(world)))
    r = Resharder(plan, S, D, g1, timeout=timeout)
    out: dict = {"rank": rank, "rounds": len(r.rounds)}
    r.refit()
    out["v1_exact"] = not _exact(dst, rank, _full(src), D)
    out["v1_state"] = r.state()
    full2 = _load_step(src, rank, S, 2)
    src_digest = digest_of(S)

    fail_at = max(2, len(r.rounds) // 2) if rank == 2 else -1   # half-way through rank 2's rounds
    out["fail_at"] = fail_at

    def fail(call, ops, post):
        if call == fail_at:
            raise RuntimeError(f"injected failure before round {call}")
        return post(ops)

    t0 = time.monotonic()
    with patched_p2p(fail):
        try:
            r.refit()
            out["interrupted_error"] = None
        except TransferError as e:
            out["interrupted_error"] = str(e)
            out["interrupted_round"] = e.round
    out["interrupt_seconds"] = time.monotonic() - t0
    out["interrupted_state"] = r.state()
    # same group, no rebind: retry must refuse cleanly (the group is broken) or succeed
    try:
        r.refit()
        out["same_group_retry"] = "ok"
    except ReshardError as e:
        out["same_group_retry"] = str(e)
    out["after_failed_retry_state"] = r.state()
    g2 = dist.new_group(list(range(world)))
    r.rebind(g2)
    res = r.refit()
    out["retry_version"] = res["version"]
    out["retry_exact"] = not _exact(dst, rank, full2, D)
    out["retry_state"] = r.state()
    out["src_untouched"] = digest_of(S) == src_digest

    # verify mode on the healthy group
    full3 = _load_step(src, rank, S, 3)
    rv = Resharder(plan, S, D, g2, timeout=timeout, verify=True)
    rv.refit(version=3)
    out["verify_clean_exact"] = not _exact(dst, rank, full3, D)
    full4 = _load_step(src, rank, S, 4)

    def corrupt(call, ops, post):
        works = post(ops)
        if rank == 2 and call == 3:
            # flip a byte of the first receive buffer when ITS work is waited for (the overlapped
            # gloo path unpacks each receive as soon as its own work completes)
            first = next(k for k, op in enumerate(ops) if op.op is dist.irecv)
            assert len(works) == len(ops)
            return [_CorruptingWork(w, ops[first].tensor if k == first else None) for k, w in enumerate(works)]
        return works

    with patched_p2p(corrupt):
        try:
            rv.refit(version=4)
            out["corrupt_error"] = None
        except TransferError as e:
            out["corrupt_error"] = str(e)
    out["corrupt_state"] = rv.state()
    rv.refit(version=4)   # retry on the same (healthy) group: handshake, then every buffer again
    out["verify_retry_exact"] = not _exact(dst, rank, full4, D)
    out["verify_retry_state"] = rv.state()
    return out


# ---------------------------------------------------------------------------------------- no pickle


@contextlib.contextmanager
def no_pickle():
    """Make every pickle entry point (and torch.save/load, and torch.distributed's object
    collectives' pickler) record the call and raise."""
    import torch.distributed.distributed_c10d as c10d
    calls: list[str] = []

    def trap(name):
        def f(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called while pickle is forbidden")
        return f

    targets = [(pickle, "dumps"), (pickle, "loads"), (pickle, "dump"), (pickle, "load"), (pickle, "Pickler"),
               (pickle, "Unpickler"), (c10d, "_pickler"), (c10d, "_unpickler"), (torch, "save"), (torch, "load")]
    saved = [(m, n, getattr(m, n)) for m, n in targets if hasattr(m, n)]
    for m, n, _ in saved:
        setattr(m, n, trap(f"{getattr(m, '__name__', m)}.{n}"))
    try:
        yield calls
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def json_only(rank: int, world: int) -> dict:
    """Resharder construction, refit and all_gather_json with pickle forbidden."""
    src, dst, plan, S, D = _setup(rank, ("tp=2", "tp=1,dp=2", True), budget=4096)
    with no_pickle() as calls:
        r = Resharder(plan, S, D, timeout=30, verify=True)
        r.refit()
        got = all_gather_json({"rank": rank, "plan": plan.hash[:8]})
    return {"pickle_calls": calls, "exact": not _exact(dst, rank, _full(src), D), "gathered": got}
