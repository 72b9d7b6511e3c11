"""Megatron-Core -> transformers models sharded by transformers' own tensor / expert parallelism, live.

Every rank holds a Megatron-Core model chunk and the same transformers model sharded over all ranks
(transformers' distributed loading always spans the whole default world).  The HF model is sharded
by transformers itself: ``prepare_distribute_model`` + ``maybe_distribute_model``, the two steps
``from_pretrained(..., distributed_config=...)`` runs around weight loading (``from_pretrained``
itself also needs ``accelerate``; :func:`pretrained_layouts` checks it gives the same layout).

Reference for every local shard: the Megatron full tensors gathered by the simple attribute path
(``megatron_refit_worker.reference_full``), renamed and cut to HF tensors by hand here, then sliced
by torch's own ``distribute_tensor(..., src_data_rank=None)`` with the parameter's mesh and
placements -- never by ``mcore_reshard.core.dtensor``'s box arithmetic under test.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from hf_refit_worker import HAND_MAP, _split_qkv, gqa_hf_config, hf_config
from megatron_refit_worker import _build, perturb_replicated, reference_full

from mcore_reshard.testing import megatron_cpu as mcore_cpu

KINDS = {"gqa": "LlamaForCausalLM", "qwen3": "Qwen3MoeForCausalLM", "dsv3": "DeepseekV3ForCausalLM"}


def hf_reference(full: dict, cfg, kind: str) -> dict[str, torch.Tensor]:
    """Megatron full tensors -> full HF tensors by HF name, written out by hand (not from layouts/*.toml)."""
    qnorm = ("self_attention.q_layernorm", "self_attn.q_a_layernorm" if kind == "dsv3" else "self_attn.q_norm")
    pieces = [qnorm, ("self_attention.k_layernorm", "self_attn.k_norm")] + HAND_MAP
    out, experts = {}, {}
    for name, t in full.items():
        if name.startswith("mtp."):
            continue
        if ".mlp.experts.experts." in name:   # routed expert e: stacked into the fused HF tensor
            layer, rest = name.replace("decoder.layers.", "model.layers.").split(".mlp.experts.experts.")
            e, which = rest.split(".", 1)
            key = f"{layer}.mlp.experts.{'gate_up_proj' if 'linear_fc1' in which else 'down_proj'}"
            experts.setdefault(key, {})[int(e)] = t
            continue
        n = name
        for a, b in pieces:
            n = n.replace(a, b)
        if n.endswith("linear_fc1.weight"):       # [gate; up] of a dense MLP or shared expert
            gate, up = t.chunk(2)
            out[n.replace("linear_fc1", "gate_proj")], out[n.replace("linear_fc1", "up_proj")] = gate, up
        elif n.endswith("self_attention.linear_qkv.weight"):
            q, k, v = _split_qkv(t, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels)
            base = n.replace("self_attention.linear_qkv.weight", "self_attn.")
            out.update({base + "q_proj.weight": q, base + "k_proj.weight": k, base + "v_proj.weight": v})
        else:
            out[n] = t
    for key, per in experts.items():
        out[key] = torch.stack([per[e] for e in range(len(per))])
    return out


def world_reference(chunks, ranks: int) -> dict[str, torch.Tensor]:
    """The ``reference_full`` of ranks ``[0, ranks)`` (each: its pipeline stage's layers, its experts), merged."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, reference_full(chunks))
    merged = {}
    for part in parts[:ranks]:
        for name, t in part.items():
            if name in merged and not torch.equal(merged[name], t):
                raise AssertionError(f"reference {name} differs between ranks")
            merged[name] = t
    return merged


def hf_model_config(kind: str, chunks):
    cfg, vocab = chunks[0].config, chunks[0].vocab_size
    if kind == "dsv3":
        import transformers
        return transformers.DeepseekV3ForCausalLM, hf_config(cfg, vocab)
    return gqa_hf_config(kind, cfg, vocab)


def sharded_hf_model(model_cls, hf_cfg, tp: int, ep: int):
    """A transformers model sharded by transformers over the whole world: TP ``tp``, EP ``ep``."""
    from transformers.distributed import DistributedConfig
    torch.manual_seed(0)
    model = model_cls(hf_cfg).eval()
    for name, b in model.named_buffers():   # the router bias stays fp32, as Megatron's
        if name.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    dcfg, _, meshes = model_cls.prepare_distribute_model(DistributedConfig(tp_size=tp, ep_size=ep))
    return model_cls.maybe_distribute_model(model, dcfg, meshes)


def check_shards(model, ref: dict) -> list[str]:
    """Every local tensor of ``model`` against torch's own slice of the reference: mismatches as text."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from mcore_reshard.sources.hf_model import module_tensors
    bad = []
    for name, t in module_tensors(model).items():
        if "rotary" in name:
            continue
        if name not in ref:
            bad.append(f"{name}: no reference")
            continue
        if isinstance(t, DTensor):
            want = distribute_tensor(ref[name].to(t.dtype), t.device_mesh, t.placements, src_data_rank=None).to_local()
            got = t.to_local()
        else:
            want, got = ref[name], t
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(f"{name}: local {tuple(got.shape)} {got.dtype} != reference slice {tuple(want.shape)} {want.dtype}")
    return bad


def hf_tp_scenarios(rank: int, world: int, cases: list) -> list:
    """Each case: {"model": gqa|qwen3|dsv3, "src": Megatron sizes, "kw": builder kw, "hf_ep": EP size of the HF model,
    "src_ranks": n}.  With ``src_ranks < world`` only ranks [0, n) hand their Megatron chunks to the refit (the source is
    built with dp slowest, so they hold one whole replica): the HF shards of the other ranks arrive over the network only."""
    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.sources.hf_model import parallel_styles, read_hf_layout
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = []
    for case in cases:
        kind = case["model"]
        src_ranks = case.get("src_ranks", world)
        chunks = _build(kind, case["src"], torch.float32, case.get("kw", {}),
                        "tp-cp-ep-dp-pp" if src_ranks == world else "tp-cp-ep-pp-dp")
        perturb_replicated(chunks)
        logits = mcore_cpu.forward_logits(chunks, tokens)
        ref = hf_reference(world_reference(chunks, src_ranks), chunks[0].config, kind)
        model = sharded_hf_model(*hf_model_config(kind, chunks), tp=world, ep=case.get("hf_ep", 1))
        target = read_hf_layout(model, rank)
        refit = MegatronRefit(chunks if rank < src_ranks else [], group=None, target=target, ignore_unused=kind == "dsv3")
        refit.refit()
        with torch.no_grad():
            hf_logits = model(tokens).logits.float()
        layout, _ = target
        bad = check_shards(model, ref)
        perturb_replicated(chunks, step=1)   # the next optimizer step: refit again into the same shards
        refit.refit()
        bad_again = check_shards(model, hf_reference(world_reference(chunks, src_ranks), chunks[0].config, kind))
        out.append({
            "bad": bad, "bad_after_second_refit": bad_again, "styles": sorted(set(parallel_styles(model).values())),
            "sharded": sorted(b.name for b in layout.buffers[rank].values() if b.shape != layout.tensors[b.name].shape),
            "logits_max_diff": float((hf_logits - logits).abs().max()),
            "same_argmax": bool((hf_logits.argmax(-1) == logits.argmax(-1)).all()),
            "network_bytes": refit.plan.stats["network_bytes"], "received": _received(refit.plan, rank), "lower_bound_bytes": refit.plan.stats["lower_bound_bytes"],
            "unused": refit.plan.stats["unused_tensors"]})
        mcore_cpu.destroy_megatron()
        dist.barrier()
    return out


def _received(plan, rank: int) -> int:
    """Bytes the plan sends to ``rank`` from other ranks."""
    return sum(m.nbytes for m in plan.messages if m.dst == rank and m.src != rank)


def pretrained_layouts(rank: int, world: int, cases: list) -> list:
    """``from_pretrained(path, distributed_config=...)`` (the documented user path, needs accelerate)
    against the two-step sharding above: the same layout on every rank, and the same logits."""
    from transformers.distributed import DistributedConfig

    from mcore_reshard.sources.hf_model import read_hf_layout
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = []
    for case in cases:
        kind = case["model"]
        chunks = _build(kind, case["src"], torch.float32, case.get("kw", {}))
        model_cls, hf_cfg = hf_model_config(kind, chunks)
        mcore_cpu.destroy_megatron()
        box = [tempfile.mkdtemp(prefix="hf_tp_") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank == 0:
            torch.manual_seed(0)
            model_cls(hf_cfg).save_pretrained(box[0])
        dist.barrier()
        loaded = model_cls.from_pretrained(box[0], distributed_config=DistributedConfig(tp_size=world, ep_size=case.get("hf_ep", 1))).eval()
        built = sharded_hf_model(model_cls, hf_cfg, tp=world, ep=case.get("hf_ep", 1))
        with torch.no_grad():
            diff = float((loaded(tokens).logits - built(tokens).logits).abs().max())
        out.append({"same_layout": read_hf_layout(loaded, rank)[0].to_json() == read_hf_layout(built, rank)[0].to_json(),
                    "logits_max_diff": diff})
        dist.barrier()
        if rank == 0:
            for f in os.listdir(box[0]):
                os.unlink(os.path.join(box[0], f))
            os.rmdir(box[0])
    return out
