"""The executor's pipelining (issue #16): local copies while the first round's bytes travel, the
batched (NCCL-style) path chunked into grouped ``batch_isend_irecv`` calls, a bounded number of
copy calls per message, and a peer that dies in a later chunk.  Real gloo processes; what the
executor posted is recorded from the outside (tests/helpers/pipeline_workers.py)."""
from __future__ import annotations

import os
import tempfile

import pipeline_workers as pw
import pytest
from partial_launch import spawn_partial

from mcore_reshard.tools.launch import spawn

pytestmark = pytest.mark.multiproc


def ref_windows(n: int, lo: int = pw.CHUNK_MIN, hi: int = pw.CHUNK_MAX) -> list[tuple[int, int]]:
    """Independent reference of the batched path's chunk windows: lo, 2 lo, ... capped at hi."""
    out, at, size = [], 0, lo
    while at < n:
        out.append((at, min(n, at + size)))
        at, size = at + size, min(hi, 2 * size)
    return out or [(0, 0)]


def ref_parts(sizes: list[int], direct_min: int) -> list[tuple[int, int]]:
    """(start, length) of each operation of a message: entries >= direct_min alone, runs of smaller ones together."""
    out, at, run = [], 0, None
    for s in sizes:
        if s >= direct_min:
            if run:
                out.append(tuple(run))
                run = None
            out.append((at, s))
        elif run:
            run[1] += s
        else:
            run = [at, s]
        at += s
    if run:
        out.append(tuple(run))
    return out


def expected_batched(messages, verify: bool, small: bool) -> list[list[int]]:
    """Per round of a rank, the number of operations in each batch_isend_irecv it must post."""
    lo, hi, dmin = (pw.CHUNK_MIN, pw.CHUNK_MAX, pw.DIRECT_MIN) if small else (1 << 20, 16 << 20, 256 << 10)
    out = []
    for _, msgs in messages:
        per_group: dict[int, int] = {}
        for _, _, nbytes, sizes in msgs:
            n = nbytes + (16 * len(sizes) if verify else 0)
            wins = ref_windows(n, lo, hi)
            if verify:
                groups = list(range(len(wins)))
            else:
                # each operation goes in the window its first byte falls in; empty windows are skipped
                wk = [next(k for k, (a, b) in enumerate(wins) if a <= s < b) for s, _ in ref_parts(sizes, dmin)]
                groups = [sorted(set(wk)).index(k) for k in wk]
            for g in groups:
                per_group[g] = per_group.get(g, 0) + 1
        out.append([per_group[g] for g in sorted(per_group)])
    return out


def _posts(log):
    return [len(e[1]) for e in log if e[0] == "post"]


PATH_CASES = [("tp=2,pp=2", "tp=4", True, 16384, True),         # local copies + 14 rounds + chunks
              ("tp=2,pp=2", "tp=4", True, 256 << 20, False)]    # default constants
PATH_IDS = ["small-constants-budget16384", "default-constants"]
by_case = pytest.mark.parametrize("case", range(len(PATH_CASES)), ids=PATH_IDS)


@pytest.fixture(scope="module")
def paths():
    """One 4-rank launch for both cases: per rank, per case, every path's record."""
    return spawn(pw.pipeline_paths, 4, PATH_CASES, timeout=400)


@by_case
def test_pipelined_paths_are_bit_exact(paths, case):
    for rank, per_rank in enumerate(paths):
        res = per_rank[case]
        for name, p in res["paths"].items():
            assert p["overlapped"] == name.startswith("overlapped"), (name, p["overlapped"])
            assert p["mismatched"] == 0 and p["same_storage"] and p["same_staging"], (case, rank, name)
            assert p["state_version"] == 2 and p["buffers"] == [2] and p["incomplete"] == [], (case, rank, name, p)
        st = {n: p["staging"] for n, p in res["paths"].items()}
        assert st["overlapped"] == st["batched"] <= st["overlapped_verify"] == st["batched_verify"], st


def test_the_small_constants_case_has_local_copies_rounds_and_chunks(paths):
    """The first case really has local copies, several rounds and chunked messages."""
    first = [r[0] for r in paths]
    assert sum(r["local_copies"] for r in first) > 0 and max(len(r["messages"]) for r in first) > 5
    assert max(len(ref_windows(n)) for r in first for _, ms in r["messages"] for *_, n, _ in ms) > 5


@by_case
def test_batched_path_posts_the_planned_chunks(paths, case):
    """Every round of every rank posts exactly the groups derived from the plan (both ends agree by
    construction); with the default constants a round of messages < 1 MiB is ONE grouped call with
    one operation per message (as before chunking)."""
    small = PATH_CASES[case][-1]
    for rank, per_rank in enumerate(paths):
        res = per_rank[case]
        for verify in (False, True):
            log = res["paths"]["batched_verify" if verify else "batched"]["log"]
            want = expected_batched(res["messages"], verify, small)
            assert _posts(log) == [n for rnd in want for n in rnd], (case, rank, verify)
            assert not any(e[0] == "isend" for e in log)
            if not small:
                assert want == [[len(ms)] for _, ms in res["messages"]], (rank, want)


@by_case
def test_overlapped_path_operation_count(paths, case):
    """gloo overlapped: one batch_isend_irecv per round (every receive + the first send), every
    other send its own isend: receives and sends each one operation per part."""
    small = PATH_CASES[case][-1]
    dmin = pw.DIRECT_MIN if small else 256 << 10
    for rank, per_rank in enumerate(paths):
        res = per_rank[case]
        log = res["paths"]["overlapped"]["log"]
        parts = [(sum(len(ref_parts(s, dmin)) for _, send, _, s in ms if send),
                  sum(len(ref_parts(s, dmin)) for _, send, _, s in ms if not send)) for _, ms in res["messages"]]
        assert _posts(log) == [nr + (1 if ns else 0) for ns, nr in parts], (case, rank)
        assert sum(1 for e in log if e[0] == "isend") == sum(max(0, ns - 1) for ns, _ in parts)


@by_case
def test_local_copies_run_after_the_first_post_in_bounded_calls(paths, case):
    """The local copies start only once the first round is posted (the wire does not wait for
    them), in one copy call per slice of ~4 MiB (here: one), and packing / unpacking takes at most
    one copy call per operation, far fewer than there are entries."""
    for rank, per_rank in enumerate(paths):
        res = per_rank[case]
        for name in ("overlapped", "batched"):
            log = res["paths"][name]["log"]
            kinds = [e[0] for e in log]
            if res["local_copies"] and res["messages"]:
                assert "local" in kinds and kinds.index("post") < kinds.index("local"), (rank, name, kinds[:6])
            assert sum(e[1] for e in log if e[0] == "local") == res["local_copies"]
            assert kinds.count("local") == (1 if res["local_copies"] else 0)
            ops = sum(len(e[1]) for e in log if e[0] == "post") + kinds.count("isend")
            assert kinds.count("copy") <= ops and sum(e[1] for e in log if e[0] == "copy") <= res["entries"]
            if case == 1 and res["entries"] > 40:   # default constants: one copy call per message side
                assert kinds.count("copy") <= res["entries"] / 4, (rank, name, kinds.count("copy"), res["entries"])


def test_peer_dies_in_a_later_chunk():
    """Batched path, chunked: the victim dies at its 3rd grouped call (a later chunk of its first
    round): the destination raises TransferError naming round 1 and the dead peer within 2 T."""
    T = 2.0
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "stamp")
        out = spawn_partial(pw.dies_in_later_chunk, 3, 1, 3, T, stamp, timeout=90, pg_timeout=30)
        with open(stamp) as f:
            died_at = float(f.read())
    assert not out[1]["ok"] and out[1]["exitcode"] == 17, out[1]
    for rank in (0, 2):
        assert out[rank]["ok"], out[rank]["error"]
        res = out[rank]["result"]
        assert res["type"] == "TransferError", res
        assert res["raised_at"] - died_at < 2 * T, (rank, res["raised_at"] - died_at)
        print(f"rank {rank} raised {res['raised_at'] - died_at:.2f} s after the victim died")
        assert res["state"]["interrupted"] and res["state"]["interrupted_version"] == 2, res["state"]
    dst = out[2]["result"]
    assert dst["groups_round1"] >= 4 and dst["first_plan_round"] == 0, dst
    assert dst["round"] == 1 and 1 in dst["peers"], dst
    assert "refit 2: round 1/" in dst["error"] and "rank 2" in dst["error"], dst["error"]
    assert "receiving from rank 1" in dst["error"] or "posting the round" in dst["error"], dst["error"]
    assert None in dst["state"]["buffers"].values(), dst["state"]
