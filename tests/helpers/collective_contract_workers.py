"""The collective part of the integration-level contract suite (tests/integrations/test_contract_integrations.py):
``export_hf``, ``join_refit`` and ``Fp8Resharder``'s arguments x each class of bad value, every rank
passing the same bad value, one 2-rank gloo launch, each case on a fresh group (timeout 10 s).

Each case records, per rank: what was raised (type, MRO, message), whether this rank's destination
kept its bytes (``join_refit`` / FP8: the tensors given; ``export_hf``: no index written)."""
from __future__ import annotations

import datetime
import json
import math
import os
import tempfile

import torch
import torch.distributed as dist
from adversarial_workers import cut, same_bits, snapshot
from integration_contract_cases import record

NUM = {"nan": math.nan, "inf": math.inf, "negative": -1, "zero": 0, "string": "8", "bool": True, "float": 1.5}


def export_table() -> list[tuple[str, str, str]]:
    rows = [("export_hf", "model_chunks", k) for k in ("none", "string", "empty_everywhere")]
    rows += [("export_hf", "out_dir", k) for k in ("none", "int", "a_file", "unwritable", "being_written")]
    rows += [("export_hf", "group", k) for k in ("string", "int")]
    rows += [("export_hf", "on_rank", k) for k in ("negative", "too_big", "string", "nan", "bool")]
    rows += [("export_hf", "dtype", k) for k in ("unknown", "int", "bool_dtype")]
    rows += [("export_hf", "family", k) for k in ("unknown", "int")]
    rows += [("export_hf", "vocab_size", k) for k in ("negative", "zero", "nan", "string", "larger")]
    rows += [("export_hf", "memory_bytes", k) for k in ("nan", "negative", "zero", "string", "one")]
    rows += [("export_hf", "budget_bytes", k) for k in ("nan", "negative", "string")]
    rows += [("export_hf", "timeout", k) for k in ("nan", "negative", "string")]
    return rows


def join_refit_table() -> list[tuple[str, str, str]]:
    rows = [("join_refit", "src", k) for k in ("string", "dict_not_spec", "other_ranks_part")]
    rows += [("join_refit", "dst", k) for k in ("string", "int")]
    rows += [("join_refit", "src_tensors", k) for k in ("none", "wrong_shape", "list")]
    rows += [("join_refit", "budget_bytes", k) for k in ("nan", "negative", "string")]
    rows += [("join_refit", "window_bytes", k) for k in ("nan", "negative", "string")]
    rows += [("join_refit", "allow_cast", k) for k in ("string", "none")]
    rows += [("join_refit", "timeout", k) for k in ("nan", "negative")]
    rows += [("join_refit", "error", k) for k in ("one_rank",)]
    return rows


def fp8_table() -> list[tuple[str, str, str]]:
    rows = [("Fp8Resharder", "plan", k) for k in ("none", "dict", "plain_plan")]
    rows += [("Fp8Resharder", side, k) for side in ("src", "dst") for k in ("none", "list", "empty", "extra",
                                                                            "wrong_dtype")]
    rows += [("Fp8Resharder", "timeout", k) for k in ("nan", "negative", "string")]
    rows += [("Fp8Resharder.refit", "version", k) for k in ("negative", "huge", "string")]
    return rows


TABLE = export_table() + join_refit_table() + fp8_table()


def _export_value(arg, kind, rank, tmp):
    if arg == "model_chunks":
        return {"none": None, "string": "model", "empty_everywhere": []}[kind]
    if arg == "out_dir":
        path = os.path.join(tmp, "a_file")
        open(path, "w").close()
        return {"none": None, "int": 3, "a_file": path, "unwritable": "/proc/mcore-reshard-no",
                "being_written": os.path.join(tmp, "busy")}[kind]
    if arg == "group":
        return {"string": "world", "int": 0}[kind]
    if arg == "on_rank":
        return {"negative": -1, "too_big": 2, "string": "0", "nan": math.nan, "bool": True}[kind]
    if arg == "dtype":
        return {"unknown": "int4", "int": 3, "bool_dtype": torch.bool}[kind]
    if arg == "family":
        return {"unknown": "nosuchfamily", "int": 3}[kind]
    if arg == "vocab_size":
        return {"negative": -1, "zero": 0, "nan": math.nan, "string": "x", "larger": 1 << 20}[kind]
    if arg == "memory_bytes" and kind == "one":
        return 1                      # accepted: every tensor a shard file of its own
    if arg in ("memory_bytes", "budget_bytes", "timeout", "window_bytes"):
        return NUM[kind]
    raise AssertionError((arg, kind))


def _fp8_setup(rank):
    from mcore_reshard.core.box import Box
    from mcore_reshard.core.layout import Buffer, Layout, Piece
    from mcore_reshard.fp8.quant_layout import fp8_target
    from mcore_reshard.fp8.quant_plan import make_fp8_plan
    src, dst = Layout(), Layout()
    for lay in (src, dst):
        lay.add_tensor("a.weight", (16, 16), "bfloat16")
    for r in range(2):
        box = Box((8 * r, 0), (8, 16))
        src.add_buffer(r, Buffer("a.weight", box.sizes, "bfloat16", (Piece("a.weight", box, Box.full(box.sizes)),)))
    full = Box.full((16, 16))
    dst.add_buffer(1, Buffer("a.weight", full.sizes, "bfloat16", (Piece("a.weight", full, Box.full(full.sizes)),)))
    dst = fp8_target(dst, {"a.weight"}, (8, 8))
    plan = make_fp8_plan(src, dst, (8, 8), budget_bytes=1 << 16)
    g = torch.Generator().manual_seed(0)
    S = {n: torch.randn(b.shape, generator=g).to(torch.bfloat16) for n, b in src.buffers.get(rank, {}).items()}
    from mcore_reshard.core.executor import torch_dtype
    D = {n: torch.zeros(b.shape, dtype=torch_dtype(b.dtype)) for n, b in dst.buffers.get(rank, {}).items()}
    return src, dst, plan, S, D


def collective_cases(rank: int, world: int) -> dict:
    from megatron_refit_worker import _build

    from mcore_reshard import export_hf
    from mcore_reshard.core.planner import make_plan
    from mcore_reshard.fp8.quant_resharder import Fp8Resharder
    from mcore_reshard.integrations.protocol import join_refit, rank_part
    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    from mcore_reshard.tools.demo import build_layouts
    from mcore_reshard.tools.synthetic import reference_tensor
    mcore_cpu.install_cpu_shims()
    chunks = _build("gqa", {"tp": 2}, torch.float32, {})
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    fsrc, fdst, fplan, _, _ = _fp8_setup(rank)
    tmp = tempfile.mkdtemp(prefix="mcore-reshard-cc-")
    out = {}
    for k, (api, arg, kind) in enumerate(TABLE):
        g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
        o: dict
        if api == "export_hf":
            kw = {"timeout": 10.0, "progress": False}
            args = [chunks, os.path.join(tmp, f"e{k}"), g]
            v = _export_value(arg, kind, rank, tmp)
            if arg == "model_chunks":
                args[0] = v
            elif arg == "out_dir":
                args[1] = v if not (kind == "a_file" and rank == 1) else args[1]    # only the writer's path matters
            elif arg == "group":
                args[2] = v
            else:
                kw[arg] = v
            holder = None
            if kind == "being_written" and rank == 0:    # another writer owns the directory meanwhile
                from mcore_reshard.util.owned_dir import OwnedDirectory
                holder = OwnedDirectory(args[1], what="another export").acquire()
            o = record(lambda: export_hf(*args, **kw) and None)
            if holder is not None:
                holder.abort()
            index = os.path.join(args[1], "model.safetensors.index.json") if isinstance(args[1], str) else ""
            o["dst_untouched"] = not os.path.exists(index)
            if o["type"] is None and kind == "one" and rank == 0:    # the writer's directory: one tensor per shard file
                files = list(json.load(open(index))["weight_map"].values())
                if len(set(files)) != len(files):
                    o.update(type="WrongResult", mro=["WrongResult"], error=f"{len(files)} tensors in {len(set(files))} files")
        elif api == "join_refit":
            S, D = cut(src, rank, full), cut(dst, rank, full, fill=7)
            before = snapshot(D)
            kw = {"src": rank_part(src, rank), "src_tensors": S, "dst": rank_part(dst, rank), "dst_tensors": D,
                  "timeout": 10.0, "allow_cast": False}
            if arg in ("src", "dst"):
                kw[arg] = {"string": "layout", "dict_not_spec": {"tp": 2}, "other_ranks_part": src, "int": 3}[kind]
            elif arg == "src_tensors":
                n0 = sorted(S)[0]
                kw[arg] = {"none": None, "wrong_shape": {**S, n0: torch.zeros(3)}, "list": list(S.values())}[kind]
            elif arg == "allow_cast":
                kw[arg] = {"string": "maybe", "none": None}[kind]
            elif arg == "error":
                kw[arg] = "this rank found a problem" if rank == 1 else None
            else:
                kw[arg] = NUM[kind]
            o = record(lambda: join_refit(g, **kw).refit() and None)
            o["dst_untouched"] = same_bits(before, D)
            if o["type"] is None:
                o["exact"] = same_bits(cut(dst, rank, full, 0), D)
        else:
            _, _, _, S, D = _fp8_setup(rank)
            before = snapshot(D)
            fkw = {"timeout": 10.0}
            fargs = [fplan, S, D, g]
            version = None
            if arg == "plan":
                fargs[0] = {"none": None, "dict": {}, "plain_plan": make_plan(src, dst, budget_bytes=4096)}[kind]
            elif arg in ("src", "dst"):
                T = S if arg == "src" else D
                n0 = sorted(T)[0] if T else None
                bad = {"none": None, "list": list(T.values()), "empty": {},
                       "extra": {**T, "not.in.plan": torch.zeros(2)},
                       "wrong_dtype": {**T, n0: T[n0].float()} if n0 else {"x": torch.zeros(1)}}[kind]
                fargs[1 if arg == "src" else 2] = bad
            elif arg == "timeout":
                fkw["timeout"] = NUM[kind]
            else:
                version = {"negative": -1, "huge": 2 ** 63, "string": "1"}[kind]
            o = record(lambda: Fp8Resharder(*fargs, **fkw).refit(version) and None)
            o["dst_untouched"] = same_bits(before, D)
        out["|".join((api, arg, kind))] = o
        dist.barrier()
    return out
