"""A transformers Qwen3-MoE tiny model sharded by torch itself (``parallelize_module`` TP over ``tp``,
then FSDP2 ``fully_shard`` over ``dp``, DeviceMesh ``(dp=2, tp=2)`` on 4 gloo ranks), read by
``read_dtensor_layout`` and refit into a Hugging Face model (whole on rank 0) and a vLLM layout (tp=2 on
ranks 2-3).  Reference: the model's own full state dict before sharding, and torch's ``full_tensor()``."""
from __future__ import annotations

import torch
from hf_tp_layout_worker import tiny


def sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    cls, cfg = tiny("qwen3")
    torch.manual_seed(0)
    model = cls(cfg).eval()
    full = {n: t.detach().clone() for n, t in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh["tp"], {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                         "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return cls, cfg, model, full


def _engine(layout, rank: int, src, src_t, full) -> tuple[list, int]:
    """Refit into this rank's buffers of an engine layout (7-filled); (mismatches vs ``full``, buffers)."""
    from mcore_reshard.integrations.protocol import join_refit, rank_part
    part = rank_part(layout, rank)
    tensors = {n: torch.full(b.shape, 7.0) for n, b in part.buffers.get(rank, {}).items()}
    r = join_refit(None, src=src, src_tensors=src_t, dst=part if tensors else None, dst_tensors=tensors,
                   ignore_unused=True, timeout=120)
    r.refit()
    bad = []
    for n, t in tensors.items():
        buf = part.buffers[rank][n]
        covered = torch.zeros(buf.shape, dtype=torch.bool)
        for p in buf.pieces:
            if not torch.equal(t[p.local.slices()], full[p.tensor][p.box.slices()].reshape(p.local.sizes)):
                bad.append((n, p.tensor))
            covered[p.local.slices()] = True
        if not torch.equal(t[~covered], torch.zeros_like(t[~covered])):
            bad.append((n, "padding"))
    return bad, len(tensors)


def fsdp_tp_to_hf_and_vllm(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    from mcore_reshard.integrations.protocol import join_refit
    from mcore_reshard.sources.dtensor_model import read_dtensor_layout
    from mcore_reshard.sources.hf_model import read_hf_layout
    from mcore_reshard.targets.config import from_hf_config
    from mcore_reshard.targets.sglang import sglang_layout
    from mcore_reshard.targets.vllm import vllm_layout
    cls, cfg, model, full = sharded_model()
    placements = {n: [str(p) for p in t.placements] for n, t in model.named_parameters() if isinstance(t, DTensor)}
    torch_full = {n: t.full_tensor() for n, t in model.named_parameters() if isinstance(t, DTensor)}
    torch_ok = all(torch.equal(torch_full[n], full[n]) for n in torch_full)
    src, src_t = read_dtensor_layout(model, rank)
    # 1. Hugging Face, whole on rank 0
    hf = None
    dst, dst_t = None, {}
    if rank == 0:
        hf = cls(cfg).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.fill_(7)
        dst, dst_t = read_hf_layout(hf, 0)
    r = join_refit(None, src=src, src_tensors=src_t, dst=dst, dst_tensors=dst_t, timeout=120)
    r.refit()
    hf_ok = None
    if rank == 0:
        got = hf.state_dict()
        hf_ok = sorted(n for n in full if "rotary" not in n and not torch.equal(got[n], full[n]))
    # 2. vLLM tp=2 on ranks 2-3, 3. SGLang tp=2 ep=2 on ranks 0-1 (every rank also holds training shards)
    vl_bad, vl_n = _engine(vllm_layout(from_hf_config(cfg), tp=2, rank_offset=2, dtype="float32"), rank, src, src_t, full)
    sg_bad, sg_n = _engine(sglang_layout(from_hf_config(cfg), tp=2, ep=2, dtype="float32"), rank, src, src_t, full)
    return {"torch_ok": torch_ok, "hf_mismatch": hf_ok, "vllm_bad": vl_bad, "vllm_buffers": vl_n,
            "sglang_bad": sg_bad, "sglang_buffers": sg_n,
            "network": r.plan.stats["network_bytes"], "lower_bound": r.plan.stats["lower_bound_bytes"],
            "placements": {n: placements[n] for n in ("model.layers.0.self_attn.q_proj.weight",
                                                      "model.layers.0.self_attn.o_proj.weight",
                                                      "model.layers.0.mlp.experts.gate_up_proj", "lm_head.weight")
                           if n in placements},
            "dtensor_params": len(placements), "params": len(list(model.named_parameters()))}


def fsdp_tp_params_to_dtensors(rank: int, world: int) -> dict:
    """The sharded model's parameters passed straight to ``reshard`` (parameters TP leaves whole are
    DTensors over each rank's own ``dp`` sub-mesh: replicas over ``tp``), into ``Shard(-1)`` DTensors
    over a 1-D mesh of all 4 ranks; each destination shard vs torch's own split of the full tensor."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    import mcore_reshard
    cls, cfg, model, full = sharded_model()
    mesh = DeviceMesh("cpu", torch.arange(4))
    src = {n: p for n, p in model.named_parameters()}
    dst, locals_ = {}, {}
    for n, p in src.items():
        want = Shard(0)._split_tensor(full[n], 4, with_padding=False)[0][rank] if p.dim() == 1 else \
            Shard(p.dim() - 1)._split_tensor(full[n], 4, with_padding=False)[0][rank]
        locals_[n] = (torch.full_like(want, 7.0).contiguous(), want)
        dst[n] = DTensor.from_local(locals_[n][0], mesh, [Shard(0) if p.dim() == 1 else Shard(p.dim() - 1)],
                                    run_check=False, shape=full[n].shape, stride=full[n].stride())
    res = mcore_reshard.reshard(src, dst, timeout=120)
    bad = sorted(n for n, (got, want) in locals_.items() if not torch.equal(got, want))
    submeshes = sorted({str(p.device_mesh.mesh.tolist()) for p in src.values()})
    return {"bad": bad, "tensors": len(res.plan.tensors), "submeshes": submeshes,
            "network": res.plan.stats["network_bytes"], "lower_bound": res.plan.stats["lower_bound_bytes"]}
