"""Short layout strings for the CLI: ``[engine:]key=value,...``.

=====================================  ======================================================
``tp=2,pp=16,ep=64`` / ``megatron:…``   Megatron-Core (keys tp pp cp ep etp dp vpp first last;
                                        dp defaults to the smallest value that makes EP fit)
``vllm:tp=8,dp=2,ep``                   vLLM (``ep`` = enable_expert_parallel; ``pp=N``;
                                        ``legacy`` = pre-``routed_experts`` parameter names;
                                        ``replicas=N`` engines side by side)
``sglang:tp=16,dp=16,ep=16,dpattn``     SGLang (``dpattn`` = --enable-dp-attention;
                                        ``fuse`` / ``nofuse`` the shared expert;
                                        ``replicas=N`` engines side by side)
``hf``                                  Hugging Face, unsharded on one rank
=====================================  ======================================================

The grammar (:data:`GRAMMAR`, docs/layout-strings.md), strictly: ``hf``, or an optional engine and
a colon, then items separated by single commas, each ``key=N`` (N a whole number >= 1 in ASCII
digits) or a flag, every key at most once and known to the engine; no whitespace anywhere.  Anything
else is a ValueError naming the bad part (:func:`parse`).

Example: ``build(parse("vllm:tp=8,dp=2,ep"), cfg, rank_offset=256)`` gives the 16-rank vLLM
layout on ranks 256..271.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import gcd

from ..core.layout import Layout
from ..sources.megatron_spec import ParallelSizes, megatron_layout
from ..targets import ModelConfig, hf_layout, sglang_layout, vllm_layout

GRAMMAR = """\
layout = "hf" | [engine ":"] item *("," item)
engine = "megatron" | "vllm" | "sglang"
item   = key "=" N | flag          (keys and flags: KEYS[engine])
N      = 1*DIGIT, a whole number >= 1 (ASCII digits)
no whitespace; no empty item; every key at most once"""

#: engine -> (keys taking ``=N``, flags taking no value)
KEYS = {
    "megatron": (("tp", "pp", "cp", "ep", "etp", "dp", "vpp", "first", "last"), ()),
    "vllm": (("tp", "dp", "pp", "replicas"), ("ep", "legacy")),
    "sglang": (("tp", "dp", "ep", "replicas"), ("dpattn", "fuse", "nofuse")),
    "hf": ((), ()),
}
ENGINES = tuple(KEYS)
#: what a flag means, for the error that finds one given a value
FLAG_MEANING = {"ep": "enable_expert_parallel", "legacy": "parameter names before experts.routed_experts",
                "dpattn": "--enable-dp-attention", "fuse": "shared expert fused into the routed experts",
                "nofuse": "shared expert kept apart"}
EXAMPLE = {"megatron": "tp=2,pp=2", "vllm": "vllm:tp=8,dp=2,ep", "sglang": "sglang:tp=8,dp=8,ep=8,dpattn", "hf": "hf"}
_NUMBER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class LayoutSpec:
    engine: str
    sizes: dict          # key -> int (flags -> 1)
    text: str

    def world(self, cfg: ModelConfig | None = None) -> int:
        """Ranks the layout takes (all replicas)."""
        s = self.sizes
        if self.engine == "hf":
            return 1
        if self.engine == "megatron":
            return megatron_sizes(self).world
        if self.engine == "sglang":      # dp is attention data parallelism inside the tp ranks
            return s.get("tp", 1) * s.get("replicas", 1)
        return s.get("tp", 1) * s.get("dp", 1) * s.get("pp", 1) * s.get("replicas", 1)


def _keys_text(engine: str) -> str:
    sizes, flags = KEYS[engine]
    text = f"{engine} keys: " + " ".join(f"{k}=N" for k in sizes) if sizes else f"{engine} takes no keys"
    return text + (f"; flags: {' '.join(flags)}" if flags else "")


def parse(text: str) -> LayoutSpec:
    """``text`` as a :class:`LayoutSpec`; a ValueError naming the bad part unless it follows
    :data:`GRAMMAR` (the caller adds which option gave it)."""
    if not isinstance(text, str):
        raise ValueError(f"a layout string, not {type(text).__name__}")
    if not text:
        raise ValueError("empty layout string; e.g. " + " or ".join(EXAMPLE.values()))
    space = re.search(r"\s", text)
    if space:
        raise ValueError(f"whitespace at character {space.start() + 1} ({space.group()!r}): a layout string has "
                         f"none, e.g. {EXAMPLE['megatron']!r}")
    if text == "hf":
        return LayoutSpec("hf", {}, text)
    engine, sep, rest = text.partition(":")
    if not sep:
        engine, rest = "megatron", text
    if engine not in KEYS:
        raise ValueError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)} (lower case), e.g. "
                         f"{EXAMPLE['vllm']!r}")
    if engine == "hf":
        raise ValueError(f"'hf' takes no keys: write 'hf', not {text!r}")
    if not rest:
        raise ValueError(f"nothing after {engine + ':'!r}; {_keys_text(engine)}, e.g. {EXAMPLE[engine]!r}")
    size_keys, flags = KEYS[engine]
    sizes: dict[str, int] = {}
    given: dict[str, str] = {}
    at = len(text) - len(rest)          # character offset of the current item in ``text``
    for item in rest.split(","):
        if not item:
            where = "at the start" if at == len(text) - len(rest) else "at the end" if at == len(text) else \
                f"at character {at + 1}"
            raise ValueError(f"empty item {where} (two commas in a row, or a comma at either end): items are "
                             "separated by single commas")
        key, eq, value = item.partition("=")
        if not key:
            raise ValueError(f"{item!r} has no key; {_keys_text(engine)}")
        if key not in size_keys and key not in flags:
            raise ValueError(f"unknown key {key!r} in {item!r}; {_keys_text(engine)}")
        if key in given:
            raise ValueError(f"{key!r} given twice ({given[key]!r} and {item!r})")
        given[key] = item
        if key in flags:
            if eq:
                raise ValueError(f"{item!r}: {key!r} is a flag of {engine} layouts ({FLAG_MEANING[key]}) and "
                                 f"takes no value: write {key!r}")
            sizes[key] = 1
        elif not eq:
            raise ValueError(f"{item!r} needs a value: {key}=N, N a whole number >= 1")
        elif not value:
            raise ValueError(f"{item!r} has no value: {key}=N, N a whole number >= 1")
        elif not _NUMBER.fullmatch(value) or int(value) < 1:
            raise ValueError(f"bad size {item!r}: {value!r} is not a whole number >= 1")
        else:
            sizes[key] = int(value)
        at += len(item) + 1
    if "fuse" in sizes and "nofuse" in sizes:
        raise ValueError(f"'fuse' and 'nofuse' contradict each other in {text!r}: give one")
    return LayoutSpec(engine, sizes, text)


def with_sizes(spec: LayoutSpec, **sizes: int | None) -> str:
    """``spec``'s string with ``sizes`` set (None: removed), in its own order, new keys last:
    ``with_sizes(parse("tp=1,pp=15"), first=5)  ->  "tp=1,pp=15,first=5"``."""
    out = {**spec.sizes, **sizes}
    flags = KEYS[spec.engine][1]
    items = [k if k in flags else f"{k}={v}" for k, v in out.items() if v is not None]
    prefix = spec.text.partition(":")[0] + ":" if ":" in spec.text else ""
    return prefix + ",".join(items)


def expert_dp(tp: int, pp: int, cp: int, ep: int, etp: int) -> int:
    """The smallest dp with ``etp * ep * pp`` dividing the world ``tp * pp * cp * dp`` (every
    dp fitting it is a multiple of this one)."""
    need, base = etp * ep * pp, tp * pp * cp
    return need // gcd(need, base)


def megatron_sizes(spec: LayoutSpec) -> ParallelSizes:
    s = dict(spec.sizes)
    known = set(KEYS["megatron"][0])
    if set(s) - known:
        raise ValueError(f"{spec.text}: unknown Megatron keys {sorted(set(s) - known)}; known: {sorted(known)}")
    tp, pp, cp, ep = s.get("tp", 1), s.get("pp", 1), s.get("cp", 1), s.get("ep", 1)
    etp = s.get("etp", tp)
    if "dp" not in s:
        s["dp"] = expert_dp(tp, pp, cp, ep, etp)
    return ParallelSizes(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=s["dp"], vpp=s.get("vpp", 1),
                         first_stage_layers=s.get("first"), last_stage_layers=s.get("last"))


def replicate(layout: Layout, copies: int, stride: int) -> Layout:
    """``copies`` instances of ``layout``, instance i on ranks shifted by ``i * stride`` (engine
    replicas side by side; buffers shared, read-only)."""
    if copies == 1:
        return layout
    out = Layout(dict(layout.tensors), {})
    for i in range(copies):
        for r, bufs in layout.buffers.items():
            out.buffers[r + i * stride] = dict(bufs)
    return out


def build(spec: LayoutSpec, cfg: ModelConfig, rank_offset: int = 0, dtype: str = "bfloat16") -> Layout:
    """The canonical layout this string describes, on ranks from ``rank_offset``."""
    s = spec.sizes
    if spec.engine == "hf":
        return hf_layout(cfg, rank=rank_offset, dtype=dtype)
    if spec.engine == "megatron":
        return megatron_layout(cfg, megatron_sizes(spec), cfg.family, dtype=dtype, rank_offset=rank_offset)
    copies = s.get("replicas", 1)
    if spec.engine == "vllm":
        one = vllm_layout(cfg, tp=s.get("tp", 1), dp=s.get("dp", 1), enable_expert_parallel=bool(s.get("ep")),
                          rank_offset=rank_offset, dtype=dtype, names="legacy" if s.get("legacy") else "current",
                          pp=s.get("pp", 1))
    else:
        fuse = True if s.get("fuse") else False if s.get("nofuse") else None
        one = sglang_layout(cfg, tp=s.get("tp", 1), dp=s.get("dp", 1), ep=s.get("ep", 1),
                            enable_dp_attention=bool(s.get("dpattn")), fuse_shared_expert=fuse,
                            rank_offset=rank_offset, dtype=dtype)
    return replicate(one, copies, spec.world() // copies)
