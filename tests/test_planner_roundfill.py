"""``RoundFill`` (the first fit under a per-rank budget that both planners use) against a plain
first fit that scans every round: the same (round, count) for every call, in any order of item
sizes (rising, falling, mixed: the waves order of templated placement makes lims fall)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from mcore_reshard.core.planner.rounds import RoundFill


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
