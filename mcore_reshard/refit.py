"""Reshard a live Megatron-Core model into another live model (any parallel config), shard to shard.

``MegatronRefit(src_chunks, dst_chunks, group)`` is collective over ``group``: each rank reads its
own part of both layouts from the models (``megatron_model.read_layout``), the parts are exchanged
as JSON, every rank maps them to canonical tensors through the family table, plans, and binds the
executor.  ``refit()`` then moves every weight.  Any error on any rank (unknown tensor, config
mismatch, uncovered region) is raised on every rank before a byte moves.

Example, colocated TP2 PP2 -> TP1 EP4 on 4 ranks (every rank holds both models)::

    rank | src_chunks (train)  | dst_chunks (inference)
    0..3 | [gpt_tp2pp2]        | [gpt_tp1ep4]
    r = MegatronRefit(src, dst, group=None); r.refit()     # after each optimizer step

Disaggregated: training ranks pass ``dst_chunks=[]``, inference ranks ``src_chunks=[]``.

Any other target (Hugging Face, vLLM, SGLang) is passed as ``target=(layout, tensors)``: this
rank's part of the target layout in canonical names and its real tensors, e.g.
``hf_model.read_hf_layout(hf_model, rank)`` (a whole model, or this rank's DTensor shards of a model
sharded by transformers' own tensor / expert parallel plans).  Source tensors the target does not hold (the MTP layer
for a transformers model) are dropped only with ``ignore_unused=True`` and listed in
``plan.stats["unused_tensors"]``.

FP8 in transit: ``target=(fp8_layout, tensors), quantize=Fp8(block=(128, 128))`` with
``fp8_layout = fp8_target(bf16_layout, quantized_tensors(bf16_layout), block)``: BF16 shards are
quantized per block of the global tensor, each block once, and sent as e4m3 bytes plus fp32 scales
(:mod:`mcore_reshard.fp8.quant_plan`); ``plan`` is then an ``Fp8Plan`` whose stats hold the assembly,
FP8 and the plain BF16 refit's bytes side by side.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .colocate import DEFAULT_TIMEOUT as COLOCATED_TIMEOUT
from .colocate import ColocatedPeer, accept_trainer, check_colocated
from .core.executor import GatherChecked, Resharder, ReshardError, all_or_none
from .core.executor.common import check_timeout
from .core.layout import Layout, merge_layouts
from .core.planner import DEFAULT_BUDGET, check_budget, make_plan
from .fp8.quant_plan import make_fp8_plan
from .fp8.quant_resharder import Fp8Resharder
from .mapper.family import canonicalize, load_family
from .sources.megatron_model import family_for, model_config, read_layout
from .util.identity import identity_of

ARCH_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "num_moe_experts", "ffn_hidden_size", "moe_ffn_hidden_size", "q_lora_rank", "kv_lora_rank",
             "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "vocab_size", "mtp_num_layers")


def agreed_config(configs: list[dict], side: str) -> dict:
    """The model config every rank of ``side`` reported (``{}`` on ranks holding no model are skipped);
    a :class:`ReshardError` naming the ``ARCH_KEYS`` on which two ranks disagree."""
    seen = [c for c in configs if c]
    if not seen:
        return {}
    for c in seen[1:]:
        diff = {k: (seen[0].get(k), c.get(k)) for k in ARCH_KEYS if seen[0].get(k) != c.get(k)}
        if diff:
            raise ReshardError(f"{side} ranks disagree on the model config: {diff}")
    return seen[0]


def config_diff(src_cfg: dict, dst_cfg: dict) -> str | None:
    """The architecture facts (``ARCH_KEYS``) on which two model configs disagree, as
    ``"hidden_size=64/128, num_moe_experts=8/16"`` (source/destination), or None."""
    diff = {k: (src_cfg.get(k), dst_cfg.get(k)) for k in ARCH_KEYS if src_cfg.get(k) != dst_cfg.get(k)}
    if not diff:
        return None
    return ", ".join(f"{k}={a}/{b}" for k, (a, b) in sorted(diff.items()))


class MegatronRefit:
    """Plan once, refit many times: Megatron-Core model chunks -> Megatron-Core model chunks.

    ``topology`` (a :class:`~mcore_reshard.core.planner.Topology`, a domain size, a rank -> domain
    list or a cost-model preset): a two-level plan (what several receivers of one NVLink domain need
    crosses the network once and is forwarded inside the domain); not with ``quantize``.

    ``colocated={"channel": path, "device": key}`` (with ``src_chunks=[]``): this process shares its
    device with a trainer rank in another process that is not a member of ``group``; it maps that
    rank's tensors (:class:`~mcore_reshard.colocate.ColocatedTrainer` on the trainer side) and holds
    its source part (:mod:`mcore_reshard.colocate`, the group ranks: :mod:`mcore_reshard.core.devices`)."""

    def __init__(self, src_chunks: Sequence[torch.nn.Module], dst_chunks: Sequence[torch.nn.Module] = (), group=None, *,
                 target: tuple[Layout, dict] | None = None, family: str = "auto", budget_bytes: int = DEFAULT_BUDGET,
                 allow_cast: bool = False, ignore_unused: bool = False, vocab_size: int | None = None,
                 timeout: float | None = None, verify: bool = False, quantize=None, topology=None,
                 colocated: dict | None = None):
        timeout = check_timeout(timeout)     # bad numbers: refused here, before anything is exchanged
        budget_bytes = check_budget(budget_bytes)
        colocated = check_colocated(colocated)
        rank = dist.get_rank(group)
        src_t, dst_t = {}, {}
        self.colocated: ColocatedPeer | None = None
        with GatherChecked(group, "reading the models", timeout=timeout) as g:
            if colocated is not None:
                if src_chunks or quantize is not None:
                    raise ValueError("colocated=: this process proxies its device's trainer rank, so src_chunks=[] "
                                     "(the trainer's tensors come mapped) and no quantize=")
                self.colocated = accept_trainer(colocated["channel"], device=colocated["device"], rank=rank,
                                                timeout=timeout or COLOCATED_TIMEOUT)
                src_l, src_t = self.colocated.layout, self.colocated.tensors
            else:
                src_l, src_t = read_layout(src_chunks, rank)
            if target is not None and dst_chunks:
                raise ValueError("pass either dst_chunks (a Megatron target) or target=(layout, tensors), not both")
            dst_l, dst_t = target if target is not None else read_layout(dst_chunks, rank)
            g.payload.update(src=src_l.to_json(), dst=dst_l.to_json(), canonical_dst=target is not None,
                             src_cfg=self.colocated.config if self.colocated else model_config(src_chunks),
                             dst_cfg=model_config(dst_chunks))
        parts = g.parts
        # Everything below is deterministic given the gathered parts, but any failure is still
        # exchanged so that no rank can be left waiting in the Resharder's handshake.
        with all_or_none(group, timeout=timeout):
            src_cfg = agreed_config([p["src_cfg"] for p in parts], "source")
            dst_cfg = agreed_config([p["dst_cfg"] for p in parts], "destination")
            canonical_dst = any(p["canonical_dst"] for p in parts)
            if canonical_dst:
                dst_cfg = src_cfg   # a non-Megatron target: its shapes are checked tensor by tensor by the planner
            diff = config_diff(src_cfg, dst_cfg)
            if diff:
                raise ReshardError("source and destination models differ (source/destination): " + diff)
            config = dict(src_cfg)
            if vocab_size is not None:
                config["vocab_size"] = vocab_size
            self.family = load_family(family_for(config) if family == "auto" else family)
            src = merge_layouts([p["src"] for p in parts])
            dst = merge_layouts([p["dst"] for p in parts])
            self.src_layout = canonicalize(src, self.family, config)
            self.dst_layout = dst if canonical_dst else canonicalize(dst, self.family, config)
            if quantize is not None and topology is not None:
                raise ReshardError("topology= (two-level plans) is not supported with quantize= (FP8 plans)")
            if quantize is not None:
                if not canonical_dst:
                    raise ReshardError("quantize= needs target=(fp8_layout, tensors) (an FP8 engine layout)")
                self.plan = make_fp8_plan(self.src_layout, self.dst_layout, quantize.block, budget_bytes=budget_bytes,
                                          memory_bytes=quantize.memory_bytes, allow_cast=allow_cast,
                                          ignore_unused=ignore_unused)
            else:
                self.plan = make_plan(self.src_layout, self.dst_layout, budget_bytes=budget_bytes,
                                      allow_cast=allow_cast, ignore_unused=ignore_unused, topology=topology)
        # what the refit bound, module by module (the chunks, their submodules, parameters; a target's model):
        # checked at every refit, a replaced module followed or refused (see mcore_reshard.util.identity)
        self.identities = [ident for side, t in (("src", src_t), ("dst", dst_t))
                            if (ident := identity_of(t, side, follow=quantize is None)) is not None]
        if quantize is not None:
            self.resharder = Fp8Resharder(self.plan, src_t, dst_t, group, timeout=timeout, verify=verify)
        else:
            self.resharder = Resharder(self.plan, src_t, dst_t, group, timeout=timeout, verify=verify,
                                       layouts=(self.src_layout, self.dst_layout))
            for ident in self.identities:
                self.resharder.watch(ident.side, ident.check)
            if self.colocated is not None:
                self.resharder.watch("src", self.colocated.check)

    def refit(self, version: int | None = None) -> dict:
        """Every weight once (collective).  First, on every rank, what was bound is checked: a model
        chunk, submodule or parameter object replaced since binding (``model.decoder.layers[1].mlp =
        new_mlp``: LoRA merged, a module re-wrapped) is followed when the new one has the same
        parameters and buffers (names, shapes, dtypes) -- the refit reads / writes the new ones --,
        otherwise every rank raises :class:`ReshardError` naming the module and the rank before a
        byte moves (the FP8 path follows nothing: bind again)."""
        if isinstance(self.resharder, Fp8Resharder):
            refusal = [p for ident in self.identities for p in ident.check()[0]]
            return self.resharder.refit(version, refusal=refusal or None)
        if self.colocated is not None:
            return self.colocated.run(lambda: self.resharder.refit(version))
        return self.resharder.refit(version)

    def state(self) -> dict:
        return self.resharder.state()

    def rebind(self, group=None) -> None:
        self.resharder.rebind(group)

    def close(self) -> None:
        """Drops a colocated trainer's mappings and its channel (nothing to do otherwise)."""
        if self.colocated is not None:
            self.colocated.close()
