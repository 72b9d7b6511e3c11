"""``RoundFill`` (the first fit under a per-rank budget that both planners use) against a plain
first fit that scans every round: the same (round, count) for every call, in any order of item
sizes (rising, falling, mixed: the waves order of templated placement makes lims fall)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_reshard.core.planner.packing import RoundFill


def plain_first_fit(budget: int, calls: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """The reference: each call's lowest round where both ranks have room for one item, as many
    items there as fit (at most ``count``), by scanning the rounds."""
    used: dict[int, list[int]] = {}
    out = []
    for s, d, n, count in calls:
        us, ud = used.setdefault(s, []), used.setdefault(d, [])
        k = 0
        while max(us[k] if k < len(us) else 0, ud[k] if k < len(ud) else 0) + n > budget:
            k += 1
        for u in (us, ud):
            u.extend([0] * (k + 1 - len(u)))
        cnt = min(count, (budget - max(us[k], ud[k])) // n)
        us[k] += cnt * n
        ud[k] += cnt * n
        out.append((k, cnt))
    return out


def run_fill(budget: int, calls) -> tuple[list[tuple[int, int]], dict]:
    fill = RoundFill(budget)
    got = [fill.place(s, d, n, c) for s, d, n, c in calls]
    return got, fill.used


def test_falling_and_rising_lims_by_hand():
    # budget 128: the 90-byte item makes rank 0's lim fall (108 -> 38: round 1, 40 bytes, leaves its
    # mask), the 8-byte one raise it again (rounds 0-2 back); the 60-byte one makes ranks 1 and 2 fall
    calls = [(0, 1, 100, 1), (0, 2, 40, 1), (0, 1, 20, 1), (0, 3, 90, 1), (0, 1, 8, 5), (2, 0, 28, 1),
             (1, 2, 60, 2)]
    got, used = run_fill(128, calls)
    assert got == [(0, 1), (1, 1), (0, 1), (2, 1), (0, 1), (1, 1), (1, 1)]
    assert got == plain_first_fit(128, calls)
    assert used[0] == [128, 68, 90] and used[1] == [128, 60] and used[2] == [0, 128] and used[3] == [0, 0, 90]


calls_st = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 64), st.integers(1, 6))
                    .filter(lambda c: c[0] != c[1]), min_size=1, max_size=120)


@settings(max_examples=300, deadline=None)
@given(calls=calls_st, budget=st.integers(64, 200))
def test_roundfill_equals_a_plain_first_fit(calls, budget):
    got, used = run_fill(budget, calls)
    assert got == plain_first_fit(budget, calls)
    assert all(x <= budget for u in used.values() for x in u)


@settings(max_examples=100, deadline=None)
@given(calls=calls_st, waves=st.integers(1, 4))
def test_roundfill_in_waves_of_falling_sizes(calls, waves):
    # the templated placement's waves order: largest first within each wave, sizes jump back up
    # at every wave boundary (the case the in-mask heap handles)
    order = sorted(calls, key=lambda c: (calls.index(c) % waves, -c[2]))
    assert run_fill(128, order)[0] == plain_first_fit(128, order)


def check_masks(fill: RoundFill) -> None:
    """Every mask a rank keeps, against its usage: the rounds over the level's lim, exactly."""
    for r, (u, index, keys, masks) in fill.state.items():
        assert u is fill.used[r] and keys == sorted(keys) and len(set(keys)) == len(keys) == len(masks)
        assert {lv: i for lv, i in enumerate(index) if i is not None} == {fill.levels[lim]: i for i, lim in enumerate(keys)}
        for lim, m in zip(keys, masks):
            assert m == sum(1 << k for k, x in enumerate(u) if x > lim), (r, lim, u)


def test_masks_follow_rising_and_falling_lims_by_hand():
    # budget 100, ranks 0 and 1 only: sizes 10, 30, 10, 60, 10 (lims 90, 70, 90, 40, 90: falling,
    # rising, falling...): every call's round and every mask after it by hand
    fill = RoundFill(100)
    got = []
    for n in (10, 30, 10, 60, 10):
        got.append(fill.place(0, 1, n, 1))
        check_masks(fill)
    assert got == [(0, 1), (0, 1), (0, 1), (1, 1), (0, 1)]
    assert fill.used[0] == [60, 60] and fill.lims == [90, 70, 40]
    u, index, keys, masks = fill.state[0]
    assert keys == [40, 70, 90] and index == [2, 1, 0]
    assert masks == [0b11, 0, 0]         # only lim 40 has rounds over it (60 > 40 in both)
    # a new lim (60: level 3, its mask from the usage): 60 + 40 = 100, round 0 full, one of three placed
    assert fill.place(0, 1, 40, 3) == (0, 1) and fill.used[0] == [100, 60]
    check_masks(fill)
    assert fill.state[0][2] == [40, 60, 70, 90] and fill.state[0][3] == [0b11, 0b1, 0b1, 0b1]
    assert fill.state[0][1] == [3, 2, 0, 1]


def test_levels_registered_ahead_are_kept_exact():
    # a level registered on a rank before anything lands, and one registered after (mask computed
    # from the usage): both kept exact, the same rounds as registering on first use
    a, b = RoundFill(64), RoundFill(64)
    for lim in (60, 48, 32):            # sizes 4, 16, 32
        a.level(lim)
    a.register(0, [0, 1, 2])
    calls = [(0, 1, 32, 1), (0, 1, 16, 1), (0, 2, 4, 3), (0, 1, 32, 1), (1, 0, 16, 2)]
    got = []
    for j, c in enumerate(calls):
        got.append(a.place(*c))
        if j == 2:
            a.register(2, [1, 0])
        check_masks(a)
    assert got == [b.place(*c) for c in calls] == plain_first_fit(64, calls)
    assert a.used == b.used


sizes_st = st.sampled_from([4, 8, 12, 16, 24, 32, 40, 64])


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), sizes_st, st.integers(1, 5))
                      .filter(lambda c: c[0] != c[1]), min_size=1, max_size=150),
       order=st.sampled_from(["given", "rising", "falling", "waves"]),
       ahead=st.lists(st.tuples(st.integers(0, 4), sizes_st), max_size=10))
def test_masks_exact_after_every_call_in_every_order(calls, order, ahead):
    # few sizes, so that levels come back: sizes rising (lims falling), falling (lims rising), in
    # waves of falling sizes (lims jump back down at each wave), or as drawn; some levels
    # registered ahead on some ranks; every mask checked after every call, the rounds against
    # the plain first fit
    if order == "rising":
        calls = sorted(calls, key=lambda c: c[2])
    elif order == "falling":
        calls = sorted(calls, key=lambda c: -c[2])
    elif order == "waves":
        calls = sorted(calls, key=lambda c: (calls.index(c) % 3, -c[2]))
    fill = RoundFill(64)
    for r, n in ahead:
        fill.register(r, [fill.level(64 - n)])
    got = []
    for c in calls:
        got.append(fill.place(*c))
        check_masks(fill)
    assert got == plain_first_fit(64, calls)
    assert all(x <= 64 for u in fill.used.values() for x in u)


def test_templated_first_fit_registers_every_level_ahead_or_fails_loudly():
    # the templated placement's fill registers each rank's levels ahead and reads masks without a
    # check: a level missing on a rank is an error (its mask None or none), never a wrong round
    from types import SimpleNamespace as NS

    import pytest

    from mcore_reshard.core.planner import placement as P
    t = NS(pairs=[(0, 1, 16), (1, 0, 32)], round_of=[0, 0], staged={0: 48, 1: 48}, senders={0, 1},
           receivers={0, 1}, plan=NS(rounds=1))
    insts = [(0, None, [3, 5])]
    lims, levels = P._levels([t], insts, 64)
    assert lims == [32, 48] and levels == {3: {0, 1}, 5: {0, 1}}
    bits = P._Bits(2, 1, 5, len(lims))
    items = sorted(P._items([t], insts, 64, bits, False, lims))
    placement, rounds, (sends, recvs, messages) = P._first_fit(items, [2], 64, bits, 6, lims, levels)
    assert placement == [[0, 0]] and rounds == 1 and messages == 2
    assert dict(sends) == {3: 16, 5: 32} and recvs == {3: 32, 5: 16}
    for broken in ({3: {0, 1}}, {3: {0, 1}, 5: {0}}):
        with pytest.raises((TypeError, IndexError)):
            P._first_fit(list(items), [2], 64, bits, 6, lims, broken)


def random_templated(rng, apart: bool):
    """Templates and instances as :mod:`.placement` reads them (a few ranks, sizes and rounds)."""
    from types import SimpleNamespace as NS
    templates = []
    for _ in range(rng.randint(1, 3)):
        pairs = []
        for _ in range(rng.randint(1, 12)):
            s, d = (rng.randint(0, 1), rng.randint(2, 3)) if apart else rng.sample(range(4), 2)
            pairs.append((s, d, 16 * rng.randint(1, 8)))
        staged: dict[int, int] = {}
        for s, d, n in pairs:
            staged[s] = staged.get(s, 0) + n
            staged[d] = staged.get(d, 0) + n
        nr = rng.randint(1, 3)
        templates.append(NS(pairs=pairs, round_of=[rng.randrange(nr) for _ in pairs], staged=staged,
                            senders={s for s, _, _ in pairs}, receivers={d for _, d, _ in pairs}, plan=NS(rounds=nr)))
    instances = []
    for _ in range(rng.randint(1, 8)):
        ranks = rng.sample(range(4), 2) + rng.sample(range(4, 8), 2) if apart else rng.sample(range(8), 4)
        instances.append((rng.randrange(len(templates)), None, ranks))
    return templates, instances


def test_both_orders_pausing_keep_the_placement_of_running_both(monkeypatch):
    # _place_counted's two orders, each fill paused once it can no longer be kept (and the first
    # resumed where the other needs more than the slack), against both orders run in full and the
    # rule applied: the first where within WAVE_SLACK x the fewest rounds, else the one with fewer
    # rounds (ties: the first); every outcome of the rule met
    import random

    from mcore_reshard.core.planner import placement as P
    rng = random.Random(15)
    seen = set()
    for case in range(400):
        apart = case % 2 == 0
        templates, instances = random_templated(rng, apart)
        budget = 16 * rng.randint(8, 16)
        slack = rng.choice([1.0, 1.05, 1.1, 1.3, 2.0])
        monkeypatch.setattr(P, "WAVE_SLACK", slack)
        most: dict[int, int] = {}
        for tid, _, ranks in instances:
            for j, v in templates[tid].staged.items():
                most[ranks[j]] = most.get(ranks[j], 0) + v
        fewest = -(-max(most.values()) // budget)
        first, second = (True, False) if apart else (False, True)
        one = P._place_counted(templates, instances, budget, waves=first)
        other = P._place_counted(templates, instances, budget, waves=second)
        if one[1] <= slack * fewest:
            want, why = one, "first within slack"
        elif other[1] < one[1]:
            want, why = other, "other fewer" + (" within slack" if other[1] <= slack * fewest else "")
        else:
            want, why = one, "first fewer or tied"
        got = P._place_counted(templates, instances, budget)
        assert got[:2] == want[:2] and got[2][2] == want[2][2], (case, why)
        assert {k: v for k, v in got[2][0].items() if v} == {k: v for k, v in want[2][0].items() if v}
        assert {k: v for k, v in got[2][1].items() if v} == {k: v for k, v in want[2][1].items() if v}
        seen.add((apart, why))
    assert seen == {(a, w) for a in (True, False) for w in ("first within slack", "other fewer", "other fewer within slack",
                                                             "first fewer or tied")}, seen
