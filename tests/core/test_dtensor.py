"""DTensor bridge against torch's own sharding (``_split_tensor``, ``distribute_tensor``,
``compute_local_shape_and_global_offset``) and real DTensors on gloo."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from mcore_reshard.core.dtensor import buffer_for, placements_for
from mcore_reshard.core.layout import Layout
from mcore_reshard.core.mesh import Mesh
from mcore_reshard.tools.launch import spawn
from mcore_reshard.tools.synthetic import materialize


def torch_local(full: torch.Tensor, mesh_sizes, coord, placements) -> torch.Tensor:
    """What DTensor's distribute_tensor keeps on ``coord``: torch's own _split_tensor, mesh dim by dim."""
    t = full
    for size, c, p in zip(mesh_sizes, coord, placements):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(t, size, with_padding=False)
        t = shards[c]
    return t


@st.composite
def placement_cases(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(nd))
    mesh_sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    options = st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, nd - 1)),
                        st.builds(lambda d, k: _StridedShard(d, split_factor=k), st.integers(0, nd - 1), st.integers(2, 3)))
    placements = [draw(options) for _ in mesh_sizes]
    return shape, mesh_sizes, placements


@settings(max_examples=300, deadline=None)
@given(placement_cases())
def test_boxes_equal_torch_split(case):
    shape, mesh_sizes, placements = case
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for coord in itertools.product(*[range(s) for s in mesh_sizes]):
        buf = buffer_for("b", "t", "int64", shape, mesh_sizes, coord, placements)
        mine = torch.zeros(buf.shape, dtype=torch.int64) - 1
        for p in buf.pieces:
            mine[p.local.slices()] = full[p.box.slices()]
        assert torch.equal(mine, torch_local(full, mesh_sizes, coord, placements)), (coord, buf)


def test_megatron_fc1_is_a_strided_shard_and_round_trips():
    mesh = Mesh.of({"tp": 2})
    lay = Layout()
    lay.add_tensor("fc1", (8, 3), "float32")
    from mcore_reshard.core.dtensor import add_from_placements
    add_from_placements(lay, "fc1", (8, 3), "float32", [2], {0: (0,), 1: (1,)}, [_StridedShard(0, split_factor=2)])
    # rank 1 holds gate rows 2:4 then up rows 6:8
    assert [(p.box.offsets[0], p.local.offsets[0]) for p in lay.buffers[1]["fc1"].pieces] == [(2, 0), (6, 2)]
    got = placements_for(lay, "fc1", mesh)
    assert got == [_StridedShard(0, split_factor=2)]
    plain = Layout()
    plain.add_sharded("w", (8, 4), "float32", Mesh.of({"tp": 2, "dp": 2}), [("tp", 1)])
    assert placements_for(plain, "w", Mesh.of({"tp": 2, "dp": 2})) == [Replicate(), Shard(1)]
    padded = Layout()
    padded.add_sharded("w", (7, 3), "float32", Mesh.of({"tp": 3}), [("tp", 0)], mode="even")   # 3+2+2 rows; torch.chunk: 3+3+1
    assert placements_for(padded, "w", Mesh.of({"tp": 3})) is None


def _dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from mcore_reshard.core.dtensor import layout_from_dtensor, mesh_ranks, to_dtensor
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert torch.equal(dm.mesh, mesh_ranks(Mesh.of({"tp": 2, "dp": 2})))
    checked = 0
    for shape, placements in [((9, 6), [Shard(0), Shard(1)]), ((8, 4), [Replicate(), Shard(0)]),
                              ((5, 7, 3), [Shard(2), Shard(0)]), ((8, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
                              ((12, 5), [Replicate(), _StridedShard(0, split_factor=2)])]:
        g = torch.Generator().manual_seed(checked)
        full = torch.randn(shape, generator=g)
        dt = distribute_tensor(full, dm, placements)
        lay = layout_from_dtensor("w", dt)
        mine = materialize(lay, rank, {"w": full})["w"]
        assert torch.equal(mine, dt.to_local()), (shape, placements)
        if not any(isinstance(p, _StridedShard) for p in placements):
            local_shape, offset = compute_local_shape_and_global_offset(shape, dm, placements)
            (p,) = lay.buffers[rank]["w"].pieces
            assert (tuple(local_shape), tuple(offset)) == (p.box.sizes, p.box.offsets)
        back = to_dtensor(mine, dm, placements, shape)
        assert back.to_local().data_ptr() == mine.data_ptr()
        assert torch.equal(back.full_tensor(), full)
        checked += 1
    return checked


@pytest.mark.multiproc
def test_real_dtensors_on_gloo():
    assert spawn(_dtensor_worker, 4, timeout=200) == [5] * 4
