"""Two-level plans on real gloo process groups: 4 ranks in two "NVLink domains" of 2 (ranks 0-1,
2-3).  A real Megatron-Core model refit with forwarding is bit-exact and sends exactly the plan's
messages and bytes, with fewer NIC bytes than the flat plan; a forwarder that dies or stalls
before forwarding makes every other rank raise TransferError, no hang."""
from __future__ import annotations

import os
import tempfile

import pytest
import topology_workers
from partial_launch import spawn_partial

from mcore_reshard.testing.megatron_cpu import spawn

pytestmark = pytest.mark.multiproc

T = 2.0


def test_synthetic_two_level_refit_counts_match_the_plan():
    results = spawn_partial(topology_workers.synthetic_two_level, 4, 4096, timeout=120, pg_timeout=30)
    for rank, o in results.items():
        assert o["ok"], o["error"]
        res = o["result"]
        for path in ("overlapped", "batched", "verify"):
            assert res[path]["mismatched"] == [], (rank, path, res[path])
            assert res[path]["messages"] == res[path]["plan_messages"], (rank, path, res[path])
            # staged bytes (+ verify trailers) and the unstaged payload sent straight from the tensors,
            # and the staging buffer: each as the plan gives them (unstaged messages take no staging)
            assert res[path]["bytes"] == res[path]["plan_bytes"], (rank, path, res[path])
            assert res[path]["unstaged"] == res[path]["plan_unstaged"], (rank, path, res[path])
            assert res[path]["staging"] == res[path]["plan_staging"], (rank, path, res[path])
        if rank in (2, 3):      # the two receivers forward to each other: some forwards unstaged, some not
            assert res["overlapped"]["plan_unstaged"] > 0
        assert res["unstaged_forwards"] == res["unstaged_messages"] > 0 and res["staged_forwards"] > 0
        s = res["stats"]
        # both receivers (ranks 2, 3) need every replicated byte from domain 0: it crosses once (the
        # uneven odd.weight is split between them: 140 B that each needs alone); every forwarded
        # byte is a NIC byte saved
        assert s["nic_bytes"] == s["hierarchical_bound_bytes"] == (res["flat_nic_bytes"] + 140) // 2 > 0
        assert s["forwarded_bytes"] + s["nic_bytes"] == s["network_bytes"] == res["flat_nic_bytes"]
    assert len({o["result"]["hash"] for o in results.values()}) == 1


TWO_LEVEL_CASES = [{"model": "gqa", "src": {"tp": 2, "pp": 2}, "dst": {"tp": 1}, "kw": {}},
                   {"model": "dsv3", "src": {"tp": 2, "pp": 2}, "dst": {"tp": 1, "ep": 2, "etp": 1}, "kw": {"mtp": True},
                    "budget": 1 << 16}]


@pytest.fixture(scope="module")
def two_level_results():
    """One 4-rank launch for both models: per rank, per case, the counts of the two-level refit."""
    return spawn(topology_workers.megatron_two_level, 4, TWO_LEVEL_CASES, timeout=600)


@pytest.mark.megatron
@pytest.mark.parametrize("case", range(len(TWO_LEVEL_CASES)), ids=["gqa TP2 PP2 -> TP1", "dsv3 TP2 PP2 -> TP1 EP2"])
def test_megatron_two_level_refit_is_bit_exact_with_fewer_nic_bytes(two_level_results, case):
    from test_megatron_refit import check_case
    results, spec = two_level_results, TWO_LEVEL_CASES[case]
    check_case(results, case, spec)
    per_rank = [r[case] for r in results]
    assert len({r["hash"] for r in per_rank}) == 1
    for r in per_rank:
        assert r["bytes_sent"] == r["plan_bytes_from_me"], r
        assert r["unstaged_sent"] == r["plan_unstaged_from_me"], r
        assert r["second_messages"] == r["plan_messages_from_me"], r
    r = per_rank[0]
    assert r["plan_nic_bytes"] == r["nic_bytes"] == r["bound"] < r["flat_nic_bytes"], r
    assert r["forwarded_bytes"] > 0 and r["network_bytes"] == r["flat_network_bytes"]
    assert sum(x["forwards_from_me"] for x in per_rank) > 0
    assert sum(x["plan_unstaged_from_me"] for x in per_rank) > 0     # some copies go unstaged


def _run(mode: str, victim: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "stamp")
        out = spawn_partial(topology_workers.forwarder_failure, 4, mode, victim, T, stamp, timeout=90, pg_timeout=30)
        with open(stamp) as f:
            what, when = f.read().split()
    return {"outcomes": out, "event": what, "event_at": float(when)}


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_forwarder_failure_is_reported_by_every_rank(mode):
    victim = 2
    run = _run(mode, victim)
    assert run["event"] == ("died" if mode == "die" else "stalled")
    out = run["outcomes"]
    assert out[3]["ok"] and out[3]["result"]["forwards_to_me"], out[3]    # rank 3 waits for rank 2's forward
    print(f"forwarder {mode}: survivors raised after", {r: round(o["result"]["raised_at"] - run["event_at"], 2)
                                                      for r, o in out.items() if o["ok"] and r != victim})
    for rank, o in out.items():
        if rank == victim and mode == "die":
            assert not o["ok"] and o["exitcode"] == 17, o
            continue
        assert o["ok"], o["error"]
        res = o["result"]
        assert res["first_ok"] and res["first_version"] == 1 and res["received_before"]
        assert res["type"] == "TransferError", res
        assert res["src_untouched"] and res["state"]["interrupted"] and res["state"]["version"] == 1
        err = res["error"]
        assert "refit 2" in err and f"rank {rank}" in err, err
        if rank != victim:
            assert res["raised_at"] - run["event_at"] < 2 * T, (rank, err)
        if res["forwards_to_me"]:
            # the receiver of the forwarded bytes names the round and the forwarder
            assert res["round"] and f"plan round {res['forwards_to_me'][0]})" in err, err
            assert victim in res["peers"] and "receives from ranks [" in err and str(victim) in err, err
            assert ("timed out after" in err) if mode == "stall" else ("a peer died" in err or "posting" in err), err
            assert res["state"]["incomplete"], res["state"]
