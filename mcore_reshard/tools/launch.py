"""Run a function on N local gloo processes (demos and tests; real runs use torchrun or Ray).

Rendezvous is a file in a fresh temporary directory, so concurrent launches never collide on a
port, and gloo is bound to the loopback interface.  Results come back as JSON text.

:func:`spawn` returns every rank's result or raises; :func:`launch` returns every rank's
:class:`RankOutcome` (also of ranks that raised, died or never reported), for tests of failures::

    rank | fn            | launch(...)[rank]
    0    | returns 3     | RankOutcome(ok=True, result=3, error=None, exitcode=0)
    1    | raises        | RankOutcome(ok=False, result=None, error="Traceback ...", exitcode=0)
    2    | os._exit(1)   | RankOutcome(ok=False, result=None, error=None, exitcode=1)
"""
from __future__ import annotations

import datetime
import json
import os
import queue
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..util import notices

if os.environ.get(notices.ENV):     # a launched rank of a run that keeps third-party notices in a log:
    notices.capture()               # from here on, before torch is imported (util/notices.py)

import torch.multiprocessing as mp  # noqa: E402


@dataclass(frozen=True)
class RankOutcome:
    """What one launched rank reported: ``ok`` and its JSON ``result``, or the ``error`` traceback
    (``None`` when it never reported: killed, ``os._exit``, past the launch's timeout), and the exit
    code of its process (``None`` while still running when the launch gave up on it)."""
    ok: bool
    result: Any = None
    error: str | None = None
    exitcode: int | None = None


def _child(rank: int, world: int, init: str, timeout_s: float, fn: Callable, args: tuple, results,
           threads: int | None, leave_at_once: bool) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads:
        torch.set_num_threads(threads)
    try:
        if init.startswith("none:"):        # world=False: the ranks build their own groups
            os.environ["MCORE_RESHARD_LAUNCH_DIR"] = init[len("none:"):]
        else:
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        out = (rank, True, json.dumps(fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        out = (rank, False, traceback.format_exc())
    results.put(out)
    if leave_at_once:
        results.close()
        results.join_thread()   # flushed to the parent: now leave without tearing groups down
        os._exit(0)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, pg_timeout: float = 120.0,
           start_method: str = "spawn", preload: Sequence[str] = (), threads: int | None = None,
           leave_at_once: bool = False, world: bool = True) -> dict[int, RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; every rank's :class:`RankOutcome`.

    ``fn`` must be importable (module level) and return JSON-serialisable data.  Ranks still running
    after ``timeout`` seconds are killed (``ok=False``, no ``error``).  ``start_method="forkserver"``
    starts the children from a server that imported ``preload`` once (no effect once this process's
    forkserver runs); ``threads`` sets each child's torch threads; ``leave_at_once``: each child
    leaves with ``os._exit`` right after reporting, so a process group broken on purpose never
    blocks teardown.  ``world=False``: no process group is made; each child finds a fresh directory
    of its launch in ``$MCORE_RESHARD_LAUNCH_DIR`` for the rendezvous files of the groups it builds
    (processes that must share no group: a colocated pair).
    """
    tmp = tempfile.mkdtemp(prefix="mcore-reshard-")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    init = f"file://{tmp}/rendezvous" if world else f"none:{tmp}"
    procs = [ctx.Process(target=_child, args=(r, world_size, init, pg_timeout, fn, args, results,
                                              threads, leave_at_once), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=min(max(deadline - time.monotonic(), 0.01), 0.2))
                outcomes[rank] = (ok, payload)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    try:   # whatever was flushed just before the last exit
                        while True:
                            rank, ok, payload = results.get(timeout=0.5)
                            outcomes[rank] = (ok, payload)
                    except queue.Empty:
                        break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
    out = {}
    for r in range(world_size):
        ok, payload = outcomes.get(r, (False, None))
        out[r] = RankOutcome(ok, json.loads(payload) if ok else None, None if ok else payload, procs[r].exitcode)
    return out


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, pg_timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result.

    ``fn`` must be importable (module level) and return JSON-serialisable data.  Any child's
    exception is re-raised in the parent as RuntimeError carrying every failing rank's traceback;
    a launch slower than ``timeout`` seconds is killed and reported.
    """
    t0 = time.monotonic()
    outcomes = launch(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout)
    failed = {r: o.error for r, o in outcomes.items() if not o.ok and o.error is not None}
    missing = [r for r, o in outcomes.items() if not o.ok and o.error is None]
    if failed or missing:
        timed_out = bool(missing) and time.monotonic() - t0 >= timeout
        detail = "\n".join(f"--- rank {r} ---\n{text}" for r, text in failed.items())
        codes = {r: outcomes[r].exitcode for r in missing}
        raise RuntimeError((f"launch timed out after {timeout:.0f} s; " if timed_out else "") + f"{len(failed)} rank(s) failed"
                           + (f"; ranks {missing} never reported (exit codes {codes})" if missing else "")
                           + f":\n{detail}")
    return [outcomes[r].result for r in range(world_size)]
