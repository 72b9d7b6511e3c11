"""Model-family tables: Megatron-Core global tensor keys -> canonical (Hugging Face) tensors.

Tables live in ``layouts/<family>.toml`` (shipped as ``mcore_reshard.layouts``).  A table has

* ``[[global]]`` entries, full Megatron keys (``embedding.word_embeddings.weight``);
* ``[[layer_prefix]]`` entries, e.g. ``decoder.layers.{L}.`` -> ``model.layers.{L}.`` and
  ``mtp.layers.{K}.transformer_layer.`` -> ``model.layers.{K+num_layers}.``;
* ``[[layer]]`` entries, key suffixes inside a layer (``self_attention.linear_proj.weight``);
* ``ignore``: regexes of keys that carry no weights for inference;
* ``[fp8]`` (optional): ``not_quantized`` regexes of canonical tensors a block-FP8 checkpoint keeps
  in high precision, ``halves`` regexes of ``[gate; up]`` tensors quantized half by half, the
  default ``block`` (see :mod:`mcore_reshard.fp8.quant_layout`).

Each entry has ``megatron``, ``hf`` (one name or a list) and a ``rule``:

=========  ====================================================================================
rename     same global tensor under another name (the default)
split      ``hf`` is a list; the Megatron tensor is their concatenation along ``dim`` (default 0)
           in equal parts (Megatron's ``linear_fc1`` global = ``[gate_proj; up_proj]``)
gqa_qkv    Megatron's ``linear_qkv``: per query group ``[q (heads/groups rows of head_dim);
           k; v]`` -> ``q_proj``, ``k_proj``, ``v_proj``; sizes from the model config
vocab      rows past the real vocab size are padding (not part of the canonical tensor)
=========  ====================================================================================

Example (gqa_qkv, 4 heads, 2 groups, head_dim 1): Megatron rows ``[q0 q1 k0 v0 | q2 q3 k1 v1]``
map to ``q_proj`` rows 0-3, ``k_proj`` rows 0-1 and ``v_proj`` rows 0-1.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Mapping, Sequence

from ..core.box import Box
from ..core.layout import Buffer, Layout, LayoutError, Piece
from .fp8_rules import Fp8Rules

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

_PLACEHOLDER = re.compile(r"\{(\w+)(?:\+(\w+))?\}")


class FamilyError(LayoutError):
    """A tensor the family table does not know, or a table that contradicts the model."""


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    rule: str = "rename"
    dim: int = 0


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    globals: tuple[Rule, ...]
    layer_prefixes: tuple[tuple[str, str], ...]
    layer_rules: tuple[Rule, ...]
    ignore: tuple[str, ...]
    fp8: "Fp8Rules | None" = None     # ``[fp8]``: which canonical tensors a block-FP8 checkpoint quantizes

    def fp8_rules(self) -> "Fp8Rules":
        if self.fp8 is None:
            raise FamilyError(f"family {self.name} has no [fp8] section in layouts/{self.name}.toml: "
                              "which of its tensors an FP8 checkpoint quantizes is unknown")
        return self.fp8

    def is_ignored(self, key: str) -> bool:
        return any(re.search(p, key) for p in self.ignore)

    def match(self, key: str, config: Mapping[str, int]) -> tuple[Rule, tuple[str, ...]]:
        """The rule for a Megatron key and the canonical names it maps to."""
        for rule in self.globals:
            m = _template_regex(rule.megatron).fullmatch(key)
            if m:
                return rule, tuple(_fill(h, m.groupdict(), config) for h in rule.hf)
        for mprefix, hprefix in self.layer_prefixes:
            m = _template_regex(mprefix, prefix=True).match(key)
            if not m:
                continue
            rest = key[m.end():]
            hp = _fill(hprefix, m.groupdict(), config)
            for rule in self.layer_rules:
                if rule.megatron == rest:
                    return rule, tuple(hp + h for h in rule.hf)
        raise FamilyError(f"family {self.name}: no table entry for Megatron tensor {key!r} "
                          f"(add it to layouts/{self.name}.toml, or to its ignore list if inference does not need it)")


@lru_cache(maxsize=None)
def _template_regex(template: str, prefix: bool = False) -> re.Pattern:
    out, pos = "", 0
    for m in _PLACEHOLDER.finditer(template):
        out += re.escape(template[pos:m.start()]) + f"(?P<{m.group(1)}>\\d+)"
        pos = m.end()
    out += re.escape(template[pos:])
    return re.compile(out)


def _fill(template: str, groups: Mapping[str, str], config: Mapping[str, int]) -> str:
    def value(name: str) -> int:
        if name in groups:
            return int(groups[name])
        if name.isdigit():
            return int(name)
        if name in config:
            return int(config[name])
        raise FamilyError(f"template {template!r}: unknown variable {name!r}")
    return _PLACEHOLDER.sub(lambda m: str(value(m.group(1)) + (value(m.group(2)) if m.group(2) else 0)), template)


def _rules(items) -> tuple[Rule, ...]:
    out = []
    for it in items or ():
        hf = it["hf"]
        out.append(Rule(it["megatron"], tuple(hf) if isinstance(hf, list) else (hf,), it.get("rule", "rename"), it.get("dim", 0)))
    return tuple(out)


def parse_family(text: str, name: str = "<table>") -> Family:
    if tomllib is None:
        raise FamilyError("reading family tables needs Python >= 3.11 (tomllib)")
    data = tomllib.loads(text)
    return Family(data.get("name", name), data.get("doc", ""), _rules(data.get("global")),
                  tuple((p["megatron"], p["hf"]) for p in data.get("layer_prefix", ())),
                  _rules(data.get("layer")), tuple(data.get("ignore", ())), Fp8Rules.from_table(data.get("fp8")))


@lru_cache(maxsize=None)
def load_family(name: str) -> Family:
    """A shipped table by name (``deepseek_v3``, ``llama``, ``qwen3_moe``)."""
    try:
        text = resources.files("mcore_reshard.layouts").joinpath(f"{name}.toml").read_text()
    except FileNotFoundError:
        raise FamilyError(f"no family table {name!r}; shipped: {', '.join(shipped_families())}") from None
    return parse_family(text, name)


def shipped_families() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("mcore_reshard.layouts").iterdir() if p.name.endswith(".toml"))


# ---------------------------------------------------------------- mapping boxes through rules

def _segments_split(shape: Sequence[int], n: int, dim: int) -> list[tuple[int, int, int, int]]:
    """(part index, start row in Megatron tensor, length, start row in the part)."""
    if shape[dim] % n:
        raise FamilyError(f"cannot split dim {dim} of size {shape[dim]} into {n} equal parts")
    size = shape[dim] // n
    return [(i, i * size, size, 0) for i in range(n)]


def _segments_qkv(shape: Sequence[int], config: Mapping[str, int]) -> list[tuple[int, int, int, int]]:
    heads, groups, hd = config["num_attention_heads"], config["num_query_groups"], config["kv_channels"]
    qpg = heads // groups
    rows = groups * (qpg + 2) * hd
    if shape[0] != rows or heads % groups:
        raise FamilyError(f"linear_qkv has {shape[0]} rows; config says {groups} groups x ({qpg} q + k + v) x head_dim {hd} = {rows}")
    out, step = [], (qpg + 2) * hd
    for g in range(groups):
        out.append((0, g * step, qpg * hd, g * qpg * hd))
        out.append((1, g * step + qpg * hd, hd, g * hd))
        out.append((2, g * step + (qpg + 1) * hd, hd, g * hd))
    return out


def canonical_shapes(rule: Rule, names: Sequence[str], shape: Sequence[int], config: Mapping[str, int]) -> list[tuple[int, ...]]:
    shape = tuple(shape)
    if rule.rule == "rename":
        return [shape]
    if rule.rule == "vocab":
        vocab = int(config.get("vocab_size") or shape[0])
        return [(min(vocab, shape[0]),) + shape[1:]]
    if rule.rule == "split":
        d = rule.dim
        return [shape[:d] + (shape[d] // len(names),) + shape[d + 1:]] * len(names)
    if rule.rule == "gqa_qkv":
        heads, groups, hd = config["num_attention_heads"], config["num_query_groups"], config["kv_channels"]
        return [(heads * hd,) + shape[1:], (groups * hd,) + shape[1:], (groups * hd,) + shape[1:]]
    raise FamilyError(f"unknown rule {rule.rule!r} for {rule.megatron}")


def map_piece(rule: Rule, names: Sequence[str], shape: Sequence[int], piece: Piece,
              config: Mapping[str, int]) -> list[Piece]:
    """Cut one Megatron-space piece into canonical pieces (same local bytes, new tensor boxes)."""
    if rule.rule == "rename":
        return [Piece(names[0], piece.box, piece.local)]
    if rule.rule == "vocab":
        (cshape,) = canonical_shapes(rule, names, shape, config)
        sub = piece.box.intersect(Box.full(cshape))
        return [] if sub is None else [Piece(names[0], sub, piece.local_of(sub))]
    if rule.rule == "split":
        d, segs = rule.dim, _segments_split(shape, len(names), rule.dim)
    elif rule.rule == "gqa_qkv":
        d, segs = 0, _segments_qkv(shape, config)
    else:
        raise FamilyError(f"unknown rule {rule.rule!r} for {rule.megatron}")
    out = []
    for part, start, length, dst_start in segs:
        offs = list(piece.box.offsets)
        sizes = list(piece.box.sizes)
        lo, hi = max(offs[d], start), min(offs[d] + sizes[d], start + length)
        if hi <= lo:
            continue
        sub = Box(tuple(offs[:d] + [lo] + offs[d + 1:]), tuple(sizes[:d] + [hi - lo] + sizes[d + 1:]))
        cbox = Box(tuple(offs[:d] + [lo - start + dst_start] + offs[d + 1:]), sub.sizes)
        out.append(Piece(names[part], cbox, piece.local_of(sub)))
    return out


def canonicalize(layout: Layout, family: Family, config: Mapping[str, int]) -> Layout:
    """The same buffers, with pieces re-expressed on canonical tensors through ``family``."""
    out = Layout()
    plan: dict[str, tuple[Rule, tuple[str, ...]]] = {}
    for key, meta in sorted(layout.tensors.items()):
        rule, names = family.match(key, config)
        plan[key] = (rule, names)
        for name, shape in zip(names, canonical_shapes(rule, names, meta.shape, config)):
            out.add_tensor(name, shape, meta.dtype)
    for r in layout.ranks:
        for bname, buf in sorted(layout.buffers[r].items()):
            pieces = []
            for p in buf.pieces:
                rule, names = plan[p.tensor]
                pieces += map_piece(rule, names, layout.tensors[p.tensor].shape, p, config)
            out.add_buffer(r, Buffer(buf.name, buf.shape, buf.dtype, tuple(pieces)))
    return out
