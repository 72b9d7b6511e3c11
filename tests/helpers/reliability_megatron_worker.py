"""Refusals of MegatronRefit on real tiny Megatron-Core models (run by ``mcore_cpu.spawn``).

Each case builds a source and a destination model that disagree in one architecture fact (or a
target whose tensor names the source lacks, or a rank that hands in something that is not a
Megatron model); every rank must raise ReshardError naming the disagreement, and nothing may move.
The last case is a clean refit with pickle forbidden (and ``verify=True``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron_refit_worker import _build, perturb_replicated, reference_digests
from reliability_workers import no_pickle

from mcore_reshard.testing import megatron_cpu as mcore_cpu
from mcore_reshard.testing import tiny_models


def _params(chunks) -> dict:
    return {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}


def _attempt(build_src, build_dst, **kw) -> list:
    from mcore_reshard.core.executor import ReshardError
    from mcore_reshard.refit import MegatronRefit
    src = build_src()
    dst = build_dst()
    before_src, before_dst = _params(src), _params(dst)
    try:
        MegatronRefit(src, dst, timeout=30, **kw).refit()
        outcome = ["no error", ""]
    except ReshardError as e:
        outcome = [type(e).__name__, str(e)]
    untouched = (all(torch.equal(before_src[n], p) for n, p in _params(src).items())
                 and all(torch.equal(before_dst[n], p) for n, p in _params(dst).items()))
    mcore_cpu.destroy_megatron()
    dist.barrier()
    return outcome + [untouched]


def megatron_refusals(rank: int, world: int) -> dict:
    from mcore_reshard.core.box import Box
    from mcore_reshard.core.executor import ReshardError
    from mcore_reshard.core.layout import Buffer, Layout, Piece
    from mcore_reshard.refit import MegatronRefit

    f32 = torch.float32
    out = {}
    out["experts 8 vs 16"] = _attempt(lambda: _build("dsv3", {"tp": 2}, f32, {"mtp": False}),
                                      lambda: _build("dsv3", {"tp": 1, "ep": 2}, f32, {"mtp": False, "num_experts": 16}))
    out["query groups 4 vs 2"] = _attempt(lambda: _build("gqa", {"tp": 2}, f32, {}),
                                          lambda: _build("gqa", {"tp": 1}, f32, {"num_query_groups": 2}))
    out["layers 4 vs 2"] = _attempt(lambda: _build("qwen3", {"tp": 1}, f32, {}),
                                    lambda: _build("qwen3", {"tp": 2}, f32, {"num_layers": 2}))

    def big_vocab():
        old = tiny_models.VOCAB
        tiny_models.VOCAB = 256
        try:
            return _build("gqa", {"tp": 2}, f32, {})
        finally:
            tiny_models.VOCAB = old

    out["vocab 128 vs 256"] = _attempt(lambda: _build("gqa", {"tp": 1}, f32, {}), big_vocab)

    # a target engine whose names do not match the family table: vLLM's fused qkv_proj where the
    # llama table (Hugging Face names) has q_proj/k_proj/v_proj
    src = _build("gqa", {"tp": 2}, f32, {})
    lay = Layout()
    name = "model.layers.0.self_attn.qkv_proj.weight"
    lay.add_tensor(name, (128, 64), "float32")
    tensors = {}
    if rank == 0:
        lay.add_buffer(0, Buffer(name, (128, 64), "float32", (Piece(name, Box.full((128, 64)), Box.full((128, 64))),)))
        tensors[name] = torch.zeros(128, 64)
    try:
        MegatronRefit(src, target=(lay, tensors), ignore_unused=True, timeout=30)
        out["target names"] = ["no error", "", True]
    except ReshardError as e:
        out["target names"] = [type(e).__name__, str(e), not tensors or bool((tensors[name] == 0).all())]
    mcore_cpu.destroy_megatron()
    dist.barrier()

    # one rank hands in something that is not a Megatron model
    src = _build("gqa", {"tp": 2}, f32, {})
    dst = _build("gqa", {"tp": 1}, f32, {})
    try:
        MegatronRefit(src if rank == 0 else [torch.nn.Linear(4, 4)], dst, timeout=30)
        out["read error"] = ["no error", "", True]
    except ReshardError as e:
        out["read error"] = [type(e).__name__, str(e), True]
    mcore_cpu.destroy_megatron()
    dist.barrier()

    # clean refit with pickle forbidden, verify on
    src = _build("gqa", {"tp": 2}, f32, {})
    perturb_replicated(src)
    src_ref = reference_digests(src)
    dst = _build("gqa", {"tp": 1}, f32, {})
    with no_pickle() as calls:
        refit = MegatronRefit(src, dst, timeout=30, verify=True)
        refit.refit()
        state = refit.state()
    dst_ref = reference_digests(dst)
    out["clean"] = {"pickle_calls": calls, "same": src_ref == dst_ref, "state": state}
    mcore_cpu.destroy_megatron()
    return out
