"""The fault x collective-step matrix, generated: each collective step (group join, metadata exchange,
handshake, refit start, a round, confirmation, export write) x each fault (exception,
KeyboardInterrupt, SIGSTOP, late join; SIGKILL in launches of its own) on one rank of 2 gloo ranks,
the victim alternating between the ranks (tests/helpers/fault_matrix_workers.py).

The timeout adapts to the machine: each case first runs its step without a fault and times it
(``healthy_s``); the faulted run's group timeout is ``T = max(1 s, 3 x healthy_s)``, so the healthy
parts of a faulted run (group creation, a first refit, reading the model) never race the deadline,
and an idle machine still runs the matrix with ``T = 1 s``.

The survivor's outcome: ``raised`` -- an error of the library's own types (ReshardError,
TransferError, ...) within the step's deadline (``T`` + margin for a join / exchange / handshake,
``2T`` + margin for a refit or an export: a round's wait and the confirmation's; margin 2.5 s +
2 x ``healthy_s``), and for a refit no buffer claiming a version it does not hold, for an export the
directory holding exactly the export written before the fault; ``joined`` -- a late member the store
still admitted, both ranks holding the group (a join only); ``hang`` -- later than the deadline, or no
report; ``unclear`` -- another error type; ``silent`` -- it returned as if nothing happened.  Only
``raised`` and ``joined`` pass.

Non-lethal faults run in one launch whose every case writes its outcome as soon as it is over; a
launch that dies fails the case it died in, and the next launch goes on from the case after it.
SIGKILL runs one launch per step (set ``MCORE_RESHARD_FULL_FAULTS=1`` for every step; by default:
handshake, round, export write).  The counts fixture prints the tally (RELIABILITY.md, "Generated
contract suite").
"""
from __future__ import annotations

import os
import tempfile
import time

import fault_matrix_workers as fm
import pytest
import torch
from partial_launch import spawn_partial

pytestmark = pytest.mark.multiproc

MARGIN = 2.5
OWN = ("ReshardError", "TransferError", "PlanError", "LayoutError")
CASES = [(s, f, (i + j) % 2) for i, s in enumerate(fm.STEPS) for j, f in enumerate(fm.FAULTS)]
KILL_STEPS = fm.STEPS if os.environ.get("MCORE_RESHARD_FULL_FAULTS") else ["handshake", "round", "export_write"]
COUNTS_LABEL = "fault matrix"


def verdict(o: dict | None, step: str, victim: dict | None = None) -> str:
    if o is None or o.get("type") == "HarnessError":
        return "hang" if o is None else "harness"
    T = o["T"]
    bound = (T if step in ("join", "metadata", "handshake") else 2 * T) + MARGIN + 2 * o["healthy_s"]
    if o["elapsed"] > bound:
        return "hang"
    if o["type"] is None:       # a late member the group still admitted: fine if every rank joined alike
        return "joined" if victim is not None and victim["type"] is None else "silent"
    if not any(n in OWN for n in o["mro"]):
        return "unclear"
    if o.get("claims_true") is False or o.get("unchanged") is False:
        return "late"
    return "raised"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """``({k: [rank 0's outcome, rank 1's]}, {k: why the launch died in case k})``: one launch, relaunched
    from the next case if one dies."""
    outdir = str(tmp_path_factory.mktemp("fault_matrix"))
    t0, start, died = time.monotonic(), 0, {}
    while start < len(CASES):
        launch = spawn_partial(fm.matrix, 2, CASES, start, outdir, timeout=1200, pg_timeout=300)
        got = fm.collect(outdir, len(CASES))
        missing = next((k for k in range(start, len(CASES)) if k not in got), None)
        if missing is None:
            break
        died[missing] = "; ".join(f"rank {r}: exit code {o['exitcode']}: {(o['error'] or 'no report')[-800:]}"
                                  for r, o in launch.items() if not o["ok"]) or "the launch ended early"
        start = missing + 1
    got = fm.collect(outdir, len(CASES))
    Ts = [o["T"] for outs in got.values() for o in outs if "T" in o]
    print(f"\nfault matrix: {len(CASES)} cases in {time.monotonic() - t0:.1f} s, {len(died)} launch(es) died, "
          f"T {min(Ts, default=0):.1f}-{max(Ts, default=0):.1f} s")
    return got, died


@pytest.mark.parametrize("k", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_non_lethal(matrix, k, counts):
    got, died = matrix
    step, fault, victim = CASES[k]
    if k not in got:
        counts(step, fault, "hang")
        pytest.fail(f"the launch died in this case: {died.get(k)}")
    survivor = 1 - victim
    o, v_o = got[k][survivor], got[k][victim]
    assert o["case"] == [step, fault, victim]
    v = verdict(o, step, v_o if fault == "late" and step == "join" else None)
    counts(step, fault, v)
    assert v in ("raised", "joined"), (v, o, "victim:", v_o)
    if step == "export_write":
        assert o["unchanged"], o       # out_dir holds exactly the export written before the fault


@pytest.mark.parametrize("step", KILL_STEPS)
def test_sigkill(step, counts):
    victim = 1 if step != "export_write" else 0
    with tempfile.TemporaryDirectory() as tmp:
        out = spawn_partial(fm.killed_at, 2, step, victim, tmp, timeout=300, pg_timeout=120)
        assert not out[victim]["ok"] and out[victim]["exitcode"] == -9, out[victim]
        o = out[1 - victim]["result"] if out[1 - victim]["ok"] else None
        v = verdict(o, step)
        counts(step, "sigkill", v)
        assert v == "raised", (v, out[1 - victim])
        if step == "export_write":    # the writer died mid-export: the directory still loads the earlier export
            from transformers import AutoModelForCausalLM
            assert o["unchanged"], o
            model = AutoModelForCausalLM.from_pretrained(o["out_dir"]).eval()
            with torch.no_grad():
                logits = model(torch.tensor(o["tokens"])).logits.float()
            want = torch.tensor(o["logits"])
            assert float((logits - want).abs().max()) <= 1e-4 and torch.equal(logits.argmax(-1), want.argmax(-1))
