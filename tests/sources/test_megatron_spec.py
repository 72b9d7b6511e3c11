"""Layouts built from dims and parallel sizes (no model) equal those read from live models."""
from __future__ import annotations

import megatron_refit_worker
import pytest

from mcore_reshard.sources.megatron_spec import ParallelSizes, stage_layers
from mcore_reshard.testing.megatron_cpu import spawn

CASES = [
    {"model": "dsv3", "src": {"tp": 2, "pp": 2}, "kw": {"mtp": True}},
    {"model": "dsv3", "src": {"tp": 2, "ep": 2, "etp": 1}, "kw": {"mtp": True}},
    {"model": "dsv3", "src": {"tp": 1, "ep": 4, "etp": 1}, "kw": {"mtp": True}},
    {"model": "dsv3", "src": {"tp": 2, "ep": 2}, "kw": {"mtp": False}},
    {"model": "dsv3", "src": {"tp": 2, "pp": 2, "first_stage_layers": 1}, "kw": {"mtp": True}},
    {"model": "dsv3", "src": {"pp": 2, "vpp": 2}, "kw": {"mtp": False}},
    {"model": "gqa", "src": {"tp": 2, "pp": 2}, "kw": {}},
    {"model": "gqa", "src": {"tp": 4}, "kw": {"tied_embeddings": True}},
    {"model": "qwen3", "src": {"tp": 2, "ep": 2}, "kw": {}},
]


@pytest.mark.megatron
@pytest.mark.multiproc
def test_spec_layout_equals_live_layout():
    results = spawn(megatron_refit_worker.spec_vs_live, 4, CASES, timeout=400)
    for i, case in enumerate(CASES):
        seen = set()
        for rank, per_case in enumerate(results):
            res = per_case[i]
            assert res["buffers"] > 10
            assert res["diff"] == [], (rank, case, res["diff"])
            assert res["metas_agree"], (rank, case)
            seen |= set(res["live_tensors"])
        assert seen == set(results[0][i]["spec_tensors"]), (case, seen ^ set(results[0][i]["spec_tensors"]))


def test_stage_layers():
    assert stage_layers(4, ParallelSizes(pp=2)) == [[0, 1], [2, 3]]
    assert stage_layers(4, ParallelSizes(pp=2, vpp=2)) == [[0], [1], [2], [3]]
    assert stage_layers(61, ParallelSizes(pp=4, first_stage_layers=13, last_stage_layers=16)) == \
        [list(range(0, 13)), list(range(13, 29)), list(range(29, 45)), list(range(45, 61))]
    with pytest.raises(ValueError, match="61 layers do not divide over pp=4"):
        stage_layers(61, ParallelSizes(pp=4))
    from mcore_reshard.tools.layout_strings import megatron_sizes, parse
    # dp defaults to the smallest value that makes etp*ep*pp divide the world (2*64*16 / (2*16))
    assert megatron_sizes(parse("tp=2,pp=16,ep=64,first=3")) == \
        ParallelSizes(tp=2, pp=16, ep=64, etp=2, dp=64, first_stage_layers=3)
