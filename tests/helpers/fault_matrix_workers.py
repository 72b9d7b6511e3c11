"""Workers of tests/core/executor/test_fault_matrix.py: each collective step x each fault on one rank of 2 gloo ranks.

Steps (in a call's order): ``join`` (``integrations.protocol.join_group`` beside the default group),
``metadata`` (``join_refit``'s exchange of layout parts), ``handshake`` (``Resharder(...)``), ``start``
(a refit's start exchange), ``round`` (a transfer round), ``confirm`` (the refit's confirmation),
``export_write`` (``export_hf``'s writer writing a shard).  Faults: ``raise`` (an exception),
``kbint`` (KeyboardInterrupt), ``sigstop`` (the victim stops; the survivor continues it once it has
raised), ``late`` (the victim enters the step ``2T`` after its peer), ``sigkill`` (one launch per
step: :func:`killed_at`).  Injection is from outside the library, as in tests/helpers/adversarial_workers.py:
before the step's call, or inside it by wrapping the ``torch.distributed`` call the step makes.

Every case records, on every rank: what was raised (type, message, MRO), seconds from entering the
step to the raise, and for refit steps whether each buffer that claims a version holds its bytes;
for ``export_write``, whether the directory still holds exactly the export written before the fault.

Healthy steps never race the fault's deadline: each case first runs its step without a fault (group
timeout :data:`HEALTHY_TIMEOUT`) and measures how long it takes on this machine now (``healthy_s``,
the slower rank's); the faulted run then uses ``T = max(T_MIN, 3 x healthy_s)`` as its group timeout
(the healthy parts of it -- group creation, a first refit, reading the model -- take about
``healthy_s``), and the test judges the survivor against that ``T``.  On an idle machine ``T`` is
``T_MIN``; on a loaded one it grows with the load.

Cases run one after another in one launch, each on fresh groups, each writing its outcome to a file
as soon as both ranks have it (:func:`matrix`), so a launch that dies costs the case it died in: the
test relaunches from the next case."""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist
from adversarial_workers import _patched, cut

from mcore_reshard.core.executor import Resharder, all_gather_json
from mcore_reshard.core.planner import make_plan
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import reference_tensor

STEPS = ["join", "metadata", "handshake", "start", "round", "confirm", "export_write"]
FAULTS = ["raise", "kbint", "sigstop", "late"]
T_MIN = 1.0                # the faulted run's group timeout on an idle machine (seconds)
HEALTHY_TIMEOUT = 120.0    # the healthy run's: it only has to finish


def _fault(kind: str, T: float) -> None:
    if kind == "raise":
        raise RuntimeError("injected fault")
    if kind == "kbint":
        raise KeyboardInterrupt("injected fault")
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kind == "late":          # 2T: past the peer's deadline by T however loaded the machine (T grows with it)
        time.sleep(2 * T)
        return
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(kind)


def _record(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        o = {"type": None, "error": "", "mro": []}
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included: it may be the injected fault
        o = {"type": type(e).__name__, "error": str(e)[:600], "mro": [c.__name__ for c in type(e).__mro__]}
    o["elapsed"] = time.monotonic() - t0
    return o


def _export_chunks():
    from megatron_refit_worker import _build

    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    mcore_cpu.install_cpu_shims()
    return _build("gqa", {"tp": 2}, torch.float32, {})


def _digests(out_dir: str) -> dict:
    """sha256 of every file of ``out_dir`` (``{}`` when absent)."""
    if not os.path.isdir(out_dir):
        return {}
    return {f: hashlib.sha256(open(os.path.join(out_dir, f), "rb").read()).hexdigest()[:24]
            for f in sorted(os.listdir(out_dir))}


def _step(step: str, rank: int, victim: int, kind: str | None, T: float, tmp: str, k: int, chunks,
          tag: str = "") -> dict:
    """Run ``step`` once on this rank (``kind`` on ``victim``: the fault; None: a healthy run) on fresh groups
    of timeout ``T``; the outcome.  ``tag`` names this run's rendezvous files."""
    me = kind is not None and rank == victim
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = {n: reference_tensor(n, m.shape, step=k) for n, m in src.tensors.items()}
    S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)
    plan = make_plan(src, dst, budget_bytes=2048)
    extra: dict = {}

    def before():
        if me:
            _fault(kind, T)

    if step == "join":
        from mcore_reshard.integrations.protocol import join_group

        def run():
            before()
            join_group(f"file://{tmp}/join_{k}{tag}", 2, rank, timeout_s=T)
        return _record(run)
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=T))
    if step == "metadata":
        from mcore_reshard.integrations.protocol import join_refit, rank_part

        def run():
            before()
            join_refit(g, src=rank_part(src, rank), src_tensors=S, dst=rank_part(dst, rank), dst_tensors=D,
                       allow_cast=False)
        return _record(run)
    if step == "handshake":
        def run():
            before()
            Resharder(plan, S, D, g)
        return _record(run)
    if step == "export_write":
        import safetensors.torch

        from mcore_reshard import export_hf
        out_dir = os.path.join(tmp, f"export_{k}")     # the healthy run's export, then the faulted one, here

        def mk(orig):
            def f(*a, **kw):
                if me:
                    _fault(kind, T)
                return orig(*a, **kw)
            return f
        with _patched(safetensors.torch, "save_file", mk) if rank == victim else contextlib.nullcontext():
            # the faulted export stores bfloat16: a byte of it in out_dir would show
            o = _record(lambda: export_hf(chunks, out_dir, g, on_rank=victim, timeout=T, progress=False,
                                          memory_bytes=1 << 14, dtype=None if kind is None else torch.bfloat16))
        o["digests"] = _digests(out_dir)
        o["index_written"] = os.path.exists(os.path.join(out_dir, "model.safetensors.index.json"))
        return o
    r = Resharder(plan, S, D, g)          # refit 1 lands; the fault hits refit 2
    r.refit()
    full2 = {n: reference_tensor(n, m.shape, step=k + 100) for n, m in src.tensors.items()}
    for n, t in cut(src, rank, full2).items():
        S[n].copy_(t)
    dist.barrier(group=g)
    calls = [0]
    mod, name, nth = {"start": (dist, "all_gather", 1), "confirm": (dist, "all_gather", 2),
                      "round": (dist, "batch_isend_irecv", 2)}[step]

    def mk(orig):
        def f(*a, **kw):
            calls[0] += 1
            if me and calls[0] == nth:
                _fault(kind, T)
            return orig(*a, **kw)
        return f
    with _patched(mod, name, mk):
        o = _record(lambda: r.refit())
    st = r.state()
    want = {1: cut(dst, rank, full, 0), 2: cut(dst, rank, full2, 0)}
    o["claims_true"] = all(torch.equal(want[v][n], D[n]) for n, v in st["buffers"].items() if v is not None)
    o["state_version"] = st["version"]
    o.update(extra)
    return o


def _healthy(step: str, rank: int, victim: int, tmp: str, k: int, chunks) -> tuple[float, dict]:
    """The step without a fault, under a generous timeout: how long it takes here and now (the slower
    rank's), and what it left (the export's directory)."""
    o = _step(step, rank, victim, None, HEALTHY_TIMEOUT, tmp, k, chunks, tag="_healthy")
    both = all_gather_json({"s": o["elapsed"], "error": o["error"] if o["type"] is not None else None})
    errors = [f"rank {r}: {b['error']}" for r, b in enumerate(both) if b["error"] is not None]
    if errors:
        raise RuntimeError(f"the healthy run of {step} failed: {'; '.join(errors)}")
    return max(b["s"] for b in both), o


def _case(step: str, kind: str, victim: int, rank: int, tmp: str, k: int, chunks, pids: list) -> dict:
    healthy_s, h = _healthy(step, rank, victim, tmp, k, chunks)
    T = max(T_MIN, 3.0 * healthy_s)
    o = _step(step, rank, victim, kind, T, tmp, k, chunks)
    o.update(T=T, healthy_s=healthy_s)
    if step == "export_write":       # the directory holds exactly what the healthy export wrote
        o["unchanged"] = o["digests"] == h["digests"] and bool(h["digests"])
    if kind == "sigstop" and rank != victim:
        time.sleep(0.2)
        os.kill(pids[victim], signal.SIGCONT)
    return o


def matrix(rank: int, world: int, cases: list, start: int, outdir: str) -> int:
    """Cases ``start..`` ``(step, fault, victim)`` in one launch, on fresh groups; the default group only
    synchronizes.  Each outcome goes to ``outdir/case_{k}.rank{rank}.json`` once the case is over on this
    rank (so a launch that dies part-way keeps what it did); returns how many cases ran."""
    pids = all_gather_json(os.getpid())
    tmp = tempfile.mkdtemp(prefix="mcore-reshard-matrix-") if rank == 0 else None
    tmp = all_gather_json(tmp)[0]
    chunks = _export_chunks() if any(s == "export_write" for s, _, _ in cases[start:]) else None
    for k in range(start, len(cases)):
        step, kind, victim = cases[k]
        if len(set(all_gather_json(k))) != 1:
            raise RuntimeError(f"rank {rank}: the ranks are at different cases: relaunch")
        try:
            o = _case(step, kind, victim, rank, tmp, k, chunks, pids)
        except BaseException as e:  # noqa: BLE001 - the harness failed here: this case fails, the next ones run
            o = {"type": "HarnessError", "error": f"{type(e).__name__}: {e}"[:600], "mro": [], "elapsed": None}
        o["case"] = [step, kind, victim]
        with open(os.path.join(outdir, f"case_{k}.rank{rank}.json"), "w") as f:
            json.dump(o, f)
        dist.barrier()
    return len(cases) - start


def collect(outdir: str, n: int, world: int = 2) -> dict:
    """``{k: [outcome of rank 0, rank 1]}`` for the cases every rank reported."""
    out = {}
    for k in range(n):
        paths = [os.path.join(outdir, f"case_{k}.rank{r}.json") for r in range(world)]
        if all(os.path.exists(p) for p in paths):
            out[k] = [json.load(open(p)) for p in paths]
    return out


def killed_at(rank: int, world: int, step: str, victim: int, tmp: str) -> dict:
    """SIGKILL of ``victim`` at ``step`` (one launch per case: the default group cannot go on).  For the
    export, the directory first holds a complete export, which must survive the kill unchanged; the
    survivor reports Megatron's logits for the test to load it."""
    chunks = _export_chunks() if step == "export_write" else None
    healthy_s, h = _healthy(step, rank, victim, tmp, 0, chunks)
    T = max(T_MIN, 3.0 * healthy_s)
    logits = {}
    if step == "export_write":     # Megatron's own logits, while both ranks live (TP 2)
        from mcore_reshard.testing import megatron_cpu as mcore_cpu
        tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        logits = {"tokens": tokens.tolist(), "logits": mcore_cpu.forward_logits(chunks, tokens).tolist()}
    o = _step(step, rank, victim, "sigkill", T, tmp, 0, chunks)
    o.update(T=T, healthy_s=healthy_s, **logits)
    if step == "export_write":
        o["unchanged"] = o["digests"] == h["digests"] and bool(h["digests"])
        o["out_dir"] = os.path.join(tmp, "export_0")
    return o
