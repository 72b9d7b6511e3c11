"""vLLM weight-transfer backend ``mcore_reshard`` (vLLM >= 0.16 ``vllm.distributed.weight_transfer``).

Every tensor goes shard to shard into every worker, over the project's process-group protocol
(:mod:`mcore_reshard.integrations.protocol`): no full-tensor broadcast, no ``load_weights``, no
fallback.  The refit follows vLLM's load lifecycle (:mod:`~mcore_reshard.integrations.vllm_postload`):
``update_weights`` writes vLLM's loader format (the live parameter where post-load processing leaves
it alone, a persistent loader-format buffer where it repacks or replaces it), ``finish_weight_update``
re-runs vLLM's own ``process_weights_after_loading`` over it.  The MTP draft model is refit through
vLLM's draft update (``start_draft_weight_update``).

Selecting it (one documented call registers both sides; vLLM also runs it in every worker through
the ``vllm.general_plugins`` entry point this package declares)::

    from mcore_reshard.integrations.vllm_transfer import register
    register()
    llm = LLM(model=..., tensor_parallel_size=tp, weight_transfer_config=WeightTransferConfig(backend="mcore_reshard"))

    # trainer, every rank (T ranks, group ranks [0, T); the engine's workers follow at T)
    info = McoreReshardTrainerInitInfo(init_method="tcp://host:port", world_size=T + workers, rank=r)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=MegatronSource(chunks, r))
    trainer.send_weights()              # every step: start_weight_update / update_weights / finish_weight_update
    trainer.send_weights(draft=True)    # the MTP draft model, through start_draft_weight_update

``client`` is a ``VLLMWeightSyncClient`` (vLLM's ``HTTPVLLMWeightSyncClient`` / ``RayVLLMWeightSyncClient``,
or any object with its four methods; the draft update also needs ``start_draft_weight_update``, which
``AsyncLLM`` has); the trainer
engine issues its blocking calls from a thread while every trainer rank runs its side of the
transfer.  The worker side needs no client: vLLM creates :class:`McoreReshardWeightTransferEngine`
from ``WeightTransferConfig(backend="mcore_reshard")`` and calls ``init_transfer_engine`` /
``update_weights`` / ``finish_weight_update``.

The classes live one side per module, at top level, each importing vLLM:
:mod:`.vllm_transfer_engine` (``McoreReshardInitInfo``, ``McoreReshardUpdateInfo``,
``McoreReshardWeightTransferEngine``) and :mod:`.vllm_transfer_trainer` (``McoreReshardTrainerInitInfo``,
``MegatronSource``, ``McoreReshardTrainerWeightTransferEngine``).  This module imports neither vLLM nor
them until :func:`register` runs or one of those names is read from it.
"""
from __future__ import annotations

import importlib
from typing import Mapping

BACKEND = "mcore_reshard"
PLAN_KEYS = ("budget_bytes", "allow_cast", "ignore_unused", "verify")
REPORTS_KEPT = 64          # the worker keeps its last refits' reports (a long RL run refits thousands of times)
#: each class of the backend -> the module (of this package) defining it, imported on first use
CLASSES = {
    "McoreReshardInitInfo": "vllm_transfer_engine", "McoreReshardUpdateInfo": "vllm_transfer_engine",
    "McoreReshardWeightTransferEngine": "vllm_transfer_engine",
    "McoreReshardTrainerInitInfo": "vllm_transfer_trainer", "MegatronSource": "vllm_transfer_trainer",
    "McoreReshardTrainerWeightTransferEngine": "vllm_transfer_trainer",
}


def plan_kwargs(options: Mapping) -> dict:
    """The planning options (``PLAN_KEYS``) among an init info's fields, for ``join_refit``."""
    return {k: options[k] for k in PLAN_KEYS if k in options}


def register() -> None:
    """Register ``mcore_reshard`` with vLLM's ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory`` (idempotent).  Also the ``vllm.general_plugins`` entry point."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _module("McoreReshardWeightTransferEngine"),
                                                    "McoreReshardWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, _module("McoreReshardTrainerWeightTransferEngine"),
                                                     "McoreReshardTrainerWeightTransferEngine")


def _module(cls: str) -> str:
    return f"{__package__}.{CLASSES[cls]}"


def __getattr__(name: str):
    """The backend's classes, read through this module (their modules import vLLM on first use)."""
    if name in CLASSES:
        return getattr(importlib.import_module(_module(name)), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKEND", "CLASSES", "PLAN_KEYS", "plan_kwargs", "register", *CLASSES]
