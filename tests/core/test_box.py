"""Boxes (splits, subtraction, budget cuts) and a Piece's local / global box maps."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_reshard.core.box import Box, split_box, split_sizes, subtract


@st.composite
def boxes(draw, max_dim=6):
    nd = draw(st.integers(1, 3))
    offs = tuple(draw(st.integers(0, 3)) for _ in range(nd))
    sizes = tuple(draw(st.integers(1, max_dim)) for _ in range(nd))
    return Box(offs, sizes)


def _mark(shape, boxes_):
    a = np.zeros(shape, dtype=np.int64)
    for b in boxes_:
        a[b.slices()] += 1
    return a


@settings(max_examples=200, deadline=None)
@given(boxes(), st.integers(1, 40))
def test_split_box_covers_once_within_limit(box, limit):
    parts = list(split_box(box, limit))
    assert all(p.numel <= limit for p in parts)
    cnt = _mark(box.ends, parts)
    assert (cnt[box.slices()] == 1).all() and cnt.sum() == box.numel


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3).flatmap(lambda nd: st.tuples(*[st.tuples(st.integers(0, 3), st.integers(1, 5))] * (2 * nd))))
def test_subtract_is_exact(dims):
    nd = len(dims) // 2
    a = Box(tuple(o for o, _ in dims[:nd]), tuple(s for _, s in dims[:nd]))
    b = Box(tuple(o for o, _ in dims[nd:]), tuple(s for _, s in dims[nd:]))
    rest = subtract(a, b)
    shape = tuple(max(x, y) for x, y in zip(a.ends, b.ends))
    expect = _mark(shape, [a])
    inter = a.intersect(b)
    if inter is not None:
        expect[inter.slices()] = 0
    assert (_mark(shape, rest) == expect).all()


def test_split_modes():
    assert split_sizes(10, 3, "even") == [4, 3, 3]
    assert split_sizes(10, 3, "chunk") == [4, 4, 2]
    assert split_sizes(3 * 4 + 1, 4, "even") == [4, 3, 3, 3]
    assert split_sizes(2, 4, "chunk") == [1, 1, 0, 0]


def test_piece_global_of_inverts_local_of():
    from mcore_reshard.core.box import Box
    from mcore_reshard.core.layout import Piece
    # an expert's [I, H] rows placed at slot 3 of a stacked [E, I, H] buffer (size-1 dim squeezed)
    p = Piece("gate", Box((4, 0), (8, 6)), Box((3, 0, 0), (1, 8, 6)))
    sub = Box((6, 2), (2, 3))
    assert p.local_of(sub) == Box((3, 2, 2), (1, 2, 3))
    assert p.global_of(p.local_of(sub)) == sub
    q = Piece("w", Box((10, 0), (4, 4)), Box((2, 0), (4, 4)))       # same shape: a shift
    assert q.global_of(Box((3, 1), (1, 2))) == Box((11, 1), (1, 2))
