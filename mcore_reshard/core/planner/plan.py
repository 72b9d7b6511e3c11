"""Plan data: :class:`Copy`, :class:`Message`, :class:`Plan` (JSON and the sha256 hash), constants."""
from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Protocol, runtime_checkable

from ..box import Box, unchecked_box
from ..gcpause import paused_gc

DEFAULT_BUDGET = 256 << 20
ALIGN = 16  # byte alignment of every entry in a staging buffer
PLAN_VERSION = 1


#: plan JSON ``version`` -> reader, for representations other than this module's (registered by
#: :mod:`.templates` when the planner package is imported)
PLAN_FORMATS: dict = {}


class PlanError(ValueError):
    """The two layouts cannot be reconciled; the message names tensor, ranks, shapes and region."""


def check_budget(value, what: str = "budget_bytes") -> int:
    """``value`` as a staging budget in bytes; :class:`PlanError` (a ValueError) naming ``what``
    unless an integer (bool, float, NaN, inf, str refused) of at least 1 KiB."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlanError(f"{what}={value!r}: must be an integer number of bytes >= 1024, "
                        f"not {type(value).__name__}")
    if value < 1024:
        raise PlanError(f"{what}={int(value)}: staging budget {int(value)} B is below the 1 KiB minimum")
    return int(value)


def align(n: int) -> int:
    """``n`` bytes rounded up to the staging alignment :data:`ALIGN` (every staged entry starts
    aligned): ``align(1) == 16``, ``align(32) == 32``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Copy(NamedTuple):
    """One box of ``tensor`` from ``src_buffer[src_local]`` on ``src`` to ``dst_buffer[dst_local]`` on ``dst``.

    Immutable, with fields by name like a frozen dataclass; a named tuple because a full-size plan
    makes ~10^5..10^7 of them and a tuple is several times cheaper to build."""
    tensor: str
    box: Box
    src: int
    src_buffer: str
    src_local: Box
    dst: int
    dst_buffer: str
    dst_local: Box
    nbytes: int          # bytes on the wire (source dtype)
    offset: int = -1     # byte offset in the message's staging buffer (-1 for local copies)

    def to_json(self) -> list:
        return [self.tensor, self.box.to_json(), self.src, self.src_buffer, self.src_local.to_json(),
                self.dst, self.dst_buffer, self.dst_local.to_json(), self.nbytes, self.offset]

    @staticmethod
    def from_json(o) -> "Copy":
        if len(o) == 10 and all(isinstance(x, int) for x in (o[2], o[5], o[8], o[9])):
            return make_copy(o[0], _box_json(o[1]), o[2], o[3], _box_json(o[4]), o[5], o[6], _box_json(o[7]), o[8], o[9])
        return Copy(o[0], Box.from_json(o[1]), o[2], o[3], Box.from_json(o[4]), o[5], o[6], Box.from_json(o[7]), o[8], o[9])


def make_copy(tensor, box, src, src_buffer, src_local, dst, dst_buffer, dst_local, nbytes, offset=-1) -> Copy:
    """``Copy(...)`` without the generated ``__new__``'s keyword handling (the same object, faster)."""
    return tuple.__new__(Copy, (tensor, box, src, src_buffer, src_local, dst, dst_buffer, dst_local, nbytes, offset))


def contiguous(sizes, shape) -> bool:
    """Whether a box of ``sizes`` is one contiguous run of a row-major buffer of ``shape``: every
    dim after its first dim of size != 1 is full (offsets do not matter).  Decides, from the plan
    alone, whether a copy can go straight from / into its tensors (:attr:`Message.unstaged`)."""
    sizes = tuple(sizes)
    for d, n in enumerate(sizes):
        if n != 1:
            return tuple(sizes[d + 1:]) == tuple(shape[d + 1:])
    return True


def _box_json(o) -> Box:
    offs, sizes = tuple(o[0]), tuple(o[1])
    if len(offs) == len(sizes) and (not sizes or (min(sizes) >= 0 and min(offs) >= 0)):
        return unchecked_box(offs, sizes)
    return Box(offs, sizes)     # raises the checked constructor's error


class Message(NamedTuple):
    """The copies ``src`` sends ``dst`` in one round (a named tuple, as :class:`Copy`: immutable,
    fields by name, cheap to build by the ~10^5 in a full-size plan).  ``forward``: a two-level plan's forwarded
    message (:mod:`.topology`): its entries' ``src_buffer`` / ``src_local`` name the sender's
    *destination* buffer, written in an earlier round.  ``unstaged`` (two-level plans): every
    entry is contiguous in its buffer on both ends (:func:`contiguous`, the tensor not cast) and
    goes straight from the sender's tensor into the receiver's, one operation per entry, without
    staging: the message takes no staging memory and no part of the budget (its ``nbytes`` and
    entry offsets are laid out as for any message, but nothing is staged there).  Each flag is
    in the JSON (and so the hash) only when set."""
    round: int
    src: int
    dst: int
    nbytes: int                 # staging bytes (entries aligned to 16 bytes); none staged when unstaged
    entries: tuple[Copy, ...]
    forward: bool = False
    unstaged: bool = False

    def to_json(self) -> dict:
        o = {"round": self.round, "src": self.src, "dst": self.dst, "nbytes": self.nbytes,
             "entries": [c.to_json() for c in self.entries]}
        if self.forward:
            o["forward"] = True
        if self.unstaged:
            o["unstaged"] = True
        return o

    @staticmethod
    def from_json(o) -> "Message":
        flags = []
        for key in ("forward", "unstaged"):
            x = o.get(key, False)
            if x is not False and x is not True:
                raise PlanError(f"message round {o.get('round')} {o.get('src')}->{o.get('dst')}: {key}={x!r} "
                                "must be true or false")
            flags.append(x)
        return Message(o["round"], o["src"], o["dst"], o["nbytes"], tuple(Copy.from_json(c) for c in o["entries"]),
                       *flags)


@contextlib.contextmanager
def malformed(field: str):
    """Turn a crash while reading plan JSON field ``field`` into a :class:`PlanError` naming it
    (the block may narrow it: ``where[:] = ["messages[3]"]``): a missing key, an entry of the
    wrong arity or type."""
    where = [field]
    try:
        yield where
    except PlanError as e:
        raise PlanError(f"plan field {where[0]}: {e}") from e
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        what = {KeyError: f"missing key {e}", IndexError: "an entry of the wrong arity"}.get(type(e), "wrong type or value")
        raise PlanError(f"plan field {where[0]} is malformed: {what} ({type(e).__name__}: {str(e)[:200]})") from e


@runtime_checkable
class StoredPlan(Protocol):
    """What every kind of plan offers (:class:`Plan`, :class:`~.templates.TemplatedPlan`,
    :class:`mcore_reshard.fp8.quant_plan.Fp8Plan`): its JSON (``to_json``, ``dumps``; read back by the
    kind's ``from_json``), the sha256 ``hash`` every rank compares before anything moves, a
    ``summary`` for people and its ``stats``."""
    stats: dict

    def to_json(self) -> dict: ...

    def dumps(self) -> str: ...

    @property
    def hash(self) -> str: ...

    def summary(self) -> str: ...


@runtime_checkable
class CopyPlan(StoredPlan, Protocol):
    """A plan of copies: what :func:`~.validate.validate_plan` and the executor read
    (:class:`Plan`, a part of one, :class:`~.templates.TemplatedPlan`; an FP8 plan holds one as
    ``rest``).  Example, rank 0 sending ``w`` [4, 8] bf16 to rank 1 in one round::

        plan.rounds == 1; plan.ranks == [0, 1]
        plan.messages == [Message(round=0, src=0, dst=1, nbytes=64, entries=(Copy("w", ...),))]
        plan.buffers["dst"][1]["w"] == [[4, 8], "bfloat16"]"""
    tensors: dict
    buffers: dict
    messages: list
    local_copies: list
    padding: list
    budget_bytes: int
    rounds: int

    @property
    def ranks(self) -> list[int]: ...


class PlanBase:
    """What :class:`Plan` and :class:`~.templates.TemplatedPlan` (each a :class:`CopyPlan`) share,
    made from their JSON and fields: ``dumps`` and ``summary``."""

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def summary(self) -> str:
        s = self.stats
        lines = [
            f"tensors            {len(self.tensors)}",
            f"bytes over network {s['network_bytes']:,} (lower bound {s['lower_bound_bytes']:,})",
            f"bytes copied local {s['local_bytes']:,}",
            f"messages           {s['messages']} in {self.rounds} round(s), budget {self.budget_bytes:,} B/rank",
            f"max sent / rank    {s['max_send_bytes']:,}  max received / rank {s['max_recv_bytes']:,}",
            f"staging / rank     {s.get('max_stage_bytes', 0):,} B (send + receive, one round)",
            f"padding regions    {len(self.padding)} ({s['padding_bytes']:,} B zero-filled)",
        ]
        return "\n".join(lines)


@paused_gc()
def canonical_hash(plan: StoredPlan) -> str:
    """sha256 of ``plan``'s canonical JSON (sorted keys, no spaces), its stats excluded (they hold timings)."""
    obj = plan.to_json()
    obj.pop("stats")
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Plan(PlanBase):
    """Plain-data plan (a :class:`CopyPlan`); ``whole``: for one rank's part of a templated plan
    (:func:`~.templates.part_of`), the whole plan, whose hash the part carries.  ``buffers[side][rank][name] = (shape, dtype)`` lets every rank check its
    real tensors against the plan before anything moves."""
    tensors: dict[str, dict]                         # name -> {"shape", "src_dtype", "dst_dtype"}
    buffers: dict[str, dict[int, dict[str, list]]]   # "src"/"dst" -> rank -> name -> [shape, dtype]
    messages: list[Message]
    local_copies: list[Copy]
    padding: list[tuple[int, str, Box]]              # (rank, dst buffer, local region) zero-filled
    budget_bytes: int
    rounds: int
    stats: dict = field(default_factory=dict)
    whole: "CopyPlan | None" = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "tensors": self.tensors,
            "buffers": {side: {str(r): bufs for r, bufs in sorted(ranks.items())} for side, ranks in self.buffers.items()},
            "budget_bytes": self.budget_bytes,
            "rounds": self.rounds,
            "messages": [m.to_json() for m in self.messages],
            "local_copies": [c.to_json() for c in self.local_copies],
            "padding": [[r, b, box.to_json()] for r, b, box in self.padding],
            "stats": self.stats,
        }

    @staticmethod
    def from_json(o: Mapping) -> "Plan":
        """The plan of JSON ``o`` (either representation); every malformed field (a missing key,
        an entry of the wrong arity or type) is a :class:`PlanError` naming it."""
        if not isinstance(o, Mapping):
            raise PlanError(f"plan JSON is a {type(o).__name__}, not an object")
        other = PLAN_FORMATS.get(o.get("version")) if isinstance(o.get("version"), (int, str)) else None
        if other is not None:          # another plan representation (a templated plan)
            with malformed("templated plan"):
                return other(o)
        if o.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version {o.get('version')} is not {PLAN_VERSION}")
        with malformed("tensors"):
            tensors = dict(o["tensors"])
        with malformed("buffers"):
            buffers = {side: {int(r): bufs for r, bufs in ranks.items()} for side, ranks in o["buffers"].items()}
        with malformed("messages") as where:
            messages = []
            for i, m in enumerate(o["messages"]):
                where[:] = [f"messages[{i}]"]
                messages.append(Message.from_json(m))
        with malformed("local_copies") as where:
            local = []
            for i, c in enumerate(o["local_copies"]):
                where[:] = [f"local_copies[{i}]"]
                local.append(Copy.from_json(c))
        with malformed("padding") as where:
            padding = []
            for i, (r, b, box) in enumerate(o["padding"]):
                where[:] = [f"padding[{i}]"]
                padding.append((r, b, Box.from_json(box)))
        with malformed("stats"):
            stats = dict(o["stats"])
        with malformed("budget_bytes / rounds"):
            budget, rounds = o["budget_bytes"], o["rounds"]
        return Plan(tensors=tensors, buffers=buffers, messages=messages, local_copies=local, padding=padding,
                    budget_bytes=budget, rounds=rounds, stats=stats)

    @property
    def hash(self) -> str:
        """sha256 of the canonical JSON, stats excluded (they hold timings); a part of a templated plan
        (:func:`plan_part`) has the whole plan's hash, a templated plan that of its compact form."""
        return canonical_hash(self) if self.whole is None else self.whole.hash

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.buffers["src"]) | set(self.buffers["dst"]))
