"""Adversarial cases run inside spawned gloo processes (tests/core/*/test_adversarial_*.py).

Every case records JSON facts: what was raised (type, message), whether destination and source
tensors kept their exact bytes, and for successes whether the destination is bit-exact against
an independent reference (the full tensors cut by the layout, ``materialize``).  Faults are
injected from outside the library only (wrapped ``torch.distributed`` calls, signals, threads).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from mcore_reshard.core.executor import Resharder, ReshardError, all_gather_json, torch_dtype
from mcore_reshard.core.executor import digest_of as _digest_of
from mcore_reshard.core.layout import Layout
from mcore_reshard.core.mesh import Mesh
from mcore_reshard.core.planner import Plan, make_plan
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import materialize, reference_tensor

ALL_DTYPES = ["float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "int32",
              "int16", "int8", "uint8", "bool"]


# ---------------------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (bitwise comparison: NaN payloads and -0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def same_bits(a: dict, b: dict) -> bool:
    """Bitwise equal (a tensor swapped for a meta one holds no bytes: skipped)."""
    return set(a) == set(b) and all(torch.equal(bits(a[n]), bits(b[n])) for n in a
                                    if "meta" not in (a[n].device.type, b[n].device.type))


def digest_of(tensors: dict) -> dict:
    return _digest_of({n: t for n, t in tensors.items() if t.device.type != "meta"})


def snapshot(tensors: dict) -> dict:
    return {n: t.detach().clone() for n, t in tensors.items()}


def full_tensors(layout: Layout, step: int = 0) -> dict:
    """Deterministic full tensors of every dtype; float payloads are random bytes (NaN, inf, -0
    and subnormals included), bool is 0/1."""
    out = {}
    for n, m in layout.tensors.items():
        dt = torch_dtype(m.dtype)
        g = torch.Generator().manual_seed(sum(map(ord, n)) * 131 + step)
        numel = 1
        for s in m.shape:
            numel *= s
        if dt == torch.bool:
            out[n] = torch.randint(0, 2, tuple(m.shape), generator=g).bool()
        elif dt in (torch.float32, torch.float64) and step % 2 == 0 and numel:
            out[n] = reference_tensor(n, m.shape, dt, step)
        else:
            raw = torch.randint(0, 256, (numel * dt.itemsize,), generator=g, dtype=torch.uint8)
            out[n] = raw.view(dt).reshape(tuple(m.shape))
            if dt.is_floating_point and numel >= 4:
                flat = out[n].reshape(-1)
                flat[0], flat[1], flat[2], flat[3] = float("nan"), float("inf"), -0.0, float("-inf")
    return out


def cut(layout: Layout, rank: int, full: dict, fill=7) -> dict:
    """This rank's buffers cut from the full tensors (the reference), padding = ``fill``."""
    return materialize(layout, rank, full, fill=fill)


def outcome(fn) -> dict:
    try:
        res = fn()
        return {"type": None, "error": "", "result": res}
    except ReshardError as e:
        return {"type": type(e).__name__, "error": str(e)[:2000], "round": getattr(e, "round", None)}
    except (ValueError, TypeError, KeyError) as e:
        return {"type": type(e).__name__, "error": str(e)[:2000]}


def dtype_layouts(world: int = 2):
    """Every dtype, incl. fp8 and bool; shapes 0-size, 1-D, 4-D and 5-D; tp=2 row split on ranks
    0-1 -> the full tensor on the last rank (disaggregated when world=3) + a column re-split."""
    src, dst = Layout(), Layout()
    tp = Mesh.of({"tp": 2})
    last = Mesh.of({"tp": 1}, rank_offset=world - 1)
    shapes = [(4, 6), (0, 4), (2, 3, 2, 2), (2, 1, 2, 1, 3), (6,), (4, 2, 2)]
    for i, dt in enumerate(ALL_DTYPES):
        shape = shapes[i % len(shapes)]
        name = f"t{i}_{dt}"
        src.add_sharded(name, shape, dt, tp, [("tp", 0)])
        other = [d for d in range(1, len(shape)) if shape[d] % 2 == 0]
        if other and i % 2:
            dst.add_sharded(name, shape, dt, tp, [("tp", other[0])])     # re-split along another dim
        else:
            dst.add_sharded(name, shape, dt, last)
    return src, dst


# ------------------------------------------------------------------ plan tampering (world 2)


def tampered_plans(rank: int, world: int, _unused, mutations: list) -> list:
    """Each mutation ``(label, mutated plan JSON)`` is bound and refit on every rank; returns per
    case: refused (type, message) with destinations and sources untouched, or success with the
    destination bit-exact against the reference."""
    src, dst = dtype_layouts(world)
    full = full_tensors(src)
    out = []
    for label, pj in mutations:
        S = cut(src, rank, full)
        D = cut(dst, rank, full, fill=7)
        before_d, before_s = snapshot(D), digest_of(S)
        want = cut(dst, rank, full, fill=0)

        def run():
            plan = Plan.from_json(pj)
            r = Resharder(plan, S, D, timeout=20, layouts=(src, dst))
            r.refit()
            return r.state()["version"]

        try:
            res = outcome(run)
        except Exception as e:  # noqa: BLE001 - Plan.from_json itself refuses (same on every rank)
            res = {"type": "from_json:" + type(e).__name__, "error": str(e)[:300]}
        res.update(label=label, dst_untouched=same_bits(before_d, D), src_untouched=digest_of(S) == before_s,
                   exact=same_bits(want, D))
        out.append(res)
        dist.barrier()
    return out


# ---------------------------------------------------------------------------- misuse (world 2)


def _fresh(rank, src, dst, full, fill=7):
    return cut(src, rank, full), cut(dst, rank, full, fill=fill)


def misuse(rank: int, world: int) -> dict:
    """Items 1, 3, 4, 5, 6, 7, 8, 9 (JSON), 11 of issue #13 and more misuse, one launch."""
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    # the copy-by-copy plan: the tampering cases below edit its JSON fields (copies, local copies, boxes)
    plan = make_plan(src, dst, budget_bytes=4096, templates=False)
    res: dict = {}

    def refused(case, make, *, refit=True):
        """``make()`` -> Resharder; record whether it (or its refit) raised before a byte moved."""
        S, D = _fresh(rank, src, dst, full)
        bd, bs = snapshot(D), digest_of(S)

        def go():
            r = make(S, D)
            if refit:
                r.refit()
            return None
        o = outcome(go)
        after = digest_of(S)
        o.update(dst_untouched=same_bits(bd, D), src_untouched=all(bs[k] == v for k, v in after.items()))
        res[case] = o
        dist.barrier()

    # -- item 1: two Resharders, same plan and geometry, refit in different orders on the two ranks
    Sa, Da = _fresh(rank, src, dst, full)
    Sb = cut(src, rank, {n: reference_tensor(n, m.shape, step=5) for n, m in src.tensors.items()})
    Db = cut(dst, rank, full, fill=3)
    a = Resharder(plan, Sa, Da, timeout=10)
    b = Resharder(plan, Sb, Db, timeout=10)
    bda, bdb = snapshot(Da), snapshot(Db)
    first, second = (a, b) if rank == 0 else (b, a)
    res["cross_1"] = outcome(lambda: first.refit() and None)
    res["cross_2"] = outcome(lambda: second.refit() and None)
    res["cross_untouched"] = same_bits(bda, Da) and same_bits(bdb, Db)
    res["cross_states"] = [a.state()["version"], b.state()["version"], a.state()["interrupted"], b.state()["interrupted"]]
    a.refit()
    b.refit()
    res["cross_after_exact"] = (same_bits(cut(dst, rank, full, 0), Da)
                                and same_bits(cut(dst, rank, {n: reference_tensor(n, m.shape, step=5) for n, m in src.tensors.items()}, 0), Db))
    dist.barrier()

    # -- item 4: tampered plans validate_plan used to pass
    pj = json.loads(plan.dumps())

    def reshaped():
        q = json.loads(json.dumps(pj))
        for c in q["local_copies"]:
            box = c[7]
            if len(box[1]) == 2 and box[1][0] % 2 == 0 and box[1][0] > 1:
                box[1] = [box[1][0] // 2, box[1][1] * 2]
                return q
        raise AssertionError("no 2-D copy to reshape")

    def relabelled():
        q = json.loads(json.dumps(pj))
        for n, meta in q["tensors"].items():
            if meta["src_dtype"] == "float32":
                meta["src_dtype"] = meta["dst_dtype"] = "int32"
                return q
        raise AssertionError("no float32 tensor")

    refused("plan_reshaped_box", lambda S, D: Resharder(Plan.from_json(reshaped()), S, D, timeout=10))
    refused("plan_dtype_relabelled", lambda S, D: Resharder(Plan.from_json(relabelled()), S, D, timeout=10))
    # the layouts a plan claims to come from: a plan of other layouts (same shapes, other split)
    other_src, other_dst = build_layouts("tp=2", "tp=2", True)
    refused("plan_of_other_layouts", lambda S, D: Resharder(plan, S, D, timeout=10, layouts=(other_src, other_dst)))
    refused("plan_float_offsets", lambda S, D: Resharder(Plan.from_json(_float_offsets(pj)), S, D, timeout=10))

    # -- item 5: nn.Parameter sources and destinations (requires_grad=True)
    S, D = _fresh(rank, src, dst, full)
    PS = {n: torch.nn.Parameter(t) for n, t in S.items()}
    PD = {n: torch.nn.Parameter(t) for n, t in D.items()}
    o = outcome(lambda: Resharder(plan, PS, PD, timeout=10).refit() and None)
    o["exact"] = same_bits(cut(dst, rank, full, 0), {n: p.data for n, p in PD.items()})
    o["still_parameters"] = all(isinstance(p, torch.nn.Parameter) and p.requires_grad and p.is_leaf and p.grad_fn is None
                                for p in list(PS.values()) + list(PD.values()))
    res["parameters"] = o
    dist.barrier()

    # -- item 6: a staging buffer that aliases a source or a destination
    def alias_staging(side):
        def make(S, D):
            t = (S if side == "src" else D)[sorted(S if side == "src" else D)[0]]
            return Resharder(plan, S, D, timeout=10, staging=t.view(-1).view(torch.uint8))
        return make
    refused("staging_aliases_src", alias_staging("src"))
    refused("staging_aliases_dst", alias_staging("dst"))
    refused("staging_not_uint8", lambda S, D: Resharder(plan, S, D, timeout=10, staging=torch.zeros(1 << 16)))

    # -- item 7: meta device tensors
    def meta(side):
        def make(S, D):
            T = S if side == "src" else D
            n = sorted(T)[0]
            T[n] = torch.empty_like(T[n], device="meta")
            return Resharder(plan, S, D, timeout=10)
        return make
    refused("meta_dst", meta("dst"))
    refused("meta_src", meta("src"))

    # -- tensor kinds without plain strided storage, given on rank 1 only: refused on every rank, by name
    res["kinds"] = _tensor_kinds(rank, src, dst, full, plan)

    # -- item 8: options that must agree: overlap, the environment variable, threads
    refused("overlap_differs", lambda S, D: Resharder(plan, S, D, timeout=10, overlap=(rank == 0)))
    os.environ["MCORE_RESHARD_OVERLAP"] = "0" if rank == 0 else "1"
    refused("overlap_env_differs", lambda S, D: Resharder(plan, S, D, timeout=10))
    os.environ.pop("MCORE_RESHARD_OVERLAP")
    S, D = _fresh(rank, src, dst, full)
    r = Resharder(plan, S, D, timeout=10)
    os.environ["MCORE_RESHARD_OVERLAP"] = "1" if rank == 0 else "0"    # changed between refits, on one rank
    bd = snapshot(D)
    res["overlap_env_changed"] = outcome(lambda: r.refit() and None)
    res["overlap_env_changed"]["dst_untouched"] = same_bits(bd, D)
    os.environ.pop("MCORE_RESHARD_OVERLAP")
    res["overlap_env_restored"] = outcome(lambda: r.refit()["version"])
    dist.barrier()
    res["threads"] = _two_threads(rank, src, dst, full, plan)
    dist.barrier()

    # -- item 9: numbers (every rank passes the same bad value: refused locally, at once)
    for bad in (0, -1, float("nan"), float("inf"), "5", True):
        refused(f"timeout={bad!r}", lambda S, D, bad=bad: Resharder(plan, S, D, timeout=bad))
    refused("version=-1", lambda S, D: _refit_version(Resharder(plan, S, D, timeout=10), -1), refit=False)
    refused("version=1.5", lambda S, D: _refit_version(Resharder(plan, S, D, timeout=10), 1.5), refit=False)

    # -- misuse: a plan that belongs to another rank count, rebind to a group that renumbers ranks
    S, D = _fresh(rank, src, dst, full)
    r = Resharder(plan, S, D, timeout=10)
    r.refit()
    rev = dist.new_group([0, 1])
    res["rebind_same_ok"] = outcome(lambda: (r.rebind(rev), r.refit()["version"])[1])
    # wrong order: rank 0 refits while rank 1 rebinds; then both refit
    res["wrong_order"] = outcome(lambda: (r.refit() if rank == 0 else r.rebind(r.group)) and None)
    res["wrong_order_then"] = outcome(lambda: r.refit()["version"])
    res["wrong_order_exact"] = same_bits(cut(dst, rank, full, 0), D)
    # rebind where only one rank rebinds this Resharder and the other a different one
    S2, D2 = _fresh(rank, src, dst, full)
    r2 = Resharder(plan, S2, D2, timeout=10)
    g3 = dist.new_group([0, 1])
    res["rebind_different"] = outcome(lambda: (r if rank == 0 else r2).rebind(g3))
    dist.barrier()

    # -- item 11: a source written by another thread during a refit, verify=True detects it
    res["source_written"] = _source_written(rank, src, dst, full)
    dist.barrier()
    # -- item 3: interrupted right after the confirmation
    res["after_confirm"] = _interrupt_after_confirm(rank, src, dst, full, plan)
    dist.barrier()
    # -- every dtype (fp8, bool), NaN / inf / -0 payloads, 0-size and >3-D tensors
    res["dtypes"] = _all_dtypes(rank, world)
    return res


class _Plain(torch.Tensor):
    """A tensor subclass of no known kind (its storage is plain, but nothing proves writes land)."""


def _kinds() -> dict:
    """Tensor kinds a refit cannot move in place: name -> (make from a dense tensor, words its error must say)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return {
        "sparse_coo": (lambda t: t.to_sparse(), "sparse_coo tensor"),
        "sparse_csr": (lambda t: t.reshape(t.shape[0], -1).to_sparse_csr(), "sparse_csr tensor"),
        "sparse_csc": (lambda t: t.reshape(t.shape[0], -1).to_sparse_csc(), "sparse_csc tensor"),
        "sparse_bsr": (lambda t: t.reshape(t.shape[0], -1)[:2, :2].to_sparse_bsr((1, 1)), "sparse_bsr tensor"),
        "sparse_bsc": (lambda t: t.reshape(t.shape[0], -1)[:2, :2].to_sparse_bsc((1, 1)), "sparse_bsc tensor"),
        "parameter_sparse": (lambda t: torch.nn.Parameter(t.to_sparse(), requires_grad=False), "sparse_coo tensor"),
        "nested": (lambda t: torch.nested.nested_tensor([t.clone(), t.clone()]), "nested tensor"),
        "nested_jagged": (lambda t: torch.nested.nested_tensor([t.clone(), t.clone()], layout=torch.jagged),
                          "__torch_dispatch__"),
        "quantized": (lambda t: torch.quantize_per_tensor(t.float(), 0.5, 0, torch.qint8), "quantized qint8"),
        "functional": (lambda t: torch._to_functional_tensor(t.clone()), "functional tensor wrapper"),
        "fake": (lambda t: FakeTensorMode().from_tensor(t), "FakeTensor, a tensor subclass with its own __torch_dispatch__"),
        "subclass": (lambda t: t.clone().as_subclass(_Plain), "_Plain, a tensor subclass"),
    }


def _tensor_kinds(rank, src, dst, full, plan) -> dict:
    """Each kind as rank 1's first source, then as its first destination (rank 0 gives plain tensors):
    every rank must raise ReshardError at construction, nothing moved; then a bound destination whose
    ``param.data`` is rebound to a FakeTensor between refits (the parameter is then a meta tensor: no
    storage): refused at the refit on every rank.  (``param.data = <functional wrapper>`` is not a
    case: torch itself crashes on the parameter's next detach.)"""
    import warnings
    out = {}
    for kind, (make, _) in _kinds().items():
        for side in ("src", "dst"):
            S, D = _fresh(rank, src, dst, full)
            bd, bs = snapshot(D), digest_of(S)
            given = {"src": dict(S), "dst": dict(D)}
            name = sorted(given[side])[0]
            if rank == 1:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    given[side][name] = make(given[side][name])
            o = outcome(lambda: Resharder(plan, given["src"], given["dst"], timeout=10).refit() and None)
            o.update(dst_untouched=same_bits(bd, D), src_untouched=digest_of(S) == bs, name=name)
            out[f"{kind}/{side}"] = o
            dist.barrier()
    S, D = _fresh(rank, src, dst, full)
    PD = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in D.items()}
    r = Resharder(plan, S, PD, timeout=10)
    r.refit()
    name = sorted(PD)[0]
    if rank == 1:
        from torch._subclasses.fake_tensor import FakeTensorMode
        PD[name].data = FakeTensorMode().from_tensor(torch.zeros_like(D[name]))
    bd = snapshot({n: D[n] for n in D if n != name})
    o = outcome(lambda: r.refit() and None)
    o.update(dst_untouched=same_bits(bd, {n: D[n] for n in D if n != name}), src_untouched=True, name=name)
    out["fake/followed"] = o
    dist.barrier()
    return out


def _refit_version(r, v):
    r.refit(version=v)
    return r


def _float_offsets(pj):
    q = json.loads(json.dumps(pj))
    q["local_copies"][0][7][0] = [float(x) + 0.5 for x in q["local_copies"][0][7][0]]
    return q


def _two_threads(rank, src, dst, full, plan) -> dict:
    """Two threads refit two Resharders over the same group at the same time, on every rank."""
    S1, D1 = _fresh(rank, src, dst, full)
    S2, D2 = _fresh(rank, src, dst, full)
    r1 = Resharder(plan, S1, D1, timeout=5)
    r2 = Resharder(plan, S2, D2, timeout=5)
    got = {}
    start = threading.Barrier(2)

    def run(name, r):
        start.wait()
        got[name] = outcome(lambda: [r.refit()["version"] for _ in range(3)])

    ts = [threading.Thread(target=run, args=(n, r)) for n, r in (("t1", r1), ("t2", r2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    got["alive"] = [t.is_alive() for t in ts]
    want = cut(dst, rank, full, 0)
    got["states"] = [r1.state(), r2.state()]
    got["claims_exact"] = all(same_bits(want, D) for r, D in ((r1, D1), (r2, D2)) if r.state()["version"] > 0)
    return got


def _source_written(rank, src, dst, full) -> dict:
    """verify=True: rank 0's sources are rewritten by another thread while the refit runs."""
    plan = make_plan(src, dst, budget_bytes=1024)
    S, D = _fresh(rank, src, dst, full)
    r = Resharder(plan, S, D, timeout=10, verify=True)
    stop = threading.Event()

    def writer():
        k = 0
        while not stop.is_set():
            k += 1
            for t in S.values():
                t.add_(1.0)
            time.sleep(0.0005)

    th = threading.Thread(target=writer)
    if rank == 0:
        th.start()
    o = outcome(lambda: r.refit() and None)
    stop.set()
    if rank == 0:
        th.join()
    o["state"] = r.state()
    return o


def _interrupt_after_confirm(rank, src, dst, full, plan) -> dict:
    """Rank 1 gets KeyboardInterrupt right after the confirmation of refit 2 completed (its peers
    count refit 2 as complete); the documented recovery (rebind, refit) must converge, 4 times."""
    S, D = _fresh(rank, src, dst, full)
    r = Resharder(plan, S, D, timeout=10)
    r.refit()
    out = {"attempts": []}
    for attempt in range(4):
        orig = dist.all_gather
        calls = [0]

        class Interrupting:
            def __init__(self, w):
                self.w = w

            def wait(self, *a):
                self.w.wait(*a)
                raise KeyboardInterrupt("injected right after the confirmation")

            def is_completed(self):
                return self.w.is_completed()

        def patched(*a, **k):
            calls[0] += 1
            w = orig(*a, **k)
            return Interrupting(w) if (rank == 1 and calls[0] == 2) else w   # call 1: refit start, 2: confirm

        dist.all_gather = patched
        try:
            try:
                r.refit()
                first = "ok"
            except KeyboardInterrupt:
                first = "KeyboardInterrupt"
            except ReshardError as e:
                first = f"{type(e).__name__}: {e}"
        finally:
            dist.all_gather = orig
        st1 = r.state()
        same = outcome(lambda: r.refit()["version"])      # same group: refused (rebind first) on every rank
        r.rebind(dist.new_group([0, 1]))
        rec = outcome(lambda: r.refit()["version"])
        out["attempts"].append({"first": first, "state_after": st1, "same_group": same, "recovered": rec,
                                "state": r.state(), "exact": same_bits(cut(dst, rank, full, 0), D)})
        dist.barrier()
    return out


def _all_dtypes(rank, world) -> dict:
    src, dst = dtype_layouts(world)
    out = {}
    for label, kw in (("overlapped", {}), ("batched", {"overlap": False}), ("verify", {"verify": True})):
        for budget in (1024, 1 << 20):
            plan = make_plan(src, dst, budget_bytes=budget)
            full = full_tensors(src, step=1)
            S = cut(src, rank, full)
            D = cut(dst, rank, full, fill=7)
            r = Resharder(plan, S, D, timeout=20, **kw)
            r.refit()
            full2 = full_tensors(src, step=2)
            fresh = cut(src, rank, full2)
            for n, t in S.items():
                t.copy_(fresh[n])
            r.refit()
            want = cut(dst, rank, full2, fill=0)
            out[f"{label}/{budget}"] = {"exact": same_bits(want, D), "rounds": plan.rounds,
                                        "mismatched": [n for n in D if not torch.equal(bits(want[n]), bits(D[n]))]}
            dist.barrier()
    return out


def missing_peer(rank: int, world: int) -> dict:
    """Item 10: MegatronRefit (and all_gather_json) with a peer that never joins."""
    from mcore_reshard.refit import MegatronRefit
    if rank == 1:
        time.sleep(6)
        return {"rank": 1}
    t0 = time.monotonic()
    o = outcome(lambda: MegatronRefit([], [], timeout=2) and None)
    o["seconds"] = time.monotonic() - t0
    return o


# ------------------------------------------------------------------------------ faults (world 3)


@contextlib.contextmanager
def _patched(module, name, make):
    orig = getattr(module, name)
    setattr(module, name, make(orig))
    try:
        yield
    finally:
        setattr(module, name, orig)


def _fault(kind: str, stamp: list, pids: list, T: float):
    stamp.append(time.time())
    if kind == "raise":
        raise RuntimeError("injected fault")
    if kind == "kbint":
        raise KeyboardInterrupt("injected fault")
    if kind == "stall":
        time.sleep(3 * T)
        return
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)     # a survivor sends SIGCONT once it has raised
        return
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(kind)


def fault_cases(rank: int, world: int, cases: list, T: float) -> list:
    """Each case ``(stage, kind, victim)``: refit 1 lands; before refit 2 new source weights are
    loaded; ``victim`` suffers ``kind`` at ``stage`` of refit 2.  Records per rank: the outcome,
    seconds from the fault to the raise, the state, which buffers claim which version and whether
    their bytes are that version's, and whether ``rebind`` + ``refit()`` then converges bit-exactly.
    Cases run one after another, each on fresh groups (the default group only synchronizes)."""
    pids = all_gather_json(os.getpid())
    src, dst = build_layouts("tp=2", "tp=1", False)        # ranks 0-1 -> rank 2
    plan = make_plan(src, dst, budget_bytes=2048)
    out = []
    for stage, kind, victim in cases:
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=T))
        full1 = {n: reference_tensor(n, m.shape, step=1) for n, m in src.tensors.items()}
        full2 = {n: reference_tensor(n, m.shape, step=2) for n, m in src.tensors.items()}
        S, D = cut(src, rank, full1), cut(dst, rank, full1, fill=7)
        stamp: list = []
        me = rank == victim
        res = {"case": [stage, kind, victim], "rank": rank}
        if stage == "construct":
            t0 = time.time()
            if me:
                try:
                    _fault(kind, stamp, pids, T)          # raise / KeyboardInterrupt: never joins
                    o = outcome(lambda: Resharder(plan, S, D, g, timeout=None) and None)   # stalled: late
                except BaseException as e:  # noqa: BLE001
                    o = {"type": type(e).__name__, "error": str(e)}
            else:
                o = outcome(lambda: Resharder(plan, S, D, g, timeout=None) and None)
            res.update(o, raised_at=time.time(), t0=t0, fault_at=stamp[0] if stamp else None)
            out.append(res)
            _resume(rank, victim, kind, pids)
            dist.barrier()
            continue
        r = Resharder(plan, S, D, g, timeout=None)        # timeout=None: the group's (T)
        r.refit()
        fresh = cut(src, rank, full2)
        for n, t in S.items():
            t.copy_(fresh[n])
        src_digest = digest_of(S)
        dist.barrier()
        calls = [0]
        import mcore_reshard.core.executor.rounds as rounds_mod
        ctx = contextlib.nullcontext()
        if me and stage in ("start", "confirm"):
            nth = 1 if stage == "start" else 2

            def mk(orig):
                def f(*a, **k):
                    calls[0] += 1
                    if calls[0] == nth:
                        _fault(kind, stamp, pids, T)
                    return orig(*a, **k)
                return f
            ctx = _patched(dist, "all_gather", mk)
        elif me and stage == "round":
            def mk(orig):
                def f(ops):
                    calls[0] += 1
                    if calls[0] == 3:
                        _fault(kind, stamp, pids, T)
                    return orig(ops)
                return f
            ctx = _patched(dist, "batch_isend_irecv", mk)
        elif me and stage == "unpack":
            def mk(orig):
                def f(*a, **k):
                    calls[0] += 1
                    if calls[0] == 4:
                        _fault(kind, stamp, pids, T)
                    return orig(*a, **k)
                return f
            ctx = _patched(rounds_mod, "unpack", mk)
        t0 = time.time()
        with ctx:
            try:
                r.refit()
                o = {"type": None, "error": ""}
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included: it is the injected fault
                o = {"type": type(e).__name__, "error": str(e)[:1500], "round": getattr(e, "round", None)}
        res.update(o, raised_at=time.time(), t0=t0, fault_at=stamp[0] if stamp else None)
        _resume(rank, victim, kind, pids)
        st = r.state()
        res["state"] = st
        res["src_untouched"] = digest_of(S) == src_digest
        want = {1: cut(dst, rank, full1, 0), 2: cut(dst, rank, full2, 0)}
        res["claims_true"] = all(torch.equal(want[v][n], D[n]) for n, v in st["buffers"].items() if v is not None)
        dist.barrier()
        g2 = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=10 * T))
        r.rebind(g2)
        rec = r.refit()
        res["recovered_version"] = rec["version"]
        res["recovered_exact"] = same_bits(want[2], D)
        res["recovered_state"] = r.state()
        out.append(res)
        dist.barrier()
    return out


def _inject(kind: str) -> None:
    """The fault itself: a real SIGINT to this process (Python raises KeyboardInterrupt at the next
    instruction, right here), or an exception."""
    if kind == "sigint":
        signal.raise_signal(signal.SIGINT)
        time.sleep(0)              # the interpreter runs the handler before this returns
        raise AssertionError("SIGINT was not delivered")
    raise RuntimeError("injected fault")


def _hook(stage: str, kind: str):
    """``(module or class, attribute, wrapper maker)`` that injects ``kind`` at ``stage`` of a refit."""
    import mcore_reshard.core.executor.rounds as rounds_mod
    import mcore_reshard.core.executor.transfer as transfer_mod
    from mcore_reshard.core.executor.resharder import Resharder as _R
    calls = [0]

    def before(orig, nth=1, when=lambda *a, **k: True):
        def f(*a, **k):
            if when(*a, **k):
                calls[0] += 1
                if calls[0] == nth:
                    _inject(kind)
            return orig(*a, **k)
        return f

    def after(orig, when=lambda *a, **k: True):
        def f(*a, **k):
            out = orig(*a, **k)
            if when(*a, **k):
                _inject(kind)
            return out
        return f

    def confirm(*a, **k):
        return (a[1] if len(a) > 1 else k.get("kind")) == 3

    def last_round(self, stage, version):
        return stage == len(self.binding.rounds) - 1

    return {
        "before_start": (_R, "follow_owners", before),                         # outside the refit's state
        "start": (transfer_mod, "refit_start", after),                         # the start agreed everywhere
        "local": (transfer_mod.LocalCopies, "step", before),                   # first slice of the local copies
        "round": (rounds_mod, "unpack", lambda o: before(o, nth=3)),           # the 3rd message unpacked
        "last_round": (transfer_mod.Refit, "stage_end", lambda o: after(o, when=last_round)),   # every round landed
        "confirm": (transfer_mod, "exchange", lambda o: before(o, when=confirm)),              # before the confirmation
        "after_confirm": (transfer_mod, "exchange", lambda o: after(o, when=confirm)),         # the confirmation completed
    }[stage]


def interrupt_retry_cases(rank: int, world: int, cases: list, T: float) -> list:
    """Issue 37 defect 9, deterministic: ``(stage, kind, victim, path)``: every rank holds sources and
    destinations (pp=3 -> dp=3 colocated: each rank sends, receives and copies locally, ~100 rounds);
    refit 1 lands; new sources; refit 2 with ``kind`` ("sigint": a real SIGINT; "raise") injected on
    ``victim`` at ``stage``; then at once, without waiting for each other (the documented recovery as a
    user runs it), every rank retries ``refit()`` on the same group; then ``rebind(fresh group)`` and
    ``refit()``.  Records per call its outcome and whether this rank's destinations hold exactly the
    version each buffer claims (and, after a success, exactly the new weights)."""
    src, dst = build_layouts("pp=3", "tp=1,dp=3", True)
    plan = make_plan(src, dst, budget_bytes=8192)
    out = []
    for stage, kind, victim, path in cases:
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=T))
        full1 = {n: reference_tensor(n, m.shape, step=1) for n, m in src.tensors.items()}
        full2 = {n: reference_tensor(n, m.shape, step=2) for n, m in src.tensors.items()}
        S, D = cut(src, rank, full1), cut(dst, rank, full1, fill=7)
        want = {1: cut(dst, rank, full1, 0), 2: cut(dst, rank, full2, 0)}
        r = Resharder(plan, S, D, g, timeout=None, overlap=None if path == "overlapped" else False)
        r.refit()
        for n, t in cut(src, rank, full2).items():
            S[n].copy_(t)
        dist.barrier()

        def claims():
            # versions >= 2 all hold the step-2 weights (the sources do not change after refit 1)
            return all(torch.equal(want[min(v, 2)][n], D[n]) for n, v in r.state()["buffers"].items() if v is not None)

        def call(fn):
            try:
                o = {"type": None, "result": fn()}
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included: it is the injected fault
                o = {"type": type(e).__name__, "error": str(e)[:600]}
            o["claims_true"] = claims()
            o["exact"] = same_bits(want[2], D)
            return o

        res = {"case": [stage, kind, victim, path], "rank": rank}
        owner, name, make = _hook(stage, kind)
        ctx = _patched(owner, name, make) if rank == victim else contextlib.nullcontext()
        with ctx:
            res["first"] = call(lambda: r.refit()["version"])
        res["retry"] = call(lambda: r.refit()["version"])          # at once, on the same group
        g2 = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=10 * T))
        res["rebind"] = call(lambda: r.rebind(g2))
        res["final"] = call(lambda: r.refit()["version"])
        res["state"] = r.state()
        out.append(res)
        dist.barrier()
    return out


def _resume(rank, victim, kind, pids):
    """A survivor continues a SIGSTOPped victim once it has raised (the victim then sees its broken group)."""
    if kind == "sigstop" and rank != victim and rank == (victim + 1) % len(pids):
        time.sleep(0.2)
        os.kill(pids[victim], signal.SIGCONT)


def killed(rank: int, world: int, stage: str, victim: int, T: float, stamp_path: str) -> dict:
    """SIGKILL of ``victim`` at ``stage`` of refit 2 (one launch per case: the group cannot go on)."""
    src, dst = build_layouts("tp=2", "tp=1", False)
    plan = make_plan(src, dst, budget_bytes=2048)
    full1 = {n: reference_tensor(n, m.shape, step=1) for n, m in src.tensors.items()}
    full2 = {n: reference_tensor(n, m.shape, step=2) for n, m in src.tensors.items()}
    S, D = cut(src, rank, full1), cut(dst, rank, full1, fill=7)
    r = Resharder(plan, S, D, timeout=T)
    r.refit()
    fresh = cut(src, rank, full2)
    for n, t in S.items():
        t.copy_(fresh[n])
    dist.barrier()

    def die():
        with open(stamp_path, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    calls = [0]
    import mcore_reshard.core.executor.rounds as rounds_mod
    target = {"start": (dist, "all_gather", 1), "confirm": (dist, "all_gather", 2),
              "round": (dist, "batch_isend_irecv", 2), "unpack": (rounds_mod, "unpack", 3)}[stage]
    mod, name, nth = target

    def mk(orig):
        def f(*a, **k):
            calls[0] += 1
            if rank == victim and calls[0] == nth:
                die()
            return orig(*a, **k)
        return f

    with _patched(mod, name, mk):
        o = outcome(lambda: r.refit() and None)
    o["raised_at"] = time.time()
    st = r.state()
    o["state"] = st
    want = {1: cut(dst, rank, full1, 0), 2: cut(dst, rank, full2, 0)}
    o["claims_true"] = all(torch.equal(want[v][n], D[n]) for n, v in st["buffers"].items() if v is not None)
    return o
