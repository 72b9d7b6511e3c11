"""Replicas share their Buffer objects: ``megatron_layout`` makes a buffer once per distinct
(name, tensor, split, block, dtype), ``Layout.from_json`` makes buffers equal in JSON one object, and
``Layout.add_buffer`` checks a Buffer object once -- the same layouts by value (and so the same plans),
fewer objects for the planner to put in canonical form, and nothing bad let through."""
from __future__ import annotations

import json

import pytest

from mcore_reshard.core.box import Box
from mcore_reshard.core.layout import Buffer, Layout, LayoutError, Piece
from mcore_reshard.sources.megatron_spec import ParallelSizes, megatron_layout
from mcore_reshard.targets import dsv3_671b


def tiny():
    return dsv3_671b().with_(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, hidden_size=64,
                             moe_intermediate_size=16, intermediate_size=128, vocab_size=256,
                             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
                             qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, num_nextn_predict_layers=0)


@pytest.mark.parametrize("sizes", [ParallelSizes(tp=2, ep=2, etp=1, dp=2), ParallelSizes(tp=2, pp=2, dp=2, ep=2, etp=2),
                                   ParallelSizes(tp=1, ep=4, dp=4)])
def test_megatron_layout_shares_a_buffer_between_replicas_only(sizes):
    # for every buffer name: ranks whose buffers are equal hold one object, unequal ones others
    lay = megatron_layout(tiny(), sizes, "deepseek_v3")
    by_name: dict = {}
    for r, bufs in lay.buffers.items():
        for name, buf in bufs.items():
            by_name.setdefault(name, []).append(buf)
    shared = split = 0
    for name, bufs in by_name.items():
        for x in bufs:
            for y in bufs:
                assert (x is y) == (x == y), name
        shared += len(bufs) - len({id(x) for x in bufs})
        split += len({id(x) for x in bufs}) > 1
    assert shared > 0 and split > 0         # some replicas, some shards
    # by value it is the layout a JSON round trip gives
    again = Layout.from_json(json.loads(json.dumps(lay.to_json())))
    assert again.to_json() == lay.to_json()


def test_from_json_makes_equal_buffers_one_object_and_still_refuses_bad_ones():
    lay = Layout()
    lay.add_tensor("w", (4, 2), "float32")
    full = Buffer("w", (4, 2), "float32", (Piece("w", Box((0, 0), (4, 2)), Box((0, 0), (4, 2))),))
    half = Buffer("w", (2, 2), "float32", (Piece("w", Box((2, 0), (2, 2)), Box((0, 0), (2, 2))),))
    for r, buf in ((0, full), (1, full), (2, half)):
        lay.add_buffer(r, buf)
    obj = json.loads(json.dumps(lay.to_json()))
    got = Layout.from_json(obj)
    assert got.buffers[0]["w"] is got.buffers[1]["w"] and got.buffers[2]["w"] is not got.buffers[0]["w"]
    assert got.to_json() == lay.to_json()
    # a rank whose copy is out of its tensor is refused, even beside a good one of the same name
    bad = json.loads(json.dumps(obj))
    bad["buffers"]["3"] = [{"name": "w", "shape": [4, 2], "dtype": "float32", "pieces": [["w", [[1, 0], [4, 2]], [[0, 0], [4, 2]]]]}]
    with pytest.raises(LayoutError, match="outside"):
        Layout.from_json(bad)
    # a float that equals an int is not merged with the int buffer (1.0 == 1): refused as before
    odd = json.loads(json.dumps(obj))
    odd["buffers"]["1"][0]["pieces"][0][1] = [[0.0, 0], [4, 2]]
    with pytest.raises(ValueError, match="must be integers"):
        Layout.from_json(odd)
    # ... nor a bool (False == 0) or a float anywhere else in the buffer: shape, box, local box
    for path, value, error in ((("shape",), [4.0, 2], r"shape \(4\.0, 2\) must be a tuple of integers"),
                               (("pieces", 0, 1), [[False, 0], [4, 2]], r"must be integers, got False \(bool\)"),
                               (("pieces", 0, 2), [[0, 0], [4, 2.0]], r"must be integers, got 2\.0 \(float\)")):
        odd = json.loads(json.dumps(obj))
        at = odd["buffers"]["1"][0]
        for k in path[:-1]:
            at = at[k]
        at[path[-1]] = value
        with pytest.raises(ValueError, match=error):
            Layout.from_json(odd)


def test_add_buffer_checks_an_object_once_and_every_other_object(monkeypatch):
    lay = Layout()
    lay.add_tensor("w", (4,), "float32")
    calls = []
    real = Layout._check_buffer
    monkeypatch.setattr(Layout, "_check_buffer", lambda self, r, b: (calls.append((r, b.name)), real(self, r, b)))
    a = Buffer("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
    twin = Buffer("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
    for r in range(3):
        lay.add_buffer(r, a)
    lay.add_buffer(3, twin)
    assert calls == [(0, "w"), (3, "w")]
    wrong = Buffer("v", (4,), "float32", (Piece("w", Box((1,), (4,)), Box((0,), (4,))),))
    for r in (4, 5):
        with pytest.raises(LayoutError, match="outside"):
            lay.add_buffer(r, wrong)
    with pytest.raises(LayoutError, match="two buffers named"):
        lay.add_buffer(0, a)


def test_add_buffers_checks_a_tuple_once_keeps_order_and_refuses_conflicts(monkeypatch):
    lay = Layout()
    lay.add_tensor("w", (4, 2), "float32")
    calls = []
    real = Layout._check_buffer
    monkeypatch.setattr(Layout, "_check_buffer", lambda self, r, b: (calls.append((r, b.name)), real(self, r, b)))
    top = Buffer("top", (2, 2), "float32", (Piece("w", Box((0, 0), (2, 2)), Box((0, 0), (2, 2))),))
    bottom = Buffer("bottom", (2, 2), "float32", (Piece("w", Box((2, 0), (2, 2)), Box((0, 0), (2, 2))),))
    part = (bottom, top)
    for r in range(3):
        lay.add_buffers(r, part)
    assert calls == [(0, "bottom"), (0, "top")]            # once per tuple, not per rank
    assert [list(lay.buffers[r]) for r in range(3)] == [["bottom", "top"]] * 3
    assert all(lay.buffers[r]["top"] is top for r in range(3))
    lay.add_buffers(3, (top,))                              # a new tuple of a checked buffer: no check
    assert len(calls) == 2 and list(lay.buffers[3]) == ["top"]
    with pytest.raises(LayoutError, match="rank 0 has two buffers named top"):
        lay.add_buffers(0, (top,))
    with pytest.raises(LayoutError, match="rank 4 has two buffers named top"):
        lay.add_buffers(4, (top, top))
    with pytest.raises(LayoutError, match="tuple of Buffers"):
        lay.add_buffers(4, [top])
    both = Buffer("both", (3, 2), "float32", (Piece("w", Box((0, 0), (2, 2)), Box((0, 0), (2, 2))),
                                              Piece("w", Box((2, 0), (2, 2)), Box((1, 0), (2, 2)))))
    for r in (5, 6):        # refused on every rank it is offered to, nothing added
        with pytest.raises(LayoutError, match=f"rank {r} buffer both: pieces .* overlap at local \\[1:2, 0:2\\]"):
            lay.add_buffers(r, (top, both))
        assert r not in lay.buffers or not lay.buffers[r]


def test_a_checked_geometry_is_not_trusted_for_a_tensor_of_another_shape():
    # two layers' buffers with the same boxes: the second is checked against its own tensor's shape
    lay = Layout()
    lay.add_tensor("l0.w", (4, 2), "float32")
    lay.add_tensor("l1.w", (2, 2), "float32")
    box, local = Box((2, 0), (2, 2)), Box((0, 0), (2, 2))
    lay.add_buffers(0, (Buffer("l0", (2, 2), "float32", (Piece("l0.w", box, local),)),))
    lay.add_buffers(0, (Buffer("l0b", (2, 2), "float32", (Piece("l0.w", box, local),)),))     # same geometry: fine
    with pytest.raises(LayoutError, match=r"rank 1 buffer l1: box \[2:4, 0:2\] is outside l1.w of shape \(2, 2\)"):
        lay.add_buffers(1, (Buffer("l1", (2, 2), "float32", (Piece("l1.w", box, local),)),))
    with pytest.raises(LayoutError, match="local box .* is outside it"):     # same tensor, smaller buffer
        lay.add_buffers(1, (Buffer("l0c", (1, 2), "float32", (Piece("l0.w", Box((2, 0), (1, 2)), Box((1, 0), (1, 2))),)),))


def test_a_copy_with_other_tensors_checks_again():
    # a shallow copy shares the record of checked buffers; given other tensors, it checks again
    import copy
    lay = Layout()
    lay.add_tensor("w", (4,), "float32")
    a = Buffer("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
    lay.add_buffer(0, a)
    other = copy.copy(lay)
    other.tensors = {}
    other.buffers = {}
    with pytest.raises(LayoutError, match="undeclared tensor"):
        other.add_buffer(1, a)


def test_merged_rank_parts_share_replicas_and_still_name_conflicts():
    # MegatronRefit's layout of every rank's JSON part: replicas on different ranks become one
    # object; parts that disagree on a tensor, or describe one rank twice, are refused as before
    from mcore_reshard.core.layout import merge_layouts

    def part(rank, offset):
        lay = Layout()
        lay.add_tensor("w", (4, 2), "float32")
        lay.add_buffer(rank, Buffer("w", (2, 2), "float32", (Piece("w", Box((offset, 0), (2, 2)), Box((0, 0), (2, 2))),)))
        return json.loads(json.dumps(lay.to_json()))
    got = merge_layouts([part(0, 0), part(1, 2), part(2, 0)])
    assert got.buffers[0]["w"] is got.buffers[2]["w"] and got.buffers[1]["w"] != got.buffers[0]["w"]
    other = part(3, 0)
    other["tensors"]["w"] = [[8, 2], "float32"]
    with pytest.raises(LayoutError, match="w"):
        merge_layouts([part(0, 0), other])
    with pytest.raises(LayoutError, match="two buffers named"):
        merge_layouts([part(0, 0), part(0, 2)])
    # Layout objects (the engine protocol's built specs) merge with JSON parts, conflicts named the same way
    mixed = merge_layouts([Layout.from_json(part(0, 0)), part(1, 2)])
    assert mixed.to_json() == merge_layouts([part(0, 0), part(1, 2)]).to_json()
    assert mixed.buffers[1]["w"].pieces[0].box.offsets == (2, 0)
    with pytest.raises(LayoutError, match="rank 0 has two buffers named w"):
        merge_layouts([Layout.from_json(part(0, 0)), Layout.from_json(part(0, 2))])


def test_builders_pause_the_collector_and_restore_it():
    # paused_gc: the collector is off inside (nested too), its state restored after, also on an error;
    # the layout builders run under it and leave an enabled collector enabled, a disabled one disabled
    import gc

    from mcore_reshard.core.gcpause import paused_gc
    from mcore_reshard.core.layout import merge_layouts
    from mcore_reshard.targets import vllm_layout

    seen = []

    @paused_gc()
    def inner():
        seen.append(gc.isenabled())
        with paused_gc():
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
        raise KeyError("x")

    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            with pytest.raises(KeyError):
                inner()
            assert gc.isenabled() is state
            lay = megatron_layout(tiny(), ParallelSizes(tp=2, dp=2), "deepseek_v3")
            assert gc.isenabled() is state
            vllm_layout(tiny(), tp=2)
            assert gc.isenabled() is state
            parts = [json.loads(json.dumps(Layout(lay.tensors, {r: b}).to_json())) for r, b in lay.buffers.items()]
            assert merge_layouts(parts).to_json() == lay.to_json()
            assert gc.isenabled() is state
            with pytest.raises(LayoutError):     # a builder that raises restores the collector too
                Layout.from_json({"tensors": {}, "buffers": {"0": [Buffer("b", (2,), "float32", (
                    Piece("t", Box((0,), (2,)), Box((0,), (2,))),)).to_json()]}})
            assert gc.isenabled() is state
        assert seen == [False] * 6
    finally:
        (gc.enable if was else gc.disable)()
