"""The windowed executor on real gloo processes (one launch of 4: two senders, two receivers): a
streamed refit lands window by window, the receiver's memory for a window exists only during a
refit, the control messages are one per window plus one, and every failure -- a receiver's work
between windows, a refusal, ranks that ask for different windows -- reaches every rank."""
from __future__ import annotations

import pytest
import windowed_workers

from mcore_reshard.tools.launch import spawn

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def runs():
    return spawn(windowed_workers.cases, 4, timeout=300, pg_timeout=60)


def test_stream_lands_every_window_bit_exact_and_frees_its_memory(runs):
    windows = {r["stream"]["windows"] for r in runs}
    assert len(windows) == 1 and windows.pop() > 3
    for rank, r in enumerate(runs):
        s = r["stream"]
        assert s["staging"] <= s["budget"] == windowed_workers.BUDGET
        for i, ref in enumerate(s["refits"], start=1):
            assert ref["version"] == i and ref["bad"] == [], (rank, ref)
            # one refit start per window (no per-window confirmation) + the final exchange
            assert ref["exchanges"] == s["windows"] + 1, (rank, ref)
            if rank >= 2:
                assert ref["landed"] == s["windows"] and ref["held_during"] > 0 and ref["held_after"] == 0
        assert s["state"] == 2


def test_work_failing_between_windows_stops_every_rank(runs):
    for rank, r in enumerate(runs):
        f = r["work_fails"]
        assert f["error"] and "refit refused before any byte moved" in f["error"], (rank, f)
        assert "rank 3 refuses this refit: its work after window 1 failed: RuntimeError: processing failed" in f["error"]
        assert f["window2_untouched"] and f["window1_landed"] and f["version"] == 2


def test_work_failing_after_the_last_window_fails_every_rank(runs):
    for rank, r in enumerate(runs):
        e = r["last_fails"]["error"]
        assert e and "every window moved, but rank 2: its work after window" in e and "last processing failed" in e


def test_refusal_reaches_every_rank_before_any_byte(runs):
    for r in runs:
        e = r["refused"]["error"]
        assert e and "refit refused before any byte moved" in e and "a parameter was replaced" in e


def test_ranks_asking_different_windows_refused_everywhere(runs):
    for r in runs:
        e = r["mismatch"]["error"]
        assert e and "ranks ask for different windows: window_bytes=4096 on ranks [2]; window_bytes=8192 on ranks [3]" in e


def test_windowed_plans_of_different_windows_refused_by_hash(runs):
    for r in runs:
        e = r["hash"]["error"]
        assert e and "plan hashes differ between ranks" in e
