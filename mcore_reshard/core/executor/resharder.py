"""The :class:`Resharder`: binds a plan to this rank's tensors once (validation + handshake), then
each ``refit()`` moves the bytes; keeps versions, interruptions and the group (``rebind``)."""
from __future__ import annotations

import datetime
import os
from typing import Mapping

import torch
import torch.distributed as dist

from ..planner import Plan
from . import rounds as _rounds
from .binding import bind
from .common import check_timeout, group_device, group_timeout, waits_block
from .errors import ReshardError
from .handshake import agree, group_guard
from .transfer import run_refit
from .validation import check_binding, own_part


class Resharder:
    """Binds ``plan`` to this rank's tensors; ``refit()`` moves the weights (collective).

    ``src``/``dst`` map buffer names to this rank's real tensors (a rank may have either, both or
    none); they must be exactly the buffers the plan gives this rank.  Source tensors are only read
    (a destination tensor sharing memory with a source is refused).  ``timeout`` (seconds) bounds
    the handshake, every round and the final confirmation: a dead or stalled peer makes every rank
    raise :class:`TransferError` instead of waiting (``None``: the process group's own timeout;
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
    """

    def __init__(self, plan: Plan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                 group=None, *, timeout: float | None = None, verify: bool = False, confirm: bool = True,
                 staging: torch.Tensor | None = None, overlap: bool | None = None, layouts=None):
        self._timeout_arg = check_timeout(timeout)
        if overlap not in (None, True, False) or not isinstance(verify, bool) or not isinstance(confirm, bool):
            raise ValueError(f"overlap={overlap!r} (None, True or False), verify={verify!r}, confirm={confirm!r} (True or False)")
        self._shared_staging = staging
        self._layouts = layouts
        self.overlap = overlap
        self.plan = plan
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._set_timeout()
        self.verify = bool(verify)
        self.confirm = bool(confirm)
        # detached views share the caller's storage: refits copy_ into them without autograd
        # (nn.Parameter sources / destinations stay leaves, requires_grad and all)
        self.src = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in dict(src).items()}
        self.dst = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in dict(dst).items()}
        self.version = 0                   # last refit version confirmed complete
        # a templated plan is bound through this rank's own part, made from its templates alone (no
        # other rank's copies are ever made here); its hash, what the handshake compares, is the whole plan's
        self._part, errors = own_part(plan, self.rank)
        self._buffer_version: dict[str, int | None] = {} if errors else {
            n: None for n in self._part.buffers["dst"].get(self.rank, {})}
        self._interrupted: dict | None = None
        self._sources_changed = False
        self._dirty = False                # an interrupted refit may have left operations pending on the group
        # the plan's digest, computed once (seconds for a plan with 100k+ copies): the handshake,
        # every refit's start and confirmation carry it; the bound plan is not to be changed
        self._digest = plan.hash
        # the binding id: rank 0's random token, agreed in the handshake; every refit start
        # compares it, so two Resharders over one group can never exchange each other's bytes
        errors = errors or self._validate()
        if not errors:
            try:     # views and staging before the handshake: a failure here (memory) reaches every rank
                self._bind()
            except Exception as e:  # noqa: BLE001
                errors.append(f"rank {self.rank}: binding failed: {type(e).__name__}: {str(e)[:300]}")
        with group_guard(group, self.rank, "bind a Resharder"):
            msgs = agree(group, self._digest, errors, options=self._options(), timeout=self.timeout_s,
                         token=int.from_bytes(os.urandom(8), "little"))
        self._token = msgs[0]["token"]

    def _set_timeout(self) -> None:
        """The timeout and what the rounds look up once per group (not once per operation)."""
        self.timeout_s = self._timeout_arg if self._timeout_arg is not None else group_timeout(self.group)
        self.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.waits_block = waits_block(self.group)

    # ------------------------------------------------------------------ validation and binding

    def _options(self) -> str:
        return f"verify={int(self.verify)},confirm={int(self.confirm)},overlap={int(self.overlapped())}"

    def _validate(self) -> list[str]:
        try:
            return check_binding(self._part, self.rank, self.world, self.group, self.src, self.dst, self.overlap,
                                 self._shared_staging, self._layouts, ranks=self.plan.ranks)
        except Exception as e:  # noqa: BLE001 - a crash in a check must still reach every rank
            return [f"rank {self.rank}: validation failed: {type(e).__name__}: {e}"]

    def _bind(self) -> None:
        b = bind(self._part, self.rank, self.src, self.dst, verify=self.verify, staging=self._shared_staging,
                 device=self._device(), dst_names=list(self._buffer_version))
        self.local, self.padding, self.staging = b.local, b.padding, b.staging
        self.rounds, self.round_numbers = b.rounds, b.round_numbers
        self._first_stage, self._last_stage = b.first_stage, b.last_stage

    def _device(self) -> torch.device:
        for t in list(self.dst.values()) + list(self.src.values()):
            return t.device
        return group_device(self.group)

    @property
    def staging_bytes(self) -> int:
        """Bytes of this rank's one staging buffer (<= the plan's budget, + 16 B per entry when
        ``verify``): the most this rank stages to send plus receive in any one round."""
        return self.staging.numel()

    def rebind(self, group=None) -> None:
        """Collective: use ``group`` from now on (e.g. a fresh group after a transfer failure broke
        the old one: gloo closes its pairs on a timeout; NCCL communicators must be aborted).
        Re-runs the construction handshake (every rank must rebind the same Resharder); staging
        buffers, views and recorded versions stay.  ``timeout=None`` follows the new group's timeout."""
        rank = dist.get_rank(group)
        errors = []
        if rank != self.rank:
            errors.append(f"rank {rank}: this Resharder was bound as rank {self.rank} of its old group; "
                          "the new group must keep every rank's number")
        self.group = group
        self.world = dist.get_world_size(group)
        self._set_timeout()
        errors = errors or self._validate()
        with group_guard(group, self.rank, "rebind"):
            msgs = agree(group, self._digest, errors, options=self._options(), timeout=self.timeout_s, token=self._token)
        tokens = sorted({m["token"] for m in msgs})
        if len(tokens) > 1:
            raise ReshardError(f"rank {self.rank}: rebind refused: ranks rebind different Resharders "
                               f"(binding ids {[f'{t:016x}' for t in tokens]})")
        self._dirty = False

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
        source tensors while a refit runs (``verify=True`` detects it).

        ``refusal``: reasons this rank found not to refit (an integration's own checks, e.g. an
        engine parameter replaced after binding): non-empty, every rank raises
        :class:`ReshardError` in the refit start, before any byte moves, this rank naming them.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version={version!r}: must be a non-negative integer (or None)")
        with group_guard(self.group, self.rank, "refit"), torch.no_grad():
            return run_refit(self, version, refusal)

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
        return _rounds.use_overlap(self.group, self.overlap)
