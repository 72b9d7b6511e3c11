"""Workers of tests/core/executor/test_adversarial_generalised.py (issue: trust that generalises): defect
classes no earlier adversarial suite named, each run on real gloo processes.

Every case records JSON facts: what was raised (type, message), whether the destination (and
source) tensors kept their exact bytes, and for successes whether the destination is bit-exact
against an independent reference (the full tensors cut by the layout)."""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from adversarial_workers import cut, digest_of, dtype_layouts, full_tensors, same_bits, snapshot

from mcore_reshard.core.executor import Resharder
from mcore_reshard.core.layout import Layout
from mcore_reshard.core.mesh import Mesh
from mcore_reshard.core.planner import make_plan
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import reference_tensor


def _setup():
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    return src, dst, full, make_plan(src, dst, budget_bytes=4096)


def outcome(fn) -> dict:
    """What ``fn`` did: its result, or the type and message of what it raised (any exception:
    the tests judge which types are a clean refusal)."""
    try:
        return {"type": None, "error": "", "result": fn()}
    except Exception as e:  # noqa: BLE001
        return {"type": type(e).__name__, "error": str(e)[:2000]}


def _params(tensors: dict) -> dict:
    return {n: torch.nn.Parameter(t, requires_grad=False) for n, t in tensors.items()}


def _case(res: dict, name: str, fn, D: dict | None = None, S: dict | None = None) -> None:
    """Run ``fn`` (-> JSON-able result), record its outcome and whether D / S kept their bytes."""
    bd = snapshot(D) if D is not None else None
    bs = digest_of(S) if S is not None else None
    o = outcome(fn)
    if D is not None:
        o["dst_untouched"] = same_bits(bd, D)
    if S is not None:
        o["src_untouched"] = digest_of(S) == bs
    res[name] = o
    dist.barrier()


def defects(rank: int, world: int) -> dict:
    """Defects 1, 2, 5, 6, 8, 9, 11, 13 of the issue, one launch of 2 ranks."""
    src, dst, full, plan = _setup()
    new_full = {n: reference_tensor(n, m.shape, step=9) for n, m in src.tensors.items()}
    res: dict = {}
    name = sorted(plan.buffers["dst"][rank])[0]

    # 1: param.data rebound after binding, on a destination (same shape/dtype/strides): followed
    S, D = cut(src, rank, full), _params(cut(dst, rank, full, fill=7))
    r = Resharder(plan, S, D, timeout=20)
    old = D[name].data
    D[name].data = torch.full_like(old, 3.0)
    before_old = old.clone()

    def go1():
        r.refit()
        return r.state()
    res["dst_rebound"] = outcome(go1)
    res["dst_rebound"].update(exact=same_bits(cut(dst, rank, full, 0), {n: p.data for n, p in D.items()}),
                              old_storage_untouched=torch.equal(old, before_old))
    dist.barrier()

    # 2: the same on a source: the refit sends the new storage
    S, D = _params(cut(src, rank, full)), cut(dst, rank, full, fill=7)
    r = Resharder(plan, S, D, timeout=20)
    r.refit()
    new_S = cut(src, rank, new_full)
    for n, p in S.items():
        p.data = new_S[n].clone()

    def go2():
        r.refit()
        return r.state()["version"]
    res["src_rebound"] = outcome(go2)
    res["src_rebound"]["exact"] = same_bits(cut(dst, rank, new_full, 0), D)
    dist.barrier()

    # 2b: both sides rebound after a refit on the batched path (overlap=False), whose per-round
    # chunk schedules hold views: the next refit reads / writes the new storage
    S, D = _params(cut(src, rank, full)), _params(cut(dst, rank, full, fill=7))
    r = Resharder(plan, S, D, timeout=20, overlap=False)
    r.refit()
    old_D = {n: p.data for n, p in D.items()}
    for n, p in S.items():
        p.data = new_S[n].clone()
    for n, p in D.items():
        p.data = torch.full_like(p.data, 3.0)
    res["rebound_batched"] = outcome(lambda: r.refit()["version"])
    res["rebound_batched"].update(exact=same_bits(cut(dst, rank, new_full, 0), {n: p.data for n, p in D.items()}),
                                  old_storage_kept=same_bits(cut(dst, rank, full, 0), old_D),
                                  rounds=len(r.rounds))
    dist.barrier()

    # 1b: rebound to another shape (rank 1 only): refused on every rank before a byte moves
    S, D = cut(src, rank, full), _params(cut(dst, rank, full, fill=7))
    r = Resharder(plan, S, D, timeout=20)
    if rank == 1:
        D[name].data = torch.zeros(3, dtype=D[name].dtype)
    _case(res, "dst_rebound_other_shape", lambda: r.refit() and None, D=D)
    res["dst_rebound_other_shape"]["state"] = r.state()["version"]

    # 5: version out of int64 range: a ValueError naming version on every rank, then a refit works
    S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)
    r = Resharder(plan, S, D, timeout=20)
    _case(res, "version_huge", lambda: r.refit(version=2 ** 63) and None, D=D)
    res["version_huge_retry"] = outcome(lambda: r.refit()["version"])
    res["version_huge_retry"]["exact"] = same_bits(cut(dst, rank, full, 0), D)
    dist.barrier()

    # 6: verify=True on bool tensors holding bytes other than 0/1: moved byte for byte, no false alarm
    bsrc, bdst = dtype_layouts(2)
    bfull = full_tensors(bsrc)
    for n, t in bfull.items():
        if t.dtype == torch.bool and t.numel():
            raw = t.view(torch.uint8).reshape(-1)
            raw[0::3] = 2
            raw[1::5] = 255
    bplan = make_plan(bsrc, bdst, budget_bytes=1024)
    for overlap in (True, False):
        S, D = cut(bsrc, rank, bfull), cut(bdst, rank, bfull, fill=7)
        r = Resharder(bplan, S, D, timeout=20, verify=True, overlap=overlap)
        res[f"bool_bytes_verify_{overlap}"] = outcome(lambda: r.refit()["version"])
        res[f"bool_bytes_verify_{overlap}"]["exact"] = same_bits(cut(bdst, rank, bfull, 0), D)
        dist.barrier()

    # 8: a Resharder built under inference_mode, refit outside it: exact
    S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)

    def go8():
        with torch.inference_mode():
            r = Resharder(plan, S, D, timeout=20)
        return r.refit()["version"]
    res["built_in_inference_mode"] = outcome(go8)
    res["built_in_inference_mode"]["exact"] = same_bits(cut(dst, rank, full, 0), D)
    dist.barrier()
    # 8b: a destination that is an inference tensor: refused at bind on every rank
    S = cut(src, rank, full)
    with torch.inference_mode():
        D = cut(dst, rank, full, fill=7)
    _case(res, "inference_dst", lambda: Resharder(plan, S, D if rank == 0 else cut(dst, rank, full, fill=7),
                                                  timeout=20).refit() and None, D=D)

    # 9: a Replicate DTensor destination: its local tensor is written, exact
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    mesh = init_device_mesh("cpu", (world,))
    S, Dl = cut(src, rank, full), cut(dst, rank, full, fill=7)
    D = {n: DTensor.from_local(t, mesh, [Replicate()], run_check=False) for n, t in Dl.items()}

    def go9():
        return Resharder(plan, S, D, timeout=20).refit()["version"]
    res["dtensor_dst"] = outcome(go9)
    res["dtensor_dst"]["exact"] = same_bits(cut(dst, rank, full, 0), {n: d.to_local() for n, d in D.items()})
    dist.barrier()
    # 9b: a DTensor whose local shard does not match the plan: refused before a byte moves
    S, Dl = cut(src, rank, full), cut(dst, rank, full, fill=7)
    from torch.distributed.tensor import Shard
    first = sorted(Dl)[0]        # rank 0: its first buffer as a DTensor holding half of it
    D = dict(Dl)
    if rank == 0:
        D[first] = DTensor.from_local(Dl[first][: Dl[first].shape[0] // 2], mesh, [Shard(0)], run_check=False)
    _case(res, "dtensor_dst_wrong_shard", lambda: Resharder(plan, S, D, timeout=20).refit() and None, D=Dl)

    # 11: a strided source and a destination living in its gaps (disjoint bytes): accepted, exact
    ls, ld = Layout(), Layout()
    tp = Mesh.of({"tp": 2})
    ls.add_sharded("a", (4, 4), "float32", tp, [("tp", 0)])
    ld.add_sharded("a", (4, 4), "float32", tp, [("tp", 1)])
    afull = {"a": torch.arange(16, dtype=torch.float32).reshape(4, 4) + 100 * rank * 0}
    aplan = make_plan(ls, ld, budget_bytes=1024)
    base = torch.full((2, 12), -1.0)
    sv = base[:, :4]
    sv.copy_(cut(ls, rank, afull)["a"])
    dv = base[0, 4:12].view(4, 2)
    dv.fill_(7)

    def go11():
        return Resharder(aplan, {"a": sv}, {"a": dv}, timeout=20).refit()["version"]
    res["interleaved_views"] = outcome(go11)
    res["interleaved_views"]["exact"] = (torch.equal(dv, cut(ld, rank, afull)["a"])
                                         and torch.equal(sv, cut(ls, rank, afull)["a"]))
    dist.barrier()
    # 11b: a destination that really overlaps the source's bytes: still refused
    base = torch.zeros(2, 12)
    sv = base[:, :4]
    sv.copy_(cut(ls, rank, afull)["a"])
    dv = base.view(-1)[3:11].view(4, 2)     # its first element is the source's (0, 3)
    _case(res, "overlapping_views", lambda: Resharder(aplan, {"a": sv}, {"a": dv}, timeout=20).refit() and None,
          D={"a": dv})

    # 13: a rank outside the plan's group
    g = dist.new_group([0])
    one_s, one_d = Layout(), Layout()
    one = Mesh.of({"tp": 1})
    one_s.add_sharded("a", (4, 4), "float32", one)
    one_d.add_sharded("a", (4, 4), "float32", one)
    oplan = make_plan(one_s, one_d, budget_bytes=1024)
    S, D = {"a": torch.ones(4, 4)}, {"a": torch.zeros(4, 4)}
    res["outside_group"] = outcome(lambda: Resharder(oplan, S, D, group=g, timeout=20).refit()["version"])
    res["outside_group"]["dst_untouched"] = bool((D["a"] == 0).all()) if rank == 1 else None
    res["outside_group"]["exact"] = torch.equal(D["a"], S["a"])
    dist.barrier()
    return res


def stalled_peer(rank: int, world: int, out_path: str) -> dict:
    """Defect 3: the default timeout (None) on a group made by ``new_group()`` without a timeout
    (torch gives it 30 min) follows the default group's 5 s: rank 1 stops itself (SIGSTOP) inside
    the first round; rank 0 must raise within that bound, then kills it (the launch ends)."""
    src, dst, full, plan = _setup()
    S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)
    group = dist.new_group([0, 1])
    r = Resharder(plan, S, D, group=group)
    timeout_s = r.timeout_s
    dist.barrier()
    if rank == 1:
        import mcore_reshard.core.executor.rounds as rounds  # what the point-to-point transports call
        orig = rounds.round_overlapped if r.overlapped() else rounds.round_batched

        def stop(*a, **kw):
            with open(out_path, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            return orig(*a, **kw)
        rounds.round_overlapped = rounds.round_batched = stop
    t0 = time.monotonic()
    o = outcome(lambda: r.refit()["version"])
    o.update(elapsed=time.monotonic() - t0, timeout_s=timeout_s)
    if rank == 0 and os.path.exists(out_path):
        os.kill(int(open(out_path).read()), signal.SIGKILL)
    return o


def late_handshake(rank: int, world: int, late: int, delay: float) -> dict:
    """Defect 4: rank ``late`` joins the handshake ``delay`` s after its peers (timeout 3 s):
    the handshake must end the same way on every rank."""
    src, dst, full, plan = _setup()
    S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)
    if rank == late:
        time.sleep(delay)
    t0 = time.monotonic()
    o = outcome(lambda: Resharder(plan, S, D, timeout=3) and None)
    o["elapsed"] = time.monotonic() - t0
    return o


def interrupted_handshake(rank: int, world: int, victim: int) -> dict:
    """Defect 4: rank ``victim`` gets KeyboardInterrupt inside the handshake's exchange, after the bytes of
    every rank arrived (its peers' exchange completes)."""
    import mcore_reshard.core.executor.handshake as hs
    src, dst, full, plan = _setup()
    S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)
    if rank == victim:     # SIGINT while waiting on the exchange, once every rank's bytes are in
        orig = hs.bounded_wait

        def interrupted(*a, **kw):
            orig(*a, **kw)
            raise KeyboardInterrupt
        hs.bounded_wait = interrupted
    t0 = time.monotonic()
    try:
        o = outcome(lambda: Resharder(plan, S, D, timeout=3) and None)
    except KeyboardInterrupt:
        o = {"type": "KeyboardInterrupt", "error": ""}
    o["elapsed"] = time.monotonic() - t0
    return o
