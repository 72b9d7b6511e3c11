"""The planner's intermediate records, with named fields: source holders, remote regions, copies
before packing, forwarded copies, template instances.

Named tuples: a full-size plan makes ~10^5..10^6 of each, a tuple is several times cheaper to
build than a dataclass instance, sorts field by field (the packing order is a plain sort of the
copies: -bytes first, so largest first, then src, dst, ..., the unique sequence number), and the C
first fit (``_cfit.c``: ``fit_copies``, ``entries``) reads :class:`PendingCopy` /
:class:`ForwardCopy` fields by position: their field order is that kernel's interface.

Built in hot loops as ``new(Cls, (v0, v1, ...))`` (:data:`new`, ``tuple.__new__``: the same
object as ``Cls(v0, v1, ...)`` without the generated ``__new__``'s Python frame); read by name.

Example (rank 1 needs rows 0..3 of ``w`` [4, 8] bf16, held by rank 0)::

    Region(neg_nbytes=-64, tensor="w", offsets=(0, 0), sizes=(4, 8), dst=1, dst_buffer="w", seq=0,
           holders=[Holder(0, "w", piece)], ...)
    PendingCopy(neg_nbytes=-64, src=0, dst=1, tensor="w", offsets=(0, 0), sizes=(4, 8), seq=0, ...)
"""
from __future__ import annotations

from typing import NamedTuple

from ..box import Box
from ..layout import Piece

#: ``new(Cls, values)``: a named tuple of ``values`` (in field order) without ``Cls.__new__``'s frame
new = tuple.__new__


class Holder(NamedTuple):
    """A source rank holding a box of a tensor: in its buffer ``buffer`` as ``piece``."""
    rank: int
    buffer: str
    piece: Piece


class SourceBox(NamedTuple):
    """A disjoint source box of a tensor and its holders (:func:`~.index.source_index`)."""
    box: Box
    holders: list               # [Holder]


class Region(NamedTuple):
    """A part of a destination piece that no rank holding it locally can copy (:func:`~.matching.match`):
    ``box`` (``offsets``, ``sizes``) of ``tensor``, needed in ``dst_buffer`` of rank ``dst``
    at ``dst_local`` (``dst_local_offsets``, ``dst_local_sizes``), held by ``holders``."""
    neg_nbytes: int             # -bytes: sorts largest first
    tensor: str
    offsets: tuple
    sizes: tuple
    dst: int
    dst_buffer: str
    seq: int                    # sequence number: unique, breaks every tie
    holders: list               # [Holder]
    dst_piece: Piece
    itemsize: int
    box: Box
    dst_local_offsets: tuple
    dst_local_sizes: tuple
    dst_local: Box


class PendingCopy(NamedTuple):
    """A remote copy before round packing (:func:`~.senders.choose_senders`): becomes a
    :class:`~.plan.Copy` of its message, with its staging offset, when packed."""
    neg_nbytes: int             # -bytes: sorts largest first
    src: int
    dst: int
    tensor: str
    offsets: tuple
    sizes: tuple
    seq: int                    # sequence number: unique, breaks every tie
    src_buffer: str
    src_local: Box
    dst_buffer: str
    dst_local_offsets: tuple
    dst_local_sizes: tuple
    box: Box
    dst_local: Box


class CarrierKey(NamedTuple):
    """What identifies a carrier's own copy (:mod:`.topology`): the carrier, its destination buffer,
    the tensor and the box."""
    rank: int
    buffer: str
    tensor: str
    offsets: tuple
    sizes: tuple


class ForwardCopy(NamedTuple):
    """A two-level plan's forwarded copy (:func:`~.topology.plan_forwarding`): a :class:`PendingCopy`
    whose ``src`` is the carrier, reading from the carrier's destination buffer, placed after the
    carrier's own copy (``carrier``) lands; ``unstaged``: contiguous in both buffers, no staging."""
    neg_nbytes: int
    src: int
    dst: int
    tensor: str
    offsets: tuple
    sizes: tuple
    seq: int
    src_buffer: str
    src_local: Box
    dst_buffer: str
    dst_local_offsets: tuple
    dst_local_sizes: tuple
    box: Box
    dst_local: Box
    carrier: CarrierKey
    unstaged: bool


class LayerNumbers(NamedTuple):
    """The layer numbers of a template instance: of its tensors, source and destination buffer names
    (None: the names carry no layer number)."""
    tensors: int | None
    src: int | None
    dst: int | None


class Instance(NamedTuple):
    """One use of a template (:mod:`.templates`): template ``template`` with its canonical names
    numbered ``layers`` and its rank indices mapped to ``ranks`` (``ranks[j]``: rank index j)."""
    template: int
    layers: LayerNumbers
    ranks: tuple
