"""Executor: the only module that talks to ``torch.distributed``.

``Resharder(plan, src, dst, group)`` binds a plan to this rank's real tensors once; each
``refit()`` then moves the bytes: local copies directly, remote ones packed into one flat staging
buffer per message and exchanged round by round, unpacked with ``copy_`` into the existing
destination storage (addresses never change).  On NCCL (any backend but gloo) a round is one
grouped ``batch_isend_irecv`` (pack all, exchange all, unpack all); on gloo it is overlapped:
receives posted first, each send posted as soon as it is packed, each receive unpacked as soon as
it has arrived, and every entry of >= 256 KiB its own operation, sent from a contiguous source view /
received into a contiguous destination view without staging copies (:meth:`Resharder.overlapped`).

Construction is collective over ``group``: every rank checks its tensors and its part of the plan
(:func:`mcore_reshard.planner.validate_plan`), then all ranks exchange (plan hash, options, ok flag,
error text) so that any mismatch makes *every* rank raise the same :class:`ReshardError` before a
byte moves, instead of leaving peers waiting.

Failures during a transfer (a peer that dies, stalls or drops the connection) raise
:class:`TransferError` naming the refit version, the round and the peers, within ``timeout``
seconds of the round's start on the ranks that wait for the missing peer (gloo's ``wait(timeout)``
then closes the pairs, so their own peers fail at once).  The destination side records which
refit version every buffer fully holds (:meth:`Resharder.state`); an interrupted refit is reported
there, and the next ``refit()`` (after :meth:`Resharder.rebind` to a fresh group when the old one is
broken) rewrites every buffer.  ``verify=True`` sends a checksum of every copied box with its
message and checks the received and unpacked bytes against it.

Example (4 ranks, colocated): every rank builds the same plan from the same layouts, then::

    rank | src tensors               | dst tensors
    0    | {"w": w_tp0}              | {"w": w_full}
    1    | {"w": w_tp1}              | {}
    r = Resharder(plan, src, dst, group); r.refit()   # on every rank, after each training step
    r.state()  # {"version": 1, "interrupted": False, "buffers": {"w": 1}, ...} on rank 0
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist

from .planner import Plan, validate_plan

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int64": torch.int64,
    "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_MSG_BYTES = 1024
_OPT_BYTES = 64
_CS_BYTES = 16          # per-entry checksum trailer in verify mode: two int64
_CS_CHUNK = 1 << 20     # bytes per checksum chunk (bounds the temporary memory of verify mode)
_CS_MOD = 65521
_DIRECT_MIN = 256 << 10   # overlapped path: entries of at least this many bytes get their own P2P operation


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ReshardError(RuntimeError):
    """Raised on every rank together when any rank finds the plan or its tensors inconsistent."""


class TransferError(ReshardError):
    """A refit failed while moving bytes (peer died or stalled, connection closed, checksum
    mismatch).  ``version``, ``round`` (1-based, 0 for the local/confirm stages) and ``peers`` say
    where; the destination buffers it left incomplete are listed by :meth:`Resharder.state`."""

    def __init__(self, message: str, *, version: int, round: int | None = None, peers: list[int] | None = None):
        super().__init__(message)
        self.version = version
        self.round = round
        self.peers = list(peers or [])


@dataclass
class _Round:
    sends: list   # (peer, staging slice, [(staging view, src view)], message, parts (Resharder._parts))
    recvs: list   # (peer, staging slice, [(staging view, dst view)], message, parts (Resharder._parts))
    send_peers: list = field(default_factory=list)
    recv_peers: list = field(default_factory=list)


def _check_tensors(plan: Plan, rank: int, side: str, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    errors, missing = [], []
    want = plan.buffers[side].get(rank, {})
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            missing.append(f"rank {rank}: {side} tensor {name} {shape} {dtype} is missing")
        elif not isinstance(t, torch.Tensor):
            errors.append(f"rank {rank}: {side} tensor {name} is a {type(t).__name__}, not a torch.Tensor")
        elif list(t.shape) != list(shape) or dtype_name(t.dtype) != dtype:
            errors.append(f"rank {rank}: {side} tensor {name} is {list(t.shape)} {dtype_name(t.dtype)}, plan says {shape} {dtype}")
        elif side == "dst" and not t.is_contiguous():
            errors.append(f"rank {rank}: dst tensor {name} is not contiguous")
    if missing and len(missing) == len(want):   # all of them: a layout read for another rank, not one lost tensor
        missing = [f"{missing[0]}, and so is every other of the {len(want)} {side} tensor(s) the plan puts on this "
                   f"rank{_WRONG_RANK}"]
    errors = missing + errors
    extra = sorted(set(tensors) - set(want))
    if extra:
        errors.append(f"rank {rank}: {len(extra)} {side} tensor(s) the plan does not have on this rank: "
                      + ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else "")
                      + (" (a destination tensor the plan never writes would silently keep old weights)" if side == "dst" else "")
                      + (_WRONG_RANK if not want else ""))
    return errors


_WRONG_RANK = (": was this side's layout read for another rank? read_hf_layout(model, rank) and read_layout(chunks, rank) "
               "take this process's rank in the refit group, dist.get_rank(group), not its global dist.get_rank()")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of the memory a tensor view can touch."""
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _check_aliasing(rank: int, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> list[str]:
    """A destination tensor that shares memory with a source tensor (or another destination
    tensor) would overwrite the source weights or receive two writers."""
    spans = []
    for side, tensors in (("src", src), ("dst", dst)):
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.numel():
                lo, hi = _span(t)
                spans.append((t.device.type, t.device.index, lo, hi, side, name))
    spans.sort()
    errors = []
    for i, a in enumerate(spans):
        for b in spans[i + 1:]:
            if b[:2] != a[:2] or b[2] >= a[3]:
                break
            if "dst" in (a[4], b[4]):
                x, y = sorted([a, b], key=lambda t: (t[4] != "src", t[5]))
                errors.append(f"rank {rank}: {x[4]} tensor {x[5]} and {y[4]} tensor {y[5]} share memory; a refit would "
                              + ("overwrite the source weights" if x[4] == "src" else "write both"))
        if len(errors) >= 8:
            break
    return errors


def _per_round(plan: Plan, rank: int) -> dict[int, tuple[list, list]]:
    per_round: dict[int, tuple[list, list]] = {}
    for m in plan.messages:
        if m.src == rank:
            per_round.setdefault(m.round, ([], []))[0].append(m)
        if m.dst == rank:
            per_round.setdefault(m.round, ([], []))[1].append(m)
    return per_round


def staging_size(plan: Plan, rank: int, verify: bool = False) -> int:
    """Bytes of the one staging buffer a :class:`Resharder` of ``plan`` needs on ``rank``: the most
    it sends plus receives in any round (+ a checksum per entry with ``verify``).  Resharders that
    never run at the same time may share one buffer of the largest size (``staging=``), as the
    FP8 refit's per-group plans do."""
    trailer = _CS_BYTES if verify else 0
    return max((sum(m.nbytes + trailer * len(m.entries) for m in sends + recvs)
                for sends, recvs in _per_round(plan, rank).values()), default=0)


def _group_ranks_hint(world: int) -> str:
    return f"0..{world - 1}" if world else "none"


def _bounded_wait(work, timeout: float | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))


# control messages (handshake, retry handshake, confirmation) share one fixed size and carry their
# kind, so ranks at different protocol steps are detected instead of exchanging mismatched bytes
_KIND = {1: "handshake", 2: "retry handshake", 3: "confirmation"}
_C_KIND, _C_OK, _C_VER, _C_DIGEST, _C_OPT, _C_TEXT = 0, 1, 2, 10, 42, 42 + _OPT_BYTES
_C_SIZE = _C_TEXT + _MSG_BYTES


def _put(payload: torch.Tensor, at: int, data: bytes, limit: int) -> None:
    data = data[:limit]
    if data:
        payload[at:at + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _exchange(group, kind: int, *, digest: str = "", version: int = 0, ok: bool = True, options: str = "",
              text: str = "", timeout: float | None = None) -> list[dict]:
    """All-gather one fixed-size control message per rank (tensors, never pickle)."""
    world = dist.get_world_size(group)
    payload = torch.zeros(_C_SIZE, dtype=torch.uint8)
    payload[_C_KIND] = kind
    payload[_C_OK] = 1 if ok else 0
    _put(payload, _C_VER, int(version).to_bytes(8, "little", signed=True), 8)
    _put(payload, _C_DIGEST, bytes.fromhex(digest) if digest else b"", 32)
    _put(payload, _C_OPT, options.encode(), _OPT_BYTES)
    _put(payload, _C_TEXT, text.encode(), _MSG_BYTES)
    payload = payload.to(_group_device(group))
    gathered = [torch.empty_like(payload) for _ in range(world)]
    _bounded_wait(dist.all_gather(gathered, payload, group=group, async_op=True), timeout)
    out = []
    for g in gathered:
        b = bytes(g.cpu().tolist())
        out.append({"kind": b[_C_KIND], "ok": bool(b[_C_OK]),
                    "version": int.from_bytes(b[_C_VER:_C_VER + 8], "little", signed=True),
                    "digest": b[_C_DIGEST:_C_DIGEST + 32].hex(),
                    "options": b[_C_OPT:_C_TEXT].rstrip(b"\0").decode(errors="replace"),
                    "text": b[_C_TEXT:].rstrip(b"\0").decode(errors="replace")})
    return out


def _step_mismatch(msgs: list[dict], kind: int) -> str | None:
    if all(m["kind"] == kind for m in msgs):
        return None
    by: dict[str, list[int]] = {}
    for r, m in enumerate(msgs):
        by.setdefault(f"{_KIND.get(m['kind'], 'unknown step %d' % m['kind'])} (refit {m['version']})", []).append(r)
    return "ranks are at different protocol steps: " + "; ".join(f"ranks {rs} in {k}" for k, rs in sorted(by.items()))


def agree(group, digest: str, errors: list[str], *, options: str = "", timeout: float | None = None,
          kind: int = 1, version: int = 0) -> None:
    """Collective: exchange plan digest, options and local errors; raise :class:`ReshardError` on
    every rank if any rank reported an error or the digests or options differ.  Never pickles.
    ``timeout`` bounds the wait (a rank that never joins makes the others raise after it)."""
    rank = dist.get_rank(group)
    t0 = time.monotonic()
    try:
        msgs = _exchange(group, kind, digest=digest, version=version, ok=not errors, options=options,
                         text="; ".join(errors), timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a peer that died or never joined
        raise ReshardError(f"reshard {_KIND[kind]} failed on rank {rank} after {time.monotonic() - t0:.1f} s "
                           f"(a peer died, never joined, or the process group is broken): {type(e).__name__}: {e}"
                           + (f" | this rank's own problems: {'; '.join(errors)}" if errors else "")) from e
    problems = []
    step = _step_mismatch(msgs, kind)
    if step:
        problems.append(step)
    hashes = [m["digest"] for m in msgs]
    if len(set(hashes)) > 1:
        by_hash: dict[str, list[int]] = {}
        for r, h in enumerate(hashes):
            by_hash.setdefault(h[:12], []).append(r)
        problems.append("plan hashes differ between ranks: " + "; ".join(f"{h} on ranks {rs}" for h, rs in sorted(by_hash.items())))
    opt_texts = [m["options"] for m in msgs]
    if not step and len(set(opt_texts)) > 1:
        by_opt: dict[str, list[int]] = {}
        for r, o in enumerate(opt_texts):
            by_opt.setdefault(o, []).append(r)
        problems.append("options differ between ranks: " + "; ".join(f"{o or '(none)'} on ranks {rs}" for o, rs in sorted(by_opt.items())))
    texts: dict[str, list[int]] = {}
    for r, m in enumerate(msgs):
        if not m["ok"]:
            texts.setdefault(m["text"] or f"rank {r} failed its checks", []).append(r)
    for text, rs in texts.items():
        problems.append(text if len(rs) == 1 or text.startswith("rank ") else f"ranks {rs}: {text}")
    versions = sorted({m["version"] for m in msgs})
    if kind == 2 and not step and len(versions) > 1:
        problems.append(f"ranks retry different refit versions {versions}")
    if problems:
        head = "reshard refused before any transfer: " if kind == 1 else f"refit {version} retry refused: "
        raise ReshardError(head + " | ".join(problems))


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bytes of ``t`` (row-major): plain, and weighted by position (so
    swapped or shifted bytes are caught).  On ``t``'s device; temporaries <= 16 MiB."""
    b = t.detach().reshape(-1)
    if not b.is_contiguous():
        b = b.contiguous()
    b = b.view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=b.device)
    for lo in range(0, b.numel(), _CS_CHUNK):
        x = b[lo:lo + _CS_CHUNK].to(torch.int64)
        w = torch.arange(lo, lo + x.numel(), dtype=torch.int64, device=b.device).remainder_(_CS_MOD).add_(1)
        out[0] += x.sum()
        out[1] += (x * w).sum()
    return out


def _is_timeout(e: BaseException) -> bool:
    text = str(e)
    return "imed out" in text or "timeout caused" in text


def _is_closed(e: BaseException) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("closed", "reset by peer", "broken pipe", "connection refused"))


class Resharder:
    """Binds ``plan`` to this rank's tensors; ``refit()`` moves the weights (collective).

    ``src``/``dst`` map buffer names to this rank's real tensors (a rank may have either, both or
    none); they must be exactly the buffers the plan gives this rank.  Source tensors are only read
    (a destination tensor sharing memory with a source is refused).  ``timeout`` (seconds) bounds
    the handshake, every round and the final confirmation: a dead or stalled peer makes every rank
    raise :class:`TransferError` instead of waiting (``None``: the process group's own timeout).
    ``verify`` adds a checksum per copied box to every message and checks what arrives (debug;
    must be the same on every rank).  ``confirm`` ends every refit with a tiny all-gather so that
    ``refit()`` returns only when every rank has landed every byte (then ``state()["version"]`` is
    the same everywhere).  ``staging``: a uint8 tensor to use instead of allocating the staging
    buffer, when at least :func:`staging_size` bytes (shared by Resharders run one after another).
    ``overlap``: how a round moves its messages (see :meth:`overlapped`); ``None`` (default): overlapped
    on gloo, one grouped ``batch_isend_irecv`` per round on every other backend (NCCL).
    """

    def __init__(self, plan: Plan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                 group=None, *, timeout: float | None = None, verify: bool = False, confirm: bool = True,
                 staging: torch.Tensor | None = None, overlap: bool | None = None):
        self._shared_staging = staging
        self.overlap = overlap
        self.plan = plan
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout_s = None if timeout is None else float(timeout)
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.verify = bool(verify)
        self.confirm = bool(confirm)
        self.src = dict(src)
        self.dst = dict(dst)
        self.version = 0                   # last refit version confirmed complete
        self._buffer_version: dict[str, int | None] = {n: None for n in plan.buffers["dst"].get(self.rank, {})}
        self._interrupted: dict | None = None
        self._needs_handshake = False
        # the plan's digest, computed once (seconds for a plan with 100k+ copies): the handshake,
        # every retry and every refit's confirmation carry it; the bound plan is not to be changed
        self._digest = plan.hash
        agree(group, self._digest, self._validate(), options=self._options(), timeout=self.timeout_s)
        self._bind()

    # ------------------------------------------------------------------ validation and binding

    def _options(self) -> str:
        return f"verify={int(self.verify)},confirm={int(self.confirm)}"

    def _validate(self) -> list[str]:
        try:
            return self._checks()
        except Exception as e:  # noqa: BLE001 - a crash in a check must still reach every rank
            return [f"rank {self.rank}: validation failed: {type(e).__name__}: {e}"]

    def _checks(self) -> list[str]:
        plan, r = self.plan, self.rank
        errors = []
        outside = [q for q in plan.ranks if not 0 <= q < self.world]
        if outside:
            errors.append(f"rank {r}: plan ranks {outside[:8]}{' ...' if len(outside) > 8 else ''} are outside the "
                          f"process group of {self.world} rank(s) ({_group_ranks_hint(self.world)})")
        errors += _check_tensors(plan, r, "src", self.src) + _check_tensors(plan, r, "dst", self.dst)
        errors += _check_aliasing(r, self.src, self.dst)
        backend = dist.get_backend(self.group)
        if self.overlap and backend != "gloo":
            errors.append(f"rank {r}: overlap=True needs the gloo backend; this group uses {backend}, whose "
                          "point-to-point operations must stay in one batch_isend_irecv per round")
        errors += [f"rank {r}: plan is inconsistent: {p}" for p in validate_plan(plan, r, limit=5)]
        return errors

    def _bind(self) -> None:
        r, plan = self.rank, self.plan
        self.local = [(self.dst[c.dst_buffer][c.dst_local.slices()], self.src[c.src_buffer][c.src_local.slices()], c)
                      for c in plan.local_copies if c.dst == r]
        self.padding = [(self.dst[b][box.slices()], b) for rr, b, box in plan.padding if rr == r]
        trailer = _CS_BYTES if self.verify else 0
        per_round = _per_round(plan, r)
        # ONE staging buffer per rank: in each round its front holds the messages this rank sends,
        # the rest the messages it receives (the plan keeps send + receive <= budget per round)
        size = staging_size(plan, r, self.verify)
        shared = self._shared_staging
        if shared is not None and shared.numel() >= size:
            self.staging = shared[:size]
        else:
            self.staging = torch.empty(size, dtype=torch.uint8, device=self._device())
        self.rounds: list[_Round] = []
        self.round_numbers: list[int] = []
        # stage at which each destination buffer is first / last written (-1: local copies and padding)
        first: dict[str, int] = {}
        last: dict[str, int] = {}

        def touch(name: str, stage: int) -> None:
            first.setdefault(name, stage)
            last[name] = stage

        for _, b in self.padding:
            touch(b, -1)
        for _, _, c in self.local:
            touch(c.dst_buffer, -1)
        for k in sorted(per_round):
            sends, recvs = per_round[k]
            rnd = _Round([], [])
            base = 0
            for m in sends:
                size = m.nbytes + trailer * len(m.entries)
                buf = self.staging[base:base + size]
                pairs = [(self._view(buf, c), self.src[c.src_buffer][c.src_local.slices()]) for c in m.entries]
                rnd.sends.append((m.dst, buf, pairs, m, self._parts(m, buf, pairs)))
                base += size
            for m in recvs:             # right after this round's sends, in the same buffer
                size = m.nbytes + trailer * len(m.entries)
                buf = self.staging[base:base + size]
                pairs = [(self._view(buf, c), self.dst[c.dst_buffer][c.dst_local.slices()]) for c in m.entries]
                rnd.recvs.append((m.src, buf, pairs, m, self._parts(m, buf, pairs)))
                base += size
                for c in m.entries:
                    touch(c.dst_buffer, len(self.rounds))
            rnd.send_peers = sorted({m.dst for m in sends})
            rnd.recv_peers = sorted({m.src for m in recvs})
            self.rounds.append(rnd)
            self.round_numbers.append(k)
        for name in self._buffer_version:
            if name not in first:
                touch(name, -1)   # buffers nothing writes (empty) are complete after the local stage
        self._first_stage = {s: sorted(n for n, f in first.items() if f == s) for s in set(first.values())}
        self._last_stage = {s: sorted(n for n, l in last.items() if l == s) for s in set(last.values())}

    def _device(self) -> torch.device:
        for t in list(self.dst.values()) + list(self.src.values()):
            return t.device
        return _group_device(self.group)

    def _parts(self, m, buf: torch.Tensor, pairs: list) -> list:
        """How the overlapped path moves message ``m``: ``[(wire tensor, pairs to pack / unpack)]``,
        one point-to-point operation each, in entry order.  Both ends derive the SAME split from
        the plan alone (entry sizes), so their operations match one to one: every entry of at
        least ``_DIRECT_MIN`` bytes is its own operation, consecutive smaller entries share one.
        Then each end decides alone, from its own tensors, whether an own-operation entry goes
        straight from the source / into the destination (its view is contiguous, of the staged
        dtype: wire tensor = the view's bytes, nothing to pack / unpack) or through its staging
        view as usual.  Staging stays reserved for every entry (staging accounting unchanged;
        direct entries just leave theirs untouched).  With ``verify`` (checksum trailer) or
        entries not laid out in order: the whole message as one staged operation."""
        whole = [(buf, pairs)]
        if self.verify or not pairs:
            return whole
        at = 0
        for c in m.entries:
            if c.offset != at:
                return whole
            at += c.nbytes
        if at != m.nbytes:
            return whole
        parts, group = [], []

        def flush():
            if group:
                lo = group[0][0].offset
                hi = group[-1][0].offset + group[-1][0].nbytes
                parts.append((buf[lo:hi], [p for _, p in group]))
                group.clear()

        for c, (stage, t) in zip(m.entries, pairs):
            if c.nbytes < _DIRECT_MIN:
                group.append((c, (stage, t)))
                continue
            flush()
            if t.is_contiguous() and t.dtype == stage.dtype and t.numel() * t.element_size() == c.nbytes:
                parts.append((t.reshape(-1).view(torch.uint8), []))
            else:
                parts.append((buf[c.offset:c.offset + c.nbytes], [(stage, t)]))
        flush()
        return parts

    def _view(self, staging: torch.Tensor, c) -> torch.Tensor:
        dtype = torch_dtype(self.plan.tensors[c.tensor]["src_dtype"])
        return staging[c.offset:c.offset + c.nbytes].view(dtype).view(c.src_local.sizes)

    @property
    def staging_bytes(self) -> int:
        """Bytes of this rank's one staging buffer (<= the plan's budget, + 16 B per entry when
        ``verify``): the most this rank stages to send plus receive in any one round."""
        return self.staging.numel()

    def rebind(self, group=None) -> None:
        """Collective: use ``group`` from now on (e.g. a fresh group after a transfer failure broke
        the old one: gloo closes its pairs on a timeout; NCCL communicators must be aborted).
        Re-runs the construction handshake; staging buffers, views and recorded versions stay."""
        rank = dist.get_rank(group)
        errors = []
        if rank != self.rank:
            errors.append(f"rank {rank}: this Resharder was bound as rank {self.rank} of its old group; "
                          "the new group must keep every rank's number")
        self.group = group
        self.world = dist.get_world_size(group)
        errors = errors or self._validate()
        agree(group, self._digest, errors, options=self._options(), timeout=self.timeout_s)
        self._needs_handshake = False

    # ------------------------------------------------------------------ state

    def state(self) -> dict:
        """What this rank's destination buffers hold (local, no communication)::

            {"version": 3,                # last refit confirmed complete (0: none yet)
             "interrupted": False,        # the last refit on this rank failed part-way
             "interrupted_version": None, "failed_round": None, "error": None,
             "buffers": {"w": 3, ...},    # refit version each destination buffer fully holds
             "incomplete": []}            # buffers holding no complete version (None above)
        """
        info = self._interrupted or {}
        return {
            "version": self.version,
            "interrupted": self._interrupted is not None,
            "interrupted_version": info.get("version"),
            "failed_round": info.get("round"),
            "error": info.get("error"),
            "buffers": dict(self._buffer_version),
            "incomplete": sorted(n for n, v in self._buffer_version.items() if v is None),
        }

    # ------------------------------------------------------------------ refit

    def _stage_begin(self, stage: int) -> None:
        for name in self._first_stage.get(stage, ()):
            self._buffer_version[name] = None

    def _stage_end(self, stage: int, version: int) -> None:
        for name in self._last_stage.get(stage, ()):
            self._buffer_version[name] = version

    def refit(self, version: int | None = None) -> dict:
        """Move every byte of the plan once (collective); returns counts (messages and bytes sent by
        this rank) and the version.

        ``version`` labels what the destination now holds (e.g. the training step); default: last
        completed version + 1, so a retry after an interrupted refit reuses the interrupted number.
        After an interruption the next call first re-checks the group (a collective handshake) and
        then rewrites every destination buffer; if the group is broken it raises at once: call
        :meth:`rebind` with a fresh group, then ``refit()`` again.
        """
        v = self.version + 1 if version is None else int(version)
        if self._needs_handshake and self.confirm:
            try:
                agree(self.group, self._digest, [], options=self._options(), timeout=self.timeout_s, kind=2, version=v)
            except ReshardError as e:
                raise ReshardError(f"rank {self.rank}: cannot retry refit {v}: {e} -- after an interrupted refit on a "
                                   "broken process group, call rebind(new_group) on every rank first") from e
            self._needs_handshake = False
        problems: list[str] = []
        try:
            stats = self._transfer(v, problems)
            if self.confirm:
                self._confirm(v, problems)
        except TransferError as e:
            self._interrupted = {"version": v, "round": e.round, "error": str(e)}
            self._needs_handshake = True
            raise
        except BaseException as e:  # noqa: BLE001 - anything else that stops a refit half-way
            self._interrupted = {"version": v, "round": None, "error": f"{type(e).__name__}: {e}"}
            self._needs_handshake = True
            raise
        self.version = v
        self._interrupted = None
        stats["version"] = v
        return stats

    def _transfer(self, v: int, problems: list[str]) -> dict:
        self._stage_begin(-1)
        for view, _ in self.padding:
            view.zero_()
        bad_buffers = set()
        for d, s, c in self.local:
            d.copy_(s.reshape(d.shape))
            if self.verify and d.dtype == s.dtype and not torch.equal(_checksum(d), _checksum(s)):
                problems.append(f"local copy of {c.tensor}{c.box} into buffer {c.dst_buffer} differs from the source")
                bad_buffers.add(c.dst_buffer)
        self._stage_end(-1, v)
        sent = nmsg = 0
        overlap = self.overlapped()
        for i, rnd in enumerate(self.rounds):
            self._stage_begin(i)
            if overlap:
                self._round_overlapped(v, i, rnd, problems, bad_buffers)
            else:
                self._round_batched(v, i, rnd, problems, bad_buffers)
            self._stage_end(i, v)
            nmsg += len(rnd.sends)
            sent += sum(b.numel() for _, b, *_ in rnd.sends)
        for name in bad_buffers:
            self._buffer_version[name] = None
        if problems and not self.confirm:
            raise TransferError(f"refit {v} on rank {self.rank} failed verification: " + "; ".join(problems[:8]), version=v)
        return {"messages_sent": nmsg, "staged_bytes_sent": sent}

    # ------------------------------------------------------------------ one round, two ways

    def overlapped(self) -> bool:
        """Whether rounds run overlapped (see :meth:`_round_overlapped`) on the current group.

        ``overlap=None`` (default) chooses by backend: overlapped on gloo, whose ``isend``/``irecv``
        are independent asynchronous operations (``batch_isend_irecv`` on gloo only posts them one
        after another), and batched on every other backend: NCCL point-to-point operations must be
        launched inside one group (one ``batch_isend_irecv``) per round, or two ranks sending to
        each other can deadlock.  ``overlap=True`` on a non-gloo backend is refused for the same
        reason (construction and :meth:`rebind` raise).  The environment variable ``MCORE_RESHARD_OVERLAP`` (``0``/``1``) overrides the
        default choice (benchmarks); an explicit ``overlap`` argument wins over it."""
        backend = dist.get_backend(self.group)
        want = self.overlap
        if want is None:
            env = os.environ.get("MCORE_RESHARD_OVERLAP", "").strip()
            want = backend == "gloo" if env not in ("0", "1") else env == "1"
        return bool(want) and backend == "gloo"

    def _pack(self, buf: torch.Tensor, pairs: list, m) -> None:
        for j, (stage, s) in enumerate(pairs):
            stage.copy_(s)
            if self.verify:
                buf[m.nbytes + _CS_BYTES * j:m.nbytes + _CS_BYTES * (j + 1)].view(torch.int64).copy_(_checksum(s))

    def _unpack(self, i: int, peer: int, buf: torch.Tensor, pairs: list, m, problems: list[str], bad_buffers: set) -> None:
        n = len(self.rounds)
        for j, (stage, d) in enumerate(pairs):
            c = m.entries[j]
            if self.verify:
                want = buf[m.nbytes + _CS_BYTES * j:m.nbytes + _CS_BYTES * (j + 1)].view(torch.int64)
                if not torch.equal(_checksum(stage), want):
                    problems.append(f"round {i + 1}/{n}: {c.tensor}{c.box} from rank {peer} arrived with a "
                                    f"different checksum than rank {peer} sent (buffer {c.dst_buffer})")
                    bad_buffers.add(c.dst_buffer)
                    continue
            d.copy_(stage.reshape(d.shape))
            if self.verify and d.dtype == stage.dtype and not torch.equal(_checksum(d), _checksum(stage)):
                problems.append(f"round {i + 1}/{n}: {c.tensor}{c.box} from rank {peer} differs from what "
                                f"arrived after unpacking into buffer {c.dst_buffer}")
                bad_buffers.add(c.dst_buffer)

    def _round_batched(self, v: int, i: int, rnd: _Round, problems: list[str], bad_buffers: set) -> None:
        """Pack every send, post all sends and receives in ONE ``batch_isend_irecv`` (NCCL groups
        them: no deadlock whatever the order), wait for all, then unpack every receive."""
        for _, buf, pairs, m, _ in rnd.sends:
            self._pack(buf, pairs, m)
        ops = [dist.P2POp(dist.isend, buf, group=self.group, group_peer=peer) for peer, buf, *_ in rnd.sends]
        ops += [dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer) for peer, buf, *_ in rnd.recvs]
        labels = [f"sending to rank {peer}" for peer, *_ in rnd.sends] + [f"receiving from rank {peer}" for peer, *_ in rnd.recvs]
        if ops:
            t0 = time.monotonic()
            try:
                works = dist.batch_isend_irecv(ops)
                if len(works) != len(ops):
                    labels = ["exchanging with ranks " + ",".join(map(str, sorted(set(rnd.send_peers) | set(rnd.recv_peers))))] * len(works)
                deadline = None if self.timeout_s is None else t0 + self.timeout_s
                for work, label in zip(works, labels):
                    try:
                        _bounded_wait(work, None if deadline is None else deadline - time.monotonic())
                    except Exception as e:  # noqa: BLE001
                        raise self._round_error(v, i, rnd, label, e, time.monotonic() - t0) from e
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001 - posting failed (peer gone before the round)
                raise self._round_error(v, i, rnd, "posting the round", e, time.monotonic() - t0) from e
        for peer, buf, pairs, m, _ in rnd.recvs:
            self._unpack(i, peer, buf, pairs, m, problems, bad_buffers)

    def _round_overlapped(self, v: int, i: int, rnd: _Round, problems: list[str], bad_buffers: set) -> None:
        """gloo only (:meth:`overlapped`): packing, the wire and unpacking overlap.

        1. One ``batch_isend_irecv`` opens the round: every receive of the round (so peers' bytes
           can land at once) plus the first send, packed just before.
        2. Every further send is packed and posted (``isend``) right away, in the plan's order (the
           same order on both ends of every pair; gloo matches a pair's messages in order), so its
           bytes travel while the next one is packed.
        3. Receives are unpacked one by one as soon as each has arrived (first every one already
           complete, else the next in order is waited for), while the others still travel.
        4. Then the sends are waited for (their buffers are reused by the next round).

        A message goes as one or more operations (:meth:`_parts`): its large entries one each, sent
        straight from a contiguous source view and received straight into a contiguous destination
        view (no pack / unpack copy; never with ``verify``).  Every wait is bounded by the round's deadline (its start + ``timeout``) and
        fails with the same :class:`TransferError` (round, peers, what it was waiting for) as the
        batched path."""
        t0 = time.monotonic()
        deadline = None if self.timeout_s is None else t0 + self.timeout_s

        def left():
            return None if deadline is None else deadline - time.monotonic()

        def wait(work, label):
            try:
                _bounded_wait(work, left())
            except Exception as e:  # noqa: BLE001
                raise self._round_error(v, i, rnd, label, e, time.monotonic() - t0) from e

        # one operation per part, in plan order: (peer, wire tensor, pairs, message)
        sends = [(peer, w, pp, m) for peer, _, _, m, parts in rnd.sends for w, pp in parts]
        recvs = [(peer, w, pp, m) for peer, _, _, m, parts in rnd.recvs for w, pp in parts]
        ops = [dist.P2POp(dist.irecv, w, group=self.group, group_peer=peer) for peer, w, *_ in recvs]
        if sends:
            peer, w, pairs, m = sends[0]
            self._pack(w, pairs, m)
            ops.append(dist.P2POp(dist.isend, w, group=self.group, group_peer=peer))
        if not ops:
            return
        label = "posting the round"
        try:
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):
                raise RuntimeError(f"batch_isend_irecv returned {len(works)} work(s) for {len(ops)} operation(s) "
                                   "(a coalescing backend: use overlap=False)")
            recv_works = works[:len(recvs)]
            send_works = [(works[-1], f"sending to rank {sends[0][0]}")] if sends else []
            for peer, w, pairs, m in sends[1:]:
                self._pack(w, pairs, m)
                label = f"sending to rank {peer}"
                send_works.append((dist.isend(w, group=self.group, group_dst=peer), label))
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 - posting failed (peer gone before or during the round)
            raise self._round_error(v, i, rnd, label, e, time.monotonic() - t0) from e
        pending = list(range(len(recvs)))
        while pending:
            done = [k for k in pending if recv_works[k].is_completed()] or pending[:1]
            for k in done:
                peer, w, pairs, m = recvs[k]
                wait(recv_works[k], f"receiving from rank {peer}")
                self._unpack(i, peer, w, pairs, m, problems, bad_buffers)
            pending = [k for k in pending if k not in done]
        for work, label in send_works:
            wait(work, label)

    def _round_error(self, v: int, i: int, rnd: _Round, label: str, e: BaseException, waited: float) -> TransferError:
        peers = sorted(set(rnd.send_peers) | set(rnd.recv_peers))
        if _is_timeout(e):
            what = f"timed out after {waited:.1f} s (timeout {self.timeout_s} s) {label}"
        elif _is_closed(e):
            what = f"failed after {waited:.1f} s {label} (a peer died or closed its connection)"
        else:
            what = f"failed after {waited:.1f} s {label}"
        return TransferError(
            f"refit {v}: round {i + 1}/{len(self.rounds)} of this rank (plan round {self.round_numbers[i]}) on rank "
            f"{self.rank} {what}; this round sends to ranks {rnd.send_peers} and receives from ranks {rnd.recv_peers}; "
            f"destination buffers incomplete here: {sum(1 for x in self._buffer_version.values() if x is None)}; "
            f"cause: {type(e).__name__}: {str(e)[:300]}", version=v, round=i + 1, peers=peers)

    def _confirm(self, v: int, problems: list[str]) -> None:
        """Every rank reports (version, ok); raise unless every rank landed this version."""
        t0 = time.monotonic()
        try:
            msgs = _exchange(self.group, 3, digest=self._digest, version=v, ok=not problems,
                             text="; ".join(problems[:8]), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001
            raise TransferError(
                f"refit {v}: rank {self.rank} finished its rounds but the final confirmation failed after "
                f"{time.monotonic() - t0:.1f} s (timeout {self.timeout_s} s): another rank died or stopped part-way; "
                f"{'this rank: ' + '; '.join(problems[:4]) + '; ' if problems else ''}cause: {type(e).__name__}: {str(e)[:300]}",
                version=v, round=0) from e
        step = _step_mismatch(msgs, 3)
        failed = [r for r, m in enumerate(msgs) if not m["ok"]]
        versions = sorted({m["version"] for m in msgs})
        if step or failed or len(versions) > 1:
            text = f"refit {v} did not complete everywhere (rank {self.rank}):"
            if step:
                text += " " + step
            elif failed:
                text += " " + "; ".join(f"rank {r}: {msgs[r]['text']}" for r in failed)
            if not step and len(versions) > 1:
                text += f" ranks refit different versions {versions}"
            raise TransferError(text, version=v, round=0, peers=failed)


def all_gather_json(obj, group=None, timeout: float | None = None) -> list:
    """Every rank's JSON-able ``obj``, in rank order (metadata exchange; never pickle)."""
    data = json.dumps(obj, sort_keys=True).encode()
    device = _group_device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    _bounded_wait(dist.all_gather(sizes, size, group=group, async_op=True), timeout)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    out = [torch.empty_like(buf) for _ in range(world)]
    _bounded_wait(dist.all_gather(out, buf, group=group, async_op=True), timeout)
    return [json.loads(bytes(o[:int(n)].cpu().tolist()).decode()) for o, n in zip(out, sizes)]


def digest_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 (first 24 hex digits) of every tensor's bytes: to show in tests and tools that a
    refit left its source weights untouched."""
    out = {}
    for name, t in sorted(tensors.items()):
        b = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        out[name] = hashlib.sha256(b).hexdigest()[:24]
    return out
