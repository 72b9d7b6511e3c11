"""Inference-engine integrations (layer 5): refit a running vLLM or SGLang engine in place from the trainer.

* :mod:`.protocol` -- the protocol every side runs: :func:`join_group` (one process group for the
  trainer ranks and the engine workers, next to the engine's own world), :func:`join_refit` (exchange
  layout parts / specs, plan, bind a :class:`~mcore_reshard.core.executor.Resharder`), layout specs,
  :func:`check_tensors` (live parameters against a layout, before anything moves),
  :func:`megatron_source` (the trainer's canonical layout part);
* :mod:`.hooks` -- per-engine post-refit hooks (MLA absorbed weights, FP8 guard, cache reset);
* :mod:`.vllm_worker` -- ``McoreReshardWorkerExtension`` for ``LLM(worker_extension_cls=...)``;
* :mod:`.sglang_loader` -- ``load`` for ``--custom-weight-loader`` and the ``SGLangRefit`` session.

Nothing here imports vLLM or SGLang at import time.  See ``docs/engines.md``.
"""
from .hooks import DERIVED, POST_REFIT, PostRefitError, run_post_refit
from .protocol import (
                       build_layout,
                       check_tensors,
                       join_group,
                       join_refit,
                       layout_spec,
                       leave_group,
                       live_tensors,
                       megatron_source,
                       rank_part,
)

__all__ = ["DERIVED", "POST_REFIT", "PostRefitError", "build_layout", "check_tensors", "join_group", "join_refit",
           "layout_spec", "leave_group", "live_tensors", "megatron_source", "rank_part", "run_post_refit"]
