"""mcore_reshard.tools.launch: every rank's outcome comes back from ``launch`` (returned, raised, died),
and ``spawn`` raises naming each failing rank and each rank that never reported."""
import os

import pytest

from mcore_reshard.tools.launch import RankOutcome, launch, spawn

pytestmark = pytest.mark.multiproc


def times_ten(rank: int, world: int) -> int:
    return rank * 10


def mixed(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    if rank == 2:
        os._exit(3)
    return rank


def test_launch_reports_every_rank_and_spawn_names_the_failures():
    out = launch(mixed, 3, timeout=120, pg_timeout=60, leave_at_once=True)
    assert out[0] == RankOutcome(ok=True, result=0, error=None, exitcode=0)
    assert not out[1].ok and out[1].result is None and out[1].exitcode == 0
    assert out[1].error.rstrip().endswith("ValueError: rank 1 refuses"), out[1].error
    assert out[2] == RankOutcome(ok=False, result=None, error=None, exitcode=3)
    with pytest.raises(RuntimeError, match=r"^1 rank\(s\) failed; ranks \[2\] never reported \(exit codes \{2: 3\}\)") as e:
        spawn(mixed, 3, timeout=120, pg_timeout=60)
    assert "--- rank 1 ---" in str(e.value) and "ValueError: rank 1 refuses" in str(e.value)
    assert spawn(times_ten, 2, timeout=120) == [0, 10]
