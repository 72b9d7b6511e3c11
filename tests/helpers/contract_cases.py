"""The generated contract suite's cases (tests/integrations/test_contract_generated.py): every public argument
of the core APIs x every class of bad value, as a table.  A case is ``(api, argument, value
class, how to make the value)``; the Resharder cases run in one 2-rank gloo launch
(:func:`resharder_cases`), the planner / plan JSON / MegatronRefit cases in process.

Outcomes (the judge, :func:`judge`): ``refused`` -- an error of the library's own types
(ReshardError, TransferError, PlanError, LayoutError) or a ValueError / TypeError whose message
names the argument, with every destination byte unchanged; ``ok`` -- success with the destination
bit-exact against the reference; anything else (a raw KeyError / IndexError / AttributeError or
torch error, a refusal after bytes changed, a success with wrong bytes) is ``DEFECT``."""
from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist
from adversarial_workers import cut, same_bits, snapshot

OWN_ERRORS = ("ReshardError", "TransferError", "PlanError", "LayoutError")


def judge(o: dict, argument: str) -> str:
    """``refused`` / ``ok`` / ``DEFECT`` for one recorded outcome ``o`` (type, error, dst_untouched, exact)."""
    if o["type"] is None:
        return "ok" if o.get("exact", True) else "DEFECT"
    named = o["type"] in OWN_ERRORS or (o["type"] in ("ValueError", "TypeError") and argument in o["error"])
    return "refused" if named and o.get("dst_untouched", True) else "DEFECT"


def record(fn) -> dict:
    try:
        return {"type": None, "error": "", "result": fn()}
    except Exception as e:  # noqa: BLE001 - the judge decides
        return {"type": type(e).__name__, "error": str(e)[:1000]}


# ------------------------------------------------------------------ Resharder (construction, refit, rebind, state)

BAD_NUMBERS = {"nan": math.nan, "inf": math.inf, "negative": -1, "zero": 0, "string": "5", "bool": True,
               "huge": 1e308, "none_list": [1]}
BAD_VERSIONS = {"nan": math.nan, "inf": math.inf, "negative": -1, "huge": 2 ** 63, "huger": 2 ** 70, "string": "1",
                "bool": True, "float": 1.5}


def _resharder_table() -> list[tuple[str, str, str]]:
    """(api, argument, value class) of every Resharder case, in run order."""
    rows = [("Resharder", "plan", k) for k in ("none", "dict", "string", "plan_json")]
    rows += [("Resharder", side, k) for side in ("src", "dst") for k in
             ("none", "list", "empty", "not_tensor", "wrong_shape", "wrong_dtype", "extra", "meta_device",
              "dtensor", "inference", "aliasing")]
    rows += [("Resharder", "dst", "non_contiguous")]
    rows += [("Resharder", "group", k) for k in ("string", "int")]
    rows += [("Resharder", "timeout", k) for k in BAD_NUMBERS]
    rows += [("Resharder", flag, k) for flag in ("verify", "confirm", "overlap") for k in ("string", "int", "none")]
    rows += [("Resharder", "staging", k) for k in ("wrong_dtype", "two_dim", "aliasing_dst", "too_small", "string",
                                                    "inference")]
    rows += [("Resharder", "layouts", k) for k in ("string", "swapped")]
    rows += [("Resharder.refit", "version", k) for k in BAD_VERSIONS]
    rows += [("Resharder.refit", "rebound", k) for k in ("same_layout_dst", "same_layout_src", "other_shape",
                                                         "other_dtype", "onto_source")]
    rows += [("Resharder.rebind", "group", k) for k in ("string", "int", "same")]
    rows += [("Resharder.state", "-", "after_refused_refit")]
    return rows


RESHARDER_TABLE = _resharder_table()


def _value(arg: str, kind: str, rank: int, plan, S: dict, D: dict, src, dst):
    """The bad value of ``arg`` of class ``kind`` (the tensors dicts are this rank's fresh ones)."""
    first = sorted(D)[0]
    if arg == "plan":
        return {"none": None, "dict": {}, "string": "plan", "plan_json": json.loads(plan.dumps())}[kind]
    if arg in ("src", "dst"):
        T = S if arg == "src" else D
        n = sorted(T)[0]
        t = T[n]
        if kind == "none":
            return None
        if kind == "list":
            return list(T.values())
        if kind == "empty":
            return {}
        if kind == "not_tensor":
            return {**T, n: t.tolist()}
        if kind == "wrong_shape":
            return {**T, n: torch.zeros(t.numel() + 1, dtype=t.dtype)}
        if kind == "wrong_dtype":
            return {**T, n: t.to(torch.float64)}
        if kind == "extra":
            return {**T, "not.in.plan": torch.zeros(2)}
        if kind == "meta_device":
            return {**T, n: torch.empty_like(t, device="meta")}
        if kind == "dtensor":           # a Replicate DTensor: bound through its local tensor
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Replicate
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            return {k: DTensor.from_local(v, mesh, [Replicate()], run_check=False) for k, v in T.items()}
        if kind == "inference":
            with torch.inference_mode():
                return {k: v.clone() for k, v in T.items()}
        if kind == "aliasing":          # one of ``arg``'s tensors made a view of the other side's largest tensor
            other = D if arg == "src" else S
            big = max(other.values(), key=lambda x: x.numel())
            fits = [k for k in sorted(T) if 0 < T[k].numel() <= big.numel() and T[k].dtype == big.dtype]
            k = fits[0]
            return {**T, k: big.reshape(-1)[:T[k].numel()].view(T[k].shape)}
        if kind == "non_contiguous":
            big = torch.zeros(*t.shape, 2, dtype=t.dtype)
            return {**T, n: big[..., 0]}
    if arg == "group":
        return {"string": "world", "int": 0}[kind]
    if arg == "timeout":
        return BAD_NUMBERS[kind]
    if arg in ("verify", "confirm", "overlap"):
        return {"string": "yes", "int": 1, "none": None}[kind]
    if arg == "staging":
        if kind == "wrong_dtype":
            return torch.zeros(1 << 16, dtype=torch.float32)
        if kind == "two_dim":
            return torch.zeros(2, 1 << 15, dtype=torch.uint8)
        if kind == "aliasing_dst":
            return D[first].reshape(-1).view(torch.uint8)
        if kind == "too_small":
            return torch.zeros(1, dtype=torch.uint8)
        if kind == "string":
            return "staging"
        if kind == "inference":
            with torch.inference_mode():
                return torch.zeros(1 << 16, dtype=torch.uint8)
    if arg == "layouts":
        return {"string": "layouts", "swapped": (dst, src)}[kind]
    if arg == "version":
        return BAD_VERSIONS[kind]
    raise AssertionError((arg, kind))


def resharder_cases(rank: int, world: int) -> dict:
    """Every RESHARDER_TABLE case on 2 ranks (every rank passes the same bad value), one launch."""
    from mcore_reshard.core.executor import Resharder
    from mcore_reshard.core.planner import make_plan
    from mcore_reshard.tools.demo import build_layouts
    from mcore_reshard.tools.synthetic import reference_tensor
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    plan = make_plan(src, dst, budget_bytes=4096)
    want = cut(dst, rank, full, fill=0)
    out = {}
    for api, arg, kind in RESHARDER_TABLE:
        S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)
        before = snapshot(D)
        kw: dict = {"timeout": 10}
        args = [plan, S, D]
        check = D
        exact_of = None
        expect = want
        if api == "Resharder":
            v = _value(arg, kind, rank, plan, S, D, src, dst)
            if arg in ("plan",):
                args[0] = v
            elif arg == "src":
                args[1] = v
            elif arg == "dst":
                args[2] = v
                if isinstance(v, dict) and kind in ("dtensor",):
                    exact_of = {k: t.to_local() for k, t in v.items()}
                elif isinstance(v, dict) and kind == "inference":
                    check = v
            else:
                kw[arg] = v

            def run():
                r = Resharder(*args, **kw)
                return r.refit()["version"]
        elif api == "Resharder.refit" and arg == "version":
            v = BAD_VERSIONS[kind]

            def run():
                r = Resharder(plan, S, D, timeout=10)
                return r.refit(version=v)["version"]
        elif api == "Resharder.refit":
            P = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in D.items()}
            Q = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in S.items()}
            first = sorted(P)[0]

            def run():
                r = Resharder(plan, Q, P, timeout=10)
                if kind == "same_layout_dst":
                    P[first].data = torch.full_like(P[first], 5)
                elif kind == "same_layout_src":
                    s0 = sorted(Q)[0]
                    Q[s0].data = Q[s0].data.clone()
                elif kind == "other_shape":
                    P[first].data = torch.zeros(P[first].numel() + 2, dtype=P[first].dtype)
                elif kind == "other_dtype":
                    P[first].data = P[first].data.to(torch.float64)
                elif kind == "onto_source":
                    s0 = sorted(Q)[0]
                    same = [k for k in P if P[k].shape == Q[s0].shape and P[k].dtype == Q[s0].dtype]
                    P[same[0] if same else first].data = Q[s0].data if same else P[first].data
                return r.refit()["version"]
            exact_of = P       # a followed rebinding: the new storage holds the refit; refused: D (the old) unchanged
        elif api == "Resharder.rebind":
            def run():
                r = Resharder(plan, S, D, timeout=10)
                r.rebind({"string": "world", "int": 0, "same": None}[kind])
                return r.refit()["version"]
        else:   # state after a refused refit
            def run():
                r = Resharder(plan, S, D, timeout=10)
                try:
                    r.refit(version=-1)
                except ValueError:
                    pass
                st = r.state()
                assert st["version"] == 0 and not st["interrupted"] and same_bits(before, D), st
                return st["version"]
            expect = before       # nothing moved: the destination is what it was
        o = record(run)
        if check is not None:
            o["dst_untouched"] = same_bits(before, check) if o["type"] else True
        if o["type"] is None:
            got = exact_of if exact_of is not None else D
            o["exact"] = same_bits(expect, {k: (t.data if isinstance(t, torch.nn.Parameter) else t) for k, t in got.items()})
        out[f"{api}|{arg}|{kind}"] = o
        dist.barrier()
    return out
