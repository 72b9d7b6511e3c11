"""Reliability, parts 2 and 3: failures during a transfer, no silent partial update.

Disaggregated synthetic model, tp=2 on ranks 0-1 -> tp=1 on rank 2, 2 KiB staging budget (dozens
of rounds), real gloo processes, ``timeout=T``.  Failures are injected from outside the library
(a wrapped ``batch_isend_irecv``):

* a peer dies (``os._exit``) mid-transfer or between refits, or stalls for 3T: every surviving
  rank raises TransferError naming the refit, the round and the peers within 2T of the event
  (measured against the time the victim stamped just before dying / stalling), and the source
  weights are unchanged (sha256 before/after);
* one rank raises half-way through its rounds: every rank raises; the destination's ``state()`` says
  which buffers hold which version and that the refit was interrupted; after ``rebind`` to a
  fresh group the next refit is bit-exact and the state is clean;
* ``verify=True``: a byte flipped in a received staging buffer makes every rank raise (the
  receiving rank names the tensor), and the retry on the same group repairs it.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import reliability_workers
from partial_launch import spawn_partial

pytestmark = pytest.mark.multiproc

T = 2.0   # the executor timeout used in these tests (seconds)


@pytest.fixture(scope="module")
def measured(request):
    """Seconds from each injected failure to each survivor's raise, as the tests below measured (and
    bounded) them; written to the terminal once the module's tests have run (RELIABILITY.md's numbers)."""
    found: dict = {}
    yield found
    if found:
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print(f"\nreliability transfer measurements (T = {T:.1f} s): "
                  f"{ {k: {r: round(v, 2) for r, v in d.items()} for k, d in found.items()} }")


def _run_failure(mode: str, victim: int, at_call: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "stamp")
        out = spawn_partial(reliability_workers.peer_failure, 3, mode, victim, at_call, T, stamp, timeout=90, pg_timeout=30)
        with open(stamp) as f:
            what, when = f.read().split()
    return {"outcomes": out, "event": what, "event_at": float(when)}


def _check_survivors(run, victim, mode):
    out = run["outcomes"]
    delays = {}
    for rank, o in out.items():
        if rank == victim and mode == "die":
            assert not o["ok"] and o["exitcode"] == 17, o
            continue
        assert o["ok"], o["error"]
        res = o["result"]
        assert res["first_ok"] and res["first_version"] == 1
        assert res["type"] == "TransferError", res
        assert res["src_untouched"], f"rank {rank}: source weights changed by a failed refit"
        assert res["state"]["interrupted"] and res["state"]["interrupted_version"] == 2
        assert res["state"]["version"] == 1
        err = res["error"]
        assert "refit 2" in err and f"rank {rank}" in err, err
        if res["round"]:   # failed inside a round: the message names it and its peers
            assert f"round {res['round']}/" in err and "sends to ranks" in err and "receives from ranks" in err, err
        else:              # finished its rounds, then the confirmation could not complete
            assert "final confirmation failed" in err or "did not complete everywhere" in err, err
        if rank != victim:
            delays[rank] = res["raised_at"] - run["event_at"]
            assert delays[rank] < 2 * T, (rank, delays[rank], err)
        if rank == 2:   # the destination: which buffers hold refit 1, 2, or nothing complete
            versions = set(res["state"]["buffers"].values())
            assert versions <= {1, 2, None} and None in versions, res["state"]
            assert res["state"]["incomplete"] == sorted(n for n, v in res["state"]["buffers"].items() if v is None)
    return delays


def test_peer_dies_mid_transfer(measured):
    run = _run_failure("die", victim=1, at_call=3)   # a source rank dies before its 3rd round
    delays = _check_survivors(run, 1, "die")
    dst = run["outcomes"][2]["result"]
    assert dst["round"] >= 3 and 1 in dst["peers"], dst["error"]   # its 3rd round that involves rank 1
    # depending on timing the loss shows while posting the round or while receiving from rank 1
    assert ("receiving from rank 1" in dst["error"] or "posting the round" in dst["error"]), dst["error"]
    assert "a peer died or closed its connection" in dst["error"], dst["error"]
    measured["die mid-transfer"] = delays


def test_peer_dies_between_refits(measured):
    run = _run_failure("die", victim=2, at_call=1)   # the destination dies before refit 2 posts anything
    measured["die between refits"] = _check_survivors(run, 2, "die")


def test_peer_stalls(measured):
    run = _run_failure("stall", victim=0, at_call=2)  # a source stalls 3T before its 2nd round
    delays = _check_survivors(run, 0, "stall")
    dst = run["outcomes"][2]["result"]
    assert dst["round"] == 2 and "timed out after" in dst["error"] and "receiving from rank 0" in dst["error"], dst["error"]
    assert abs(delays[2] - T) < 0.5 * T, delays   # the receiver gives up at the timeout, not later
    measured["stall"] = delays


def test_interrupted_refit_is_reported_and_repaired(measured):
    out = spawn_partial(reliability_workers.interrupt_and_retry, 3, T, timeout=120, pg_timeout=30)
    res = {}
    for rank, o in out.items():
        assert o["ok"], o["error"]
        res[rank] = o["result"]
    for rank, r in res.items():
        assert r["v1_exact"] and r["v1_state"]["version"] == 1
        # the injected failure: every rank raised, within the timeout (+ slack)
        assert r["interrupted_error"] is not None, rank
        assert r["interrupt_seconds"] < 2 * T, (rank, r["interrupt_seconds"])
        st = r["interrupted_state"]
        assert st["interrupted"] and st["interrupted_version"] == 2 and st["version"] == 1
        # the broken group refuses a retry without rebind, clearly
        assert "call rebind(new_group)" in r["same_group_retry"], r["same_group_retry"]
        # rebind + retry: bit-exact, clean state, source never modified
        assert r["retry_version"] == 2 and r["retry_exact"], rank
        assert r["retry_state"]["version"] == 2 and not r["retry_state"]["interrupted"]
        assert set(r["retry_state"]["buffers"].values()) <= {2} and not r["retry_state"]["incomplete"]
        assert r["src_untouched"]
        # verify mode
        assert r["verify_clean_exact"]
        assert r["corrupt_error"] is not None, rank
        assert r["corrupt_state"]["interrupted"] and r["corrupt_state"]["interrupted_version"] == 4
        assert r["verify_retry_exact"] and r["verify_retry_state"]["version"] == 4
        assert not r["verify_retry_state"]["interrupted"] and not r["verify_retry_state"]["incomplete"]
    dst = res[2]
    k = dst["fail_at"]
    assert f"round {k}/{dst['rounds']}" in dst["interrupted_error"], dst["interrupted_error"]
    assert f"injected failure before round {k}" in dst["interrupted_error"]
    assert dst["interrupted_round"] == k
    st = dst["interrupted_state"]
    assert st["failed_round"] == k
    versions = st["buffers"]
    # buffers whose last round landed hold refit 2; buffers whose rounds had begun hold nothing
    # complete (None); buffers not yet touched still hold refit 1
    # (which buffers already completed depends on how the plan packed rounds: 2 may be absent)
    assert None in versions.values() and set(versions.values()) <= {None, 1, 2}, versions
    assert st["incomplete"] == sorted(n for n, v in versions.items() if v is None)
    # the corrupted byte: the receiver names the tensor and the sender; the others hear about it
    assert "arrived with a different checksum than rank" in dst["corrupt_error"], dst["corrupt_error"]
    assert dst["corrupt_state"]["incomplete"], dst["corrupt_state"]
    for rank in (0, 1):
        assert "rank 2:" in res[rank]["corrupt_error"] and "different checksum" in res[rank]["corrupt_error"]
    measured["interrupt seconds"] = {r: x["interrupt_seconds"] for r, x in res.items()}

