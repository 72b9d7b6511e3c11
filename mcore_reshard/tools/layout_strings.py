"""Short layout strings for the CLI: ``[engine:]key=value,...``.

=====================================  ======================================================
``tp=2,pp=16,ep=64`` / ``megatron:…``   Megatron-Core (keys tp pp cp ep etp dp vpp first last;
                                        dp defaults to the smallest value that makes EP fit)
``vllm:tp=8,dp=2,ep``                   vLLM (``ep`` = enable_expert_parallel; ``pp=N``;
                                        ``legacy`` = pre-``routed_experts`` parameter names)
``sglang:tp=16,dp=16,ep=16,dpattn``     SGLang (``dpattn`` = --enable-dp-attention;
                                        ``fuse`` / ``nofuse`` the shared expert)
``hf``                                  Hugging Face, unsharded on one rank
=====================================  ======================================================

Example: ``parse_layout("vllm:tp=8,dp=2,ep", cfg, rank_offset=256)`` gives the 16-rank vLLM
layout on ranks 256..271.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from ..core.layout import Layout
from ..sources.megatron_spec import ParallelSizes, megatron_layout
from ..targets import ModelConfig, hf_layout, sglang_layout, vllm_layout

ENGINES = ("megatron", "vllm", "sglang", "hf")


@dataclass(frozen=True)
class LayoutSpec:
    engine: str
    sizes: dict          # key -> int (flags -> 1)
    text: str

    def world(self, cfg: ModelConfig | None = None) -> int:
        if self.engine == "hf":
            return 1
        if self.engine == "megatron":
            return megatron_sizes(self).world
        return self.sizes.get("tp", 1) * self.sizes.get("dp", 1) * self.sizes.get("pp", 1)


def parse(text: str) -> LayoutSpec:
    engine, sep, rest = text.partition(":")
    if not sep:
        engine, rest = ("hf", "") if text.strip() == "hf" else ("megatron", text)
    engine = engine.strip().lower()
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} in {text!r}; expected one of {', '.join(ENGINES)}")
    sizes = {}
    for item in filter(None, (t.strip() for t in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            sizes[key.strip()] = 1
        elif value.strip().isdigit() and int(value) >= 1:
            sizes[key.strip()] = int(value)
        else:
            raise ValueError(f"bad size {item!r} in {text!r}: expected key=N (N >= 1) or a flag")
    return LayoutSpec(engine, sizes, text)


def megatron_sizes(spec: LayoutSpec) -> ParallelSizes:
    s = dict(spec.sizes)
    known = {"tp", "pp", "cp", "ep", "etp", "dp", "vpp", "first", "last"}
    if set(s) - known:
        raise ValueError(f"{spec.text}: unknown Megatron keys {sorted(set(s) - known)}; known: {sorted(known)}")
    tp, pp, cp, ep = s.get("tp", 1), s.get("pp", 1), s.get("cp", 1), s.get("ep", 1)
    etp = s.get("etp", tp)
    if "dp" not in s:   # smallest dp with etp*ep*pp dividing tp*pp*cp*dp
        need = etp * ep * pp
        base = tp * pp * cp
        s["dp"] = need // gcd(need, base)
    return ParallelSizes(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=s["dp"], vpp=s.get("vpp", 1),
                         first_stage_layers=s.get("first"), last_stage_layers=s.get("last"))


def build(spec: LayoutSpec, cfg: ModelConfig, rank_offset: int = 0, dtype: str = "bfloat16") -> Layout:
    """The canonical layout this string describes, on ranks from ``rank_offset``."""
    s = spec.sizes
    if spec.engine == "hf":
        return hf_layout(cfg, rank=rank_offset, dtype=dtype)
    if spec.engine == "megatron":
        return megatron_layout(cfg, megatron_sizes(spec), cfg.family, dtype=dtype, rank_offset=rank_offset)
    if spec.engine == "vllm":
        return vllm_layout(cfg, tp=s.get("tp", 1), dp=s.get("dp", 1), enable_expert_parallel=bool(s.get("ep")),
                           rank_offset=rank_offset, dtype=dtype, names="legacy" if s.get("legacy") else "current",
                           pp=s.get("pp", 1))
    fuse = True if s.get("fuse") else False if s.get("nofuse") else None
    return sglang_layout(cfg, tp=s.get("tp", 1), dp=s.get("dp", 1), ep=s.get("ep", 1),
                         enable_dp_attention=bool(s.get("dpattn")), fuse_shared_expert=fuse,
                         rank_offset=rank_offset, dtype=dtype)
