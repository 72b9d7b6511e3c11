"""Windowed plans: a destination cut into consecutive *windows* of whole modules, one plan per window.

A streamed refit (an engine that must run post-load processing on a module once its last byte
has arrived, with no second copy of its weights) moves one window at a time: the window's plan
completes within its own rounds, then the receiver processes those modules and reuses the
window's memory for the next one.  Every rank -- sender or receiver -- derives the same windows
from the destination layout and the agreed ``window_bytes`` alone (:func:`partition`), so the
windowed plan is as deterministic and hashable as one plan, and its bytes over the network are
the sum of each window's lower bound: the whole transfer's lower bound.

A *module* is a destination buffer's name without its last component (``model.layers.0.mlp.
experts.w13_weight`` -> ``model.layers.0.mlp.experts``), the unit an engine processes.  Modules
are taken in natural order (``layers.2`` before ``layers.10``) and packed greedily: a module joins
the current window while every rank's bytes in the window stay within ``window_bytes``; a module
larger than that on some rank gets a window of its own.  Example, ``window_bytes`` 96 KiB, two
engine ranks (TP2), a dense layer::

    window | modules                                    | rank 2 B  | rank 3 B
    0      | model.embed_tokens                         | 16,384    | 16,384
    1      | model.layers.0.input_layernorm             | 73,856    | 73,856
           | model.layers.0.self_attn.kv_a_proj_with_mqa|           |
    2      | model.layers.0.self_attn.kv_b_proj         | 131,072   | 131,072   (> 96 KiB: alone)
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Mapping

from ..gcpause import paused_gc
from ..layout import Buffer, Layout
from .plan import PlanError

WINDOWED_PLAN_VERSION = 1
DEFAULT_WINDOW = 1 << 30      # bytes of one window's destination buffers per rank (1 GiB)
_DIGITS = re.compile(r"(\d+)")


def module_of(buffer: str) -> str:
    """The module a destination buffer belongs to: its name without the last component."""
    return buffer.rpartition(".")[0]


def natural_key(name: str) -> tuple:
    """Sort key that orders the numbers inside a name by value (``layers.2`` < ``layers.10``)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in _DIGITS.split(name) if p)


@dataclass(frozen=True)
class Window:
    """One window: its modules (natural order) and, per destination rank, its buffers and their bytes."""
    modules: tuple[str, ...]
    buffers: dict[int, tuple[str, ...]]
    nbytes: dict[int, int]

    def to_json(self) -> dict:
        return {"modules": list(self.modules), "buffers": {str(r): list(b) for r, b in sorted(self.buffers.items())},
                "nbytes": {str(r): n for r, n in sorted(self.nbytes.items())}}

    @staticmethod
    def from_json(o: Mapping) -> "Window":
        return Window(tuple(o["modules"]), {int(r): tuple(b) for r, b in o["buffers"].items()},
                      {int(r): int(n) for r, n in o["nbytes"].items()})


def check_window_bytes(value) -> int:
    """``window_bytes`` as an int of at least 1 KiB (:class:`PlanError`, a ValueError, naming it otherwise)."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1024:
        raise PlanError(f"window_bytes={value!r}: must be an integer number of bytes >= 1024 (the destination "
                        "bytes of one window per rank)")
    return int(value)


def _buffer_bytes(buf: Buffer) -> int:
    from ..layout import itemsize
    n = itemsize(buf.dtype)
    for s in buf.shape:
        n *= s
    return n


def partition(dst: Layout, window_bytes: int) -> list[Window]:
    """The windows of ``dst`` (see the module doc): deterministic from the layout and the budget."""
    window_bytes = check_window_bytes(window_bytes)
    by_module: dict[str, dict[int, list[str]]] = {}
    sizes: dict[str, dict[int, int]] = {}
    for r in dst.ranks:
        for name, buf in dst.buffers[r].items():
            mod = module_of(name)
            by_module.setdefault(mod, {}).setdefault(r, []).append(name)
            per = sizes.setdefault(mod, {})
            per[r] = per.get(r, 0) + _buffer_bytes(buf)
    windows: list[Window] = []
    cur: list[str] = []
    used: dict[int, int] = {}

    def close():
        if not cur:
            return
        bufs: dict[int, list[str]] = {}
        for m in cur:
            for r, names in by_module[m].items():
                bufs.setdefault(r, []).extend(sorted(names, key=natural_key))
        windows.append(Window(tuple(cur), {r: tuple(b) for r, b in sorted(bufs.items())},
                              {r: used[r] for r in sorted(bufs)}))

    for mod in sorted(by_module, key=natural_key):
        need = sizes[mod]
        if cur and any(used.get(r, 0) + n > window_bytes for r, n in need.items()):
            close()
            cur, used = [], {}
        cur.append(mod)
        for r, n in need.items():
            used[r] = used.get(r, 0) + n
    close()
    return windows


def restrict(layout: Layout, buffers: Mapping[int, object] | None = None, tensors: set | None = None) -> Layout:
    """``layout`` with only the buffers named in ``buffers`` (rank -> names; None: every buffer) and,
    when ``tensors`` is given, only the pieces of those tensors (a buffer left with none is
    dropped).  Buffers kept whole stay the same objects (replicas stay recognisable)."""
    out = Layout()
    made: dict[int, Buffer] = {}
    for r in layout.ranks:
        keep = None if buffers is None else set(buffers.get(r, ()))
        for name, buf in layout.buffers[r].items():
            if keep is not None and name not in keep:
                continue
            if tensors is not None:
                new = made.get(id(buf))
                if new is None:
                    pieces = tuple(p for p in buf.pieces if p.tensor in tensors)
                    new = made[id(buf)] = buf if len(pieces) == len(buf.pieces) else \
                        Buffer(buf.name, buf.shape, buf.dtype, pieces)
                buf = new
                if not buf.pieces:
                    continue
            for p in buf.pieces:
                m = layout.tensors[p.tensor]
                if p.tensor not in out.tensors:
                    out.tensors[p.tensor] = m
            out.buffers.setdefault(r, {})[name] = buf
    return out


@dataclass
class WindowedPlan:
    """One plan per window (same order as ``windows``), ``window_bytes`` the agreed budget.  Plain
    data: ``to_json`` / ``from_json``, a sha256 ``hash`` over the windows and every plan's hash."""
    window_bytes: int
    windows: list[Window]
    plans: list
    stats: dict = field(default_factory=dict)

    @property
    def budget_bytes(self) -> int:
        return max((p.budget_bytes for p in self.plans), default=0)

    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.plans)

    @property
    def ranks(self) -> list[int]:
        return sorted({r for p in self.plans for r in p.ranks})

    @property
    def messages(self) -> list:
        """Every window's messages, window after window (rounds numbered within each window)."""
        return [m for p in self.plans for m in p.messages]

    @property
    def local_copies(self) -> list:
        return [c for p in self.plans for c in p.local_copies]

    def to_json(self) -> dict:
        return {"version": WINDOWED_PLAN_VERSION, "window_bytes": self.window_bytes,
                "windows": [w.to_json() for w in self.windows], "plans": [p.to_json() for p in self.plans],
                "stats": self.stats}

    @staticmethod
    def from_json(o: Mapping) -> "WindowedPlan":
        from .plan import Plan
        if not isinstance(o, Mapping) or o.get("version") != WINDOWED_PLAN_VERSION:
            raise PlanError(f"windowed plan version {o.get('version') if isinstance(o, Mapping) else o!r} "
                            f"is not {WINDOWED_PLAN_VERSION}")
        windows = [Window.from_json(w) for w in o["windows"]]
        plans = [Plan.from_json(p) for p in o["plans"]]
        if len(windows) != len(plans):
            raise PlanError(f"windowed plan: {len(windows)} windows but {len(plans)} plans")
        return WindowedPlan(int(o["window_bytes"]), windows, plans, dict(o.get("stats", {})))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    @paused_gc()
    def hash(self) -> str:
        obj = {"version": WINDOWED_PLAN_VERSION, "window_bytes": self.window_bytes,
               "windows": [w.to_json() for w in self.windows], "plans": [p.hash for p in self.plans]}
        return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def summary(self) -> str:
        s = self.stats
        return "\n".join([
            f"windows            {len(self.windows)} (window budget {self.window_bytes:,} B/rank, largest "
            f"{s.get('max_window_bytes', 0):,} B" + (f"; {s['oversize_windows']} module(s) alone over budget"
                                                     if s.get("oversize_windows") else "") + ")",
            f"bytes over network {s.get('network_bytes', 0):,} (lower bound {s.get('lower_bound_bytes', 0):,})",
            f"rounds             {self.rounds} (staging budget {self.budget_bytes:,} B/rank)",
        ])


def make_windowed_plan(src: Layout, dst: Layout, *, window_bytes: int = DEFAULT_WINDOW, make_plan=None,
                       **plan_kw) -> WindowedPlan:
    """One plan per window of ``dst`` (:func:`partition`), each from the source pieces it needs.

    ``plan_kw`` are :func:`~mcore_reshard.core.planner.make_plan`'s (``budget_bytes``,
    ``allow_cast``, ``ignore_unused``, ``templates``): the tensor checks (missing sources, unused
    sources, shapes, casts) run once over the whole layouts, with the same errors as one plan."""
    from . import make_plan as _make_plan
    from .index import _check_tensors
    make = make_plan or _make_plan
    for what, lay in (("src", src), ("dst", dst)):
        if not isinstance(lay, Layout):
            raise TypeError(f"make_windowed_plan: {what}={type(lay).__name__}: must be a Layout")
    window_bytes = check_window_bytes(window_bytes)
    _check_tensors(src, dst, bool(plan_kw.get("allow_cast", False)), bool(plan_kw.get("ignore_unused", False)))
    windows = partition(dst, window_bytes)
    # where each tensor sits in the source: a window plans from the source buffers holding its tensors only
    src_buffers: dict[str, dict[int, set]] = {}
    for r in src.ranks:
        for name, buf in src.buffers[r].items():
            for p in buf.pieces:
                src_buffers.setdefault(p.tensor, {}).setdefault(r, set()).add(name)
    kw = dict(plan_kw, ignore_unused=True)
    plans = []
    with paused_gc():
        for w in windows:
            wdst = restrict(dst, w.buffers)
            need = set(wdst.tensors)
            holders: dict[int, set] = {}
            for t in need:
                for r, names in src_buffers.get(t, {}).items():
                    holders.setdefault(r, set()).update(names)
            plans.append(make(restrict(src, holders, need), wdst, **kw))
    stats = {"windows": len(windows),
             "max_window_bytes": max((n for w in windows for n in w.nbytes.values()), default=0),
             "oversize_windows": sum(1 for w in windows if any(n > window_bytes for n in w.nbytes.values())),
             "network_bytes": sum(p.stats.get("network_bytes", 0) for p in plans),
             "lower_bound_bytes": sum(p.stats.get("lower_bound_bytes", 0) for p in plans),
             "local_bytes": sum(p.stats.get("local_bytes", 0) for p in plans),
             "messages": sum(p.stats.get("messages", 0) for p in plans)}
    return WindowedPlan(window_bytes, windows, plans, stats)


__all__ = ["DEFAULT_WINDOW", "WINDOWED_PLAN_VERSION", "Window", "WindowedPlan", "check_window_bytes",
           "make_windowed_plan", "module_of", "natural_key", "partition", "restrict"]
