"""The :class:`Resharder`: binds a plan to this rank's tensors once (validation + handshake), then
each ``refit()`` moves the bytes through its :class:`~.transfer.Refit`, which owns every piece of
refit state (the binding, the group, the versions, interruptions); ``rebind`` changes the group."""
from __future__ import annotations

import datetime
import os
from typing import Mapping

import torch
import torch.distributed as dist

from ..planner import Plan
from .binding import Binding, bind
from .common import check_timeout, group_device
from .errors import ReshardError
from .handshake import agree, group_guard
from .owners import Owners, describe, is_dtensor, record, storage_of
from .preflight import check_aliasing, check_arguments, check_binding, member_rank, own_part
from .transfer import Channel, LocalCopies, Refit
from .transport import Transport, transport_for


class Resharder:
    """Binds ``plan`` to this rank's tensors; ``refit()`` moves the weights (collective).

    ``src``/``dst`` map buffer names to this rank's real tensors (a rank may have either, both or
    none); they must be exactly the buffers the plan gives this rank.  Source tensors are only read
    (a destination tensor sharing memory with a source is refused).  ``timeout`` (seconds) bounds
    the handshake, every round and the final confirmation: a dead or stalled peer makes every rank
    raise :class:`TransferError` instead of waiting (``None``: the process group's own timeout, or
    the default group's when shorter -- a ``new_group()`` made without ``timeout=`` has torch's 30 min;
    never unbounded).
    ``verify`` adds a checksum per copied box to every message and checks what arrives (debug;
    must be the same on every rank).  ``confirm`` ends every refit with a tiny all-gather so that
    ``refit()`` returns only when every rank has landed every byte (then ``state()["version"]`` is
    the same everywhere).  ``staging``: a uint8 tensor to use instead of allocating the staging
    buffer, when at least :func:`staging_size` bytes (shared by Resharders run one after another).
    ``overlap``: how a round moves its messages (see :meth:`overlapped`); ``None`` (default): overlapped
    on gloo, grouped ``batch_isend_irecv`` calls (one per chunk, pipelined) on every other backend (NCCL).
    ``layouts``: ``(src_layout, dst_layout)`` the plan claims to come from; when given, every copy
    of this rank is checked against them before a byte moves (``MegatronRefit`` passes them).
    Refits run without autograd on detached views (``nn.Parameter`` tensors stay as they are).

    What is bound: the objects given (the *owners*: ``nn.Parameter``, tensor or DTensor) and the
    storage each uses at bind.  A DTensor is bound through its local shard (``to_local()``), which
    must be the buffer the plan gives this rank.  A destination (or staging buffer) that is an
    inference tensor (made under ``torch.inference_mode()``) is refused: torch forbids writing it in
    place outside inference mode.  Every refit first checks, before a byte moves, that each owner
    still uses the storage bound (pointer, shape, strides; a loop of compares): an owner rebound
    since (``param.data = new``, as engines do in post-load processing) is **followed** -- the
    refit reads / writes the new storage -- when the new tensor has the bound shape, strides, dtype
    and device and shares no memory with another bound tensor; otherwise the refit is refused on
    every rank with a :class:`ReshardError` naming the tensor, the rank and both storages.  A
    tensor passed as a temporary (``param.data``, ``t.view(...)``) is its own owner: rebinding the
    parameter it came from cannot be seen -- pass the parameter itself.  Bool tensors move as bytes
    (a byte other than 0 / 1 lands unchanged).

    The process group: every refit, handshake and :meth:`rebind` runs collectives on ``group``;
    nothing else may run collectives on that group meanwhile (another thread's ``all_reduce``
    could be matched with a control message: the refit then fails, possibly after bytes moved on
    some ranks).  Give each Resharder (or each user of collectives) a group of its own
    (``dist.new_group``); a second Resharder operation on the same group in this process is refused
    (``group_guard``), collectives of other code are not detectable.  A process that is not a member
    of ``group`` gets a ValueError naming its rank and the group's ranks.
    """

    def __init__(self, plan: Plan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                 group=None, *, timeout: float | None = None, verify: bool = False, confirm: bool = True,
                 staging: torch.Tensor | None = None, overlap: bool | None = None, layouts=None):
        self._timeout_arg = check_timeout(timeout)
        check_arguments(plan, src, dst, layouts)
        if overlap not in (None, True, False) or not isinstance(verify, bool) or not isinstance(confirm, bool):
            raise ValueError(f"overlap={overlap!r} (None, True or False), verify={verify!r}, confirm={confirm!r} (True or False)")
        self._shared_staging = staging
        self._layouts = layouts
        self.overlap = overlap
        self.plan = plan
        self.rank = member_rank(group, "bind a Resharder")
        self.verify = bool(verify)
        self.confirm = bool(confirm)
        channel = Channel.of(group, dist.get_world_size(group), self._timeout_arg)
        # detached views share the caller's storage: refits copy_ into them without autograd
        # (nn.Parameter sources / destinations stay leaves, requires_grad and all); a DTensor is
        # bound through its local shard.  The owners (the objects given) are kept: every refit
        # checks that they still use the storage bound (param.data rebound: see refit)
        with torch.inference_mode(False):
            src_views = {n: storage_of(t) if isinstance(t, torch.Tensor) else t for n, t in dict(src).items()}
            dst_views = {n: storage_of(t) if isinstance(t, torch.Tensor) else t for n, t in dict(dst).items()}
        self._owners = Owners([record(side, n, owner, have[n]) for side, given, have in
                               (("src", src, src_views), ("dst", dst, dst_views))
                               for n, owner in dict(given).items() if isinstance(owner, torch.Tensor)])
        # a templated plan is bound through this rank's own part, made from its templates alone (no
        # other rank's copies are ever made here); its hash, what the handshake compares, is the whole plan's
        self._part, errors = own_part(plan, self.rank)
        errors += self._intake_errors(src, dst, staging, src_views, dst_views)
        dst_names = [] if errors else list(self._part.buffers["dst"].get(self.rank, {}))
        # the plan's digest, computed once (seconds for a plan with 100k+ copies): the handshake,
        # every refit's start and confirmation carry it; the bound plan is not to be changed
        self._digest = plan.hash
        # the one owner of what refits read and change (binding, group, versions, interruption)
        self._refit = Refit(self.rank, self.verify, self.confirm, self._digest, dst_names, channel)
        errors = errors or self._validate(src_views, dst_views)
        if not errors:
            try:     # views and staging before the handshake: a failure here (memory) reaches every rank
                with torch.inference_mode(False):    # normal tensors even when built under inference_mode
                    self._refit.swap(self._bind(src_views, dst_views))
            except Exception as e:  # noqa: BLE001
                errors.append(f"rank {self.rank}: binding failed: {type(e).__name__}: {str(e)[:300]}")
        # the binding id: rank 0's random token, agreed in the handshake; every refit start
        # compares it, so two Resharders over one group can never exchange each other's bytes
        with group_guard(group, self.rank, "bind a Resharder"):
            msgs = agree(group, self._digest, errors, options=self._options(), timeout=self.timeout_s,
                         token=int.from_bytes(os.urandom(8), "little"), settle=True)
        self._refit.agreed(msgs[0]["token"])

    # ------------------------------------------------------------------ what is bound (read-only views)

    @property
    def version(self) -> int:
        """The last refit version confirmed complete (0: none yet)."""
        return self._refit.version

    @property
    def binding_id(self) -> int:
        """The binding id: rank 0's random 64-bit token, agreed in the construction handshake (the
        same on every rank of this binding; every refit start compares it)."""
        return self._refit.token

    @property
    def group(self):
        """The process group refits run on (changed by :meth:`rebind`)."""
        return self._refit.channel.group

    @property
    def world(self) -> int:
        return self._refit.channel.world

    @property
    def timeout_s(self) -> float:
        """The bound of every wait, in seconds (``timeout=None``: the group's own)."""
        return self._refit.channel.timeout_s

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @property
    def waits_block(self) -> bool:
        return self._refit.channel.waits_block

    @property
    def src(self) -> dict:
        """Buffer name -> the source tensor refits read (a detached view of the owner's storage)."""
        return self._refit.binding.src

    @property
    def dst(self) -> dict:
        """Buffer name -> the destination tensor refits write."""
        return self._refit.binding.dst

    @property
    def staging(self) -> torch.Tensor:
        return self._refit.binding.staging

    @property
    def local(self) -> list:
        """This rank's local copies (:class:`~.binding.LocalCopy`)."""
        return self._refit.binding.local

    @property
    def padding(self) -> list:
        return self._refit.binding.padding

    @property
    def rounds(self) -> list:
        """This rank's rounds (:class:`~.binding.Round`), in plan-round order."""
        return self._refit.binding.rounds

    @property
    def round_numbers(self) -> list:
        return self._refit.binding.round_numbers

    # ------------------------------------------------------------------ validation and binding

    def _options(self) -> str:
        return f"verify={int(self.verify)},confirm={int(self.confirm)},overlap={int(self.overlapped())}"

    def _intake_errors(self, src, dst, staging, src_views, dst_views) -> list[str]:
        """Tensors a refit could not use as given: an inference tensor to write (torch refuses an
        in-place write to it outside ``inference_mode``), a DTensor whose local shard is not the
        buffer the plan gives this rank."""
        errors = []
        want = self._part.buffers
        for side, given in (("src", src), ("dst", dst), ("staging", {"buffer": staging})):
            for n, t in dict(given).items():
                if not isinstance(t, torch.Tensor):
                    continue
                if side != "src" and t.is_inference():
                    errors.append(f"rank {self.rank}: {side} {'tensor ' + n if side == 'dst' else 'buffer'} is an inference "
                                  "tensor (made under torch.inference_mode()): a refit writes it in place, which torch "
                                  "refuses outside inference mode; make it outside torch.inference_mode()")
                if side != "staging" and is_dtensor(t):
                    local = src_views[n] if side == "src" else dst_views[n]
                    shape = want.get(side, {}).get(self.rank, {}).get(n, (None,))[0]
                    if shape is not None and list(local.shape) != list(shape):
                        errors.append(f"rank {self.rank}: {side} tensor {n} is a DTensor {list(t.shape)} placements "
                                      f"{list(t.placements)} whose local shard is {list(local.shape)}; the plan gives this "
                                      f"rank {list(shape)}: a DTensor is bound through its local shard")
        return errors

    def _validate(self, src: dict, dst: dict) -> list[str]:
        try:
            return check_binding(self._part, self.rank, self.world, self.group, src, dst, self.overlap,
                                 self._shared_staging, self._layouts, ranks=self.plan.ranks)
        except Exception as e:  # noqa: BLE001 - a crash in a check must still reach every rank
            return [f"rank {self.rank}: validation failed: {type(e).__name__}: {e}"]

    def _bind(self, src: dict, dst: dict, staging=None) -> Binding:
        return bind(self._part, self.rank, src, dst, verify=self.verify,
                    staging=self._shared_staging if staging is None else staging,
                    device=self._device(src, dst), dst_names=list(self._refit.buffer_version))

    def _device(self, src: dict, dst: dict) -> torch.device:
        for t in list(dst.values()) + list(src.values()):
            return t.device
        return group_device(self.group)

    @property
    def staging_bytes(self) -> int:
        """Bytes of this rank's one staging buffer (<= the plan's budget, + 16 B per entry when
        ``verify``): the most this rank stages to send plus receive in any one round."""
        return self.staging.numel()

    def follow_owners(self) -> list[str]:
        """Local, before a refit's start exchange: every owner whose storage changed since bind
        (``param.data = new``) is followed when the new storage has the bound shape, strides,
        dtype and device (and shares no memory with another bound tensor): a new binding is made on
        it and swapped in whole.  Returns the problems of the others (the refit is then refused on
        every rank)."""
        changed = self._owners.changed()
        if not changed:
            return []
        problems = []
        src, dst = dict(self.src), dict(self.dst)
        for rec, now in changed:
            why = Owners.why_not_followed(rec, now)
            if why is None and rec.side == "dst" and now.is_inference():
                why = "the new tensor is an inference tensor (a refit writes it in place outside inference mode)"
            if why is not None:
                problems.append(f"rank {self.rank}: {rec.side} tensor {rec.name}: param.data was rebound after binding: "
                                f"storage 0x{rec.ptr:x} -> {describe(now)}; {why}")
            (src if rec.side == "src" else dst)[rec.name] = now
        if problems:
            return problems
        problems = check_aliasing(self.rank, src, dst, self.staging)
        if problems:
            return [p + " (after following a rebound param.data)" for p in problems]
        with torch.inference_mode(False):
            self._refit.swap(self._bind(src, dst, staging=self.staging))
        self._owners.followed(changed)
        return []

    def rebind(self, group=None) -> None:
        """Collective: use ``group`` from now on (e.g. a fresh group after a transfer failure broke
        the old one: gloo closes its pairs on a timeout; NCCL communicators must be aborted).
        Re-runs the construction handshake (every rank must rebind the same Resharder); staging
        buffers, views and recorded versions stay.  ``timeout=None`` follows the new group's timeout."""
        rank = member_rank(group, "rebind a Resharder")
        errors = []
        if rank != self.rank:
            errors.append(f"rank {rank}: this Resharder was bound as rank {self.rank} of its old group; "
                          "the new group must keep every rank's number")
        self._refit.use(Channel.of(group, dist.get_world_size(group), self._timeout_arg))
        errors = errors or self._validate(self.src, self.dst)
        with group_guard(group, self.rank, "rebind"):
            msgs = agree(group, self._digest, errors, options=self._options(), timeout=self.timeout_s,
                         token=self.binding_id, settle=True)
        tokens = sorted({m["token"] for m in msgs})
        if len(tokens) > 1:
            raise ReshardError(f"rank {self.rank}: rebind refused: ranks rebind different Resharders "
                               f"(binding ids {[f'{t:016x}' for t in tokens]})")
        self._refit.settled()

    # ------------------------------------------------------------------ state

    def state(self) -> dict:
        """What this rank's destination buffers hold (local, no communication)::

            {"version": 3,                # last refit confirmed complete (0: none yet)
             "interrupted": False,        # the last refit on this rank failed part-way
             "interrupted_version": None, "failed_round": None, "error": None,
             "buffers": {"w": 3, ...},    # refit version each destination buffer fully holds
             "incomplete": []}            # buffers holding no complete version (None above)
        """
        return self._refit.snapshot()

    # ------------------------------------------------------------------ refit

    def refit(self, version: int | None = None, *, refusal: list[str] | None = None) -> dict:
        """Move every byte of the plan once (collective); returns counts (messages and bytes sent by
        this rank) and the version.

        Every refit starts with a collective check (:func:`~.handshake.refit_start`) before any
        byte moves: all ranks refit this same Resharder (plan digest + binding id), with the same
        options and version.  ``version`` labels what the destination now holds (e.g. the
        training step); default: the highest of every rank's last completed version + 1, so ranks
        that disagree after an interruption converge.  After an interruption that may have left
        operations pending on the group the refit is refused on every rank: call :meth:`rebind`
        with a fresh group on every rank, then ``refit()`` again.  The caller must not write the
        source tensors while a refit runs (``verify=True`` detects it), and nothing else may run
        collectives on the group while it runs (see the class docstring).  ``version``: an
        integer in ``[0, 2**63)`` (ValueError naming it otherwise, before anything moves).
        Bound tensors rebound since bind (``param.data = new``) are followed or refused first (see
        the class docstring).

        ``refusal``: reasons this rank found not to refit (an integration's own checks, e.g. an
        engine parameter replaced after binding): non-empty, every rank raises
        :class:`ReshardError` in the refit start, before any byte moves, naming them.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                    or not 0 <= version < 1 << 63):
            raise ValueError(f"version={version!r}: must be an integer in [0, 2**63) (or None)")
        with group_guard(self.group, self.rank, "refit"), torch.no_grad():
            return self._refit.run(version, refusal, follow=self.follow_owners, options=self._options(),
                                   transport=self.transport())

    def copy_local(self) -> None:
        """This rank's local copies alone, as a refit runs them (:class:`~.transfer.LocalCopies`), with
        no communication and no version bookkeeping: the benchmarks' floor of a refit's local work."""
        with torch.no_grad():
            LocalCopies(self._refit, [], set()).drain()

    def transport(self) -> Transport:
        """The point-to-point transport of the next refit's rounds on the current group
        (:mod:`.transport`; chosen as :meth:`overlapped` says)."""
        return transport_for(self.group, self.overlap)

    def overlapped(self) -> bool:
        """Whether rounds run overlapped (see :func:`~.rounds.round_overlapped`) on the current group.

        ``overlap=None`` (default) chooses by backend: overlapped on gloo, whose ``isend``/``irecv``
        are independent asynchronous operations (``batch_isend_irecv`` on gloo only posts them one
        after another), and batched on every other backend: NCCL point-to-point operations must be
        launched inside groups (``batch_isend_irecv``; :func:`~.rounds.round_batched` posts one per
        chunk, derived from the plan alike on both ends), or two ranks sending to each other can
        deadlock.  ``overlap=True`` on a non-gloo backend is refused for the same
        reason (construction and :meth:`rebind` raise).  The environment variable ``MCORE_RESHARD_OVERLAP`` (``0``/``1``) overrides the
        default choice (benchmarks); an explicit ``overlap`` argument wins over it."""
        return self.transport().name == "overlapped"
