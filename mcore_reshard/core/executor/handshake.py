"""Collective control messages (tensors, never pickle): :func:`agree` (handshake / retry), the
refit confirmation's exchange (:func:`exchange`), :func:`all_gather_json` (metadata) and the two
guards that make a failure on one rank an error on all (:class:`GatherChecked`, :func:`all_or_none`)."""
from __future__ import annotations

import contextlib
import datetime
import enum
import json
import threading
import time

import torch
import torch.distributed as dist

from .common import bounded_wait, check_timeout, group_device, group_timeout
from .errors import ReshardError

_MSG_BYTES = 1024
_OPT_BYTES = 64



class Step(enum.IntEnum):
    """The protocol step a control message belongs to (its first byte).  Control messages of every
    step share one fixed size and carry their step, so ranks at different steps are detected
    (:func:`step_mismatch`) instead of exchanging mismatched bytes."""
    HANDSHAKE = 1          # a Resharder's construction, and its rebind
    RETRY_HANDSHAKE = 2    # agree(kind=RETRY_HANDSHAKE): every rank retries the same version
    CONFIRMATION = 3       # the end of every refit: every rank landed every byte
    REFIT_START = 4        # the start of every refit, before any byte moves
    # the opening of a metadata exchange (all_gather_json; ``version``: its payload's size): every
    # collective step of the library begins with a message of this one size, so a rank at another
    # step (a worker calling join_refit again while its peers refit) is refused on every rank
    # instead of gloo aborting the process on a size mismatch
    METADATA_EXCHANGE = 5
    REUSE_CHECK = 6        # dtensor_reshard: every rank found the same cached binding
    WINDOWED_END = 7       # the end of a windowed refit: every rank's work after the last window done

    @property
    def label(self) -> str:
        """How messages name the step (``"refit start"``)."""
        return self.name.lower().replace("_", " ")


def step_label(kind: int) -> str:
    """The :class:`Step` label of a control message's kind byte (``"unknown step 9"`` otherwise)."""
    try:
        return Step(kind).label
    except ValueError:
        return f"unknown step {kind}"


_C_KIND, _C_OK, _C_FLAGS, _C_VER, _C_TOKEN, _C_DIGEST, _C_OPT = 0, 1, 2, 3, 11, 19, 51
_C_TEXT = _C_OPT + _OPT_BYTES
_C_SEQ = _C_TEXT + _MSG_BYTES     # the sender's check-in count on the group (see checkin)
_C_SIZE = _C_SEQ + 8


def _put(payload: torch.Tensor, at: int, data: bytes, limit: int) -> None:
    data = data[:limit]
    if data:
        payload[at:at + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def exchange(group, kind: Step, *, digest: str = "", version: int = 0, ok: bool = True, options: str = "",
             text: str = "", timeout: float | None = None, token: int = 0, flags: int = 0) -> list[dict]:
    """All-gather one fixed-size control message per rank (tensors, never pickle): kind (a :class:`Step`), ok,
    ``flags`` (a byte), refit ``version``, ``token`` (64-bit binding id), plan ``digest``,
    ``options`` and error ``text``; returns them as dicts in rank order.  Each also carries the
    sender's check-in count on the group (``seq``); every rank continues from the highest (a rank
    that checked in for a step the others were not at stays in step with them afterwards)."""
    world = dist.get_world_size(group)
    name = _group_name(group)
    payload = torch.zeros(_C_SIZE, dtype=torch.uint8)
    payload[_C_KIND] = kind
    payload[_C_OK] = 1 if ok else 0
    payload[_C_FLAGS] = flags & 0xFF
    _put(payload, _C_VER, int(version).to_bytes(8, "little", signed=True), 8)
    _put(payload, _C_TOKEN, int(token).to_bytes(8, "little", signed=False), 8)
    _put(payload, _C_DIGEST, bytes.fromhex(digest) if digest else b"", 32)
    _put(payload, _C_OPT, options.encode(), _OPT_BYTES)
    _put(payload, _C_TEXT, text.encode(), _MSG_BYTES)
    _put(payload, _C_SEQ, _SEQ.get(name, 0).to_bytes(8, "little", signed=False), 8)
    payload = payload.to(group_device(group))
    gathered = [torch.empty_like(payload) for _ in range(world)]
    bounded_wait(dist.all_gather(gathered, payload, group=group, async_op=True), timeout, group)
    out = []
    for g in gathered:
        b = bytes(g.cpu().tolist())
        out.append({"kind": b[_C_KIND], "ok": bool(b[_C_OK]), "flags": b[_C_FLAGS],
                    "version": int.from_bytes(b[_C_VER:_C_VER + 8], "little", signed=True),
                    "token": int.from_bytes(b[_C_TOKEN:_C_TOKEN + 8], "little", signed=False),
                    "digest": b[_C_DIGEST:_C_DIGEST + 32].hex(),
                    "options": b[_C_OPT:_C_TEXT].rstrip(b"\0").decode(errors="replace"),
                    "text": b[_C_TEXT:_C_SEQ].rstrip(b"\0").decode(errors="replace"),
                    "seq": int.from_bytes(b[_C_SEQ:_C_SEQ + 8], "little", signed=False)})
    if name is not None:
        _SEQ[name] = max(m["seq"] for m in out)
    return out


_F_SETTLE = 4       # handshake message flag: the sender settles the outcome through the store (_settle)
_SEQ: dict[str, int] = {}   # check-ins per process group name (checkin; kept in step by exchange)


def _group_name(group) -> str | None:
    try:
        from torch.distributed import distributed_c10d as c10d
        return c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001 - not a real group (tests)
        return None


def checkin(group) -> tuple | None:
    """Record in the group's store that this rank reached its next check-in exchange; returns
    what :func:`missing_ranks` needs (None when the group has no store)."""
    try:
        from torch.distributed import distributed_c10d as c10d
        pg = group if group is not None else dist.group.WORLD
        name = c10d._get_process_group_name(pg)
        seq = _SEQ[name] = _SEQ.get(name, 0) + 1
        store = c10d._get_process_group_store(pg)
        store.set(f"mcore_reshard/checkin/{seq}/{dist.get_rank(group)}", b"1")
        return store, seq, dist.get_world_size(group)
    except Exception:  # noqa: BLE001 - best effort: only improves the error message
        return None


def missing_ranks(ticket) -> list[int] | None:
    """The ranks that never reached the check-in exchange of ``ticket`` (None: unknown)."""
    if ticket is None:
        return None
    store, seq, world = ticket
    try:
        return [r for r in range(world) if not store.check([f"mcore_reshard/checkin/{seq}/{r}"])]
    except Exception:  # noqa: BLE001
        return None


def _who(ticket) -> str:
    gone = missing_ranks(ticket)
    if gone is None:
        return "(which ranks did not answer is unknown)"
    if not gone:
        return "(every rank reached it: the process group is broken or a rank failed inside it)"
    return f"ranks {gone} did not answer"


def step_mismatch(msgs: list[dict], kind: Step) -> str | None:
    """None when every rank sent a control message of ``kind``, else who is at which step."""
    if all(m["kind"] == kind for m in msgs):
        return None
    by: dict[str, list[int]] = {}
    for r, m in enumerate(msgs):
        refit = m["kind"] in (Step.RETRY_HANDSHAKE, Step.CONFIRMATION, Step.REFIT_START)
        by.setdefault(step_label(m["kind"]) + (f" (refit {m['version']})" if refit else ""), []).append(r)
    return "ranks are at different protocol steps: " + "; ".join(f"ranks {rs} in {k}" for k, rs in sorted(by.items()))


def _by_value(values: list[str]) -> dict[str, list[int]]:
    by: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by.setdefault(v, []).append(r)
    return by


def _settle(ticket, rank: int, ok: bool, timeout: float | None, group) -> str | None:
    """The exchange of ``ticket`` ended on this rank (``ok``: it completed): record that in the
    group's store; when it completed, wait (at most ``timeout``) for every rank's verdict.  Returns
    why the handshake failed elsewhere (None: every rank completed it).  A gloo all-gather can
    complete on one rank while a peer times out (a rank that joined late, or was interrupted once
    the bytes were out): without this, that rank would succeed alone."""
    if ticket is None:
        return None
    store, seq, world = ticket
    key = f"mcore_reshard/verdict/{seq}/"
    try:        # O(1) store operations per rank: a count of completed exchanges, one verdict key
        if not ok:
            store.set(key + "all", f"0:{rank}".encode())
            return None
        if store.add(key + "ok", 1) == world:
            store.set(key + "all", b"1")
    except Exception:  # noqa: BLE001 - best effort (the store is gone: the peers time out)
        return None
    limit = timeout if timeout is not None else group_timeout(group)
    try:
        store.wait([key + "all"], datetime.timedelta(seconds=limit))
        verdict = store.get(key + "all").decode()
    except Exception:  # noqa: BLE001 - timed out: some rank gave no verdict
        return f"not every rank reported completing it within {limit:.1f} s (a rank died or stalled)"
    if verdict == "1":
        return None
    return f"rank {verdict.split(':', 1)[-1]} failed it (timed out, was interrupted or died)"


def agree(group, digest: str, errors: list[str], *, options: str = "", timeout: float | None = None,
          kind: Step = Step.HANDSHAKE, version: int = 0, token: int = 0, settle: bool = False) -> list[dict]:
    """Collective: exchange plan digest, options and local errors; raise :class:`ReshardError` on
    every rank if any rank reported an error or the digests or options differ.  Never pickles.
    ``timeout`` bounds the wait (a rank that never joins makes the others raise after it, naming
    the ranks that did not answer).  ``settle``: the exchange ends the same way on every rank
    (:func:`_settle`, through the group's store): a rank whose exchange completed raises too when
    any other rank's failed.  Returns every rank's control message (``token``: each rank's)."""
    rank = dist.get_rank(group)
    t0 = time.monotonic()
    ticket = checkin(group)
    try:
        msgs = exchange(group, kind, digest=digest, version=version, ok=not errors, options=options,
                        text="; ".join(errors), timeout=timeout, token=token, flags=_F_SETTLE if settle else 0)
    except BaseException as e:  # noqa: BLE001 - a peer that died or never joined; KeyboardInterrupt
        if settle:
            _settle(ticket, rank, False, timeout, group)
        if not isinstance(e, Exception):
            raise
        raise ReshardError(f"reshard {step_label(kind)} failed on rank {rank} after {time.monotonic() - t0:.1f} s: "
                           f"{_who(ticket)} (a peer died, never joined, or the process group is broken): {type(e).__name__}: {e}"
                           + (f" | this rank's own problems: {'; '.join(errors)}" if errors else "")) from e
    # every rank settles only when every rank's message says it does (same step, same kind of caller);
    # otherwise every rank sees the mismatch in the messages and raises below
    if settle and all(m["kind"] == kind and m["flags"] & _F_SETTLE for m in msgs):
        if ticket is not None:      # the verdict key every rank agrees on: the highest check-in count
            ticket = (ticket[0], max(m["seq"] for m in msgs), ticket[2])
        elsewhere = _settle(ticket, rank, True, timeout, group)
        if elsewhere:
            raise ReshardError(f"reshard {step_label(kind)} failed on rank {rank}: its exchange completed here but not on "
                               f"every rank: {elsewhere}; every rank raises (no rank is bound alone)")
    problems = []
    step = step_mismatch(msgs, kind)
    if step:
        problems.append(step)
    hashes = [m["digest"] for m in msgs]
    if len(set(hashes)) > 1:
        by_hash = _by_value([h[:12] for h in hashes])
        problems.append("plan hashes differ between ranks: " + "; ".join(f"{h} on ranks {rs}" for h, rs in sorted(by_hash.items())))
    opt_texts = [m["options"] for m in msgs]
    if not step and len(set(opt_texts)) > 1:
        by_opt = _by_value(opt_texts)
        problems.append("options differ between ranks: " + "; ".join(f"{o or '(none)'} on ranks {rs}" for o, rs in sorted(by_opt.items())))
    texts: dict[str, list[int]] = {}
    for r, m in enumerate(msgs):
        if not m["ok"]:
            texts.setdefault(m["text"] or f"rank {r} failed its checks", []).append(r)
    for text, rs in texts.items():
        problems.append(text if len(rs) == 1 or text.startswith("rank ") else f"ranks {rs}: {text}")
    versions = sorted({m["version"] for m in msgs})
    if kind == Step.RETRY_HANDSHAKE and not step and len(versions) > 1:
        problems.append(f"ranks retry different refit versions {versions}")
    if problems:
        head = "reshard refused before any transfer: " if kind == Step.HANDSHAKE else f"refit {version} retry refused: "
        raise ReshardError(head + " | ".join(problems))
    return msgs


def all_gather_json(obj, group=None, timeout: float | None = None) -> list:
    """Every rank's JSON-able ``obj``, in rank order (metadata exchange; never pickle).  A rank
    that does not join within ``timeout`` (None: the group's timeout) makes the others raise
    :class:`ReshardError` naming it."""
    timeout = check_timeout(timeout)
    data = json.dumps(obj, sort_keys=True).encode()
    device = group_device(group)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    t0 = time.monotonic()
    ticket = checkin(group)
    try:     # the sizes, as control messages (Step.METADATA_EXCHANGE): a rank at another step is seen, not mismatched
        opening = exchange(group, Step.METADATA_EXCHANGE, version=len(data), timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a peer that died or never joined
        raise ReshardError(f"metadata exchange (all_gather_json) failed on rank {rank} after "
                           f"{time.monotonic() - t0:.1f} s: {_who(ticket)}; cause: {type(e).__name__}: {str(e)[:300]}") from e
    step = step_mismatch(opening, Step.METADATA_EXCHANGE)
    if step:
        raise ReshardError(f"metadata exchange (all_gather_json) refused on rank {rank}: {step} (a rank called a "
                           "collective of the library the others are not in, e.g. join_refit again while they refit); "
                           "nothing was exchanged")
    sizes = [m["version"] for m in opening]
    try:
        longest = max(sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(device)
        out = [torch.empty_like(buf) for _ in range(world)]
        bounded_wait(dist.all_gather(out, buf, group=group, async_op=True), timeout, group)
    except Exception as e:  # noqa: BLE001 - a peer that died or never joined
        raise ReshardError(f"metadata exchange (all_gather_json) failed on rank {rank} after "
                           f"{time.monotonic() - t0:.1f} s: {_who(ticket)}; cause: {type(e).__name__}: {str(e)[:300]}") from e
    return [json.loads(bytes(o[:n].cpu().tolist()).decode()) for o, n in zip(out, sizes)]


_F_EXPLICIT, _F_DIRTY = 1, 2


class GatherChecked:
    """Collective context manager: run this rank's part of a metadata exchange, then all-gather it;
    an exception in the block on *any* rank makes *every* rank raise one :class:`ReshardError`
    naming each failing rank (nobody is left waiting in a later collective)::

        with GatherChecked(group, "reading the models", timeout=t) as g:
            g.payload["src"] = read(...)          # rank 1 raises ValueError("no chunks")
        g.parts   # every rank's payload, in rank order -- or, on every rank:
        # ReshardError: reading the models failed: rank 1: ValueError: no chunks

    ``g.payload`` starts as ``{"error": None}``; whatever the block puts there must be JSON-able."""

    def __init__(self, group, what: str, *, timeout: float | None = None):
        self.group, self.what, self.timeout = group, what, timeout
        self.payload: dict = {"error": None}
        self.parts: list[dict] = []

    def __enter__(self) -> "GatherChecked":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False      # KeyboardInterrupt & co. propagate as they are
        if exc is not None:
            self.payload = {"error": f"rank {dist.get_rank(self.group)}: {type(exc).__name__}: {exc}"}
        self.parts = all_gather_json(self.payload, self.group, timeout=self.timeout)
        errors = [p["error"] for p in self.parts if p.get("error")]
        if errors:
            raise ReshardError(f"{self.what} failed: " + " | ".join(errors)) from exc
        return True


@contextlib.contextmanager
def all_or_none(group, *, timeout: float | None = None):
    """Collective guard around work every rank does alike after an exchange (merging, planning):
    an exception on this rank is first exchanged (:func:`agree` with no digest), so that *every*
    rank raises the same :class:`ReshardError` -- the others in their next :func:`agree` (the
    :class:`Resharder` handshake) -- instead of waiting for this one."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every rank must hear about it
        agree(group, "00" * 32, [f"rank {dist.get_rank(group)}: {type(e).__name__}: {e}"], timeout=timeout)
        raise  # unreachable: agree raises on every rank


def refit_start(group, *, rank: int, digest: str, token: int, proposal: int, explicit: bool, options: str,
                dirty: bool, timeout: float | None, problems: list[str] = ()) -> int:
    """Collective, before any byte of a refit moves: every rank states which binding it refits
    (plan digest + binding token), with which options, which version it proposes (``explicit``:
    the caller passed ``version=``) and whether operations of an interrupted refit may still be
    pending on this group (``dirty``).  Returns the agreed version (the explicit one, else the
    highest proposal, so ranks that disagree after an interruption converge); raises
    :class:`ReshardError` on every rank if they refit different Resharders, options differ,
    explicit versions differ, any rank is dirty or reports ``problems`` of its own (bound tensors
    it cannot use any more).  A failed exchange raises (the caller turns it into a
    :class:`TransferError`)."""
    flags = (_F_EXPLICIT if explicit else 0) | (_F_DIRTY if dirty else 0)
    own = list(problems)
    msgs = exchange(group, Step.REFIT_START, digest=digest, version=proposal, options=options, token=token, flags=flags,
                    timeout=timeout, ok=not own, text="; ".join(own))
    problems = [m["text"] or f"rank {q} failed its checks" for q, m in enumerate(msgs) if not m["ok"]]
    step = step_mismatch(msgs, Step.REFIT_START)
    if step:
        problems.append(step)
    else:
        binds = _by_value([f"plan {m['digest'][:12]} binding {m['token']:016x}" for m in msgs])
        if len(binds) > 1:
            problems.append("ranks refit different Resharders (two Resharders over one group must refit in the same "
                            "order on every rank): " + "; ".join(f"{b} on ranks {rs}" for b, rs in sorted(binds.items())))
        opts = _by_value([m["options"] for m in msgs])
        if len(opts) > 1:
            problems.append("options differ between ranks: " + "; ".join(f"{o} on ranks {rs}" for o, rs in sorted(opts.items())))
        dirty_ranks = [r for r, m in enumerate(msgs) if m["flags"] & _F_DIRTY]
        if dirty_ranks:
            problems.append(f"ranks {dirty_ranks} were interrupted with operations possibly still pending on this "
                            "process group: call rebind(new_group) on every rank first")
        wanted = sorted({m["version"] for m in msgs if m["flags"] & _F_EXPLICIT})
        if len(wanted) > 1:
            problems.append(f"ranks ask for different refit versions {wanted}")
    if problems:
        raise ReshardError(f"rank {rank}: refit refused before any byte moved: " + " | ".join(problems))
    wanted = [m["version"] for m in msgs if m["flags"] & _F_EXPLICIT]
    return wanted[0] if wanted else max(m["version"] for m in msgs)


class _Claim:
    """A Resharder operation holding a process group in this process (:func:`group_guard`): the
    object itself is the claim, ``thread`` names who holds it."""
    __slots__ = ("thread",)

    def __init__(self, thread: str):
        self.thread = thread


_CLAIMS: dict[int, _Claim] = {}     # id(process group) -> the operation holding it


@contextlib.contextmanager
def group_guard(group, rank: int, what: str):
    """One Resharder operation at a time per process group in this process: a second thread
    that tries (a refit, handshake or rebind over the same group) gets :class:`ReshardError` at
    once instead of interleaving its messages with the first one's (gloo aborts the process).

    A KeyboardInterrupt (SIGINT) landing anywhere in here never leaves the group claimed: the
    claim is one atomic ``dict.setdefault`` inside the ``try`` (this operation holds the group iff
    its own claim object is stored), and the release has no call in it (CPython runs a signal's
    handler only at calls, function starts and backward jumps)."""
    key = id(group if group is not None else dist.group.WORLD)
    me = _Claim(threading.current_thread().name)
    try:
        holder = _CLAIMS.setdefault(key, me)
        if holder is not me:
            raise ReshardError(f"rank {rank}: cannot {what}: thread {holder.thread!r} is running a refit or handshake "
                               "over the same process group in this process; Resharders sharing a group must run one "
                               "after another (use one thread, or a group per thread)")
        yield
    finally:
        if key in _CLAIMS and _CLAIMS[key] is me:
            del _CLAIMS[key]
