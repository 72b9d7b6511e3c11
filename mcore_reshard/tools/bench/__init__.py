"""``mcore-reshard bench``: full-size plans (metadata only), a cost model, pictures, live runs.

Three parts, each reproducible from the command line (``BENCHMARKS.md`` has the results)::

    mcore-reshard bench --full-size                      # DeepSeek-V3 671B plans, 128-1024 ranks
    mcore-reshard bench --cli                            # `mcore-reshard plan` on each: wall / plan build
    mcore-reshard bench --live --sizes 20M,100M,300M     # 4 CPU processes, three methods side by side
    mcore-reshard bench --smoke                          # a small version of both (seconds)

(``python -m mcore_reshard.tools.bench ...`` takes the same options.)

Modules: :mod:`.configs` (what is benchmarked), :mod:`.baselines` (lower bound, gather + broadcast from
the layouts), :mod:`.fullsize` (metadata-only plans), :mod:`.live` (4 gloo processes, three methods
side by side), :mod:`.report` (tables, pictures), :mod:`.cli` (options, driver).

Full size: every configuration builds the source layout with
:func:`mcore_reshard.sources.megatron_spec.megatron_layout` and the target with the vLLM / SGLang / Megatron
layout builders, then calls :func:`mcore_reshard.core.planner.make_plan` once (whole plan, default
256 MiB staging budget), each configuration in its own process (``--timeout`` per configuration).
Reported: bytes moved against the lower bound and against a gather + broadcast baseline computed
from the same layouts (:func:`gather_broadcast`), max / mean bytes per sending and per receiving
rank, messages, rounds, plan time and plan memory, and the :mod:`mcore_reshard.tools.costmodel`
predictions next to the published figures.

Gather + broadcast baseline, precisely: the unit is one tensor of the Hugging Face checkpoint
(:func:`checkpoint_units`: a canonical tensor, except that stacked experts count per expert and per
gate / up / down projection, as the checkpoint stores them).  For every unit, the source rank
holding the most of it is the *root*; every distinct source box the root lacks is sent to it once
(by the least-loaded holder); then the root sends the whole unit to every destination rank that
needs any part of it (other than itself).  Bytes = gathered bytes + unit bytes x receivers.
(Megatron-Bridge's export all-gathers every TP shard to every TP rank before the broadcast, so it
moves more than this; NeMo RL's broadcast path sends every tensor to every inference worker.)
"""
import importlib

#: public name -> the submodule defining it, imported on first use (``mcore-reshard plan`` registers the
#: ``bench`` options without importing the drivers, their subprocess / tracemalloc / statistics imports)
_WHERE = {**dict.fromkeys(("checkpoint_units", "gather_broadcast", "lower_bound"), "baselines"),
          **dict.fromkeys(("CONFIGS", "FULL_SIZE_DEFAULT", "PUBLISHED", "FullSizeConfig", "kimi_k2_1t", "small_config"),
                          "configs"),
          **dict.fromkeys(("run_cli", "run_full_size", "run_full_size_config", "traffic_matrix"), "fullsize"),
          **dict.fromkeys(("add_bench_parser", "cmd_bench", "main"), "options"),
          **dict.fromkeys(("markdown_full_size", "markdown_live", "plot_full_size", "plot_live"), "report")}

__all__ = ["CONFIGS", "FULL_SIZE_DEFAULT", "FullSizeConfig", "PUBLISHED", "add_bench_parser", "checkpoint_units",
           "cmd_bench", "gather_broadcast", "kimi_k2_1t", "lower_bound", "main", "markdown_full_size", "markdown_live",
           "plot_full_size", "plot_live", "run_cli", "run_full_size", "run_full_size_config", "small_config", "traffic_matrix"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
