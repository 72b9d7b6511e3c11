"""DTensor bridge: layouts from ``(DeviceMesh, placements)`` and back, and DTensors over local shards.

Placements are read left to right over the mesh dims, as DTensor does: ``Shard(d)`` chunks the
current local tensor along ``d`` (``torch.chunk`` sizes), ``_StridedShard(d, split_factor=k)``
first cuts it into ``k`` chunks and takes this rank's chunk of each (Megatron's ``[gate; up]``
``linear_fc1`` over TP is ``_StridedShard(0, split_factor=2)`` of the fused ``[2F, H]`` tensor),
``Replicate()`` leaves it.  Example, ``[gate; up]`` with F=2, H=1, tp=2::

    rank | placements                      | local rows of [g0 g1 u0 u1]
    0    | [_StridedShard(0, split_factor=2)] | g0 u0
    1    |                                 | g1 u1

This module imports ``torch.distributed.tensor`` only for the placement classes, DeviceMesh and
``DTensor.from_local``; the box arithmetic is plain Python.
"""
from __future__ import annotations

import itertools
from typing import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .box import Box, split_sizes
from .layout import Buffer, Layout, Piece, check_shape
from .mesh import Mesh

Interval = tuple[int, int]   # (global offset, length) along one tensor dim


def _take(intervals: list[Interval], start: int, length: int) -> list[Interval]:
    """Local positions [start, start+length) of a dim made of ``intervals``, as global intervals."""
    out, pos = [], 0
    for off, n in intervals:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if hi > lo:
            out.append((off + lo - pos, hi - lo))
        pos += n
    return out


def _split(intervals: list[Interval], parts: int, index: int) -> list[Interval]:
    total = sum(n for _, n in intervals)
    sizes = split_sizes(total, parts, "chunk")
    return _take(intervals, sum(sizes[:index]), sizes[index])


def local_intervals(global_shape: Sequence[int], mesh_sizes: Sequence[int], coord: Sequence[int],
                    placements: Sequence) -> list[list[Interval]]:
    """Per tensor dim, the global intervals this coordinate holds, in local order."""
    global_shape = check_shape(global_shape, "global shape")
    dims = [[(0, s)] for s in global_shape]
    for size, c, p in zip(mesh_sizes, coord, placements):
        dim = getattr(p, "dim", None)
        if isinstance(p, Shard) and (type(dim) is not int or not -len(dims) <= dim < len(dims)):
            raise ValueError(f"placement {p}: dim {dim!r} is out of range for a tensor of shape {list(global_shape)}")
        if isinstance(p, _StridedShard):
            total = sum(n for _, n in dims[p.dim])
            seg_sizes = split_sizes(total, p.split_factor, "chunk")
            out, pos = [], 0
            for seg in seg_sizes:
                out += _split(_take(dims[p.dim], pos, seg), size, c)
                pos += seg
            dims[p.dim] = out
        elif isinstance(p, Shard):
            dims[p.dim] = _split(dims[p.dim], size, c)
        elif isinstance(p, Replicate):
            continue
        else:
            raise ValueError(f"placement {p} is not supported (Shard, _StridedShard, Replicate only)")
    return dims


def buffer_for(name: str, tensor: str, dtype: str, global_shape: Sequence[int], mesh_sizes: Sequence[int],
               coord: Sequence[int], placements: Sequence) -> Buffer:
    """The local buffer of one coordinate: a piece per combination of per-dim intervals."""
    dims = local_intervals(global_shape, mesh_sizes, coord, placements)
    shape = tuple(sum(n for _, n in d) for d in dims)
    local_starts = [list(itertools.accumulate([0] + [n for _, n in d]))[:-1] for d in dims]
    pieces = []
    for combo in itertools.product(*[range(len(d)) for d in dims]):
        gbox = Box(tuple(dims[k][i][0] for k, i in enumerate(combo)), tuple(dims[k][i][1] for k, i in enumerate(combo)))
        if gbox.numel == 0:
            continue
        pieces.append(Piece(tensor, gbox, Box(tuple(local_starts[k][i] for k, i in enumerate(combo)), gbox.sizes)))
    return Buffer(name, shape, dtype, tuple(pieces))


def mesh_coords(device_mesh) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """Dim sizes and rank -> coordinate of a DeviceMesh (any rank tensor, not only aranges)."""
    ranks = device_mesh.mesh
    coords = {int(ranks[idx]): idx for idx in itertools.product(*[range(s) for s in ranks.shape])}
    return list(ranks.shape), coords


def mesh_ranks(mesh: Mesh) -> torch.Tensor:
    """The rank tensor of the DeviceMesh equivalent to ``mesh`` (slowest axis first)."""
    _, sizes = mesh.device_mesh_shape()
    return torch.arange(mesh.size).reshape(sizes) + mesh.rank_offset


def add_from_placements(layout: Layout, tensor: str, global_shape: Sequence[int], dtype: str,
                        mesh_sizes: Sequence[int], coords: Mapping[int, Sequence[int]], placements: Sequence,
                        buffer: str | None = None) -> None:
    """Add ``tensor`` as laid out by ``placements`` over a mesh given as rank -> coordinate."""
    layout.add_tensor(tensor, global_shape, dtype)
    for rank, coord in sorted(coords.items()):
        layout.add_buffer(rank, buffer_for(buffer or tensor, tensor, dtype, global_shape, mesh_sizes, coord, placements))


def layout_from_dtensor(name: str, dt: DTensor) -> Layout:
    """A one-tensor layout describing every rank of ``dt``'s mesh."""
    sizes, coords = mesh_coords(dt.device_mesh)
    lay = Layout()
    add_from_placements(lay, name, tuple(dt.shape), str(dt.dtype).removeprefix("torch."), sizes, coords, dt.placements)
    return lay


def placements_for(layout: Layout, tensor: str, mesh: Mesh, max_split_factor: int = 4) -> list | None:
    """Placements (one per DeviceMesh dim of ``mesh``, slowest axis first) that reproduce how
    ``layout`` holds ``tensor`` on the mesh's ranks, or None when DTensor cannot express it
    (several pieces of different tensors in one buffer, padding, uneven splits other than chunk)."""
    meta = layout.tensors[tensor]
    held = {}
    for r in mesh.ranks:
        bufs = [b for b in layout.buffers.get(r, {}).values() if any(p.tensor == tensor for p in b.pieces)]
        if len(bufs) != 1 or any(p.tensor != tensor for p in bufs[0].pieces) or bufs[0].padding():
            return None
        held[r] = bufs[0]
    names, sizes = mesh.device_mesh_shape()
    coords = {r: tuple(mesh.coord(r)[a] for a in names) for r in mesh.ranks}
    options = [Replicate()] + [Shard(d) for d in range(len(meta.shape))] + [
        _StridedShard(d, split_factor=k) for d in range(len(meta.shape)) for k in range(2, max_split_factor + 1)]
    for combo in itertools.product(options, repeat=len(sizes)):
        if all(_same(buffer_for(held[r].name, tensor, meta.dtype, meta.shape, sizes, coords[r], combo), held[r])
               for r in mesh.ranks):
            return list(combo)
    return None


def _same(a: Buffer, b: Buffer) -> bool:
    return a.shape == b.shape and sorted((p.box, p.local) for p in a.pieces) == sorted((p.box, p.local) for p in b.pieces)


def to_dtensor(local: torch.Tensor, device_mesh, placements: Sequence, global_shape: Sequence[int]) -> DTensor:
    """A real DTensor over this rank's existing local shard (no copy, no communication)."""
    stride = tuple(itertools.accumulate(reversed(list(global_shape)[1:] + [1]), lambda a, b: a * b))[::-1]
    return DTensor.from_local(local, device_mesh, list(placements), run_check=False,
                              shape=torch.Size(global_shape), stride=stride)
