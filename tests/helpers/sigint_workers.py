"""Issue 37 defect 9 as a user meets it: a REAL SIGINT (``os.kill`` from a timer thread) lands on
rank 2 at an arbitrary instant of a refit (any bytecode: the library's bookkeeping, a ``finally``,
between a receive landing and its unpack...), then the documented recovery runs: every rank retries
``refit()`` on the same group, then ``rebind(fresh group)`` and ``refit()``.

Plan: ``pp=3`` -> ``dp=3`` colocated (rank 2 receives from ranks 0 and 1, sends to both and copies
locally; tens of rounds of ~1 MiB).  The sources hold phase ``p``'s weights for the refit(s) of
phase ``p`` (1: the first refit, 2: the interrupted one and its retry, 3: after the rebind), so
stale bytes of an earlier phase are detected.  Facts per call: what it raised, whether this rank's
destinations are bit-exact for the phase, and whether every buffer holds what its version claims.
"""
from __future__ import annotations

import contextlib
import datetime
import dis
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from mcore_reshard.core.executor import Resharder
from mcore_reshard.core.planner import make_plan
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import materialize, reference_tensor

VICTIM = 2


def _phase_tensors(src, dst, rank: int):
    full = {p: {n: reference_tensor(n, m.shape, step=p) for n, m in src.tensors.items()} for p in (1, 2, 3)}
    return ({p: materialize(src, rank, full[p]) for p in full},
            {p: materialize(dst, rank, full[p], fill=0) for p in full})


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def _interrupted(call, offset: float) -> dict:
    """``call()`` with a real SIGINT sent to this process ``offset`` s after it starts (from a timer
    thread); the signal is always delivered inside this function (outcome "late": after the call
    returned)."""
    timer = threading.Timer(offset, os.kill, (os.getpid(), signal.SIGINT))
    o: dict = {"type": None}
    try:
        timer.start()
        o["result"] = call()
        o["returned"] = True
        timer.join()
        time.sleep(0.05)            # the handler runs at the next bytecode: here at the latest
    except KeyboardInterrupt as e:
        o["type"] = "KeyboardInterrupt"
        o["late"] = bool(o.get("returned"))
        o["error"] = str(e)[:200]
    except Exception as e:  # noqa: BLE001
        o["type"] = type(e).__name__
        o["error"] = str(e)[:400]
        timer.join()
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:
            o["late"] = True
    return o


_TRACED = ("mcore_reshard", "distributed_c10d.py", "contextlib.py")
_primed = False


class OpcodeTrap:
    """Counts the bytecode instructions executed in the library's frames (and torch.distributed's
    and contextlib's Python code); with ``at``, raises KeyboardInterrupt at instruction ``at`` --
    where a SIGINT arriving just then would surface.  Every instruction (a superset of where a
    signal can surface), or with ``signal_points`` only where CPython runs a pending signal's
    handler: at ``RESUME`` (a function's start, after a ``yield``), ``JUMP_BACKWARD`` and right after
    a ``CALL`` (counted after any call; the interpreter checks after calls into C)."""

    def __init__(self, at: int | None = None, signal_points: bool = False):
        self.at, self.n, self.fired, self.signal_points = at, 0, None, signal_points
        self.prev: dict = {}

    def _local(self, frame, event, arg):
        if event == "opcode":
            if self.signal_points:
                op = dis.opname[frame.f_code.co_code[frame.f_lasti]]
                prev, self.prev[id(frame)] = self.prev.get(id(frame), ""), op
                if op not in ("RESUME", "JUMP_BACKWARD") and not prev.startswith("CALL"):
                    return self._local
            self.n += 1
            if self.at is not None and self.n == self.at and self.fired is None:
                self.fired = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
                raise KeyboardInterrupt(f"injected at instruction {self.n}: {self.fired}")
        return self._local

    def _global(self, frame, event, arg):
        if any(t in frame.f_code.co_filename for t in _TRACED):
            frame.f_trace_opcodes = True
            return self._local
        return None

    def run(self, call):
        global _primed
        if not _primed:     # CPython 3.12: a process's first opcode tracing emits no opcode events
            _primed = True
            OpcodeTrap().run(lambda: contextlib.nullcontext().__enter__())
        sys.settrace(self._global)
        try:
            return call()
        finally:
            sys.settrace(None)


def _trapped(call, at: int) -> dict:
    """``call()`` with KeyboardInterrupt raised at its ``at``-th traced instruction."""
    trap = OpcodeTrap(at)
    o: dict = {"type": None}
    try:
        o["result"] = trap.run(call)
    except KeyboardInterrupt as e:
        o["type"] = "KeyboardInterrupt"
        o["error"] = str(e)[:200]
    except Exception as e:  # noqa: BLE001
        o["type"] = type(e).__name__
        o["error"] = str(e)[:400]
    o["where"] = trap.fired
    return o


def sigint_trials(rank: int, world: int, trials: list, T: float, scale: int = 4, budget: int = 1 << 20,
                  group_timeout: float | None = None) -> list:
    """``trials``: ``(fraction, explicit, wait[, how])`` each: the SIGINT lands ``fraction`` of a refit's
    duration (measured on the victim just before) into refit 2 (``how="opcode"``: KeyboardInterrupt
    at that fraction of the instructions the victim ran in a refit, :class:`OpcodeTrap`); ``explicit``: versions passed
    (1, 2, 2, 3) or None; ``wait``: every rank waits (WORLD barrier) for the others before the retry
    (else each retries at once, as it gets control back).  Every wait is bounded by ``T`` s: the
    groups' own timeout, or ``Resharder(timeout=T)`` on groups of ``group_timeout`` s (then a
    collective whose wait timed out stays posted on the group until ``group_timeout``)."""
    # a process started in the background by a shell ignores SIGINT (inherited): raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    src, dst = build_layouts("pp=3", "tp=1,dp=3", True, scale=scale)
    plan = make_plan(src, dst, budget_bytes=budget)
    S_of, want = _phase_tensors(src, dst, rank)
    out = []
    for trial in trials:
        fraction, explicit, wait = trial[:3]
        how = trial[3] if len(trial) > 3 else "signal"
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=group_timeout or T))
        S = {n: t.clone() for n, t in S_of[1].items()}
        D = {n: torch.full_like(t, 7) for n, t in want[1].items()}
        r = Resharder(plan, S, D, g, timeout=T if group_timeout else None)
        t0 = time.monotonic()
        r.refit(1 if explicit else None)
        t1 = time.monotonic()
        counter = OpcodeTrap()
        if how == "opcode" and rank == VICTIM:
            counter.run(lambda: r.refit(1 if explicit else None))
        else:
            r.refit(1 if explicit else None)   # warm: the duration the offset is a fraction of
        dur = time.monotonic() - t1
        first_ok = _same(D, want[1])
        for n, t in S.items():
            t.copy_(S_of[2][n])
        dist.barrier()

        warm = r.version

        def claims(final=None):
            """Buffers whose recorded version does not match their bytes: versions up to ``warm`` are
            phase 1; ``final`` (the last refit's version, once it returned) phase 3; others phase 2."""
            bad = []
            for n, v in r.state()["buffers"].items():
                p = None if v is None else 1 if v <= warm else 3 if v == final else 2
                if p is not None and not torch.equal(D[n].view(torch.uint8), want[p][n].view(torch.uint8)):
                    bad.append(n)
            return bad

        def call(fn):
            try:
                o = {"type": None, "result": fn()}
            except Exception as e:  # noqa: BLE001
                o = {"type": type(e).__name__, "error": str(e)[:400]}
            return o

        rec = {"rank": rank, "fraction": fraction, "explicit": explicit, "wait": wait, "dur": dur,
               "first_dur": t1 - t0, "warm_ok": first_ok}
        if rank == VICTIM and how == "opcode":
            o = _trapped(lambda: r.refit(2 if explicit else None)["version"], max(1, int(fraction * counter.n)))
            o["of"] = counter.n
        elif rank == VICTIM:
            o = _interrupted(lambda: r.refit(2 if explicit else None)["version"], fraction * dur)
        else:
            o = call(lambda: r.refit(2 if explicit else None)["version"])
        o["exact"] = _same(D, want[2])
        o["bad_claims"] = claims()
        o["state"] = r.state()
        rec["interrupted"] = o
        if wait:
            dist.barrier()
        o = call(lambda: r.refit(2 if explicit else None)["version"])
        o["exact"] = _same(D, want[2])
        o["bad_claims"] = claims()
        o["state"] = r.state()
        rec["retry"] = o
        for n, t in S.items():
            t.copy_(S_of[3][n])
        g2 = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=max(30.0, 10 * T)))
        rec["rebind"] = call(lambda: r.rebind(g2))
        o = call(lambda: r.refit(3 if explicit else None)["version"])
        o["exact"] = _same(D, want[3])
        o["bad_claims"] = claims(o.get("result"))
        o["state"] = r.state()
        rec["final"] = o
        out.append(rec)
        dist.barrier()
    return out
