"""The planner's first fit in C (``core.planner._cfit`` through :mod:`.fastfit`) against the Python
reference it replaces (``RoundFill``, ``placement._fit``): the same rounds item for item, the same
staging totals and message counts, the same choice between the two placement orders, and the same
plan hashes; refused inputs fall back to the Python, never to a wrong round."""
from __future__ import annotations

import os
import random
import shutil
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_roundfill import calls_st, plain_first_fit, random_templated

from mcore_reshard.core.planner import fastfit, make_plan
from mcore_reshard.core.planner import placement as P
from mcore_reshard.core.planner.packing import RoundFill

ck = fastfit.cfit
needs_c = pytest.mark.skipif(ck is None, reason="the C kernel is not built (no C compiler?)")


def test_the_kernel_is_built_where_a_compiler_is():
    # a silent fallback would keep every test green and every plan right, only slow: where a C
    # compiler is at hand (CI, dev machines), the kernel must have been built and loaded
    if os.environ.get("MCORE_RESHARD_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("MCORE_RESHARD_PURE_PYTHON is set")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the Python reference plans")
    assert ck is not None, "mcore_reshard.core.planner._cfit did not build or is stale: pip install -e . again"
    assert ck.VERSION == fastfit.VERSION


def c_runs(budget, calls):
    rounds, ks, cs = ck.fit_runs([c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls],
                                 [c[3] for c in calls], budget)
    return rounds, list(zip(ks, cs))


@needs_c
def test_fit_runs_by_hand():
    # budget 128; the 40 bytes do not fit beside rank 0's 100 (round 1), the 20 do; of the run of
    # 8 bytes x 5, 1 fits in round 0 (rank 0 at 120), 4 in round 1 (rank 0 at 40); a rank sending
    # to itself counts its bytes once (as the Python): 2 x 64 in round 0, the third in round 1
    calls = [(0, 1, 100, 1), (0, 2, 40, 1), (0, 1, 20, 1), (0, 1, 8, 5), (3, 3, 64, 3)]
    rounds, chunks = c_runs(128, calls)
    assert chunks == [(0, 1), (1, 1), (0, 1), (0, 1), (1, 4), (0, 2), (1, 1)]
    assert rounds == 2
    fill = RoundFill(128)
    want = []
    for s, d, n, c in calls:
        while c:
            k, got = fill.place(s, d, n, c)
            want.append((k, got))
            c -= got
    assert chunks == want


@needs_c
@settings(max_examples=300, deadline=None)
@given(calls=calls_st, budget=st.integers(64, 200))
def test_fit_runs_equals_roundfill_and_a_plain_first_fit(calls, budget):
    # every chunk as RoundFill places it (RoundFill: against a plain scan in test_planner_roundfill),
    # and single items as the plain scan of every round places them
    rounds, chunks = c_runs(budget, calls)
    fill = RoundFill(budget)
    want = []
    for s, d, n, c in calls:
        left = c
        while left:
            k, got = fill.place(s, d, n, left)
            want.append((k, got))
            left -= got
    assert chunks == want
    assert rounds == fill.rounds
    one_each = [(s, d, n, 1) for s, d, n, _ in calls]
    assert [ch for ch in c_runs(budget, one_each)[1]] == plain_first_fit(budget, one_each)


@needs_c
def test_fit_runs_refuses_what_it_cannot_place():
    for calls, budget in (([(0, 1, 0, 1)], 64), ([(0, 1, 65, 1)], 64), ([(0, 1, -8, 1)], 64),
                          ([(-1, 1, 8, 1)], 64), ([(0, 1 << 24, 8, 1)], 64), ([(0, 1, 8, -1)], 64)):
        with pytest.raises(fastfit.FALLBACK):
            c_runs(budget, calls)
    with pytest.raises(ValueError):
        ck.fit_runs([0], [1, 2], [8], [1], 64)
    assert c_runs(64, []) == (0, [])
    # one full-budget item a round, 2**40 of them: refused at 2**21 rounds, in moments, within memory
    with pytest.raises(OverflowError, match="2\\*\\*21 rounds"):
        c_runs(64, [(0, 1, 64, 1 << 40)])
    with pytest.raises(MemoryError, match="more than the kernel keeps"):
        c_runs(64, [(r, r + 1, 64, 1 << 20) for r in range(0, 1 << 12, 2)])


def python_place(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setattr(fastfit, "cfit", None)
        return P._place_counted(*args, **kw)


def same(got, want):
    assert got[0] == want[0] and got[1] == want[1] and got[2][2] == want[2][2]
    for i in (0, 1):                        # staging totals: the nonzero entries
        assert {k: v for k, v in got[2][i].items() if v} == {k: v for k, v in want[2][i].items() if v}


@needs_c
def test_templated_placement_equals_the_python_in_both_orders_and_the_rule(monkeypatch):
    # random templates and instances (colocated and disaggregated), each order alone and the
    # rule between them at several slacks: placement, rounds, staging totals and messages
    rng = random.Random(16)
    for case in range(300):
        apart = case % 2 == 0
        templates, instances = random_templated(rng, apart)
        budget = 16 * rng.randint(8, 16)
        monkeypatch.setattr(P, "WAVE_SLACK", rng.choice([1.0, 1.05, 1.1, 1.3, 2.0]))
        for waves in (None, True, False):
            same(P._place_counted(templates, instances, budget, waves=waves),
                 python_place(monkeypatch, templates, instances, budget, waves=waves))
        # the kernel's 128-bit keys (items too wide for 64 bits) place the same as its 64-bit ones
        lims = P._lims(templates, budget)
        level = {lim: lv for lv, lim in enumerate(lims)}
        tpls = [([s for s, _, _ in t.pairs], [d for _, d, _ in t.pairs], [level[budget - n] for _, _, n in t.pairs],
                 t.round_of, t.plan.rounds) for t in templates]
        insts = [(tid, ranks) for tid, _, ranks in instances]
        for waves in (True, False):
            args = (tpls, insts, [budget - lim for lim in lims], budget, waves, -1, 8)
            assert ck.place(*args, True) == ck.place(*args)


@needs_c
def test_templated_placement_falls_back_on_input_the_kernel_refuses(monkeypatch):
    # a rank past the kernel's range: the Python places it, the same as it always did
    from types import SimpleNamespace as NS
    t = NS(pairs=[(0, 1, 16), (1, 0, 32)], round_of=[0, 0], staged={0: 48, 1: 48}, senders={0, 1},
           receivers={0, 1}, plan=NS(rounds=1))
    insts = [(0, None, [3, 1 << 24])]
    with pytest.raises(fastfit.FALLBACK):
        ck.place([([0, 1], [1, 0], [1, 0], [0, 0], 1)], [(0, [3, 1 << 24])], [32, 16], 64, False, -1, (1 << 24) + 1)
    same(P._place_counted([t], insts, 64), python_place(monkeypatch, [t], insts, 64))
    for bad in ([([0, 1], [1, 0], [1, 0], [0, 0], 1)], [(0, [3])]),\
               ([([0, 1], [1, 0], [1, 2], [0, 0], 1)], [(0, [3, 5])]),\
               ([([0, 1], [1, 0], [1, 0], [0], 1)], [(0, [3, 5])]),\
               ([([0, 1], [1, 0], [1, 0], [0, 0], 1)], [(1, [3, 5])]):
        with pytest.raises(fastfit.FALLBACK):
            ck.place(*bad, [32, 16], 64, False, -1, 6)


@needs_c
def test_stop_gives_up_only_past_it():
    tpl = [([0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0], 1)]
    got = ck.place(tpl, [(0, [0, 1])], [48], 64, False, -1, 2)
    assert got[:4] == ([[0, 1, 2]], 3, 3, [0, 1])
    assert array("q", got[4]).tolist() == [48, 48, 48, 0, 0, 0] and array("q", got[5]).tolist() == [0, 0, 0, 48, 48, 48]
    assert ck.place(tpl, [(0, [0, 1])], [48], 64, False, 3, 2)[1] == 3
    assert ck.place(tpl, [(0, [0, 1])], [48], 64, False, 2, 2) is None


def small_layouts(colocated: bool):
    from mcore_reshard.sources.megatron_spec import ParallelSizes, megatron_layout
    from mcore_reshard.targets import dsv3_671b, vllm_layout
    cfg = dsv3_671b().with_(num_hidden_layers=10, first_k_dense_replace=1, n_routed_experts=16,
                            hidden_size=256, moe_intermediate_size=64, intermediate_size=512,
                            vocab_size=1024, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            num_nextn_predict_layers=0)
    src = megatron_layout(cfg, ParallelSizes(tp=2, pp=2, ep=4, etp=1, dp=4), "deepseek_v3", dtype="bfloat16")
    dst = vllm_layout(cfg, tp=4, dp=2, enable_expert_parallel=True, rank_offset=0 if colocated else 16)
    return src, dst


@needs_c
@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("templates", [True, False])
def test_whole_plans_hash_the_same_with_and_without_the_kernel(monkeypatch, colocated, templates):
    src, dst = small_layouts(colocated)
    budget = 1 << 20
    got = make_plan(src, dst, budget_bytes=budget, ignore_unused=True, templates=templates)
    monkeypatch.setattr(fastfit, "cfit", None)
    want = make_plan(src, dst, budget_bytes=budget, ignore_unused=True, templates=templates)
    assert got.rounds == want.rounds > 1
    assert got.stats == want.stats
    assert got.hash == want.hash


copies_st = st.lists(st.tuples(st.integers(1, 200), st.integers(0, 5), st.integers(0, 5)).filter(lambda c: c[0] != 0),
                     min_size=0, max_size=150)


@needs_c
@settings(max_examples=300, deadline=None)
@given(raw=copies_st, budget=st.integers(208, 400), split=st.booleans())
def test_fit_copies_places_as_the_python_first_fit(raw, budget, split):
    # copies (-bytes, src, dst, sequence number, the rest unused), split (sorted first) or not (grouped by
    # (-bytes, src, dst) in sequence order): the same (round, src, dst) -> copies, in the same order
    from mcore_reshard.core.planner import packing as R
    from mcore_reshard.core.planner.senders import Copies

    def make():
        from mcore_reshard.core.planner.records import PendingCopy
        out = Copies(PendingCopy(-n, s, d, "", (), (), i, *[None] * 7) for i, (n, s, d) in enumerate(raw))
        out.split = split
        return out
    got, _, rounds = R._first_fit_runs(make(), budget)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fastfit, "cfit", None)
        want, used, want_rounds = R._first_fit_runs(make(), budget)
    assert rounds == want_rounds
    assert list(got) == sorted(want) and {k: list(v) for k, v in got.items()} == {k: list(v) for k, v in want.items()}


@needs_c
def test_fit_copies_refuses_what_it_cannot_place():
    for copies in ([(-300, 0, 1)], [(0, 0, 1)], [(5, 0, 1)], [(-8, -1, 1)], [(-8, 0)], ["x"]):
        with pytest.raises(fastfit.FALLBACK):
            ck.fit_copies(copies, 256, 16)
    with pytest.raises(TypeError):
        ck.fit_copies([(-8, 0, "1")], 256, 16)
    assert ck.fit_copies([], 256, 16) == (0, [], [])


ints_st = st.integers(-3, 1 << 25) | st.sampled_from([0, 1, 2, 3, (1 << 24) - 1, 1 << 24, (1 << 63) - 1])


@needs_c
@settings(max_examples=400, deadline=None)
@given(tpls=st.lists(st.tuples(st.lists(ints_st, max_size=4), st.lists(ints_st, max_size=4),
                               st.lists(ints_st, max_size=4), st.lists(ints_st, max_size=4), ints_st), max_size=3),
       insts=st.lists(st.tuples(ints_st, st.lists(ints_st, max_size=5)), max_size=4),
       sizes=st.lists(ints_st, max_size=4), budget=ints_st, waves=st.booleans(), stop=ints_st, span=ints_st)
def test_the_kernel_refuses_garbage_and_never_crashes(tpls, insts, sizes, budget, waves, stop, span):
    # what reaches the kernel is the planner's own data, but a refusal must be an exception the
    # caller falls back on (or a plain TypeError / OverflowError of the arguments), never a crash,
    # a hang or a round past what it says; a result must be a first fit within the budget
    try:
        got = ck.place(tpls, insts, sizes, budget, waves, stop, span)
    except (ValueError, OverflowError, MemoryError, TypeError):
        return
    if got is None:
        return
    rows, rounds, messages, ranks, sent, received = got
    used = array("q", sent)
    recv = array("q", received)
    assert len(used) == len(recv) == rounds * len(ranks)
    assert all(0 <= u + v <= budget for u, v in zip(used, recv))
    assert all(0 <= k < rounds for row in rows for k in row)
    assert sum(map(len, rows)) >= messages * (messages > 0)


@needs_c
@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.tuples(ints_st, ints_st, ints_st, ints_st), max_size=6), budget=ints_st, align=ints_st)
def test_fit_runs_and_copies_refuse_garbage(runs, budget, align):
    for call in (lambda: ck.fit_runs(*zip(*runs), budget) if runs else ck.fit_runs([], [], [], [], budget),
                 lambda: ck.fit_copies([(-n, s, d) for n, s, d, _ in runs], budget, align)):
        try:
            got = call()
        except (ValueError, OverflowError, MemoryError, TypeError):
            continue
        assert got[0] >= 0
