"""Run a function on N local gloo processes (demos and tests; real runs use torchrun or Ray).

Rendezvous is a file in a fresh temporary directory, so concurrent launches never collide on a
port, and gloo is bound to the loopback interface.  Results come back as JSON text.
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
from typing import Any, Callable

import torch.multiprocessing as mp


def _child(rank: int, world: int, init: str, timeout_s: float, fn: Callable, args: tuple, results) -> None:
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        results.put((rank, True, json.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, pg_timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result.

    ``fn`` must be importable (module level) and return JSON-serialisable data.  Any child's
    exception is re-raised in the parent as RuntimeError carrying every failing rank's traceback;
    a launch slower than ``timeout`` seconds is killed and reported.
    """
    tmp = tempfile.mkdtemp(prefix="mcore-reshard-")
    init = f"file://{tmp}/rendezvous"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world_size, init, pg_timeout, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, str]] = {}
    timed_out = False
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
                outcomes[rank] = (ok, payload)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    break  # everyone exited without reporting the rest
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    failed = {r: text for r, (ok, text) in sorted(outcomes.items()) if not ok}
    missing = sorted(set(range(world_size)) - set(outcomes))
    if failed or missing:
        detail = "\n".join(f"--- rank {r} ---\n{text}" for r, text in failed.items())
        codes = {i: procs[i].exitcode for i in missing}
        raise RuntimeError((f"launch timed out after {timeout:.0f} s; " if timed_out else "") + f"{len(failed)} rank(s) failed"
                           + (f"; ranks {missing} never reported (exit codes {codes})" if missing else "")
                           + f":\n{detail}")
    return [json.loads(outcomes[r][1]) for r in range(world_size)]
