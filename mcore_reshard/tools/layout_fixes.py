"""What fits: the fix the CLI names when a layout string does not fit a model.

Three kinds, each computed for the model at hand and checked before it is offered:

* pipeline stages (:func:`stage_fix`): the layers do not divide over ``pp`` (x ``vpp``) -> the
  ``first=`` / ``last=`` forms (uneven first / last stages) that split them, most even first;
* expert parallelism against the world (:func:`expert_dp_fix`): ``etp * ep * pp`` must divide
  ``tp * pp * cp * dp`` -> the ``dp`` values that make it;
* a size that does not divide one of the model's dimensions (heads, vocabulary, experts, ...;
  :func:`fitting_sizes`) -> for each key, the values that build, found by building the layout
  of the same model cut to one layer of each kind (:func:`proxy_model`; widths unchanged).

Example (DeepSeek-V3, 61 layers)::

    stage_fix(61, parse("pp=15,ep=16"))
    -> "'pp=15,ep=16,first=5' (stages 5/4x14) or 'pp=15,ep=16,first=5,last=4' (stages 5/4x13/4)"
"""
from __future__ import annotations

import time

from ..sources.megatron_spec import ParallelSizes, stage_layers
from ..targets import ModelConfig
from . import layout_strings
from .layout_strings import LayoutSpec

#: values tried for a size that does not fit (those whose layout would exceed MAX_TRIAL_WORLD skipped)
CANDIDATES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
MAX_TRIAL_WORLD = 4096
TRIAL_SECONDS = 20.0            # the search gives what it found by then


def _stages_text(counts: list[int]) -> str:
    """[3, 4, 4, 4, 2] -> '3/4x3/2'."""
    out, i = [], 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]}x{j - i}" if j - i > 1 else str(counts[i]))
        i = j
    return "/".join(out)


def stage_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None]]:
    """(first, last) stage sizes that split ``num_layers`` over ``pp`` stages (None: that stage is
    like the middle ones), best first: the busiest stage smallest, then the most even, then the
    lightest first + last stages (they also hold the embedding and the output layer); at most one
    of each form (first and last, first only, last only)."""
    if pp < 2:
        return []
    found = {}
    for form in ("both", "first", "last"):
        middle = pp - (2 if form == "both" else 1)
        best = None
        for k in range(0 if middle == 0 else 1, num_layers + 1):
            rest = num_layers - middle * k
            if rest < (2 if form == "both" else 1):
                break
            if middle == 0 and k:
                break
            if form == "both":
                first, last = (rest + 1) // 2, rest // 2
            else:
                first, last = (rest, None) if form == "first" else (None, rest)
            counts = [k] * pp
            if first is not None:
                counts[0] = first
            if last is not None:
                counts[-1] = last
            score = (max(counts), max(counts) - min(counts), (first or 0) + (last or 0))
            if best is None or score < best[0]:
                best = (score, first, last)
        if best is not None:
            found[form] = best
    return [(f, last) for _, f, last in sorted(found.values(), key=lambda x: x[0])]


def stage_fix(num_layers: int, spec: LayoutSpec) -> str | None:
    """None when the layers of a Megatron ``spec`` split over its pipeline stages; else the layout
    strings to write instead, each checked with
    :func:`~mcore_reshard.sources.megatron_spec.stage_layers`."""
    sizes = layout_strings.megatron_sizes(spec)
    try:
        stage_layers(num_layers, sizes)
        return None
    except ValueError:
        pass
    pp, vpp = sizes.pp, sizes.vpp
    if pp > num_layers:
        return f"pp at most {num_layers} ({num_layers} layers, at least one per stage)"
    forms = []
    for first, last in stage_splits(num_layers, pp):
        trial = ParallelSizes(pp=pp, first_stage_layers=first, last_stage_layers=last)
        counts = [len(s) for s in stage_layers(num_layers, trial)]
        text = layout_strings.with_sizes(spec, first=first, last=last, vpp=None)
        forms.append(f"{text!r} (stages {_stages_text(counts)})")
    if vpp > 1 and spec.sizes.get("first") is None and spec.sizes.get("last") is None:
        forms = [f"{layout_strings.with_sizes(spec, vpp=v)!r}" for v in range(1, num_layers // pp + 1)
                 if num_layers % (pp * v) == 0] + forms
    return " or ".join(forms[:3]) or None


def expert_dp_fix(sizes: ParallelSizes) -> str | None:
    """None when ``etp * ep * pp`` divides the world; else the dp values that make it."""
    need = sizes.etp * sizes.ep * sizes.pp
    if sizes.world % need == 0:
        return None
    step = layout_strings.expert_dp(sizes.tp, sizes.pp, sizes.cp, sizes.ep, sizes.etp)
    dps = "|".join(str(step * i) for i in range(1, 5))
    return (f"dp={dps}... (multiples of {step}: tp*pp*cp*dp must be a multiple of etp*ep*pp = {need}), or no dp= "
            f"(it defaults to the smallest, {step})")


def proxy_model(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` cut to the fewest layers that still hold one of each kind (dense, MoE), widths
    unchanged: a layout of it builds exactly when the full model's does on one pipeline stage."""
    kinds = {cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)}
    n = 1
    while n < cfg.num_hidden_layers and {cfg.is_moe_layer(i) for i in range(n)} != kinds:
        n += 1
    return cfg.with_(num_hidden_layers=n)


def _one_stage(spec: LayoutSpec, sizes: dict) -> LayoutSpec:
    """``spec`` with ``sizes``, its pipeline cut to one stage (Megatron: pp, vpp, first, last and dp
    dropped, dp then the smallest that fits; engines: pp dropped) and one replica."""
    s = {k: v for k, v in sizes.items() if k not in ("pp", "vpp", "first", "last", "replicas")}
    if spec.engine == "megatron":
        s.pop("dp", None)
    return LayoutSpec(spec.engine, s, spec.text)


def builds(spec: LayoutSpec, cfg: ModelConfig) -> bool:
    try:
        layout_strings.build(spec, cfg)
        return True
    except ValueError:              # LayoutError is a ValueError
        return False


def fitting_sizes(spec: LayoutSpec, cfg: ModelConfig) -> dict[str, list[int]]:
    """For each size key of ``spec`` (pipeline keys aside), the :data:`CANDIDATES` values that make
    its layout build on :func:`proxy_model` with the other sizes as given; {} when the layout
    builds there already (what fails is then not a width: the pipeline, the ranks)."""
    proxy = proxy_model(cfg)
    if builds(_one_stage(spec, spec.sizes), proxy):
        return {}
    size_keys = [k for k in layout_strings.KEYS[spec.engine][0] if k not in ("pp", "vpp", "first", "last", "dp",
                                                                            "replicas")]
    if spec.engine != "megatron":
        size_keys.append("dp")
    out: dict[str, list[int]] = {}
    deadline = time.monotonic() + TRIAL_SECONDS
    for key in size_keys:
        fits = []
        for v in CANDIDATES:
            trial = _one_stage(spec, {**spec.sizes, key: v})
            if trial.world() > MAX_TRIAL_WORLD or time.monotonic() > deadline:
                continue
            if builds(trial, proxy):
                fits.append(v)
        if fits:
            out[key] = fits
    return out


def fix_text(spec: LayoutSpec, cfg: ModelConfig, model: str) -> str:
    """``"; sizes that fit <model>: tp=1|2|4 or ep=..."`` for a layout that does not build, or ''."""
    fits = fitting_sizes(spec, cfg)
    if not fits:
        return ""
    alts = " or ".join(f"{k}={'|'.join(map(str, v))}" for k, v in fits.items())
    return f"; sizes that fit {model} (one changed, the others as given): {alts}"
