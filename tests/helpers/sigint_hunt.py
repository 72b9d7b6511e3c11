"""Hunt for a refit that returns without every byte after a SIGINT (issue 37 defect 9): runs
:func:`sigint_workers.sigint_trials` in 3-rank gloo launches and prints every violation.

    python tests/helpers/sigint_hunt.py n=40 launches=3 how="'signal'" scale=8 T=1.5 gto=60.0
    python tests/helpers/sigint_hunt.py n=40 how="'opcode'" scale=1 budget=65536

``how``: "signal" (a real SIGINT from a timer thread at fraction ``k/n`` of a refit's duration,
jittered) or "opcode" (KeyboardInterrupt raised at the k-th bytecode instruction the victim runs in
the library, torch.distributed and contextlib: every point a signal can surface at, and more).
``gto``: groups of that timeout with ``Resharder(timeout=T)`` (else groups of timeout ``T``).
A violation: a call that returned whose rank does not hold exactly that phase's weights, a buffer
whose recorded version is not what it holds, or a rebind / final refit that did not land.
"""
from __future__ import annotations

import ast
import collections
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sigint_workers  # noqa: E402
from partial_launch import spawn_partial  # noqa: E402


def violations(recs: list) -> list[str]:
    """What broke the guarantee in one trial (every rank's record)."""
    problems = []
    for rank, rec in enumerate(recs):
        for step in ("interrupted", "retry", "final"):
            o = rec[step]
            if o["type"] is None and not o["exact"]:
                problems.append(f"rank {rank} {step} returned {o.get('result')} without every byte")
            if o.get("bad_claims"):
                problems.append(f"rank {rank} {step}: buffers claim bytes they do not hold {o['bad_claims'][:3]}")
        for step in ("rebind", "final"):
            if rec[step]["type"] is not None:
                problems.append(f"rank {rank} {step} raised {rec[step]['type']}: {rec[step].get('error', '')[:200]}")
    return problems


def main(n=20, launches=1, seed=0, T=1.5, scale=4, budget=1 << 20, how="signal", gto=None, wait_modes=(False, True)):
    rng = random.Random(seed)
    kinds, bad, total = collections.Counter(), 0, 0
    for launch_no in range(launches):
        trials = [((k + rng.random()) / n, rng.random() < 0.5, rng.choice(wait_modes), how) for k in range(n)]
        t0 = time.time()
        out = spawn_partial(sigint_workers.sigint_trials, 3, trials, T, scale, budget, gto,
                            timeout=n * (6 * T + 20) + 60, pg_timeout=120)
        failed = {r: o for r, o in out.items() if not o["ok"]}
        if failed:
            print("launch failed:", {r: (o["exitcode"], (o["error"] or "")[-1500:]) for r, o in failed.items()})
            continue
        print(f"launch {launch_no}: {n} trials in {time.time() - t0:.0f} s", flush=True)
        for k in range(n):
            recs = [out[r]["result"][k] for r in range(3)]
            total += 1
            v = recs[sigint_workers.VICTIM]
            first = v["interrupted"]
            kinds[(first["type"], bool(first.get("late")), (first.get("where") or "").split(" ")[-1],
                   recs[0]["interrupted"]["type"], v["retry"]["type"], recs[0]["retry"]["type"])] += 1
            problems = violations(recs)
            if problems:
                bad += 1
                print("VIOLATION", json.dumps({x: v[x] for x in ("fraction", "explicit", "wait", "dur")}), problems)
                for rank, rec in enumerate(recs):
                    print(f"  rank {rank}", {s: {x: rec[s].get(x) for x in ("type", "result", "exact", "where", "error")}
                                             for s in ("interrupted", "retry", "final")})
    print("outcomes (victim's refit 2, landed after it returned, where, rank 0's refit 2, victim's retry, rank 0's retry):")
    for key, c in kinds.most_common():
        print(f"  {c:4d} {key}")
    print(f"trials {total} violations {bad}")
    return bad


if __name__ == "__main__":
    kw = {a.split("=")[0]: ast.literal_eval(a.split("=", 1)[1]) for a in sys.argv[1:]}
    sys.exit(1 if main(**kw) else 0)
