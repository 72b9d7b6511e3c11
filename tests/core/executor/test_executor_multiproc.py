"""The executor on real gloo process groups: world sizes 2, 4 and 8, several scenarios per launch
(one launch per world size, one test ID per scenario)."""
from __future__ import annotations

import pytest
import workers

from mcore_reshard.tools.launch import spawn

pytestmark = pytest.mark.multiproc


SCENARIOS = {   # world size -> (src, dst, colocated, options) run in one launch
    2: [
        ("tp=2", "tp=1", True, {}),                                     # colocated: rank 0 copies half locally
        ("tp=1", "tp=1", False, {"src_dtype": "bfloat16", "dst_dtype": "float32"}),   # cast on receive
        ("tp=1", "tp=1", False, {"budget": 2048, "reps": 2}),           # many rounds under a tiny budget
    ],
    4: [
        ("tp=2,pp=2", "tp=4", True, {}),
        ("tp=2", "tp=1,dp=2", False, {}),
        ("tp=1,dp=4,ep=4,etp=1", "tp=2,dp=2,ep=2,etp=2", True, {"src_dtype": "bfloat16"}),
    ],
    8: [
        ("tp=2,ep=2,etp=1,pp=2", "tp=4", False, {}),
        ("tp=2,dp=4,ep=4,etp=1", "tp=4,dp=2", True, {"budget": 16384}),
    ],
}
LAUNCH_TIMEOUT = {2: 300, 4: 300, 8: 400}


def _scenario_id(world: int, case: tuple) -> str:
    src, dst, colocated, opts = case
    extra = "".join(f",{k}={v}" for k, v in sorted(opts.items()))
    return f"world{world}-{src}-to-{dst}-{'colocated' if colocated else 'disaggregated'}{extra}"


@pytest.fixture(scope="module")
def scenarios():
    """``scenarios(world)``: per rank, per case, what ``workers.scenarios`` recorded (one launch per world size)."""
    launched: dict = {}

    def results(world: int) -> list:
        if world not in launched:
            launched[world] = spawn(workers.scenarios, world, SCENARIOS[world], timeout=LAUNCH_TIMEOUT[world])
        return launched[world]
    return results


@pytest.mark.parametrize("world,case", [(w, k) for w in SCENARIOS for k in range(len(SCENARIOS[w]))],
                         ids=[_scenario_id(w, c) for w in SCENARIOS for c in SCENARIOS[w]])
def test_scenario(scenarios, world, case):
    per_rank = [r[case] for r in scenarios(world)]
    assert len(per_rank) == world
    assert len({r["plan_hash"] for r in per_rank}) == 1
    for r in per_rank:
        assert r["mismatched_tensors"] == 0, r
        assert r["same_storage"], r
        # messages and bytes actually sent equal what the plan assigns to this rank
        assert r["messages_sent"] == r["expected_messages"], r
        assert r["bytes_sent"] == r["expected_bytes"], r
        # one staging buffer per rank: send + receive of its fullest round, within the budget
        assert r["staging_bytes"] == r["expected_staging"] <= r["budget"], r
    stats = per_rank[0]["stats"]
    assert stats["network_bytes"] == stats["lower_bound_bytes"]


def test_world_2_colocated_half_is_a_local_copy(scenarios):
    results = scenarios(2)
    assert results[0][0]["messages_sent"] == 0 and results[1][0]["messages_sent"] == 1


def test_world_2_tiny_budget_takes_many_rounds(scenarios):
    assert scenarios(2)[0][2]["stats"]["rounds"] > 10


def test_inconsistent_ranks_all_refuse_before_moving():
    results = spawn(workers.refusals, 2, timeout=120, pg_timeout=60)
    for rank, cases in enumerate(results):
        assert [c[0] for c in cases] == ["ReshardError"] * 3, cases
        assert all(c[2] for c in cases), "destination modified by a refused reshard"
        assert "plan hashes differ between ranks" in cases[0][1]
        assert "rank 0: dst tensor model.norm.weight is [3] float32, plan says [32] float32" in cases[1][1]
        assert "is [32] bfloat16, plan says [32] float32" in cases[2][1]


OVERLAP_CASES = [("tp=2,pp=2", "tp=4", True, 256 << 20), ("tp=2", "tp=1,dp=2", False, 4096)]


@pytest.fixture(scope="module")
def overlap_paths():
    return spawn(workers.overlap_paths, 4, OVERLAP_CASES, timeout=300)


@pytest.mark.parametrize("case", range(len(OVERLAP_CASES)),
                         ids=[f"{s}-to-{d}-{'colocated' if c else 'disaggregated'}-budget{b}" for s, d, c, b in OVERLAP_CASES])
def test_overlapped_and_batched_paths(overlap_paths, case):
    """gloo runs rounds overlapped by default (receives first, each send posted once packed, each
    receive unpacked on arrival, large entries straight from / into contiguous views); the batched
    path (overlap=False, what NCCL uses) and verify mode land the same bytes."""
    results = overlap_paths
    for rank, per_rank in enumerate(results):
        res = per_rank[case]
        assert res["overlapped"]["overlapped"] and not res["batched"]["overlapped"], res
        assert res["overlapped_verify"]["overlapped"], res
        for path in res.values():
            assert path["mismatched"] == 0 and path["same_storage"] and path["state_version"] == 2, (rank, res)
        # the same one staging buffer on both paths (direct entries leave their part untouched)
        assert res["overlapped"]["staging"] == res["batched"]["staging"] <= res["overlapped_verify"]["staging"], res
        # verify keeps every message one staged operation (its checksum trailer is staged)
        assert res["overlapped_verify"]["direct"] == 0, res
    # with _DIRECT_MIN lowered every kind of part occurs somewhere
    tot = {k: sum(r[case]["overlapped"][k] for r in results) for k in ("direct", "alone", "grouped")}
    assert tot["direct"] > 0 and tot["alone"] + tot["grouped"] > 0, tot


def test_templated_plan_bound_through_each_ranks_part():
    """4 gloo ranks, a templated plan (one template rotated across two colocated pipeline stages):
    every rank binds its own part (the whole plan's messages, copies and buffers are never made),
    two refits bit-exact, messages sent and rounds bound = the part's."""
    results = spawn(workers.templated_parts, 4, timeout=300)
    for r in results:
        assert r["templates"] == 1 and r["rotated"], r
        assert r["exact"] and r["whole_made"] == [], r
        assert r["sent"] == [r["expected_sent"]] * 2 and r["expected_sent"] > 0, r
        assert r["rounds_bound"] == r["expected_rounds"] > 0, r


def test_refusal_in_refit_start_stops_every_rank_before_moving():
    """``refit(refusal=[...])`` on one rank (an integration's check, e.g. an engine parameter replaced
    after binding): every rank raises in the refit start naming the refusing rank and its reasons;
    nothing moved; the next refit goes through."""
    results = spawn(workers.refusal_in_refit_start, 2, timeout=120, pg_timeout=60)
    for r in results:
        assert r["error"] and "refit refused before any byte moved" in r["error"], r
        assert "rank 1 refuses this refit: model.norm.weight: replaced after binding" in r["error"], r
        assert r["untouched"] and r["state_version"] == 1 and r["after"], r
