"""A real SIGINT at arbitrary instants of a refit, then the documented recovery (issue 37 defect 9).

Three gloo ranks, colocated ``pp=3`` -> ``dp=3`` (rank 2 receives from ranks 0 and 1, sends to both
and copies locally; ~10 rounds of ~1 MiB).  Per trial: two refits land; the sources change; refit 2
runs and rank 2 gets ``os.kill(getpid(), SIGINT)`` from a timer thread at a fraction of a refit's
measured duration (spread over the whole refit: the signal surfaces wherever the interpreter is,
bookkeeping and ``finally`` blocks included); every rank retries ``refit()`` on the same group (at
once, or after the others gave up); the sources change again; ``rebind(fresh group)`` + ``refit()``.
Versions passed explicitly or left to the library; every wait bounded by ``Resharder(timeout=T)``
on groups of a long timeout (a collective whose wait timed out stays posted on the group) or by the
groups' own timeout ``T``::

    rank  | refit 2                   | retry, same group          | rebind + refit
    2     | KeyboardInterrupt         | repaired (bit-exact) or    | returns, bit-exact
    0, 1  | TransferError (or lands)  | refused with the library's | returns, bit-exact
                                        error

Asserted on every rank after every call: a call that returned holds exactly that phase's weights;
every buffer that claims a version holds exactly that version's bytes (``state()``).
"""
from __future__ import annotations

import pytest
import sigint_workers
from partial_launch import spawn_ok

pytestmark = pytest.mark.multiproc

T = 1.5
N = 10
LIBRARY = ("TransferError", "ReshardError")
# (fraction of the refit's duration, explicit versions, retry after the others gave up)
TRIALS = [((k + 0.5) / N, k % 2 == 0, k % 4 >= 2) for k in range(N)]


@pytest.fixture(scope="module")
def trials():
    """Both timeout kinds, one launch each: per trial, every rank's record."""
    out = []
    for group_timeout in (None, 60.0):
        res = spawn_ok(sigint_workers.sigint_trials, 3, TRIALS, T, 4, 1 << 20, group_timeout,
                       timeout=600, pg_timeout=120)
        out += [[res[rank][k] for rank in range(3)] + [group_timeout] for k in range(N)]
    return out


def test_a_returned_refit_wrote_every_byte_after_a_real_sigint(trials):
    interrupted = survivors_raised = 0
    for recs in trials:
        *ranks, group_timeout = recs
        victim = ranks[sigint_workers.VICTIM]
        first = victim["interrupted"]
        assert first["type"] in (None, "KeyboardInterrupt"), first
        interrupted += first["type"] == "KeyboardInterrupt" and not first.get("late")
        for rank, rec in enumerate(ranks):
            where = (rank, rec["fraction"], rec["explicit"], rec["wait"], group_timeout)
            assert rec["warm_ok"], where
            if rank != sigint_workers.VICTIM:
                assert rec["interrupted"]["type"] in (None,) + LIBRARY, (where, rec["interrupted"])
                survivors_raised += rec["interrupted"]["type"] == "TransferError"
            assert rec["retry"]["type"] in (None,) + LIBRARY, (where, rec["retry"])
            for step in ("interrupted", "retry", "final"):
                o = rec[step]
                if o["type"] is None:
                    assert o["exact"], (where, step, o["result"], o["state"])      # returned => every byte
                assert not o["bad_claims"], (where, step, o["bad_claims"], o["state"])
            assert rec["rebind"]["type"] is None, (where, rec["rebind"])
            final = rec["final"]
            assert final["type"] is None and final["exact"], (where, final)
            assert not final["state"]["interrupted"] and not final["state"]["incomplete"], (where, final["state"])
    # the signal did land inside refit 2 and the survivors did fail: the recovery was exercised
    assert interrupted >= len(trials) // 2, interrupted
    assert survivors_raised >= len(trials) // 2, survivors_raised
