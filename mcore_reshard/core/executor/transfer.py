"""One refit's byte movement and its bookkeeping: padding, the rounds with the local copies
overlapped with the first one (with the
stage at which each destination buffer loses / gains its version), verify's source check, and the
final confirmation.  Each function takes the bound :class:`~.resharder.Resharder` ``r``."""
from __future__ import annotations

import time

import torch

from . import common
from .checksum import checksum
from .errors import ReshardError, TransferError
from .handshake import exchange, refit_start, step_mismatch
from .rounds import copy_all, round_batched, round_overlapped


def stage_begin(r, stage: int) -> None:
    """Buffers first written at ``stage`` (-1: local copies and padding) hold no complete version."""
    for name in r._first_stage.get(stage, ()):
        r._buffer_version[name] = None


def stage_end(r, stage: int, version: int) -> None:
    """Buffers last written at ``stage`` now hold ``version``."""
    for name in r._last_stage.get(stage, ()):
        r._buffer_version[name] = version


class LocalCopies:
    """This refit's local copies (``copy_`` from a source into a destination view on the same rank),
    run in slices of about ``_LOCAL_SLICE`` bytes (one ``torch._foreach_copy_`` each) by the first
    round whenever its bytes are on the wire, instead of all of them before any byte is posted;
    :meth:`drain` runs what is left.  With ``verify`` every copy is checked against its source."""

    def __init__(self, r, problems: list[str], bad_buffers: set):
        self.r, self.problems, self.bad = r, problems, bad_buffers
        self.k = 0

    def step(self) -> bool:
        """Run the next slice; whether copies are left after it."""
        local, k = self.r.local, self.k
        if k >= len(local):
            return False
        j, size = k, 0
        while j < len(local) and (j == k or size < common._LOCAL_SLICE):
            size += local[j].copy.nbytes
            j += 1
        sel = local[k:j]
        self.k = j
        copy_all([x.dst for x in sel], [x.src if x.src.shape == x.dst.shape else x.src.reshape(x.dst.shape) for x in sel])
        if self.r.verify:
            for x in sel:
                c = x.copy
                if x.dst.dtype == x.src.dtype and not torch.equal(checksum(x.dst), checksum(x.src)):
                    self.problems.append(f"local copy of {c.tensor}{c.box} into buffer {c.dst_buffer} differs from the source")
                    self.bad.add(c.dst_buffer)
        return self.k < len(local)

    def drain(self) -> None:
        while self.step():
            pass


def transfer(r, v: int, problems: list[str]) -> dict:
    """Padding, then every round, with the local copies done while the first round's bytes travel
    (:class:`LocalCopies`); ``problems`` collects verify failures.

    Version bookkeeping: a buffer first written by the local copies or round ``i`` loses its
    version before that stage starts (before the round's operations are posted, so before any
    byte of it can land); a buffer last written by the local copies gets this refit's version
    once they are all done (:meth:`LocalCopies.drain`, after the first round), one last written by
    round ``i`` once that round is complete.  A round that fails leaves the buffers it writes
    without a version; the local copies are still finished first (they need no peer)."""
    src_sums = {n: checksum(t) for n, t in r.src.items()} if r.verify else {}
    stage_begin(r, -1)
    for pad in r.padding:
        pad.view.zero_()
    bad_buffers: set = set()
    local = LocalCopies(r, problems, bad_buffers)

    def local_done() -> None:     # the rest of the local copies; their buffers hold ``v`` once done
        local.drain()
        stage_end(r, -1, v)

    sent = nmsg = direct = 0
    run_round = round_overlapped if r.overlapped() else round_batched
    if r.rounds and any(x.message.forward for x in r.rounds[0].sends):
        # a forwarded send (two-level plans) packs destination views, which the local copies may
        # write: those copies must be done before its round is packed
        local.drain()
    for i, rnd in enumerate(r.rounds):
        stage_begin(r, i)
        r._dirty = True      # operations of this round may stay pending if it is interrupted
        try:
            run_round(r, v, i, rnd, problems, bad_buffers, background=local.step if i == 0 else None)
        except Exception:
            if i == 0:
                local_done()
            raise
        if i == 0:
            local_done()
        r._dirty = False
        stage_end(r, i, v)
        nmsg += len(rnd.sends)
        for x in rnd.sends:
            sent += x.buf.numel()
            if x.message.unstaged:
                direct += sum(c.nbytes for c in x.message.entries)
    if not r.rounds:
        local_done()
    changed = sorted(n for n, t in r.src.items() if not torch.equal(checksum(t), src_sums[n])) if r.verify else []
    if changed:
        r._sources_changed = True
        problems.insert(0, f"source tensor(s) {', '.join(changed[:4])} on rank {r.rank} changed during refit {v} "
                        "(the caller must not write the sources while a refit runs): what was sent mixes versions")
    for name in bad_buffers:
        r._buffer_version[name] = None
    if problems and not r.confirm:
        if changed:
            drop_version(r, v)
        raise TransferError(f"refit {v} on rank {r.rank} failed verification: " + "; ".join(problems[:8]), version=v)
    # staged_bytes_sent: what went through the staging buffer (+ verify trailers); unstaged_bytes_sent:
    # the payload of unstaged messages, sent straight from the tensors
    return {"messages_sent": nmsg, "staged_bytes_sent": sent, "unstaged_bytes_sent": direct}


def drop_version(r, v: int) -> None:
    """Buffers written by refit ``v`` hold no trustworthy version (a source changed under it)."""
    for name, have in r._buffer_version.items():
        if have == v:
            r._buffer_version[name] = None


def confirm(r, v: int, problems: list[str]) -> None:
    """Every rank reports (version, ok); raise unless every rank landed this version."""
    t0 = time.monotonic()
    changed, r._sources_changed = r._sources_changed, False
    r._dirty = True
    try:
        msgs = exchange(r.group, 3, digest=r._digest, version=v, ok=not problems,
                        text="; ".join(problems[:8]), timeout=r.timeout_s, token=r._token,
                        flags=1 if changed else 0)
        r._dirty = False
    except Exception as e:  # noqa: BLE001
        raise TransferError(
            f"refit {v}: rank {r.rank} finished its rounds but the final confirmation failed after "
            f"{time.monotonic() - t0:.1f} s (timeout {r.timeout_s} s): another rank died or stopped part-way; "
            f"{'this rank: ' + '; '.join(problems[:4]) + '; ' if problems else ''}cause: {type(e).__name__}: {str(e)[:300]}",
            version=v, round=0) from e
    step = step_mismatch(msgs, 3)
    failed = [q for q, m in enumerate(msgs) if not m["ok"]]
    foreign = sorted(q for q, m in enumerate(msgs) if (m["digest"], m["token"]) != (r._digest, r._token))
    if any(m["flags"] & 1 for m in msgs) or step or foreign:
        drop_version(r, v)
    if foreign and not step:
        raise TransferError(f"refit {v} did not complete everywhere (rank {r.rank}): ranks {foreign} confirmed "
                            "another Resharder's refit (plan digest / binding id differ): what arrived here is "
                            "not trusted", version=v, round=0, peers=foreign)
    versions = sorted({m["version"] for m in msgs})
    if step or failed or len(versions) > 1:
        text = f"refit {v} did not complete everywhere (rank {r.rank}):"
        if step:
            text += " " + step
        elif failed:
            text += " " + "; ".join(f"rank {q}: {msgs[q]['text']}" for q in failed)
        if not step and len(versions) > 1:
            text += f" ranks refit different versions {versions}"
        raise TransferError(text, version=v, round=0, peers=failed)


def run_refit(r, version: int | None, refusal: list[str] | None = None) -> dict:
    """Refit start (agreed version), transfer, confirmation; records an interruption on ``r``.
    ``refusal``: this rank's own reasons not to refit (every rank then raises before a byte moves)."""
    proposal = r.version + 1 if version is None else version
    try:     # owners whose storage changed since bind (param.data = new): followed, or refused everywhere
        local_problems = r.follow_owners()
    except Exception as e:  # noqa: BLE001 - a crash here must still reach every rank
        local_problems = [f"rank {r.rank}: checking the bound tensors failed: {type(e).__name__}: {str(e)[:300]}"]
    local_problems += [f"rank {r.rank} refuses this refit: {why}" for why in refusal or ()]
    t0 = time.monotonic()
    try:
        v = refit_start(r.group, rank=r.rank, digest=r._digest, token=r._token, proposal=proposal,
                        explicit=version is not None, options=r._options(), dirty=r._dirty,
                        timeout=r.timeout_s, problems=local_problems)
    except ReshardError:
        raise        # refused on every rank before any byte moved; nothing changed here
    except BaseException as e:  # noqa: BLE001 - a peer died or the group is broken
        r._interrupted = {"version": proposal, "round": 0, "error": f"{type(e).__name__}: {e}"}
        r._dirty = True
        if not isinstance(e, Exception):
            raise
        raise TransferError(
            f"refit {proposal}: rank {r.rank} could not start: the refit start exchange failed after "
            f"{time.monotonic() - t0:.1f} s (timeout {r.timeout_s} s): a peer died, stalled or the process group "
            f"is broken; no byte moved -- call rebind(new_group) on every rank, then refit() again; "
            f"cause: {type(e).__name__}: {str(e)[:300]}", version=proposal, round=0) from e
    problems: list[str] = []
    try:
        stats = transfer(r, v, problems)
        if r.confirm:
            confirm(r, v, problems)
    except TransferError as e:
        r._interrupted = {"version": v, "round": e.round, "error": str(e)}
        raise
    except BaseException as e:  # noqa: BLE001 - anything else that stops a refit half-way
        r._interrupted = {"version": v, "round": None, "error": f"{type(e).__name__}: {e}"}
        r._dirty = True
        raise
    r.version = v
    r._interrupted = None
    stats["version"] = v
    return stats
