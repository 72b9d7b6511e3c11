"""Layouts: which boxes of which logical tensors every rank holds, and where in its local buffers.

A *logical tensor* (``TensorMeta``) has a global shape and a dtype.  A rank holds *buffers* (its
real local tensors, e.g. a parameter); a buffer is an ordered list of *pieces*, each one box of a
logical tensor placed at a box of the buffer.  The two boxes have the same number of elements and
the same sizes once size-1 dimensions are dropped, so a piece is copied with a reshape.  Local
regions that no piece covers are *padding* (e.g. vocab padding): the executor zero-fills them.

Example, Megatron's ``linear_fc1`` (``[gate; up]`` per TP rank) with ``F = 4`` and tp=2::

    rank | buffer        | piece (tensor, global box)  -> local box
    0    | fc1 [4, H]    | gate_proj [0:2, 0:H]        -> [0:2, 0:H]
         |               | up_proj   [0:2, 0:H]        -> [2:4, 0:H]
    1    | fc1 [4, H]    | gate_proj [2:4, 0:H]        -> [0:2, 0:H]
         |               | up_proj   [2:4, 0:H]        -> [2:4, 0:H]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Iterable, Mapping, Sequence

from .box import Box, split_range, subtract
from .gcpause import paused_gc
from .mesh import Mesh

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class LayoutError(ValueError):
    """A layout that contradicts itself (pieces outside their tensor or buffer, overlaps, ...)."""


def itemsize(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise LayoutError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


def _inside(box: Box, shape: Sequence[int]) -> bool:
    if len(box.offsets) != len(shape):
        return False
    for o, s, n in zip(box.offsets, box.sizes, shape):
        if o + s > n:
            return False
    return True


def _overlap(a: Box, b: Box) -> bool:
    """Whether two boxes of the same rank share an element (:meth:`Box.intersect` without the box)."""
    for x, sx, y, sy in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        if (x + sx if x + sx < y + sy else y + sy) <= (x if x > y else y):
            return False
    return True


def check_shape(shape, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints; LayoutError for a negative, fractional or non-numeric size
    (``2.5`` is refused, not truncated to 2)."""
    import operator
    try:
        dims = list(shape)
    except TypeError:
        raise LayoutError(f"{what}: shape {shape!r} is not a sequence of sizes") from None
    out = []
    for d in dims:
        try:
            n = operator.index(d) if not isinstance(d, bool) else None
        except TypeError:
            n = None
        if n is None or n < 0:
            raise LayoutError(f"{what}: shape {shape!r} has size {d!r}: sizes must be non-negative integers")
        out.append(int(n))
    return tuple(out)


def _squeezed(sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(s for s in sizes if s != 1)


@lru_cache(maxsize=1 << 12)
def _same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether boxes of sizes ``a`` and ``b`` hold the same elements once size-1 dims are dropped
    (asked once per pair of sizes: every expert of every layer asks the same)."""
    return prod(a) == prod(b) and _squeezed(a) == _squeezed(b)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Piece:
    """Box ``box`` of logical tensor ``tensor`` sits at box ``local`` of its buffer."""
    tensor: str
    box: Box
    local: Box

    def __post_init__(self):
        if self.box.sizes == self.local.sizes:
            return
        if not _same_shape(self.box.sizes, self.local.sizes):
            raise LayoutError(f"piece of {self.tensor}: global box {self.box} and local box {self.local} differ in shape")

    def local_of(self, sub: Box) -> Box:
        """The local box holding ``sub`` (a sub-box of ``self.box``)."""
        if self.box.sizes == self.local.sizes:
            return Box(tuple(l + s - g for l, s, g in zip(self.local.offsets, sub.offsets, self.box.offsets)), sub.sizes)
        gdims = [d for d, s in enumerate(self.box.sizes) if s != 1]
        ldims = [d for d, s in enumerate(self.local.sizes) if s != 1]
        offs, sizes = list(self.local.offsets), [1] * self.local.ndim
        for gd, ld in zip(gdims, ldims):
            offs[ld] = self.local.offsets[ld] + sub.offsets[gd] - self.box.offsets[gd]
            sizes[ld] = sub.sizes[gd]
        return Box(tuple(offs), tuple(sizes))

    def global_of(self, sub: Box) -> Box:
        """The global box held at local box ``sub`` (inside ``self.local``): inverse of :meth:`local_of`."""
        if self.box.sizes == self.local.sizes:
            return Box(tuple(g + s - l for g, s, l in zip(self.box.offsets, sub.offsets, self.local.offsets)), sub.sizes)
        gdims = [d for d, s in enumerate(self.box.sizes) if s != 1]
        ldims = [d for d, s in enumerate(self.local.sizes) if s != 1]
        offs, sizes = list(self.box.offsets), [1] * self.box.ndim
        for gd, ld in zip(gdims, ldims):
            offs[gd] = self.box.offsets[gd] + sub.offsets[ld] - self.local.offsets[ld]
            sizes[gd] = sub.sizes[ld]
        return Box(tuple(offs), tuple(sizes))


@dataclass(frozen=True)
class Buffer:
    """A real local tensor on one rank: its name, shape, dtype and pieces."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    def padding(self) -> list[Box]:
        """Local regions no piece covers (zero-filled by the executor)."""
        if sum(p.local.numel for p in self.pieces) == prod(self.shape):
            return []   # pieces never overlap (checked when added), so they cover everything
        rest = [Box.full(self.shape)] if prod(self.shape) else []
        for p in self.pieces:
            rest = [r for box in rest for r in subtract(box, p.local)]
        return sorted(rest)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "pieces": [[p.tensor, p.box.to_json(), p.local.to_json()] for p in self.pieces]}

    @staticmethod
    def from_json(obj) -> "Buffer":
        return Buffer(obj["name"], tuple(obj["shape"]), obj["dtype"],
                      tuple(Piece(t, Box.from_json(b), Box.from_json(l)) for t, b, l in obj["pieces"]))


_INT = {int}


def _json_key(obj) -> tuple:
    """A hashable key of a buffer's JSON form: name, shape, dtype, pieces, every number an int
    (TypeError, KeyError or ValueError otherwise: such a buffer is not shared, and
    :meth:`Buffer.from_json` says what is wrong with it).  The numbers' types are checked in one
    pass over all of them (a float or a bool equals an int in a tuple: ``1.0 == 1 == True``)."""
    name, dtype, shape = obj["name"], obj["dtype"], obj["shape"]
    if type(name) is not str or type(dtype) is not str:
        raise TypeError("name and dtype must be strings")
    pieces = tuple((t, tuple(b[0]), tuple(b[1]), tuple(l[0]), tuple(l[1])) for t, b, l in obj["pieces"])
    nums = list(shape)
    for p in pieces:
        nums += p[1]
        nums += p[2]
        nums += p[3]
        nums += p[4]
    if not set(map(type, nums)) <= _INT:
        raise TypeError("not a list of ints")
    return (name, tuple(shape), dtype, pieces)


def stacked(name: str, dtype: str, parts: Sequence[tuple[str, Box]], dim: int = 0) -> Buffer:
    """A buffer made of ``parts`` (tensor, global box) laid one after another along ``dim``.

    All parts must agree on every other dimension (Megatron's fused ``linear_qkv`` and
    ``linear_fc1``, vLLM's ``gate_up_proj`` and ``w13_weight`` are built this way).
    """
    if not parts:
        raise LayoutError(f"buffer {name}: no parts to stack")
    ref = parts[0][1].sizes
    pieces, pos = [], 0
    for tensor, box in parts:
        if box.ndim != len(ref) or any(a != b for d, (a, b) in enumerate(zip(box.sizes, ref)) if d != dim):
            raise LayoutError(f"buffer {name}: part {tensor}{box} does not stack with {parts[0][0]}{parts[0][1]} along dim {dim}")
        offs = [0] * box.ndim
        offs[dim] = pos
        pieces.append(Piece(tensor, box, Box(tuple(offs), box.sizes)))
        pos += box.sizes[dim]
    shape = list(ref)
    shape[dim] = pos
    return Buffer(name, tuple(shape), dtype, tuple(pieces))


def shard_box(shape: Sequence[int], mesh: Mesh, rank: int, placements: Sequence[tuple[str, int]],
              mode: str = "exact") -> Box:
    """The box of a tensor of ``shape`` that ``rank`` holds when it is split along tensor dim ``dim``
    over mesh axis ``axis`` for each ``(axis, dim)`` in ``placements``, in that order (later
    placements split what earlier ones left, as DTensor does for mesh dims left to right).
    Axes not named are replicated.  ``mode`` is a :func:`split_sizes` mode."""
    coord = mesh.coord(rank)
    shape = check_shape(shape, "shard_box")
    offs, sizes = [0] * len(shape), list(shape)
    for axis, dim in placements:
        if type(dim) is not int or not 0 <= dim < len(shape):
            raise LayoutError(f"placement ({axis!r}, {dim!r}): dim {dim!r} is out of range for shape {tuple(shape)}")
        n = mesh.axis_size(axis)
        try:
            off, size = split_range(sizes[dim], n, coord.get(axis, 0), mode)
        except ValueError as e:
            raise LayoutError(f"cannot split dim {dim} (size {sizes[dim]}) of shape {tuple(shape)} over {axis}={n}: {e}") from None
        offs[dim] += off
        sizes[dim] = size
    return Box(tuple(offs), tuple(sizes))


def _check_geometry(rank: int, buf: Buffer, tensors: Mapping[str, TensorMeta]) -> None:
    """Every piece of ``buf`` (on ``rank``) inside its tensor and inside the buffer, no two overlapping."""
    for p in buf.pieces:
        meta = tensors[p.tensor]
        if not _inside(p.box, meta.shape):
            raise LayoutError(f"rank {rank} buffer {buf.name}: box {p.box} is outside {p.tensor} of shape {meta.shape}")
        if not _inside(p.local, buf.shape):
            raise LayoutError(f"rank {rank} buffer {buf.name} of shape {buf.shape}: local box {p.local} of {p.tensor} is outside it")
    if len(buf.pieces) < 2:
        return
    ps = sorted(buf.pieces, key=lambda p: p.local.offsets)
    for i, a in enumerate(ps):
        end = a.local.offsets[0] + a.local.sizes[0] if a.local.ndim else None
        for b in ps[i + 1:]:
            if end is not None and b.local.offsets[0] >= end:
                break  # sorted by offset: no later piece can reach back into a
            if _overlap(a.local, b.local):
                raise LayoutError(f"rank {rank} buffer {buf.name}: pieces {a.tensor}{a.box} and {b.tensor}{b.box} "
                                  f"overlap at local {a.local.intersect(b.local)}")


@dataclass
class Layout:
    """All logical tensors of one side (source or destination) and every rank's buffers.

    Ranks are ranks of the process group the transfer runs on.
    """
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    buffers: dict[int, dict[str, Buffer]] = field(default_factory=dict)

    def add_tensor(self, name: str, shape: Sequence[int], dtype: str) -> TensorMeta:
        meta = TensorMeta(name, check_shape(shape, f"tensor {name}"), dtype)
        itemsize(dtype)
        old = self.tensors.get(name)
        if old is not None and old != meta:
            raise LayoutError(f"tensor {name} declared twice: {old.shape} {old.dtype} vs {meta.shape} {meta.dtype}")
        self.tensors[name] = meta
        return meta

    def add_buffer(self, rank: int, buffer: Buffer) -> None:
        """``buffer`` on ``rank``.  The same Buffer object may sit on several ranks (replicas:
        builders share them, which also lets the planner recognise them by identity); it is
        checked against the tensors once."""
        rank_bufs = self.buffers.setdefault(int(rank), {})
        if buffer.name in rank_bufs:
            raise LayoutError(f"rank {rank} has two buffers named {buffer.name}")
        self._check_once(rank, buffer, self._checked_cache())
        rank_bufs[buffer.name] = buffer

    def _checked_cache(self) -> dict:
        """id -> (the Buffer, or the tuple of :meth:`add_buffers`; the tensors it was checked against;
        for a tuple, its buffers by name)."""
        checked = self.__dict__.get("_checked")
        if checked is None:
            checked = self.__dict__["_checked"] = {}
        return checked

    def _check_once(self, rank: int, buffer: Buffer, checked: dict) -> None:
        """:meth:`_check_buffer`, once per Buffer object and tensors (replicas share the object)."""
        got = checked.get(id(buffer))
        if got is None or got[0] is not buffer or got[1] is not self.tensors:
            self._check_buffer(rank, buffer)
            checked[id(buffer)] = (buffer, self.tensors)

    def add_buffers(self, rank: int, buffers: tuple[Buffer, ...]) -> None:
        """The ``buffers`` on ``rank``, in order: :meth:`add_buffer` for each, but the same tuple
        object on several ranks (a part of a layer that ranks share) is checked once and then
        added in one dict update.

            rank | add_buffers(rank, norms)        norms = (input_layernorm, post_attention_layernorm)
            0    | checks both, adds both
            1    | adds both (the same tuple: no check)
        """
        self.add_parts(rank, (buffers,))

    def add_parts(self, rank: int, parts: Iterable[tuple[Buffer, ...]]) -> None:
        """:meth:`add_buffers` of each tuple in ``parts``, in order (one call for a rank's parts)."""
        rank_bufs = self.buffers.setdefault(int(rank), {})
        checked, tensors = self._checked_cache(), self.tensors
        for buffers in parts:
            got = checked.get(id(buffers))
            if got is None or got[0] is not buffers or got[1] is not tensors:
                got = checked[id(buffers)] = (buffers, tensors, self._named(rank, buffers, checked))
            named = got[2]
            if not rank_bufs.keys().isdisjoint(named):
                dup = next(n for n in named if n in rank_bufs)
                raise LayoutError(f"rank {rank} has two buffers named {dup}")
            rank_bufs.update(named)

    def _named(self, rank: int, buffers: tuple[Buffer, ...], checked: dict) -> dict[str, Buffer]:
        """``buffers`` by name, each checked (once per object, as in :meth:`add_buffer`)."""
        if type(buffers) is not tuple:
            raise LayoutError(f"rank {rank}: add_buffers takes a tuple of Buffers, not {type(buffers).__name__}")
        named: dict[str, Buffer] = {}
        for b in buffers:
            if b.name in named:
                raise LayoutError(f"rank {rank} has two buffers named {b.name}")
            self._check_once(rank, b, checked)
            named[b.name] = b
        return named

    def add_sharded(self, name: str, shape: Sequence[int], dtype: str, mesh: Mesh,
                    placements: Sequence[tuple[str, int]] = (), buffer: str | None = None,
                    mode: str = "exact") -> None:
        """One tensor held as one buffer on every rank of ``mesh`` (see :func:`shard_box`)."""
        self.add_tensor(name, shape, dtype)
        for r in mesh.ranks:
            box = shard_box(shape, mesh, r, placements, mode)
            self.add_buffer(r, Buffer(buffer or name, box.sizes, dtype, (Piece(name, box, Box.full(box.sizes)),)))

    def _check_buffer(self, rank: int, buf: Buffer) -> None:
        if not isinstance(buf.shape, tuple) or (buf.shape and (set(map(type, buf.shape)) != _INT or min(buf.shape) < 0)):
            raise LayoutError(f"rank {rank} buffer {buf.name}: shape {buf.shape!r} must be a tuple of integers >= 0")
        tensors, dtype, key = self.tensors, buf.dtype, [buf.shape]
        for p in buf.pieces:
            meta = tensors.get(p.tensor)
            if meta is None:
                raise LayoutError(f"rank {rank} buffer {buf.name}: piece of undeclared tensor {p.tensor}")
            if meta.dtype != dtype:
                raise LayoutError(f"rank {rank} buffer {buf.name} is {buf.dtype} but holds {p.tensor} of dtype {meta.dtype}")
            box, local = p.box, p.local      # their fields, not the Boxes: tuples hash without a Python call
            key += (meta.shape, box.offsets, box.sizes, local.offsets, local.sizes)
        # the rest depends on sizes and boxes only: every layer's copy of a buffer asks the same
        sound = self.__dict__.setdefault("_sound", set())
        key = tuple(key)
        if key in sound:
            return
        _check_geometry(rank, buf, self.tensors)
        sound.add(key)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.buffers)

    def pieces_of(self, tensor: str) -> list[tuple[int, str, Piece]]:
        return [(r, b.name, p) for r in self.ranks for b in self.buffers[r].values() for p in b.pieces if p.tensor == tensor]

    def iter_pieces(self) -> Iterable[tuple[int, Buffer, Piece]]:
        for r in self.ranks:
            for name in sorted(self.buffers[r]):
                buf = self.buffers[r][name]
                for p in buf.pieces:
                    yield r, buf, p

    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.tensors.values())

    def to_json(self) -> dict:
        return {"tensors": {n: [list(m.shape), m.dtype] for n, m in sorted(self.tensors.items())},
                "buffers": {str(r): [self.buffers[r][n].to_json() for n in sorted(self.buffers[r])] for r in self.ranks}}

    @staticmethod
    @paused_gc()
    def from_json(obj: Mapping) -> "Layout":
        """The layout of :meth:`to_json`; buffers equal in JSON become one shared Buffer object
        (replicas: built and checked once, recognised by identity when planning)."""
        lay = Layout()
        for n, (shape, dtype) in obj["tensors"].items():
            lay.add_tensor(n, shape, dtype)
        seen: dict = {}
        for r, bufs in obj["buffers"].items():
            for b in bufs:
                try:
                    key = _json_key(b)
                    hash(key)
                except (TypeError, KeyError, ValueError, IndexError):   # Buffer.from_json says what is wrong
                    key = None
                buf = seen.get(key) if key is not None else None
                if buf is None:
                    buf = Buffer.from_json(b)
                    if key is not None:
                        seen[key] = buf
                lay.add_buffer(int(r), buf)
        return lay

    def offset_ranks(self, delta: int) -> "Layout":
        """The same layout on ranks shifted by ``delta`` (e.g. inference ranks after the trainer's)."""
        return Layout(dict(self.tensors), {r + delta: dict(b) for r, b in self.buffers.items()})


@paused_gc()
def merge_layouts(parts: Iterable[Layout | Mapping]) -> Layout:
    """One layout of several parts (each a :class:`Layout` or its JSON, :meth:`Layout.to_json`), e.g.
    every rank's own part gathered from the group, or engine layouts built from specs plus parts.

    JSON parts on disjoint ranks that agree on their tensors are read as one JSON layout, so replicas
    on different ranks share one Buffer object; anything else is added part by part.  Refused with a
    :class:`LayoutError`: a tensor declared with two shapes or dtypes, a rank's buffer in two parts::

        rank | part A (JSON)   | part B (JSON)   | merged
        0    | w [0:2) of w[4] |                 | w [0:2)  (one Buffer object on ranks 0 and 2)
        1    |                 | w [2:4)         | w [2:4)
        2    |                 | w [0:2)         | w [0:2)
    """
    parts = list(parts)
    if not any(isinstance(p, Layout) for p in parts):
        tensors: dict = {}
        buffers: dict = {}
        joint = True
        for part in parts:
            for n, meta in part["tensors"].items():
                if tensors.setdefault(n, meta) != meta:
                    joint = False
            if not buffers.keys().isdisjoint(part["buffers"]):
                joint = False
            buffers.update(part["buffers"])
        if joint:
            return Layout.from_json({"tensors": tensors, "buffers": buffers})
    out = Layout()
    for part in parts:
        piece = part if isinstance(part, Layout) else Layout.from_json(part)
        for name, meta in piece.tensors.items():
            out.add_tensor(name, meta.shape, meta.dtype)
        for r, bufs in piece.buffers.items():       # checked against the same tensors in their part
            mine = out.buffers.setdefault(r, {})
            for b in bufs.values():
                if b.name in mine:
                    raise LayoutError(f"rank {r} has two buffers named {b.name}: two parts describe it")
                mine[b.name] = b
    return out
