"""Workers of tests/core/executor/test_executor_pipeline.py (run inside spawned gloo processes; importable).

They shrink the executor's chunk constants (``_CHUNK_MIN`` / ``_CHUNK_MAX``: the batched path's
windows) and ``_DIRECT_MIN`` so that the small synthetic model's messages are chunked into many
groups and take every kind of part, and record what the executor posts from the outside only
(wrapped ``batch_isend_irecv`` / ``isend`` and the copy calls)."""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

import mcore_reshard.core.executor.common as ex_common
import mcore_reshard.core.executor.rounds as rounds_mod
import mcore_reshard.core.executor.transfer as transfer_mod
from mcore_reshard.core.executor import Resharder, ReshardError
from mcore_reshard.core.planner import make_plan
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import materialize, reference_tensor

CHUNK_MIN, CHUNK_MAX, DIRECT_MIN = 64, 2048, 64


def shrink() -> None:
    ex_common._CHUNK_MIN, ex_common._CHUNK_MAX, ex_common._DIRECT_MIN = CHUNK_MIN, CHUNK_MAX, DIRECT_MIN


@contextlib.contextmanager
def recording(log: list):
    """Log ("post", [op kinds]) per batch_isend_irecv, ("isend",) per lone isend, ("local", n) per
    slice of local copies, ("copy", n) per pack / unpack copy call (n: tensors in it).  The round
    code sees a stand-in for ``torch.distributed`` (P2POp needs the real isend, so it is mapped back)."""
    saved = (rounds_mod.dist, transfer_mod.copy_all, rounds_mod.copy_all)

    def isend(*a, **k):
        log.append(("isend",))
        return dist.isend(*a, **k)

    class Dist:
        def __getattr__(self, name):
            return getattr(dist, name)

        def batch_isend_irecv(self, ops):
            log.append(("post", ["send" if op.op is dist.isend else "recv" for op in ops]))
            return dist.batch_isend_irecv(ops)

        def P2POp(self, op, *a, **k):
            return dist.P2POp(dist.isend if op is isend else op, *a, **k)

    Dist.isend = staticmethod(isend)

    def local(d, s):
        log.append(("local", len(d)))
        return saved[1](d, s)

    def copy(d, s):
        log.append(("copy", len(d)))
        return saved[2](d, s)

    rounds_mod.dist, transfer_mod.copy_all, rounds_mod.copy_all = Dist(), local, copy
    try:
        yield log
    finally:
        rounds_mod.dist, transfer_mod.copy_all, rounds_mod.copy_all = saved


def _messages(plan, rank):
    """[(plan round, [(peer, is_send, wire bytes, entry sizes in offset order)])] of ``rank``."""
    out: dict[int, list] = {}
    for m in plan.messages:
        for is_send, peer in ((True, m.dst), (False, m.src)):
            if (m.src if is_send else m.dst) == rank:
                out.setdefault(m.round, []).append(
                    (peer, is_send, m.nbytes, [c.nbytes for c in sorted(m.entries, key=lambda c: c.offset)]))
    return sorted(out.items())


def pipeline_paths(rank: int, world: int, cases: list) -> list:
    """Each case (src, dst, colocated, budget, shrink?): refit twice per path (overlapped,
    batched, each with and without verify): bit-exact against the reference, storage and staging
    unchanged, state version 2; what was posted and copied during the second refit."""
    out = []
    for src_spec, dst_spec, colocated, budget, small in cases:
        if small:
            shrink()
        src, dst = build_layouts(src_spec, dst_spec, colocated)
        plan = make_plan(src, dst, budget_bytes=budget)
        res = {"messages": _messages(plan, rank), "local_copies": sum(1 for c in plan.local_copies if c.dst == rank),
               "entries": sum(len(m.entries) for m in plan.messages if rank in (m.src, m.dst)), "paths": {}}
        for name, kw in (("overlapped", {}), ("batched", {"overlap": False}), ("overlapped_verify", {"verify": True}),
                         ("batched_verify", {"overlap": False, "verify": True})):
            ref = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
            S = materialize(src, rank, ref)
            D = materialize(dst, rank, ref, fill=float("nan"))
            ptrs = {n: t.data_ptr() for n, t in D.items()}
            r = Resharder(plan, S, D, timeout=60, **kw)
            staging_ptr = r.staging.data_ptr() if r.staging.numel() else None
            bad, log = 0, []
            for step in (1, 2):
                full = {n: reference_tensor(n, m.shape, step=step) for n, m in src.tensors.items()}
                fresh = materialize(src, rank, full)
                for n, t in S.items():
                    t.copy_(fresh[n])
                log.clear()
                with recording(log) if step == 2 else contextlib.nullcontext():
                    r.refit()
                want = materialize(dst, rank, full)
                bad += sum(0 if torch.equal(want[n], D[n]) else 1 for n in D)
            st = r.state()
            res["paths"][name] = {
                "overlapped": r.overlapped(), "mismatched": bad, "staging": r.staging_bytes,
                "same_storage": all(D[n].data_ptr() == p for n, p in ptrs.items()),
                "same_staging": staging_ptr is None or r.staging.data_ptr() == staging_ptr,
                "state_version": st["version"], "buffers": sorted(set(st["buffers"].values()), key=str),
                "incomplete": st["incomplete"], "log": log}
            dist.barrier()
        ex_common._CHUNK_MIN, ex_common._CHUNK_MAX, ex_common._DIRECT_MIN = 1 << 20, 16 << 20, 256 << 10
        out.append(res)
    return out


def _stamp(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


def dies_in_later_chunk(rank: int, world: int, victim: int, at_call: int, timeout: float, stamp: str) -> dict:
    """tp=2 (ranks 0-1) -> tp=1 (rank 2) on the batched path with shrunk chunks: refit 1
    completes, then ``victim`` dies (``os._exit``) at its ``at_call``-th ``batch_isend_irecv``
    of refit 2 -- a later chunk of its first round.  Reports what every other rank raised."""
    shrink()
    src, dst = build_layouts("tp=2", "tp=1", False)
    plan = make_plan(src, dst, budget_bytes=1 << 20, templates=False)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    S, D = materialize(src, rank, full), materialize(dst, rank, full, fill=float("nan"))
    r = Resharder(plan, S, D, timeout=timeout, overlap=False)
    r.refit()
    info = {"rank": rank, "groups_round1": len(rounds_mod.chunk_schedule(r.rounds[0], r.verify)) if r.rounds else 0,
            "first_plan_round": r.round_numbers[0] if r.rounds else None, "rounds": len(r.rounds)}
    calls = [0]
    orig = dist.batch_isend_irecv

    def batch(ops):
        calls[0] += 1
        if rank == victim and calls[0] == at_call:
            _stamp(stamp)
            os._exit(17)
        return orig(ops)

    dist.barrier()
    dist.batch_isend_irecv = batch
    try:
        r.refit()
        info.update(type=None, error=None)
    except ReshardError as e:
        info.update(type=type(e).__name__, error=str(e), round=getattr(e, "round", None),
                    peers=getattr(e, "peers", None))
    finally:
        dist.batch_isend_irecv = orig
    info["raised_at"] = time.time()
    info["state"] = r.state()
    return info
