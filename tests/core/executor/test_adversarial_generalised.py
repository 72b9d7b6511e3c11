"""Trust that generalises: defect classes no earlier adversarial suite named (rebound
``param.data``, the default timeout, handshakes that must end alike, out-of-range versions, bool
bytes under verify, inference tensors, DTensors, interleaved views, malformed plan JSON, bad
budgets, a rank outside the group), each on real gloo processes where a group is involved.

Each asserts the documented outcome: refused on every rank before a byte moved (destination
bytes unchanged), with an error of the library's own types or a ValueError / TypeError naming
the argument; or a bit-exact refit.
"""
from __future__ import annotations

import os
import tempfile

import generalised_workers as gw
import pytest
from partial_launch import spawn_ok, spawn_partial

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def defects():
    return spawn_ok(gw.defects, 2, timeout=300, pg_timeout=60)


def _refused_everywhere(res, case, *, types=("ReshardError",), text=()):
    for rank, r in enumerate(res):
        o = r[case]
        assert o["type"] in types, (rank, case, o)
        assert o.get("dst_untouched", True), (rank, case, o)
        for t in text:
            assert t in o["error"], (rank, case, o["error"])


def test_dst_param_data_rebound_after_binding_is_followed(defects):
    for rank, r in enumerate(defects):
        o = r["dst_rebound"]
        assert o["type"] is None, (rank, o)
        assert o["exact"], rank                    # the new storage holds the refit's bytes
        assert o["old_storage_untouched"], rank    # the storage the parameter left is not written
        assert o["result"]["version"] == 1 and not o["result"]["incomplete"], o


def test_src_param_data_rebound_after_binding_is_followed(defects):
    for rank, r in enumerate(defects):
        o = r["src_rebound"]
        assert o["type"] is None and o["result"] == 2, (rank, o)
        assert o["exact"], rank                    # the destination holds the new source's bytes


def test_param_data_rebound_after_a_batched_refit_is_followed(defects):
    """The batched path keeps each round's chunk schedule (views) between refits: after both
    sides' ``param.data`` were rebound, the next refit moves the new sources into the new
    destinations and leaves the storage the parameters left as the first refit wrote it."""
    assert any(r["rebound_batched"]["rounds"] for r in defects)      # the batched rounds ran at all
    for rank, r in enumerate(defects):
        o = r["rebound_batched"]
        assert o["type"] is None and o["result"] == 2, (rank, o)
        assert o["exact"], rank
        assert o["old_storage_kept"], rank


def test_rebound_to_another_shape_refused_on_every_rank(defects):
    _refused_everywhere(defects, "dst_rebound_other_shape", text=("was rebound after binding", "rank 1"))
    assert all(r["dst_rebound_other_shape"]["state"] == 0 for r in defects)


def test_version_out_of_range_refused_before_anything_moves(defects):
    _refused_everywhere(defects, "version_huge", types=("ValueError",), text=("version=",))
    for r in defects:
        assert r["version_huge_retry"]["type"] is None and r["version_huge_retry"]["result"] == 1, r
        assert r["version_huge_retry"]["exact"]


@pytest.mark.parametrize("overlap", [True, False])
def test_verify_on_bool_bytes_other_than_0_1(defects, overlap):
    for rank, r in enumerate(defects):
        o = r[f"bool_bytes_verify_{overlap}"]
        assert o["type"] is None and o["result"] == 1, (rank, o)
        assert o["exact"], rank                    # moved byte for byte (2 and 255 included)


def test_built_in_inference_mode_refits_outside_it(defects):
    for rank, r in enumerate(defects):
        o = r["built_in_inference_mode"]
        assert o["type"] is None and o["result"] == 1 and o["exact"], (rank, o)


def test_inference_tensor_destination_refused_at_bind(defects):
    _refused_everywhere(defects, "inference_dst")
    assert "inference tensor" in defects[0]["inference_dst"]["error"], defects[0]["inference_dst"]


def test_replicate_dtensor_destination_uses_its_local_tensor(defects):
    for rank, r in enumerate(defects):
        o = r["dtensor_dst"]
        assert o["type"] is None and o["result"] == 1 and o["exact"], (rank, o)


def test_dtensor_with_a_local_shard_other_than_the_plan_refused(defects):
    _refused_everywhere(defects, "dtensor_dst_wrong_shard", text=("DTensor",))


def test_interleaved_views_in_one_storage_are_not_sharing_memory(defects):
    for rank, r in enumerate(defects):
        o = r["interleaved_views"]
        assert o["type"] is None and o["result"] == 1 and o["exact"], (rank, o)


def test_views_overlapping_in_bytes_still_refused(defects):
    _refused_everywhere(defects, "overlapping_views", text=("share memory",))


def test_rank_outside_the_group_gets_an_error_naming_it(defects):
    o = defects[1]["outside_group"]
    assert o["type"] in ("ReshardError", "ValueError"), o
    assert "rank 1" in o["error"] and "group" in o["error"], o
    assert o["dst_untouched"], o
    assert defects[0]["outside_group"]["type"] is None and defects[0]["outside_group"]["exact"]


def test_default_timeout_follows_the_default_group_timeout():
    with tempfile.TemporaryDirectory() as tmp:
        out = spawn_partial(gw.stalled_peer, 2, os.path.join(tmp, "pid"), timeout=90, pg_timeout=5)
    o = out[0]["result"]
    assert out[0]["ok"] and o["timeout_s"] == 5.0, out[0]
    assert o["type"] == "TransferError", o
    assert o["elapsed"] < 5.0 * 2 + 3, o              # the round's deadline + the confirmation's at most


def test_late_rank_handshake_ends_alike_on_every_rank():
    out = spawn_ok(gw.late_handshake, 2, 1, 5.0, timeout=120, pg_timeout=60)
    kinds = [o["type"] for o in out]
    assert kinds == ["ReshardError", "ReshardError"], out
    assert out[0]["elapsed"] < 3 * 2 + 2, out


def test_interrupted_handshake_ends_alike_on_every_rank():
    out = spawn_ok(gw.interrupted_handshake, 2, 1, timeout=120, pg_timeout=60)
    assert out[1]["type"] == "KeyboardInterrupt", out
    assert out[0]["type"] == "ReshardError" and "rank 1 failed it" in out[0]["error"], out
    assert out[0]["elapsed"] < 3 * 2 + 2, out
