"""Spawned-rank scenarios for the FP8-in-transit tests, and the independent reference quantizer.

The reference never touches the code under test: it walks the *gathered full* tensor block by
block in plain Python (amax, scale = amax / 448 or 1.0 for an all-zero block, divide, clamp, cast).
Every destination buffer is filled with 0xFF bytes first (NaN in bf16, e4m3 and fp32: never a
quantization result), so a byte the refit does not write fails the comparison.
"""
from __future__ import annotations

import itertools

import torch

FP8 = torch.float8_e4m3fn


def ref_quantize(full: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv) of ``full``, one block at a time."""
    B0, B1 = block
    *lead, R, C = full.shape
    nr, nc = (R + B0 - 1) // B0, (C + B1 - 1) // B1
    q = torch.empty(full.shape, dtype=FP8)
    s = torch.empty(tuple(lead) + (nr, nc), dtype=torch.float32)
    for idx in itertools.product(*(range(n) for n in lead)):
        for i in range(nr):
            for j in range(nc):
                blk = full[idx][i * B0:(i + 1) * B0, j * B1:(j + 1) * B1].to(torch.float32)
                amax = blk.abs().max()
                scale = amax / 448.0 if float(amax) > 0 else torch.tensor(1.0, dtype=torch.float32)
                q[idx][i * B0:(i + 1) * B0, j * B1:(j + 1) * B1] = (blk / scale).clamp(-448.0, 448.0).to(FP8)
                s[idx][i, j] = scale
    return q, s


def sentinel(shape, dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for x in shape:
        n *= x
    return torch.full((n * dtype.itemsize,), 0xFF, dtype=torch.uint8).view(dtype).view(tuple(shape))


def allocate(layout, rank: int) -> dict[str, torch.Tensor]:
    from mcore_reshard.core.executor import torch_dtype
    return {n: sentinel(b.shape, torch_dtype(b.dtype)) for n, b in layout.buffers.get(rank, {}).items()}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_buffers(layout, rank: int, tensors: dict, expected, block) -> tuple[list[str], int]:
    """Compare every piece of this rank's destination buffers with ``expected(tensor)`` (the full
    reference, FP8 weights / scales from :func:`ref_quantize`); padding must be zero."""
    from mcore_reshard.fp8.quant_layout import FP8 as FP8_NAME
    from mcore_reshard.fp8.quant_layout import scale_name
    refs: dict[str, torch.Tensor] = {}

    def ref(name):
        if name not in refs:
            meta = layout.tensors[name]
            base = name[: -len("_scale_inv")] if name.endswith("_scale_inv") else name
            if base != name or meta.dtype == FP8_NAME:
                q, s = ref_quantize(expected(base), block)
                refs[base], refs[scale_name(base)] = q, s
            else:
                from mcore_reshard.core.executor import torch_dtype
                refs[name] = expected(name).to(torch_dtype(meta.dtype))
        return refs[name]
    bad, checked = [], 0
    for bname, buf in sorted(layout.buffers.get(rank, {}).items()):
        t = tensors[bname]
        for p in buf.pieces:
            want = ref(p.tensor)[p.box.slices()]
            got = t[p.local.slices()].reshape(p.box.sizes)
            checked += 1
            if _bytes(want) != _bytes(got):
                bad.append(f"rank {rank} {bname}: {p.tensor}{p.box} differs")
        for box in buf.padding():
            if any(_bytes(t[box.slices()])):
                bad.append(f"rank {rank} {bname}: padding {box} not zero")
    return bad, checked


# ----------------------------------------------------------------------------------- synthetic

def synthetic_full(name: str, shape) -> torch.Tensor:
    import zlib
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(tuple(shape), generator=g)
    if name.startswith("z"):
        t[..., :8, :8] = 0          # an all-zero block: scale 1.0
    return t.to(torch.bfloat16)


def synthetic_worker(rank: int, world: int, cases: list) -> list:
    return [_synthetic(rank, case) for case in cases]


def _synthetic(rank: int, case: dict) -> dict:
    from mcore_reshard.core.layout import Layout
    from mcore_reshard.fp8.quant_plan import make_fp8_plan
    from mcore_reshard.fp8.quant_resharder import Fp8Resharder
    src = Layout.from_json(case["src"])
    dst = Layout.from_json(case["dst"])
    block = tuple(case["block"])
    plan = make_fp8_plan(src, dst, block, budget_bytes=case.get("budget", 1 << 20), memory_bytes=case.get("memory"))
    src_t = {}
    for bname, buf in src.buffers.get(rank, {}).items():
        t = torch.zeros(buf.shape, dtype=torch.bfloat16)
        for p in buf.pieces:
            t[p.local.slices()] = synthetic_full(p.tensor, src.tensors[p.tensor].shape)[p.box.slices()].reshape(p.local.sizes)
        src_t[bname] = t
    before = {n: _bytes(t) for n, t in src_t.items()}
    dst_t = allocate(dst, rank)
    r = Fp8Resharder(plan, src_t, dst_t, None)
    out = r.refit()
    out2 = r.refit()              # a second refit reuses the arena and rewrites the same bytes
    bad, checked = check_buffers(dst, rank, dst_t, lambda n: synthetic_full(n, src.tensors[n].shape), block)
    st = r.state()
    return {"bad": bad, "checked": checked, "quantized_elements": out["quantized_elements"],
            "state_ok": st["version"] == 2 and not st["incomplete"] and not st["interrupted"]
            and set(st["buffers"]) == set(dst_t) and set(st["buffers"].values()) <= {2},
            "arena": plan.arena.get(rank, 0), "views": sum(len(g.views.get(rank, {})) for g in plan.groups),
            "second": out2["quantized_elements"], "stats": plan.stats, "hash": plan.hash,
            "src_untouched": all(before[n] == _bytes(t) for n, t in src_t.items())}


# ----------------------------------------------------------------------------------- Megatron

def canonical_reference(chunks) -> dict[str, torch.Tensor]:
    """Megatron full tensors (gathered by the attribute path of megatron_refit_worker) under
    canonical names, mapped by hand; experts stacked [E, ...]."""
    from megatron_refit_worker import reference_full
    full = reference_full(chunks)
    ren = [("self_attention.linear_q_down_proj", "self_attn.q_a_proj"),
           ("self_attention.linear_q_up_proj", "self_attn.q_b_proj"),
           ("self_attention.linear_kv_down_proj", "self_attn.kv_a_proj_with_mqa"),
           ("self_attention.linear_kv_up_proj", "self_attn.kv_b_proj"),
           ("self_attention.linear_proj", "self_attn.o_proj"), ("self_attention.q_layernorm", "self_attn.q_a_layernorm"),
           ("self_attention.kv_layernorm", "self_attn.kv_a_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm"),
           ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"), ("mlp.router.weight", "mlp.gate.weight"),
           ("mlp.shared_experts.linear_fc2", "mlp.shared_experts.down_proj"), ("mlp.linear_fc2", "mlp.down_proj")]
    out, experts = {}, {}
    for name, t in full.items():
        if name.startswith("mtp."):
            continue
        t = t.detach().clone()
        n = name.replace("embedding.word_embeddings.weight", "model.embed_tokens.weight").replace(
            "decoder.final_layernorm", "model.norm").replace("output_layer.weight", "lm_head.weight").replace(
            "decoder.layers.", "model.layers.")
        if ".mlp.experts.experts." in n:
            layer, rest = n.split(".mlp.experts.experts.")
            e, which = rest.split(".", 1)
            key = layer + (".mlp.experts.gate_up_proj" if "linear_fc1" in which else ".mlp.experts.down_proj")
            experts.setdefault(key, {})[int(e)] = t
            continue
        if n.endswith("linear_fc1.weight"):
            stem = n[: -len("linear_fc1.weight")]
            half = t.shape[0] // 2
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = t[:half], t[half:]
            continue
        for a, b in ren:
            n = n.replace(a, b)
        out[n] = t
    for key, per in experts.items():
        out[key] = per       # partial on EP ranks: merged across ranks by the caller
    return out


def _pack(tensors: dict) -> dict:
    def enc(t):
        return [list(t.shape), str(t.dtype).removeprefix("torch."), _bytes(t).hex()]
    return {n: ({str(e): enc(x) for e, x in t.items()} if isinstance(t, dict) else enc(t)) for n, t in tensors.items()}


def _unpack(parts: list) -> dict[str, torch.Tensor]:
    def dec(o):
        shape, dtype, hx = o
        return torch.frombuffer(bytearray(bytes.fromhex(hx)), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)
    out, experts = {}, {}
    for part in parts:
        for n, o in part.items():
            if isinstance(o, dict):
                experts.setdefault(n, {}).update({int(e): dec(x) for e, x in o.items()})
            else:
                out[n] = dec(o)
    for n, per in experts.items():
        out[n] = torch.stack([per[e] for e in range(len(per))])
    return out


def target_layout(case: dict, quantized_of_family=True):
    from mcore_reshard.fp8.quant_layout import fp8_target
    from mcore_reshard.fp8.quant_plan import quantized_tensors
    from mcore_reshard.targets import dsv3_tiny, sglang_layout, vllm_layout
    cfg = dsv3_tiny()
    kind, kw = case["target"]
    lay = (vllm_layout if kind == "vllm" else sglang_layout)(cfg, dtype="bfloat16", **kw)
    return fp8_target(lay, quantized_tensors(lay, "deepseek_v3", case["block"]), case["block"])


def megatron_worker(rank: int, world: int, cases: list) -> list:
    import torch.distributed as dist
    from megatron_refit_worker import _build, perturb_replicated

    from mcore_reshard.core.executor import all_gather_json
    from mcore_reshard.core.layout import Layout
    from mcore_reshard.fp8.quant_resharder import Fp8
    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    mcore_cpu.install_cpu_shims()
    out = []
    for case in cases:
        disagg = case.get("disaggregated", False)
        is_src = not disagg or rank < world // 2
        chunks = _build("dsv3", case["src"], torch.bfloat16, {}, "tp-cp-ep-pp-dp" if disagg else "tp-cp-ep-dp-pp")
        perturb_replicated(chunks)
        ref = canonical_reference(chunks)
        full = _unpack(all_gather_json(_pack(ref) if is_src else {}))
        fp8 = target_layout(case)
        block = tuple(case["block"])
        part = Layout(dict(fp8.tensors), {rank: fp8.buffers[rank]}) if rank in fp8.buffers else Layout()
        dst_t = allocate(fp8, rank)
        refit = MegatronRefit(chunks if is_src else [], group=None, target=(part, dst_t), ignore_unused=True,
                              allow_cast=True, quantize=Fp8(block=block, memory_bytes=case.get("memory")))
        got = refit.refit()
        bad, checked = check_buffers(fp8, rank, dst_t, lambda n: full[n], block)
        out.append({"bad": bad[:10], "checked": checked, "quantized_elements": got["quantized_elements"],
                    "stats": refit.plan.stats, "hash": refit.plan.hash,
                    "quantized_total": sum(full[n].numel() for n in refit.plan.quantized)})
        mcore_cpu.destroy_megatron()
        dist.barrier()
    return out
