"""Where a vLLM refit writes the loader format, and when vLLM's post-load processing runs: the modes.

    mode    | held between refits               | during a refit               | the engine pauses for
    stream  | nothing but the staging buffer    | one window of modules' loader| the whole transfer (windows
    (default)| (and metadata)                   | format + the deferred ones   |  land, are processed, freed)
    shadow  | a loader-format copy of every     | the same                     | post-load processing and the
            | parameter the refit writes        |                              |  copy-in only: the transfer
            |                                   |                              |  runs while it generates

**stream** (:class:`StreamWindows`): the plan is cut into windows of whole modules
(:mod:`mcore_reshard.core.planner.windows`); window ``i``'s tensors are the live parameters on the
direct path and, on the reprocess path, loader-format tensors over one *arena* that every window
reuses.  After window ``i`` has landed, vLLM's processing runs over its modules and their kernel
tensors take the result (:meth:`~.vllm_postload.PostLoad.process`); modules an attention layer
reads (MLA's ``kv_b_proj``) sit after the arena's window region until the attention layers are
processed, last.  The arena exists only during a refit: its storage is freed when the refit ends
(``untyped_storage().resize_(0)``) and allocated again at the next start (the bound tensors keep
their storage object; the executor follows the new address).  Between windows, kernel tensors of
processed modules already hold the new weights: the engine must not generate until the refit
completes (:class:`~.vllm_refit.ServingGuard`).

**shadow** (:class:`ShadowBuffers`): every tensor the refit writes has a persistent loader-format
copy (the reprocess path's of vLLM's parameter classes, the direct path's plain clones); the
transfer touches nothing the engine computes with, so it can run while the engine generates;
:meth:`ShadowBuffers.swap` then copies the direct ones in and runs the processing.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .vllm_postload import PostLoad, Reprocessed, loader_tensor, span_bytes

REFIT_MODES = ("stream", "shadow")
_ALIGN = 256          # bytes: every loader-format tensor in the arena starts aligned


def check_mode(mode) -> str:
    if mode not in REFIT_MODES:
        raise ValueError(f"refit_mode={mode!r}: expected one of {', '.join(map(repr, REFIT_MODES))}")
    return mode


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class ShadowBuffers:
    """Mode ``shadow``: a persistent loader-format copy of every tensor ``post`` writes (``names``:
    the runtime names bound), allocated once; :meth:`swap` makes the engine compute with it."""

    def __init__(self, post: PostLoad, names):
        self.post = post
        self.tensors: dict[str, torch.Tensor] = {}
        self.raw: dict[int, tuple[Reprocessed, dict]] = {}     # id(record) -> (record, its loader tensors)
        self.direct: list[tuple[str, torch.Tensor, torch.Tensor]] = []   # (name, shadow, live)
        for name in names:
            t = post.tensors[name]
            owner = post.owner.get(name)
            if owner is None:
                shadow = t.detach().clone()
                self.direct.append((name, shadow, t))
            else:
                rec, pname = owner
                shadow = loader_tensor(rec.loader[pname], device=post.device)
                self.raw.setdefault(id(rec), (rec, {}))[1][pname] = shadow
            self.tensors[name] = shadow

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def swap(self) -> dict:
        """Copy the direct shadows into the live parameters, then vLLM's processing of every
        reprocessed module (the deferred ones and the attention layers last)."""
        with torch.no_grad():
            for _, shadow, live in self.direct:
                live.copy_(shadow)
        pairs = list(self.raw.values())
        rep = self.post.process([p for p in pairs if not p[0].deferred])
        last = self.post.process([p for p in pairs if p[0].deferred], final=True)
        return _merge(rep, last)


class StreamWindows:
    """Mode ``stream``: one arena for a window's loader-format tensors (see the module doc).

    :meth:`tensors` (given to :class:`~mcore_reshard.core.executor.WindowedResharder`) builds every
    window's destination tensors on this ``rank``; :meth:`begin`, :meth:`after_window` and
    :meth:`end` bracket each refit."""

    def __init__(self, post: PostLoad, rank: int):
        self.post, self.rank = post, rank
        self.arena: torch.Tensor | None = None
        self.arena_bytes = 0
        self.window_bytes = 0               # the window region (the deferred region follows it)
        self.windows: list[list[tuple[Reprocessed, dict]]] = []
        self.deferred: list[tuple[Reprocessed, dict]] = []
        self.reports: list[dict] = []

    def tensors(self, windows) -> list[dict]:
        """Window ``i``'s destination tensors (``windows``: the plan's, every rank's buffers)."""
        post = self.post
        places: list[list[tuple[str, Reprocessed, str, int]]] = []   # (name, record, param, offset)
        deferred: list[tuple[str, Reprocessed, str]] = []
        most = 0
        for w in windows:
            off, mine = 0, []
            for name in w.buffers.get(self.rank, ()):
                owner = post.owner.get(name)
                if owner is None:
                    continue
                rec, pname = owner
                if rec.deferred:
                    deferred.append((name, rec, pname))
                    continue
                mine.append((name, rec, pname, off))
                off += _align(rec.nbytes(pname))
            places.append(mine)
            most = max(most, off)
        total = most
        dplace = []
        for name, rec, pname in deferred:
            dplace.append((name, rec, pname, total))
            total += _align(rec.nbytes(pname))
        device = post.device if post.device is not None else torch.device("cpu")
        self.arena = torch.empty(total, dtype=torch.uint8, device=device)
        self.arena_bytes, self.window_bytes = total, most
        out: list[dict] = []
        self.windows = []
        for w, mine in zip(windows, places):
            got = {name: post.tensors[name] for name in w.buffers.get(self.rank, ())
                   if name not in post.owner and name in post.tensors}
            got.update(self._place(mine, self.windows))
            out.append(got)
        self.deferred = []
        dtensors = self._place(dplace, None)
        for i, w in enumerate(windows):
            out[i].update({n: t for n, t in dtensors.items() if n in set(w.buffers.get(self.rank, ()))})
        return out

    def _place(self, places, into: list | None) -> dict:
        """Loader-format tensors at their arena offsets, grouped by module (appended to ``into`` as
        one window, or to the deferred list)."""
        by_rec: dict[int, tuple[Reprocessed, dict]] = {}
        out = {}
        for name, rec, pname, off in places:
            t = loader_tensor(rec.loader[pname], self.arena[off:off + span_bytes(rec.loader[pname])])
            by_rec.setdefault(id(rec), (rec, {}))[1][pname] = t
            out[name] = t
        if into is not None:
            into.append(list(by_rec.values()))
        else:
            self.deferred.extend(by_rec.values())
        return out

    # ------------------------------------------------------------------ one refit
    def begin(self) -> None:
        """Give the arena its memory (a new address: the bound tensors are followed)."""
        if self.arena is not None and self.arena.untyped_storage().nbytes() != self.arena_bytes:
            self.arena.untyped_storage().resize_(self.arena_bytes)
        self.reports = []

    def after_window(self, i: int) -> None:
        """Window ``i`` landed: vLLM's processing of its modules (the last window: then the
        deferred modules and the attention layers)."""
        rep = self.post.process(self.windows[i], scratch=self.arena)
        if i == len(self.windows) - 1:
            rep = _merge(rep, self.post.process(self.deferred, final=True, scratch=self.arena))
        self.reports.append(rep)

    def end(self) -> dict:
        """Free the arena; what the processing did over the refit."""
        self.free()
        total: dict = {}
        for rep in self.reports:
            total = _merge(total, rep)
        return total

    def free(self) -> None:
        if self.arena is not None:
            self.arena.untyped_storage().resize_(0)

    @property
    def held_bytes(self) -> int:
        """Bytes the arena holds now (0 between refits)."""
        return self.arena.untyped_storage().nbytes() if self.arena is not None else 0


def _merge(a: Mapping, b: Mapping) -> dict:
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v if not isinstance(v, list) else list(v)
        elif isinstance(v, list):
            out[k] = list(out[k]) + v
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = out[k] + v
        else:
            out[k] = v
    return out


__all__ = ["REFIT_MODES", "ShadowBuffers", "StreamWindows", "check_mode"]
