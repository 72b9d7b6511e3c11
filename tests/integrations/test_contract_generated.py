"""The contract suite, generated from a table (tests/helpers/contract_cases.py): each public argument of the
core APIs (``make_plan``, ``Plan.from_json``, ``Resharder`` construction / ``refit`` / ``rebind`` /
``state``, ``MegatronRefit``'s numbers) x each class of bad value (wrong type, NaN / inf,
negative, huge, empty, aliasing, wrong device, DTensor, inference tensor, rebound after bind).

Every case is its own test and must be ``refused`` (the library's own error types, or a
ValueError / TypeError naming the argument, before a destination byte changed) or ``ok`` (a
correct result: bit-exact destination, a plan that validates).  A raw KeyError / IndexError /
AttributeError or torch error, a refusal after bytes changed, or a wrong result fails it.  The
Resharder cases run in one 2-rank gloo launch; the ``counts`` fixture prints the outcome counts per
API once the module has run (the table in RELIABILITY.md, "Generated contract suite").
"""
from __future__ import annotations

import json
import math

import contract_cases as cc
import pytest
from partial_launch import spawn_ok

COUNTS_LABEL = "generated contract suite"     # the counts fixture (tests/conftest.py) heads its summary with it


@pytest.fixture(scope="module")
def resharder_results():
    return spawn_ok(cc.resharder_cases, 2, timeout=300, pg_timeout=60)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", cc.RESHARDER_TABLE, ids=lambda c: "-".join(c))
def test_resharder(resharder_results, counts, case):
    api, arg, kind = case
    key = "|".join(case)
    verdicts = {cc.judge(r[key], arg) for r in resharder_results}
    counts(api, "/".join(sorted(verdicts)))
    assert "DEFECT" not in verdicts, [r[key] for r in resharder_results]
    assert len(verdicts) == 1, ("ranks disagree", [r[key] for r in resharder_results])


# ------------------------------------------------------------------------------------- in process

def _layouts():
    from mcore_reshard.tools.demo import build_layouts
    return build_layouts("tp=2", "tp=1,dp=2", True)


PLAN_ARGS = ([("src", k) for k in ("none", "string", "int", "dst_for_src")]
             + [("dst", k) for k in ("none", "string", "empty_layout")]
             + [("budget_bytes", k) for k in ("nan", "inf", "negative", "zero", "string", "bool", "float", "huge", "none")]
             + [("allow_cast", k) for k in ("string", "none")]
             + [("templates", k) for k in ("string", "int")]
             + [("topology", k) for k in ("string", "negative", "zero")])


def _plan_value(arg, kind, src, dst):
    from mcore_reshard.core.layout import Layout
    if arg in ("src", "dst"):
        return {"none": None, "string": "layout", "int": 3, "dst_for_src": dst, "empty_layout": Layout()}[kind]
    if arg == "budget_bytes":
        return {"nan": math.nan, "inf": math.inf, "negative": -4096, "zero": 0, "string": "4096", "bool": True,
                "float": 4096.0, "huge": 1 << 70, "none": None}[kind]
    if arg == "allow_cast":
        return {"string": "no", "none": None}[kind]
    if arg == "templates":
        return {"string": "sometimes", "int": 7}[kind]
    return {"string": "nvlink", "negative": -1, "zero": 0}[kind]


@pytest.mark.parametrize("case", PLAN_ARGS, ids=lambda c: "-".join(c))
def test_make_plan(counts, case):
    from mcore_reshard.core.planner import make_plan, validate_plan
    arg, kind = case
    src, dst = _layouts()
    kw = {"src": src, "dst": dst, "budget_bytes": 1 << 16}
    kw[arg] = _plan_value(arg, kind, src, dst)

    def run():
        plan = make_plan(kw.pop("src"), kw.pop("dst"), **kw)
        problems = [p for r in plan.ranks for p in validate_plan(plan, r, limit=3)]
        assert not problems, problems
        return plan.rounds
    o = cc.record(run)
    verdict = cc.judge(o, arg)
    counts("make_plan", verdict)
    assert verdict != "DEFECT", o


def _json_cases():
    """Plan JSON broken one field at a time: each key missing / of the wrong type, entries of the wrong arity."""
    out = [("document", k) for k in ("none", "list", "string", "empty")]
    for key in ("version", "tensors", "buffers", "budget_bytes", "rounds", "messages", "local_copies", "padding",
                "stats"):
        out += [(key, "missing"), (key, "wrong_type")]
    out += [(f, k) for f in ("messages.entry", "local_copies.entry", "padding.entry")
            for k in ("short", "long", "wrong_type")]
    out += [("messages.entry", "missing_key"), ("templated", "missing_templates"), ("templated", "short_instance")]
    return out


JSON_CASES = _json_cases()


@pytest.mark.parametrize("case", JSON_CASES, ids=lambda c: "-".join(c))
def test_plan_from_json(counts, case):
    from mcore_reshard.core.planner import Plan, make_plan
    field, kind = case
    src, dst = _layouts()
    plan = make_plan(src, dst, budget_bytes=4096, templates=field == "templated")
    pj = json.loads(plan.dumps())
    if field == "document":
        pj = {"none": None, "list": [], "string": "plan", "empty": {}}[kind]
    elif field == "templated":
        if kind == "missing_templates":
            del pj["templates"]
        else:
            pj["instances"][0] = pj["instances"][0][:1]
    elif "." not in field:
        if kind == "missing":
            del pj[field]
        else:
            pj[field] = 3.5 if field != "version" else [1]
    else:
        top = field.split(".")[0]
        entries = pj[top] if top != "messages" else pj["messages"][0]["entries"]
        if kind == "missing_key":
            del pj["messages"][0]["nbytes"]
        elif kind == "short":
            entries[0] = entries[0][:2]
        elif kind == "long":
            entries[0] = list(entries[0]) + [1, 2, 3]
        else:
            entries[0] = "entry"
    o = cc.record(lambda: Plan.from_json(pj) and None)
    if o["type"] is None:       # accepted by the parser: validate_plan (run at bind) must refuse it, or it is sound
        from mcore_reshard.core.planner import validate_plan
        again = Plan.from_json(pj)
        problems = cc.record(lambda: [p for r in again.ranks for p in validate_plan(again, r, limit=3)])
        if problems["type"] is not None:
            o = problems                      # validate_plan crashed: a defect
        elif problems["result"]:
            o = {"type": "PlanError", "error": "validate_plan: " + problems["result"][0]}
    # only the library's own error (PlanError) counts as the parser's refusal
    verdict = {"PlanError": "refused", None: "ok"}.get(o["type"], "DEFECT")
    counts("Plan.from_json", verdict)
    assert verdict != "DEFECT", (case, o)


MR_CASES = ([("budget_bytes", k) for k in ("nan", "inf", "negative", "string", "bool", "float", "none")]
            + [("timeout", k) for k in ("nan", "inf", "negative", "zero", "string", "bool")]
            + [("colocated", k) for k in ("string", "bool", "keys", "extra", "empty_channel", "device_int",
                                          "long_channel")])
COLOCATED_BAD = {"string": "/tmp/x.sock", "bool": True, "keys": {"channel": "/tmp/x.sock"},
                 "extra": {"channel": "/tmp/x.sock", "device": "a", "rank": 0},
                 "empty_channel": {"channel": "", "device": "a"}, "device_int": {"channel": "/tmp/x.sock", "device": 0},
                 "long_channel": {"channel": "/tmp/" + "c" * 200, "device": "a"}}


@pytest.mark.parametrize("case", MR_CASES, ids=lambda c: "-".join(c))
def test_megatron_refit_numbers(counts, case):
    from mcore_reshard.refit import MegatronRefit
    arg, kind = case
    value = {"nan": math.nan, "inf": math.inf, "negative": -1, "zero": 0, "string": "5", "bool": True,
             "float": 4096.0, "none": None}.get(kind) if arg != "colocated" else COLOCATED_BAD[kind]
    o = cc.record(lambda: MegatronRefit([], [], **{arg: value}) and None)
    verdict = cc.judge(o, arg)
    counts("MegatronRefit", verdict)
    assert verdict == "refused", o

