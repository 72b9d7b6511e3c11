"""Fault injection at every stage of a refit (issue #13): before the handshake, at the refit
start, in a round, during unpack, during the confirmation; on any rank; as an exception,
KeyboardInterrupt, a stall (3x the timeout), SIGSTOP (continued later) and SIGKILL.

Disaggregated tp=2 (ranks 0-1) -> tp=1 (rank 2), 2 KiB budget (dozens of rounds), gloo, the
executor's default ``timeout=None`` (the group's own timeout, T).  For every case:

* every survivor raises (``TransferError``; ``ReshardError`` naming the missing rank when the
  fault hits before the handshake) within 2T of the fault -- never a hang;
* ``state()`` on every rank, victim included, tells the truth: each buffer that claims refit v
  holds exactly refit v's bytes (checked by value), the others claim ``None``;
* the source weights are unchanged;
* ``rebind(new group)`` + ``refit()`` (no ``version=``) converges on every rank, bit-exact.

Non-lethal faults run one after another in one launch, each on fresh groups; each SIGKILL case is
its own launch.
"""
from __future__ import annotations

import os
import tempfile

import adversarial_workers
import pytest
from partial_launch import spawn_ok, spawn_partial

pytestmark = pytest.mark.multiproc

T = 2.0
STAGES = ["construct", "start", "round", "unpack", "confirm"]
KINDS = ["raise", "kbint", "stall", "sigstop"]
# every stage x every kind once; the victim rotates over the ranks (unpack: the receiving rank 2)
CASES = [(s, k, 2 if s == "unpack" else (i + j) % 3) for i, s in enumerate(STAGES) for j, k in enumerate(KINDS)]


@pytest.fixture(scope="module")
def non_lethal():
    """One 3-rank launch runs every non-lethal case in turn: per case, each rank's record."""
    results = spawn_ok(adversarial_workers.fault_cases, 3, CASES, T, timeout=600, pg_timeout=120)
    return [[results[rank][k] for rank in range(3)] for k in range(len(CASES))]


@pytest.mark.parametrize("k", range(len(CASES)), ids=[f"{s}-{k}-rank{v}" for s, k, v in CASES])
def test_non_lethal_faults_at_every_stage(non_lethal, k):
    stage, kind, victim = CASES[k]
    for rank in range(3):
        o = non_lethal[k][rank]
        assert o["case"] == [stage, kind, victim]
        where = (stage, kind, victim, rank)
        if rank != victim:
            if stage == "construct":
                assert o["type"] == "ReshardError", (where, o)
                assert f"ranks [{victim}] did not answer" in o["error"], (where, o["error"])
                delay = o["raised_at"] - o["t0"]
            else:
                assert o["type"] == "TransferError", (where, o)
                assert "refit 2" in o["error"], (where, o["error"])
                delay = o["raised_at"] - o["fault_at"] if o["fault_at"] else o["raised_at"] - o["t0"]
            assert delay < 2 * T + 0.5, (where, delay, o["error"])      # never a hang
        else:
            assert o["type"] in (None, "TransferError", "ReshardError", "RuntimeError", "KeyboardInterrupt"), (where, o)
            if o["type"] in ("RuntimeError", "KeyboardInterrupt"):     # only the injected fault itself, raw
                assert (kind, o["error"]) in (("raise", "injected fault"), ("kbint", "injected fault")), (where, o)
        if stage == "construct":
            continue
        st = o["state"]
        assert o["claims_true"], (where, st)                  # no buffer claims bytes it does not hold
        assert o["src_untouched"], where
        if o["type"] is not None:
            assert st["interrupted"] and st["version"] == 1, (where, st)
            assert set(st["buffers"].values()) <= {1, 2, None}, (where, st)
        assert o["recovered_version"] == 2 and o["recovered_exact"], (where, o["recovered_state"])
        assert not o["recovered_state"]["interrupted"] and not o["recovered_state"]["incomplete"], where


@pytest.mark.parametrize("stage,victim", [("start", 2), ("round", 1), ("unpack", 2), ("confirm", 0)])
def test_sigkill(stage, victim):
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "stamp")
        out = spawn_partial(adversarial_workers.killed, 3, stage, victim, T, stamp, timeout=120, pg_timeout=60)
        with open(stamp) as f:
            died_at = float(f.read())
    for rank, o in out.items():
        if rank == victim:
            assert not o["ok"] and o["exitcode"] == -9, o
            continue
        assert o["ok"], o["error"]
        res = o["result"]
        assert res["type"] == "TransferError", (rank, res)
        assert res["raised_at"] - died_at < 2 * T + 0.5, (rank, res["raised_at"] - died_at, res["error"])
        assert res["claims_true"], res["state"]
        assert res["state"]["interrupted"] and res["state"]["version"] == 1, res["state"]


# Issue 37 defect 9: a real SIGINT on one rank at a controlled point of a refit (before the refit start,
# right after it, in the local copies, mid-rounds, after the last round, before / after the confirmation),
# then the documented recovery as users run it -- every rank retries refit() at once on the same group,
# then rebind(fresh group) + refit() -- on the overlapped (gloo default) and batched paths, on a colocated
# pp=3 -> dp=3 plan where every rank sends, receives and copies locally.  (Exceptions, stalls, SIGSTOP
# and SIGKILL at every stage: the cases above.)  Seen here: interrupted before the refit start, the
# victim's retry joins its peers' refit (every rank succeeds, bit-exact); interrupted after its rounds,
# its retry's refit start meets the peers' confirmation (same size and collective number): every rank
# raises naming the steps; otherwise the peers time out and the same group refuses everything.
RETRY_CASES = [(stage, "sigint", 2, "overlapped")
               for stage in ("before_start", "start", "local", "round", "confirm", "after_confirm")]
RETRY_CASES += [("round", "sigint", 0, "batched"), ("last_round", "sigint", 1, "batched")]
LIBRARY = ("TransferError", "ReshardError")


@pytest.fixture(scope="module")
def interrupted():
    results = spawn_ok(adversarial_workers.interrupt_retry_cases, 3, RETRY_CASES, T, timeout=600, pg_timeout=120)
    return [[results[rank][k] for rank in range(3)] for k in range(len(RETRY_CASES))]


@pytest.mark.parametrize("k", range(len(RETRY_CASES)), ids=["-".join(map(str, c)) for c in RETRY_CASES])
def test_interrupted_then_retried_then_rebound(interrupted, k):
    """Every call that returns has written every destination byte of its version on that rank; a
    retry after an interruption repairs (bit-exact) or is refused with the library's error; no buffer
    ever claims bytes it does not hold; rebind + refit lands bit-exact everywhere."""
    stage, kind, victim, path = RETRY_CASES[k]
    for rank in range(3):
        o = interrupted[k][rank]
        assert o["case"] == [stage, kind, victim, path]
        where = (stage, kind, victim, path, rank)
        first = o["first"]
        if rank == victim:
            assert first["type"] in (None, {"sigint": "KeyboardInterrupt", "raise": "RuntimeError"}[kind]), (where, first)
        else:
            assert first["type"] in (None,) + LIBRARY, (where, first)
        for step in ("first", "retry", "rebind", "final"):
            c = o[step]
            assert c["claims_true"], (where, step, o["state"])
            if c["type"] is None and step != "rebind":
                assert c["exact"], (where, step, c)          # a refit that returned holds the new weights here
            elif step == "retry":
                assert c["type"] in LIBRARY, (where, c)    # else refused / failed with the library's error
        assert o["rebind"]["type"] is None and o["final"]["type"] is None, (where, o["rebind"], o["final"])
        assert o["final"]["exact"] and not o["state"]["interrupted"] and not o["state"]["incomplete"], (where, o["state"])
