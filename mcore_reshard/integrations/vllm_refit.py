"""One vLLM engine rank's bound refit (the weight-transfer backend and the worker extension share it).

:func:`join_engine` (collective with the trainer ranks) binds the plan in the chosen mode
(:mod:`~.vllm_refit_modes`); the :class:`EngineRefit` it returns then runs every refit::

    call          | stream (default)                          | shadow
    transfer(v)   | guard closed; window after window: land,  | the transfer starts in a background
                  |  vLLM's processing of its modules         |  thread into the shadow copy; returns
    complete(f)   | f() (post-refit hooks); guard opened      | waits for the transfer; guard closed;
                  |                                           |  swap (copy-in + processing); f(); opened
    refit(v, f)   | transfer(v) + complete(f)                 | the same, the engine paused throughout

The :class:`ServingGuard` makes the engine refuse to generate (:class:`ReshardError` from the
model's forward) while its kernel tensors may hold a mix of two weight versions: from the first
byte written into them until a refit completes.  A refit refused before any byte moved leaves the
guard open (the engine still serves the previous version exactly); one that fails after, leaves it
closed until a later refit completes (after a new group: ``init_weight_transfer_engine`` /
``mcore_reshard_join`` again).  In shadow mode a failed *transfer* touches nothing the engine
computes with: the engine keeps serving the previous version.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from ..core.executor import ReshardError
from .protocol import join_refit
from .vllm_postload import PostLoad, unwritten
from .vllm_refit_modes import ShadowBuffers, StreamWindows, check_mode

_GUARD_ATTR = "_mcore_reshard_guard"


class ServingGuard:
    """Refuses generation on one model while its weights are half-refit: a forward pre-hook that
    raises :class:`ReshardError` with the reason, installed by :meth:`close`, removed by
    :meth:`open`.  One per model (:func:`guard_of`), whichever path refits it.  (A forward hook:
    an engine replaying whole CUDA graphs does not call the model's forward; read :meth:`state`
    before generating there.)"""

    def __init__(self, model: torch.nn.Module, name: str = "model"):
        self.model, self.name = model, name
        self.reason: str | None = None
        self._handle = None

    def close(self, reason: str) -> None:
        self.reason = reason
        if self._handle is None:
            self._handle = self.model.register_forward_pre_hook(self._refuse)

    def open(self) -> None:
        self.reason = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def serving(self) -> bool:
        return self.reason is None

    def state(self) -> dict:
        return {"serving": self.serving, "reason": self.reason}

    def _refuse(self, module, args):
        raise ReshardError(f"mcore_reshard: this engine refuses to generate with its {self.name}: {self.reason}")


def guard_of(model: torch.nn.Module, name: str = "model") -> ServingGuard:
    """The model's :class:`ServingGuard` (made on first use, kept on the model)."""
    g = model.__dict__.get(_GUARD_ATTR)
    if g is None:
        g = model.__dict__[_GUARD_ATTR] = ServingGuard(model, name)
    return g


def join_engine(group, rank: int, post: PostLoad | None, dst, tensors: dict, error: str | None, *, mode: str,
                window_bytes: int, models: list, timeout: float, identity=None, colocated=None,
                **plan_kw) -> "EngineRefit":
    """Collective with the trainer ranks' :func:`~.protocol.join_refit`: binds this rank's ``tensors``
    (from ``post``, the runtime names the layout part ``dst`` gives it) in ``mode`` (``stream``
    asks for a plan in windows of ``window_bytes``).  Any ``error`` (or one found here) makes every
    rank refuse.  ``identity``: the modules holding what the refit writes
    (:func:`~.protocol.engine_identity`): one the engine replaced later makes every rank refuse.
    ``colocated``: the :class:`~mcore_reshard.colocate.ColocatedPeer` of the trainer rank on this
    worker's device: its part and mapped tensors join as this rank's source, its watcher checks
    every refit, and every refit reports "done" to it (:meth:`EngineRefit.transfer`)."""
    check_mode(mode)
    buffers = None
    if colocated is not None and error is None:
        plan_kw.update(src=colocated.layout, src_tensors=colocated.tensors)
    if error is None and post is not None:
        errs = unwritten(post, tensors)
        error = " | ".join(f"rank {rank}: {e}" for e in errs) or None
    if mode == "stream":
        stream = StreamWindows(post, rank) if post is not None and error is None else None
        dst_tensors = (lambda windows: _stream_tensors(stream, tensors, windows)) if stream is not None else tensors
        r = join_refit(group, dst=dst if error is None else None, dst_tensors=dst_tensors if error is None else {},
                       error=error, window_bytes=window_bytes, timeout=timeout, **plan_kw)
        if stream is not None:
            stream.free()
        buffers = stream
    else:
        shadow = ShadowBuffers(post, tensors) if post is not None and error is None else None
        r = join_refit(group, dst=dst if error is None else None,
                       dst_tensors=shadow.tensors if shadow is not None else {}, error=error, timeout=timeout, **plan_kw)
        buffers = shadow
    if colocated is not None:
        r.watch("src", colocated.check)
    return EngineRefit(r, rank, post, buffers, mode, models, identity, colocated)


def _stream_tensors(stream: StreamWindows, tensors: dict, windows) -> list[dict]:
    """Each window's tensors: the arena's loader-format ones, the live parameters otherwise."""
    placed = stream.tensors(windows)
    return [{n: t for n, t in window.items() if n in tensors} for window in placed]


class EngineRefit:
    """A bound refit of one engine rank in one mode (see the module doc)."""

    def __init__(self, resharder, rank: int, post: PostLoad | None, buffers, mode: str, models: list, identity=None,
                 colocated=None):
        self.resharder, self.rank, self.post, self.buffers, self.mode = resharder, rank, post, buffers, mode
        self.identity, self.colocated = identity, colocated
        self.guards = [guard_of(m, "MTP draft model" if i else "model") for i, m in enumerate(models)]
        self._job: threading.Thread | None = None
        self._job_result: dict = {}
        self._landed = False            # stream: the last transfer completed (complete() may open the guard)
        self.last: dict = {}

    # ------------------------------------------------------------------ steps
    def transfer(self, version: int | None) -> dict:
        """Stream: every window, each processed as it lands.  Shadow: start the transfer into the
        shadow copy in a background thread and return (the engine keeps generating)."""
        if self._job is not None:
            raise ReshardError(f"rank {self.rank}: a refit transfer is still running in the background: "
                               "complete() it first")
        refusal = self.post.check_storage() if self.post is not None else []
        if self.identity is not None:      # a module the engine replaced since prepare: refused everywhere
            refusal += self.identity.check()[0]
        if self.mode == "shadow":
            self._job_result = {}
            self._job = threading.Thread(target=self._shadow_transfer, args=(version, refusal), daemon=True,
                                         name=f"mcore-reshard-refit-rank{self.rank}")
            self._job.start()
            return {"rank": self.rank, "mode": "shadow", "started": True}
        return self._stream(version, refusal)

    def complete(self, post_refit: Callable[[dict], dict] | None = None) -> dict:
        """Finish the refit: (shadow: wait for the transfer, then the swap;) ``post_refit(report)``
        (the post-refit hooks); the guard opened.  Returns the report (``post_load``: the processing)."""
        rep: dict = {"rank": self.rank, "mode": self.mode}
        if self.mode == "shadow":
            if self._job is None:
                raise ReshardError(f"rank {self.rank}: complete() without a transfer() in flight")
            t0 = time.monotonic()
            self._job.join()
            self._job = None
            res = self._job_result
            rep["waited_s"] = round(time.monotonic() - t0, 4)
            if "error" in res:
                raise res["error"]
            rep["transfer"] = res["stats"]
            self._close(f"the swap to refit {res['stats'].get('version')} is in progress")
            t0 = time.monotonic()
            try:
                pl = self.buffers.swap() if self.buffers is not None else {}
            except BaseException as e:
                self._close(f"the swap to refit {res['stats'].get('version')} failed half-way ({type(e).__name__}: "
                            f"{str(e)[:200]}): refit again")
                raise
            rep["post_load"] = {**pl, "seconds": round(time.monotonic() - t0, 4)}
        else:
            if not self._landed:
                raise ReshardError(f"rank {self.rank}: completing a refit whose transfer did not complete (it "
                                   "failed, or never ran): the engine keeps refusing to generate until one does")
            self._landed = False
            rep["post_load"] = dict(self.last.get("post_load", {}))
        if post_refit is not None:
            rep["post_refit"] = post_refit(rep)
        self._open()
        return rep

    def refit(self, version: int | None, post_refit: Callable[[dict], dict] | None = None) -> dict:
        """:meth:`transfer` then :meth:`complete` (the engine paused throughout)."""
        out = self.transfer(version)
        return {**out, **self.complete(post_refit)}

    @property
    def in_flight(self) -> bool:
        """A shadow transfer started and not yet completed (its thread may have finished)."""
        return self._job is not None

    def transfer_done(self) -> bool:
        return self._job is None or not self._job.is_alive()

    # ------------------------------------------------------------------ modes
    def _shadow_transfer(self, version, refusal) -> None:
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                stats = self._run(lambda: self.resharder.refit(version, refusal=refusal or None))
            self._job_result = {"stats": {**stats, "seconds": round(time.monotonic() - t0, 4)}}
        except BaseException as e:  # noqa: BLE001 - handed to complete()
            self._job_result = {"error": e}

    def _stream(self, version, refusal) -> dict:
        r, buffers = self.resharder, self.buffers
        self._landed = False
        before = r.state()["buffers"]
        if buffers is not None:
            buffers.begin()
        self._close(f"refit {version if version is not None else ''} is in progress".replace("  ", " "))
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                stats = self._run(lambda: r.refit(version, refusal=refusal or None,
                                                  after_window=buffers.after_window if buffers is not None else None))
        except BaseException as e:
            if buffers is not None:
                buffers.free()
            after = r.state()["buffers"]
            if after == before:
                self._open()       # refused before any byte moved: the previous version, exactly
            else:
                moved = sum(1 for n, v in after.items() if v != before.get(n))
                self._close(f"refit {version} failed after {moved} of {len(after)} of its tensors on this rank were "
                            f"written ({type(e).__name__}: {str(e)[:200]}): the weights mix two versions until a "
                            "refit succeeds")
            raise
        pl = buffers.end() if buffers is not None else {}
        pl["seconds"] = round(stats.get("after_window_s", 0.0), 4)
        self.last = {"post_load": pl}
        self._landed = True
        return {"rank": self.rank, **stats, "seconds": round(time.monotonic() - t0, 3), "mode": "stream",
                "arena_bytes": buffers.arena_bytes if buffers is not None else 0}

    def _run(self, refit):
        """A colocated worker tells its trainer rank when it has read the mapped weights (ok or not)."""
        return self.colocated.run(refit) if self.colocated is not None else refit()

    # ------------------------------------------------------------------ guard and state
    def _close(self, reason: str) -> None:
        for g in self.guards:
            g.close(reason)

    def _open(self) -> None:
        for g in self.guards:
            g.open()

    def state(self) -> dict:
        """The resharder's state, whether the engine serves (the guard) and what the mode holds now."""
        s = self.resharder.state()
        s.update(mode=self.mode, serving=all(g.serving for g in self.guards),
                 mapped_bytes=self.colocated.mapped_bytes if self.colocated is not None else 0,
                 refusing=next((g.reason for g in self.guards if not g.serving), None),
                 transfer_in_flight=self.in_flight,
                 held_bytes=self.buffers.held_bytes if self.buffers is not None else 0)
        return s

    def rebind(self, group) -> None:
        self.resharder.rebind(group)


__all__ = ["EngineRefit", "ServingGuard", "guard_of", "join_engine"]
