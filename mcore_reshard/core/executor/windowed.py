"""Executor of a :class:`~mcore_reshard.core.planner.windows.WindowedPlan`: one :class:`Resharder`
per window, all on one staging buffer, refit window after window with the caller's work between.

``WindowedResharder(plan, src, dst, group)`` is collective.  ``dst`` is a mapping (every window's
buffers at once) or a callable ``dst(windows) -> [{name: tensor}, ...]`` giving each window's
tensors: a receiver that streams builds them over memory every window reuses (an engine's
loader-format window).  ``refit(version, after_window=f)`` then runs::

    window 0: refit start, rounds, confirmation     (Resharder.refit)
              f(0) on this rank                     | engine: post-load processing of window 0
    window 1: ...                                   | a failure of f(0) on any rank: refused
    ...                                             |   everywhere at window 1's start
    end:      one exchange: every rank's f() done   | so no rank reports success alone

The control messages are each window's start (one small all-gather) plus the final exchange:
``windows + 1`` per refit (a window has no confirmation of its own: its bytes have landed on this
rank when its rounds are done here, and a peer that failed makes the next window's start, or the
final exchange, fail on every rank).  ``state()`` merges the windows' (which refit version
each destination buffer holds).
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from .binding import staging_size
from .common import check_timeout, group_device
from .errors import ReshardError, TransferError
from .handshake import Step, agree, exchange, step_mismatch
from .resharder import Resharder


def _pick(tensors: Mapping, plan, side: str, rank: int) -> dict:
    want = plan.buffers[side].get(rank, {})
    return {n: t for n, t in tensors.items() if n in want}


class _OncePerRefit:
    """A watcher's check run once per refit, its answer given to every window."""

    def __init__(self, check):
        self.check, self.answer = check, None

    def reset(self) -> None:
        self.answer = None

    def __call__(self):
        if self.answer is None:
            self.answer = self.check()
        return self.answer


class WindowedResharder:
    """Binds a windowed plan to this rank's tensors (collective); ``refit`` streams it (see the module doc).

    ``src``: this rank's source tensors (every window's; each window takes those its plan reads).
    ``dst``: a mapping, or ``dst(windows)`` called once at construction, returning one mapping per window.  ``timeout``
    and ``verify`` as :class:`Resharder`'s.  A problem building the tensors on any rank makes every
    rank raise :class:`ReshardError` before anything is bound."""

    def __init__(self, plan, src: Mapping[str, torch.Tensor], dst, group=None, *, timeout: float | None = None,
                 verify: bool = False):
        from ..planner.windows import WindowedPlan
        if not isinstance(plan, WindowedPlan):
            raise TypeError(f"plan: expected a WindowedPlan (make_windowed_plan), not {type(plan).__name__}")
        if not isinstance(src, Mapping):
            raise TypeError(f"src: expected a mapping of buffer name -> tensor, not {type(src).__name__}")
        if not (isinstance(dst, Mapping) or callable(dst)):
            raise TypeError(f"dst: expected a mapping of buffer name -> tensor or a callable windows -> [mapping], "
                            f"not {type(dst).__name__}")
        self.plan, self.group = plan, group
        self._digest = plan.hash        # computed once: every refit's final exchange carries it
        self.timeout = check_timeout(timeout)
        self.rank = dist.get_rank(group)
        self.version = 0
        self.last_stats: dict = {}
        self._interrupted: dict | None = None
        errors: list[str] = []
        dsts: list[dict] = []
        try:
            given = dst(list(plan.windows)) if callable(dst) else [dst] * len(plan.windows)
            if len(given) != len(plan.windows) or not all(isinstance(g, Mapping) for g in given):
                raise TypeError(f"dst(windows) must return one mapping per window ({len(plan.windows)})")
            dsts = [_pick(g, p, "dst", self.rank) for g, p in zip(given, plan.plans)]
        except Exception as e:  # noqa: BLE001 - every rank must hear about it
            errors.append(f"rank {self.rank}: building the windows' destination tensors failed: "
                          f"{type(e).__name__}: {str(e)[:300]}")
            dsts = [{} for _ in plan.plans]
        if isinstance(dst, Mapping) and not errors:
            wanted = {n for p in plan.plans for n in p.buffers["dst"].get(self.rank, {})}
            extra = sorted(set(dst) - wanted)
            if extra:
                errors.append(f"rank {self.rank}: {len(extra)} dst tensor(s) no window writes: {', '.join(extra[:8])}")
        agree(group, self._digest, errors, options=f"windows={len(plan.windows)}", timeout=self.timeout)
        tensors = [t for d in dsts for t in d.values()] + list(src.values())
        device = tensors[0].device if tensors else group_device(group)
        self.staging = torch.empty(max((staging_size(p, self.rank, verify) for p in plan.plans), default=0),
                                   dtype=torch.uint8, device=device)
        # no per-window confirmation: a window's bytes have landed here when its rounds are done here, a
        # peer that failed makes the next window's start (or the final exchange) fail on every rank
        self._watchers: list[_OncePerRefit] = []
        self.windows = [Resharder(p, _pick(src, p, "src", self.rank), d, group, timeout=timeout, verify=verify,
                                  staging=self.staging, confirm=False) for p, d in zip(plan.plans, dsts)]

    def watch(self, side: str, check) -> None:
        """As :meth:`Resharder.watch`, for every window: ``check()`` runs once per refit (its record of
        what it saw changes when it reports a replacement) and every window follows or refuses what it
        reports for the buffers that window binds."""
        if side not in ("src", "dst") or not callable(check):
            raise ValueError(f"watch(side={side!r}, check={check!r}): side is 'src' or 'dst', check a callable")
        once = _OncePerRefit(check)
        self._watchers.append(once)
        for r in self.windows:
            r.watch(side, once)

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel()

    @property
    def dst(self) -> dict:
        """Every window's bound destination tensors on this rank."""
        return {n: t for r in self.windows for n, t in r.dst.items()}

    def refit(self, version: int | None = None, *, refusal: list[str] | None = None,
              after_window: Callable[[int], None] | None = None) -> dict:
        """Every window in order (collective), ``after_window(i)`` on this rank after window ``i``
        has landed everywhere.  ``refusal``: this rank's reasons not to refit (every rank raises
        at the first window's start, before any byte moves).  An exception of ``after_window`` on
        any rank makes every rank raise (at the next window's start, or in the final exchange).
        Returns this rank's counts, ``windows`` and the seconds spent in ``after_window``."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                    or not 0 <= version < 1 << 63):
            raise ValueError(f"version={version!r}: must be an integer in [0, 2**63) (or None)")
        out = {"messages_sent": 0, "staged_bytes_sent": 0, "unstaged_bytes_sent": 0, "windows": len(self.windows),
               "after_window_s": 0.0, "transfer_s": 0.0}
        v = version
        failed: list[str] = []
        for once in self._watchers:
            once.reset()
        try:
            for i, r in enumerate(self.windows):
                t0 = time.monotonic()
                reasons = list(refusal or ()) if i == 0 else failed
                st = r.refit(v, refusal=reasons or None)
                out["transfer_s"] += time.monotonic() - t0
                v = st["version"]
                for k in ("messages_sent", "staged_bytes_sent", "unstaged_bytes_sent"):
                    out[k] += st.get(k, 0)
                if after_window is not None:
                    t0 = time.monotonic()
                    try:
                        after_window(i)
                    except Exception as e:  # noqa: BLE001 - refused everywhere at the next step
                        failed = [f"its work after window {i} failed: {type(e).__name__}: {str(e)[:300]}"]
                    out["after_window_s"] += time.monotonic() - t0
            self._end(v if v is not None else 0, failed)
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised: state() says what is half-applied
            self._interrupted = {"version": v, "error": f"{type(e).__name__}: {e}"}
            raise
        self._interrupted = None
        self.version = v if v is not None else self.version
        out["version"] = self.version
        self.last_stats = out
        return out

    def _end(self, v: int, failed: list[str]) -> None:
        """The final exchange: every rank's work after the last window done (else every rank raises)."""
        try:
            msgs = exchange(self.group, Step.WINDOWED_END, digest=self._digest, version=v, ok=not failed,
                            text="; ".join(failed), timeout=self.timeout)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"refit {v}: rank {self.rank} moved every window but the final exchange failed: "
                                f"another rank died or stopped part-way; cause: {type(e).__name__}: {str(e)[:300]}",
                                version=v, round=0) from e
        problems = [f"rank {q}: {m['text']}" for q, m in enumerate(msgs) if not m["ok"]]
        step = step_mismatch(msgs, Step.WINDOWED_END)
        if step:
            problems.append(step)
        if problems:
            raise ReshardError(f"refit {v}: every window moved, but " + " | ".join(problems))

    def state(self) -> dict:
        """Refit version each destination buffer holds (see :meth:`Resharder.state`), every window's;
        ``windows_done``: how many windows hold the last refit attempted (the others, the one before)."""
        buffers: dict = {}
        interrupted = self._interrupted is not None
        for r in self.windows:
            s = r.state()
            buffers.update(s["buffers"])
            interrupted = interrupted or s["interrupted"]
        info = self._interrupted or {}
        return {"version": self.version, "buffers": buffers, "incomplete": sorted(n for n, v in buffers.items() if v is None),
                "interrupted": interrupted, "interrupted_version": info.get("version"), "error": info.get("error"),
                "windows": len(self.windows)}

    def rebind(self, group=None) -> None:
        """Collective: every window's :meth:`Resharder.rebind` to ``group``."""
        for r in self.windows:
            r.rebind(group)
        self.group = group


__all__ = ["WindowedResharder"]
