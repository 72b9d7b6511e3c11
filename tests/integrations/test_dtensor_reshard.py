"""``mcore_reshard.reshard`` (DTensor in, DTensor out) on 4 gloo ranks, torch itself as the oracle.

Hypothesis draws the cases (derandomized, a bounded number) in the parent; ONE 4-process launch
runs them all (tests/helpers/dtensor_reshard_worker.py): meshes of 1-3 dims over disjoint, overlapping or
identical rank sets, Shard / _StridedShard / Replicate, uneven shapes, tensors of 1-4 dims, every
dtype, DTensors and rank-list ShardSpecs.  Every destination shard must equal torch's own split of
the full tensor, ``full_tensor()`` the full tensor, (same mesh) ``redistribute``'s result; bytes
on the wire must equal the planner's lower bound and the bytes torch says each rank lacks."""
from __future__ import annotations

from math import prod

import dtensor_reshard_worker as worker
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mcore_reshard.tools.launch import spawn

pytestmark = pytest.mark.multiproc

WORLD = 4


@st.composite
def meshes(draw, ranks=None):
    """(shape, row-major ranks) of a 1-3-D mesh over distinct ranks of 0..3 (``ranks``: exactly these)."""
    if ranks is None:
        size = draw(st.integers(1, WORLD))
        ranks = draw(st.permutations(range(WORLD)))[:size]
    size = len(ranks)
    ndim = draw(st.integers(1, 3))
    shape = []
    left = size
    for _ in range(ndim - 1):
        d = draw(st.sampled_from([f for f in range(1, left + 1) if left % f == 0]))
        shape.append(d)
        left //= d
    shape.append(left)
    return [shape, list(ranks)]


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 7)) for _ in range(ndim)]
    src = draw(meshes())
    relation = draw(st.sampled_from(["same", "identical_ranks", "disjoint", "any"]))
    rest = [r for r in range(WORLD) if r not in src[1]]
    if relation == "same":
        dst = [list(src[0]), list(src[1])]
    elif relation == "identical_ranks":
        dst = draw(meshes(ranks=draw(st.permutations(src[1]))))
    elif relation == "disjoint" and rest:
        dst = draw(meshes(ranks=draw(st.permutations(rest))[:draw(st.integers(1, len(rest)))]))
    else:
        dst = draw(meshes())
    place = st.one_of(st.just(["R"]), st.builds(lambda d: ["S", d], st.integers(0, ndim - 1)),
                      st.builds(lambda d, k: ["SS", d, k], st.integers(0, ndim - 1), st.integers(2, 3)))
    return {"shape": shape, "dtype": draw(st.sampled_from(sorted(worker.DTYPES))), "seed": draw(st.integers(0, 999)),
            "spec": draw(st.booleans()),
            "src": {"mesh": src, "placements": [draw(place) for _ in src[0]]},
            "dst": {"mesh": dst, "placements": [draw(place) for _ in dst[0]]}}


def draw_cases(n: int) -> list:
    out = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def collect(case):
        out.append(case)

    collect()
    names = sorted(worker.DTYPES)
    for i, case in enumerate(out):      # every dtype, whatever the first examples drew
        if i < len(names):
            case["dtype"] = names[i]
    return out


# edge cases drawn by hand: a 0-d tensor, a zero-size dim, a negative Shard dim over a permuted 2-D mesh
EDGE_CASES = [
    {"shape": [], "dtype": "float32", "seed": 1, "src": {"mesh": [[2], [0, 1]], "placements": [["R"]]},
     "dst": {"mesh": [[2, 2], [0, 1, 2, 3]], "placements": [["R"], ["R"]]}},
    {"shape": [0, 5], "dtype": "int64", "seed": 2, "src": {"mesh": [[4], [0, 1, 2, 3]], "placements": [["S", 0]]},
     "dst": {"mesh": [[2], [2, 3]], "placements": [["S", 1]]}},
    {"shape": [3, 5], "dtype": "float16", "seed": 3, "src": {"mesh": [[4], [0, 1, 2, 3]], "placements": [["S", 0]]},
     "dst": {"mesh": [[2, 2], [3, 2, 1, 0]], "placements": [["S", -1], ["SS", 0, 2]]}},
]
CASES = draw_cases(48) + EDGE_CASES


@pytest.fixture(scope="module")
def results():
    return spawn(worker.run_cases, WORLD, CASES, timeout=400, pg_timeout=120)


def test_cases_cover_the_space():
    relations = {("same" if c["src"]["mesh"] == c["dst"]["mesh"] else
                  "disjoint" if not set(c["src"]["mesh"][1]) & set(c["dst"]["mesh"][1]) else
                  "identical" if set(c["src"]["mesh"][1]) == set(c["dst"]["mesh"][1]) else "overlap") for c in CASES}
    assert relations == {"same", "disjoint", "identical", "overlap"}
    kinds = {p[0] for c in CASES for s in ("src", "dst") for p in c[s]["placements"]}
    assert kinds == {"R", "S", "SS"}
    assert {len(c["src"]["mesh"][0]) for c in CASES} == {1, 2, 3}
    assert {len(c["shape"]) for c in CASES} == {0, 1, 2, 3, 4}
    assert len({c["dtype"] for c in CASES}) == len(worker.DTYPES)
    assert any(c["shape"][0] % prod(c["src"]["mesh"][0]) for c in CASES)      # uneven shards


def _case_id(i: int, c: dict) -> str:
    return f"{i:02d}-{c['dtype']}-{'x'.join(map(str, c['shape'])) or 'scalar'}"


by_case = pytest.mark.parametrize("i", range(len(CASES)), ids=[_case_id(i, c) for i, c in enumerate(CASES)])


@by_case
def test_every_destination_equals_torch(results, i):
    case, rows = CASES[i], [r[i] for r in results]
    assert all(row["ok"] for row in rows), (case, rows)
    assert all(row.get("full_ok", True) for row in rows), (case, rows)
    assert all(row.get("redistribute_ok", True) for row in rows), (case, rows)


@by_case
def test_bytes_equal_the_lower_bound(results, i):
    case, rows = CASES[i], [r[i] for r in results]
    needed = sum(row["needed"] for row in rows)
    assert rows[0]["network"] == rows[0]["lower_bound"] == needed, (case, rows)


@by_case
def test_second_call_reuses_the_binding(results, i):
    assert all(r[i]["reused"] == [False, True] or r[i]["reused"] == [True, True] for r in results), CASES[i]


def test_first_call_binds(results):
    assert all(r[0]["reused"] == [False, True] for r in results)


def test_same_mesh_cases_were_compared_with_redistribute(results):
    compared = sum(1 for i in range(len(CASES)) for r in results if "redistribute_ok" in r[i])
    assert compared >= 4


def test_grouped_calls_are_one_refit_with_the_bytes_of_the_dict_call():
    cases = CASES[:12]
    out = spawn(worker.grouped, WORLD, cases, timeout=200, pg_timeout=120)
    for r in out:
        assert r["ok"] and r["ok_whole"], r
        assert r["tensors"] == len(cases)
        assert r["hash"] == r["whole_hash"] and r["network"] == r["whole_network"]


def test_subgroup_ranks_are_group_ranks():
    out = spawn(worker.subgroup, WORLD, timeout=200, pg_timeout=120)
    assert out[0] == {"skipped": True}
    for r in out[1:]:
        assert r["ok"] and r["ok_spec"], r
        assert r["plan_ranks"] == [0, 1, 2]          # global ranks 1-3 as ranks of the subgroup
        assert r["network"] == 6 * 4 * 4             # the whole tensor reaches the one destination rank


def test_bad_input_is_refused_on_every_rank():
    out = spawn(worker.refusals, WORLD, timeout=200, pg_timeout=120)
    expected = [
        ("source global shape (8, 6)", "destination global shape (8, 5)"),
        ("source dtype float32", "destination dtype bfloat16"),
        ("Partial(sum)", "'tensor'", "[0, 1]"),
        ("ranks describe it differently", "ranks [3]", "(8, 7)"),
        ("rank 2", "local shard of shape (8, 2)", "(8, 3)"),
        ("rank 1", "DTensor or a ShardSpec", "Tensor"),
        ("rank 0", "KeyError", "boom"),
        ("rank 1", "version=-1"),
        ("mesh ranks [3] pass no local shard",),
        None,       # the tracked mapping, nothing replaced yet: lands
        ("rank 3: dst", "w (model: w) was replaced by another tensor object after binding", "read them again"),
    ]
    for k, needles in enumerate(expected):
        for rank, rows in enumerate(out):
            row = rows[k]
            if needles is None:
                assert row["error"] is None, (k, rank, row)
                continue
            assert row["error"] == "ReshardError", (k, rank, row)
            assert row["untouched"], (k, rank, row)
            for n in needles:
                assert n in row["text"], (k, rank, n, row["text"])
    assert all(rows[len(expected)]["works"] for rows in out)
    for rank, rows in enumerate(out[:3]):
        last = rows[-1]
        assert last["error"] == "ReshardError" and last["seconds"] < 11, last
        assert "[3]" in last["text"], last["text"]


def test_benchmark_smoke():
    """benchmarks/dtensor_bench.py on 3 tiny tensors: every way bit-exact, bytes at the lower bound (exit 0)."""
    import os
    import subprocess
    import sys

    from repo_paths import ROOT as root
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "dtensor_bench.py"), "--tensors", "3",
                          "--rows", "8", "--cols", "6", "--reps", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| same mesh |" in run.stdout and "| disjoint meshes |" in run.stdout
