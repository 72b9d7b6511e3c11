"""Workers of tests/core/executor/test_fault_matrix.py: each collective step x each fault on one rank of 2 gloo ranks.

Steps (in a call's order): ``join`` (``integrations.protocol.join_group`` beside the default group),
``metadata`` (``join_refit``'s exchange of layout parts), ``handshake`` (``Resharder(...)``), ``start``
(a refit's start exchange), ``round`` (a transfer round), ``confirm`` (the refit's confirmation),
``export_write`` (``export_hf``'s writer writing a shard).  Faults: ``raise`` (an exception),
``kbint`` (KeyboardInterrupt), ``sigstop`` (the victim stops; the survivor continues it once it has
raised), ``late`` (the victim enters the step ``T + 1`` s after its peer), ``sigkill`` (one launch per
step: :func:`killed_at`).  Injection is from outside the library, as in tests/helpers/adversarial_workers.py:
before the step's call, or inside it by wrapping the ``torch.distributed`` call the step makes.

Every case records, on every rank: what was raised (type, message, MRO), seconds from entering the
step to the raise, and for refit steps whether each buffer that claims a version holds its bytes.
Cases run one after another in one launch, each on a fresh group (timeout ``T``)."""
from __future__ import annotations

import contextlib
import datetime
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


def _fault(kind: str, T: float) -> None:
    if kind == "raise":
        raise RuntimeError("injected fault")
    if kind == "kbint":
        raise KeyboardInterrupt("injected fault")
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kind == "late":
        time.sleep(T + 1.0)
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


def _step(step: str, rank: int, victim: int, kind: str | None, T: float, tmp: str, k: int, chunks) -> dict:
    """Run ``step`` once on this rank (``kind`` on ``victim``: the fault); the outcome."""
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
            join_group(f"file://{tmp}/join_{k}", 2, rank, timeout_s=T)
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
        out_dir = os.path.join(tmp, f"export_{k}")

        def mk(orig):
            def f(*a, **kw):
                if me:
                    _fault(kind, T)
                return orig(*a, **kw)
            return f
        with _patched(safetensors.torch, "save_file", mk) if rank == victim else contextlib.nullcontext():
            o = _record(lambda: export_hf(chunks, out_dir, g, on_rank=victim, timeout=T, progress=False,
                                          memory_bytes=1 << 14))
        o["index_written"] = os.path.exists(os.path.join(out_dir, "model.safetensors.index.json"))
        return o
    r = Resharder(plan, S, D, g)          # refit 1 lands; the fault hits refit 2
    r.refit()
    full2 = {n: reference_tensor(n, m.shape, step=k + 100) for n, m in src.tensors.items()}
    for n, t in cut(src, rank, full2).items():
        S[n].copy_(t)
    dist.barrier()
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


def matrix(rank: int, world: int, cases: list, T: float) -> list:
    """Each case ``(step, fault, victim)`` in one launch, on fresh groups; the default group only synchronizes."""
    pids = all_gather_json(os.getpid())
    tmp = tempfile.mkdtemp(prefix="mcore-reshard-matrix-") if rank == 0 else None
    tmp = all_gather_json(tmp)[0]
    chunks = _export_chunks() if any(s == "export_write" for s, _, _ in cases) else None
    out = []
    for k, (step, kind, victim) in enumerate(cases):
        o = _step(step, rank, victim, kind, T, tmp, k, chunks)
        o["case"] = [step, kind, victim]
        if kind == "sigstop" and rank != victim:
            time.sleep(0.2)
            os.kill(pids[victim], signal.SIGCONT)
        out.append(o)
        dist.barrier()
    return out


def killed_at(rank: int, world: int, step: str, victim: int, T: float, tmp: str) -> dict:
    """SIGKILL of ``victim`` at ``step`` (one launch per case: the default group cannot go on)."""
    chunks = _export_chunks() if step == "export_write" else None
    return _step(step, rank, victim, "sigkill", T, tmp, 0, chunks)
