"""The launcher of the reliability tests: ``mcore_reshard.tools.launch.launch`` (gloo, file
rendezvous, JSON results), where a rank that dies (``os._exit``) or raises does not fail the launch:
every rank's outcome comes back.  Each child leaves with ``os._exit`` right after reporting, so a
process group broken on purpose never blocks teardown.

Children start from a forkserver that has imported torch once (and Megatron-Core, with the same
preload list as ``megatron_cpu.spawn``, so the two share one server): a launch costs ~1 s instead of
~9 s of per-child imports on a 2-core machine.

``spawn_partial(fn, world, *args)`` -> ``{rank: {"ok": bool, "result": obj | None,
"error": str | None, "exitcode": int | None}}``.  Ranks that never reported have ``ok=False``.
"""
from __future__ import annotations

import dataclasses
import importlib.util

from mcore_reshard.tools.launch import launch


def _preload() -> list[str]:
    if importlib.util.find_spec("megatron") is not None:
        try:
            from mcore_reshard.testing import megatron_cpu as mcore_cpu
            return list(mcore_cpu.FORKSERVER_PRELOAD)
        except Exception:  # noqa: BLE001 - fall back to torch only
            pass
    return ["torch", "torch.distributed", "mcore_reshard.core.executor"]


def spawn_partial(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0,
                  start_method: str = "forkserver") -> dict:
    out = launch(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout, start_method=start_method,
                 preload=_preload(), threads=1, leave_at_once=True)
    return {r: dataclasses.asdict(o) for r, o in out.items()}


def spawn_ok(fn, world_size: int, *args, **kw) -> list:
    """``spawn_partial`` for launches where every rank must succeed: the per-rank results in rank
    order, or RuntimeError with every failing rank's traceback / exit code."""
    out = spawn_partial(fn, world_size, *args, **kw)
    bad = {r: o for r, o in out.items() if not o["ok"]}
    if bad:
        raise RuntimeError("; ".join(f"rank {r}: exit code {o['exitcode']}\n{o['error'] or '(no report)'}" for r, o in bad.items()))
    return [out[r]["result"] for r in range(world_size)]
