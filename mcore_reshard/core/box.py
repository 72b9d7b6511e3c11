"""Axis-aligned boxes inside a tensor, and the ways a dimension is split into boxes.

A box is ``(offsets, sizes)`` with one entry per tensor dimension.  Boxes are plain tuples so that
the planner can hash, sort and serialise them without torch.

Example: a ``[10, 4]`` tensor split over 3 ranks along dim 0 with :func:`split_sizes`
(``"even"`` gives the remainder to the first ranks, like vLLM; ``"chunk"`` is ``torch.chunk``,
which is what DTensor's ``Shard`` does)::

    rank | even      | chunk
    0    | rows 0:4  | rows 0:4
    1    | rows 4:7  | rows 4:8
    2    | rows 7:10 | rows 8:10
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterator, Sequence

_INT = {int}


@dataclass(frozen=True, order=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} differ in length")
        nums = self.offsets + self.sizes
        if not nums:
            return
        if set(map(type, nums)) != _INT:        # one pass over all of them (bool, float: refused)
            x = next(x for x in nums if type(x) is not int)
            raise ValueError(f"box {self}: offsets and sizes must be integers, got {x!r} ({type(x).__name__})")
        if min(nums) < 0:
            raise ValueError(f"box with negative offset or size: {self}")

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: "Box") -> "Box | None":
        """The common box, or None when the two do not overlap (empty boxes never overlap)."""
        if other.ndim != self.ndim:
            raise ValueError(f"cannot intersect {self} with {other}: different rank")
        offs, sizes = [], []
        for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + sa, b + sb)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: "Box") -> bool:
        for a, sa, b, sb in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            if b < a or b + sb > a + sa:
                return False
        return True

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def shifted(self, delta: Sequence[int]) -> "Box":
        return Box(tuple(o + d for o, d in zip(self.offsets, delta)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def to_json(self) -> list:
        return [list(self.offsets), list(self.sizes)]

    @staticmethod
    def from_json(obj) -> "Box":
        return Box(tuple(obj[0]), tuple(obj[1]))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def split_sizes(total: int, parts: int, mode: str = "even") -> list[int]:
    """Sizes of ``parts`` consecutive blocks covering ``total`` elements.

    ``even``: remainder to the first blocks (sizes differ by at most one).
    ``chunk``: ``torch.chunk`` / DTensor ``Shard``: blocks of ``ceil(total/parts)``, trailing ones
    smaller or empty.
    ``exact``: ``total`` must divide evenly (Megatron's ``divide``), else ValueError.
    """
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    if mode == "exact":
        if total % parts:
            raise ValueError(f"{total} is not divisible by {parts}")
        return [total // parts] * parts
    if mode == "even":
        base, rem = divmod(total, parts)
        return [base + (1 if i < rem else 0) for i in range(parts)]
    if mode == "chunk":
        step = -(-total // parts) if total else 0
        return [max(0, min(step, total - i * step)) for i in range(parts)]
    raise ValueError(f"unknown split mode {mode!r}")


def split_range(total: int, parts: int, index: int, mode: str = "even") -> tuple[int, int]:
    """(offset, size) of block ``index`` of :func:`split_sizes`."""
    sizes = split_sizes(total, parts, mode)
    return sum(sizes[:index]), sizes[index]


def subtract(box: Box, cut: Box) -> list[Box]:
    """``box`` minus ``cut`` as a list of disjoint boxes (at most 2*ndim)."""
    inter = box.intersect(cut)
    if inter is None:
        return [box]
    out = []
    offs, sizes = list(box.offsets), list(box.sizes)
    for d in range(box.ndim):
        lo, hi = inter.offsets[d], inter.offsets[d] + inter.sizes[d]
        if lo > offs[d]:
            out.append(Box(tuple(offs[:d] + [offs[d]] + offs[d + 1:]),
                           tuple(sizes[:d] + [lo - offs[d]] + sizes[d + 1:])))
        end = offs[d] + sizes[d]
        if hi < end:
            out.append(Box(tuple(offs[:d] + [hi] + offs[d + 1:]),
                           tuple(sizes[:d] + [end - hi] + sizes[d + 1:])))
        offs[d], sizes[d] = lo, hi - lo
    return out


def split_box(box: Box, max_elems: int) -> Iterator[Box]:
    """Cut ``box`` into row-major consecutive sub-boxes of at most ``max_elems`` elements each.

    Cuts along the outermost dimension whose inner block fits; a single innermost row larger than
    ``max_elems`` is cut along the last dimension.
    """
    if max_elems <= 0:
        raise ValueError("max_elems must be positive")
    if box.numel <= max_elems:
        yield box
        return
    nd = box.ndim
    for d in range(nd):
        inner = prod(box.sizes[d + 1:])
        if inner <= max_elems:
            step = max(1, max_elems // inner)
            for outer in _outer_indices(box, d):  # every index of the dims before d
                for start in range(0, box.sizes[d], step):
                    n = min(step, box.sizes[d] - start)
                    offs = outer + (box.offsets[d] + start,) + box.offsets[d + 1:]
                    sizes = (1,) * d + (n,) + box.sizes[d + 1:]
                    yield Box(offs, sizes)
            return
    raise AssertionError("unreachable")


def _outer_indices(box: Box, d: int) -> Iterator[tuple[int, ...]]:
    if d == 0:
        yield ()
        return
    for head in _outer_indices(box, d - 1):
        for i in range(box.sizes[d - 1]):
            yield head + (box.offsets[d - 1] + i,)


_new = object.__new__
_setattr = object.__setattr__


def unchecked_box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
    """``Box(offsets, sizes)`` without the argument checks (about 4x faster): for the planner's
    hot loops, whose tuples come from boxes that were checked already (intersections, sub-boxes).
    Equal, hashing and ordering exactly like the checked constructor's result."""
    b = _new(Box)
    _setattr(b, "__dict__", {"offsets": offsets, "sizes": sizes})
    return b
