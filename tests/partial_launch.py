"""A launcher for the reliability tests: like ``mcore_reshard.tools.launch.spawn`` (gloo, file
rendezvous, JSON results) but a rank that dies (``os._exit``) or raises does not fail the launch:
every rank's outcome comes back.  Each child leaves with ``os._exit`` right after reporting, so a
process group broken on purpose never blocks teardown.

Children start from a forkserver that has imported torch once (and Megatron-Core, with the same
preload list as ``megatron_cpu.spawn``, so the two share one server): a launch costs ~1 s instead of
~9 s of per-child imports on a 2-core machine.

``spawn_partial(fn, world, *args)`` -> ``{rank: {"ok": bool, "result": obj | None,
"error": str | None, "exitcode": int | None}}``.  Ranks that never reported have ``ok=False``.
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

import importlib.util

import torch.multiprocessing as mp


def _preload() -> list[str]:
    if importlib.util.find_spec("megatron") is not None:
        try:
            from mcore_reshard.testing import megatron_cpu as mcore_cpu
            return list(mcore_cpu._FORKSERVER_PRELOAD)
        except Exception:  # noqa: BLE001 - fall back to torch only
            pass
    return ["torch", "torch.distributed", "mcore_reshard.core.executor"]


def _child(rank: int, world: int, init: str, pg_timeout: float, fn, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        out = (rank, True, json.dumps(fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        out = (rank, False, traceback.format_exc())
    results.put(out)
    results.close()
    results.join_thread()   # flushed to the parent: now leave without tearing groups down
    os._exit(0)


def spawn_partial(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0,
                  start_method: str = "forkserver") -> dict:
    tmp = tempfile.mkdtemp(prefix="mcore-reshard-partial-")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":   # no effect once this process's forkserver runs
        ctx.set_forkserver_preload(_preload())
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world_size, f"file://{tmp}/rendezvous", pg_timeout, fn, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.2)
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
        out[r] = {"ok": ok, "result": json.loads(payload) if ok else None, "error": None if ok else payload,
                  "exitcode": procs[r].exitcode}
    return out


def spawn_ok(fn, world_size: int, *args, **kw) -> list:
    """``spawn_partial`` for launches where every rank must succeed: the per-rank results in rank
    order, or RuntimeError with every failing rank's traceback / exit code."""
    out = spawn_partial(fn, world_size, *args, **kw)
    bad = {r: o for r, o in out.items() if not o["ok"]}
    if bad:
        raise RuntimeError("; ".join(f"rank {r}: exit code {o['exitcode']}\n{o['error'] or '(no report)'}" for r, o in bad.items()))
    return [out[r]["result"] for r in range(world_size)]
