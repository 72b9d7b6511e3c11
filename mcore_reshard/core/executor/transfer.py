"""One object owns a bound Resharder's refit state and runs its refits: a :class:`Refit`.

What it owns, and the only methods that change it:

    state                          | changed by
    binding (views, staging)       | swap()        -- whole, never edited (bind, a followed owner)
    channel (group, timeout)       | use()         -- whole (bind, rebind)
    token (the binding id)         | agreed()      -- once, after the construction handshake
    version, buffer_version,       | run() and its steps: the refit start, padding, the rounds (through
    interrupted, dirty             |   the transport) with the local copies overlapped with the first one,
                                   |   verify's source check, the final confirmation; settled() (rebind)

The rounds (:mod:`.rounds`, through a :class:`~.transport.Transport`) read it and change nothing but
the binding's memo of derived schedules."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import common
from .binding import Binding
from .checksum import checksum
from .common import group_timeout, waits_block
from .errors import ReshardError, TransferError
from .handshake import Step, exchange, refit_start, step_mismatch
from .rounds import copy_all


@dataclass(frozen=True, slots=True)
class Channel:
    """The process group a binding's refits run on, and what is looked up once per group (not once
    per operation): its size, the timeout in seconds and whether its waits block the host."""
    group: object
    world: int
    timeout_s: float
    waits_block: bool

    @classmethod
    def of(cls, group, world: int, timeout: float | None) -> "Channel":
        """``timeout=None``: the group's own timeout (:func:`~.common.group_timeout`)."""
        return cls(group, world, timeout if timeout is not None else group_timeout(group), waits_block(group))


class RefitState:
    """The refit state of one bound :class:`~.resharder.Resharder` on this rank and its bookkeeping
    (the steps that change it: :class:`Refit`, the one object a Resharder holds).

    Fixed at bind: ``rank``, ``verify``, ``confirm``, ``digest`` (the plan's).  Swapped whole:
    ``binding`` (:meth:`swap`), ``channel`` (:meth:`use`); set once: ``token`` (:meth:`agreed`).
    Changed by refits: ``version`` (the last refit confirmed complete), ``buffer_version`` (the refit
    version each destination buffer fully holds; None: none), ``interrupted`` (the last refit's
    failure: version, round, error), ``sources_changed`` (verify saw a source change during the
    last transfer) and ``dirty`` (an interrupted refit may have left operations pending on the
    group: refused until :meth:`settled`)."""

    __slots__ = ("rank", "verify", "confirm", "digest", "token", "binding", "channel", "version", "buffer_version",
                 "interrupted", "sources_changed", "dirty")

    def __init__(self, rank: int, verify: bool, confirm: bool, digest: str, dst_names, channel: Channel):
        self.rank, self.verify, self.confirm, self.digest = rank, verify, confirm, digest
        self.channel = channel
        self.token = 0
        self.binding: Binding | None = None
        self.version = 0
        self.buffer_version: dict[str, int | None] = {n: None for n in dst_names}
        self.interrupted: dict | None = None
        self.sources_changed = False
        self.dirty = False

    # what the rounds read
    @property
    def group(self):
        return self.channel.group

    @property
    def timeout_s(self) -> float:
        return self.channel.timeout_s

    @property
    def waits_block(self) -> bool:
        return self.channel.waits_block

    @property
    def rounds(self) -> list:
        return self.binding.rounds

    @property
    def round_numbers(self) -> list:
        return self.binding.round_numbers

    @property
    def src(self) -> dict:
        return self.binding.src

    def swap(self, binding: Binding) -> None:
        """Refit through ``binding`` from now on (the previous one, views of the storage it bound and
        the schedules derived from them, is dropped whole)."""
        self.binding = binding

    def use(self, channel: Channel) -> None:
        """Run every later refit on ``channel`` (construction, :meth:`Resharder.rebind`)."""
        self.channel = channel

    def agreed(self, token: int) -> None:
        """The binding id agreed in the construction handshake (every refit start compares it)."""
        self.token = token

    def settled(self) -> None:
        """The group is fresh (after a rebind): nothing of an interrupted refit is pending on it."""
        self.dirty = False

    def snapshot(self) -> dict:
        """What :meth:`Resharder.state` returns."""
        info = self.interrupted or {}
        return {
            "version": self.version,
            "interrupted": self.interrupted is not None,
            "interrupted_version": info.get("version"),
            "failed_round": info.get("round"),
            "error": info.get("error"),
            "buffers": dict(self.buffer_version),
            "incomplete": sorted(n for n, v in self.buffer_version.items() if v is None),
        }

    def stage_begin(self, stage: int) -> None:
        """Buffers first written at ``stage`` (-1: local copies and padding) hold no complete version."""
        for name in self.binding.first_stage.get(stage, ()):
            self.buffer_version[name] = None

    def stage_end(self, stage: int, version: int) -> None:
        """Buffers last written at ``stage`` now hold ``version``."""
        for name in self.binding.last_stage.get(stage, ()):
            self.buffer_version[name] = version

    def drop_version(self, v: int) -> None:
        """Buffers written by refit ``v`` hold no trustworthy version (a source changed under it)."""
        for name, have in self.buffer_version.items():
            if have == v:
                self.buffer_version[name] = None


class Refit(RefitState):
    """A :class:`RefitState` with the refit's steps: :meth:`run` (start, then :meth:`transfer` and
    :meth:`confirmation`, recording an interruption)."""

    __slots__ = ()

    def transfer(self, v: int, problems: list[str], transport) -> dict:
        """Padding, then every round through ``transport`` (a :class:`~.transport.Transport`), with the
        local copies done while the first round's bytes travel (:class:`LocalCopies`); ``problems``
        collects verify failures.

        Version bookkeeping: a buffer first written by the local copies or round ``i`` loses its
        version before that stage starts (before the round's operations are posted, so before any
        byte of it can land); a buffer last written by the local copies gets this refit's version
        once they are all done (:meth:`LocalCopies.drain`, after the first round), one last written by
        round ``i`` once that round is complete.  A round that fails leaves the buffers it writes
        without a version; the local copies are still finished first (they need no peer)."""
        b = self.binding
        src_sums = {n: checksum(t) for n, t in self.src.items()} if self.verify else {}
        self.stage_begin(-1)
        for pad in b.padding:
            pad.view.zero_()
        bad_buffers: set = set()
        local = LocalCopies(self, problems, bad_buffers)

        def local_done() -> None:     # the rest of the local copies; their buffers hold ``v`` once done
            local.drain()
            self.stage_end(-1, v)

        sent = nmsg = direct = 0
        if b.rounds and any(x.message.forward for x in b.rounds[0].sends):
            # a forwarded send (two-level plans) packs destination views, which the local copies may
            # write: those copies must be done before its round is packed
            local.drain()
        for i, rnd in enumerate(b.rounds):
            self.stage_begin(i)
            self.dirty = True      # operations of this round may stay pending if it is interrupted
            try:
                transport.run_round(self, v, i, rnd, problems, bad_buffers, background=local.step if i == 0 else None)
            except Exception:
                if i == 0:
                    local_done()
                raise
            if i == 0:
                local_done()
            self.dirty = False
            self.stage_end(i, v)
            nmsg += len(rnd.sends)
            for x in rnd.sends:
                sent += x.buf.numel()
                if x.message.unstaged:
                    direct += sum(c.nbytes for c in x.message.entries)
        if not b.rounds:
            local_done()
        changed = sorted(n for n, t in self.src.items() if not torch.equal(checksum(t), src_sums[n])) if self.verify else []
        if changed:
            self.sources_changed = True
            problems.insert(0, f"source tensor(s) {', '.join(changed[:4])} on rank {self.rank} changed during refit {v} "
                            "(the caller must not write the sources while a refit runs): what was sent mixes versions")
        for name in bad_buffers:
            self.buffer_version[name] = None
        if problems and not self.confirm:
            if changed:
                self.drop_version(v)
            raise TransferError(f"refit {v} on rank {self.rank} failed verification: " + "; ".join(problems[:8]), version=v)
        # staged_bytes_sent: what went through the staging buffer (+ verify trailers); unstaged_bytes_sent:
        # the payload of unstaged messages, sent straight from the tensors
        return {"messages_sent": nmsg, "staged_bytes_sent": sent, "unstaged_bytes_sent": direct}

    def confirmation(self, v: int, problems: list[str]) -> None:
        """Every rank reports (version, ok); raise unless every rank landed this version."""
        t0 = time.monotonic()
        changed, self.sources_changed = self.sources_changed, False
        self.dirty = True
        try:
            msgs = exchange(self.group, Step.CONFIRMATION, digest=self.digest, version=v, ok=not problems,
                            text="; ".join(problems[:8]), timeout=self.timeout_s, token=self.token,
                            flags=1 if changed else 0)
            self.dirty = False
        except Exception as e:  # noqa: BLE001
            raise TransferError(
                f"refit {v}: rank {self.rank} finished its rounds but the final confirmation failed after "
                f"{time.monotonic() - t0:.1f} s (timeout {self.timeout_s} s): another rank died or stopped part-way; "
                f"{'this rank: ' + '; '.join(problems[:4]) + '; ' if problems else ''}cause: {type(e).__name__}: {str(e)[:300]}",
                version=v, round=0) from e
        step = step_mismatch(msgs, Step.CONFIRMATION)
        failed = [q for q, m in enumerate(msgs) if not m["ok"]]
        foreign = sorted(q for q, m in enumerate(msgs) if (m["digest"], m["token"]) != (self.digest, self.token))
        if any(m["flags"] & 1 for m in msgs) or step or foreign:
            self.drop_version(v)
        if foreign and not step:
            raise TransferError(f"refit {v} did not complete everywhere (rank {self.rank}): ranks {foreign} confirmed "
                                "another Resharder's refit (plan digest / binding id differ): what arrived here is "
                                "not trusted", version=v, round=0, peers=foreign)
        versions = sorted({m["version"] for m in msgs})
        if step or failed or len(versions) > 1:
            text = f"refit {v} did not complete everywhere (rank {self.rank}):"
            if step:
                text += " " + step
            elif failed:
                text += " " + "; ".join(f"rank {q}: {msgs[q]['text']}" for q in failed)
            if not step and len(versions) > 1:
                text += f" ranks refit different versions {versions}"
            raise TransferError(text, version=v, round=0, peers=failed)

    def run(self, version: int | None, refusal: list[str] | None, *, follow, options: str, transport) -> dict:
        """Refit start (agreed version), transfer, confirmation; records an interruption.
        ``refusal``: this rank's own reasons not to refit (every rank then raises before a byte
        moves); ``follow``: the owners check (:meth:`Resharder.follow_owners`, returns problems; it
        may :meth:`swap` the binding); ``options``: the options string every rank compares;
        ``transport``: the :class:`~.transport.Transport` of the rounds."""
        proposal = self.version + 1 if version is None else version
        try:     # owners whose storage changed since bind (param.data = new): followed, or refused everywhere
            local_problems = follow()
        except Exception as e:  # noqa: BLE001 - a crash here must still reach every rank
            local_problems = [f"rank {self.rank}: checking the bound tensors failed: {type(e).__name__}: {str(e)[:300]}"]
        local_problems += [f"rank {self.rank} refuses this refit: {why}" for why in refusal or ()]
        t0 = time.monotonic()
        try:
            v = refit_start(self.group, rank=self.rank, digest=self.digest, token=self.token, proposal=proposal,
                            explicit=version is not None, options=options, dirty=self.dirty,
                            timeout=self.timeout_s, problems=local_problems)
        except ReshardError:
            raise        # refused on every rank before any byte moved; nothing changed here
        except BaseException as e:  # noqa: BLE001 - a peer died or the group is broken
            self.interrupted = {"version": proposal, "round": 0, "error": f"{type(e).__name__}: {e}"}
            self.dirty = True
            if not isinstance(e, Exception):
                raise
            raise TransferError(
                f"refit {proposal}: rank {self.rank} could not start: the refit start exchange failed after "
                f"{time.monotonic() - t0:.1f} s (timeout {self.timeout_s} s): a peer died, stalled or the process group "
                f"is broken; no byte moved -- call rebind(new_group) on every rank, then refit() again; "
                f"cause: {type(e).__name__}: {str(e)[:300]}", version=proposal, round=0) from e
        problems: list[str] = []
        try:
            stats = self.transfer(v, problems, transport)
            if self.confirm:
                self.confirmation(v, problems)
        except TransferError as e:
            self.interrupted = {"version": v, "round": e.round, "error": str(e)}
            raise
        except BaseException as e:  # noqa: BLE001 - anything else that stops a refit half-way
            self.interrupted = {"version": v, "round": None, "error": f"{type(e).__name__}: {e}"}
            self.dirty = True
            raise
        self.version = v
        self.interrupted = None
        stats["version"] = v
        return stats


class LocalCopies:
    """This refit's local copies (``copy_`` from a source into a destination view on the same rank),
    run in slices of about ``_LOCAL_SLICE`` bytes (one ``torch._foreach_copy_`` each) by the first
    round whenever its bytes are on the wire, instead of all of them before any byte is posted;
    :meth:`drain` runs what is left.  With ``verify`` every copy is checked against its source."""

    def __init__(self, st: RefitState, problems: list[str], bad_buffers: set):
        self.st, self.problems, self.bad = st, problems, bad_buffers
        self.k = 0

    def step(self) -> bool:
        """Run the next slice; whether copies are left after it."""
        local, k = self.st.binding.local, self.k
        if k >= len(local):
            return False
        j, size = k, 0
        while j < len(local) and (j == k or size < common._LOCAL_SLICE):
            size += local[j].copy.nbytes
            j += 1
        sel = local[k:j]
        self.k = j
        copy_all([x.dst for x in sel], [x.src if x.src.shape == x.dst.shape else x.src.reshape(x.dst.shape) for x in sel])
        if self.st.verify:
            for x in sel:
                c = x.copy
                if x.dst.dtype == x.src.dtype and not torch.equal(checksum(x.dst), checksum(x.src)):
                    self.problems.append(f"local copy of {c.tensor}{c.box} into buffer {c.dst_buffer} differs from the source")
                    self.bad.add(c.dst_buffer)
        return self.k < len(local)

    def drain(self) -> None:
        while self.step():
            pass
