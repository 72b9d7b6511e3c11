"""The engine tests' launcher: file-store rendezvous, a stall killed whole with every rank's stack."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest
from rank_launch import run_ranks
from repo_paths import ENGINES_DIR

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {engines!r})
    import torch.distributed as dist
    from rank_launch import install_stack_dump, rendezvous
    install_stack_dump()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(sys.argv[1], f"pid{{rank}}"), "w") as f:
        f.write(str(os.getpid()))
    dist.init_process_group("gloo", init_method=rendezvous("world"), rank=rank, world_size=world)
    dist.barrier()
    if sys.argv[2] == "stall" and rank == 1:
        def waiting_forever():
            time.sleep(3600)
        waiting_forever()
    if sys.argv[2] == "fail" and rank == 0:
        raise SystemExit(3)
    dist.barrier()
""")


def _script(tmp_path) -> str:
    path = tmp_path / "rank.py"
    path.write_text(SCRIPT.format(engines=ENGINES_DIR))
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _pids(tmp_path, n: int) -> list[int]:
    return [int((tmp_path / f"pid{r}").read_text()) for r in range(n)]


def test_ranks_meet_through_file_stores(tmp_path):
    ranks = run_ranks([sys.executable, _script(tmp_path), str(tmp_path), "ok"], 3, dict(os.environ),
                      str(tmp_path / "run"), timeout=120)
    assert not ranks.stalled and ranks.returncodes == [0, 0, 0], [ranks.tail(r) for r in range(3)]


def test_a_stall_is_killed_whole_with_every_stack(tmp_path):
    ranks = run_ranks([sys.executable, _script(tmp_path), str(tmp_path), "stall"], 3, dict(os.environ),
                      str(tmp_path / "run"), timeout=20)
    assert ranks.stalled and ranks.returncodes == [None, None, None]
    assert "waiting_forever" in ranks.tail(1, 20000)          # the stalled rank's own frame
    assert "barrier" in ranks.tail(0, 20000)                  # its peers, waiting in the collective
    assert not [p for p in _pids(tmp_path, 3) if _alive(p)]


def test_a_failed_rank_ends_the_launch_before_its_timeout(tmp_path):
    ranks = run_ranks([sys.executable, _script(tmp_path), str(tmp_path), "fail"], 2, dict(os.environ),
                      str(tmp_path / "run"), timeout=600)
    assert ranks.returncodes[0] == 3 and ranks.seconds < 200
    assert not [p for p in _pids(tmp_path, 2) if _alive(p)]
