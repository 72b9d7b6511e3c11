"""The trainer side of the vLLM weight-transfer backend ``mcore_reshard``: every trainer rank runs
``WeightTransferTrainerFactory.trainer_init(McoreReshardTrainerInitInfo(...), client=..., source=MegatronSource(chunks, r))``
(after :func:`mcore_reshard.integrations.vllm_transfer.register`), then ``send_weights()`` each step.  See
:mod:`mcore_reshard.integrations.vllm_transfer` for the whole backend.

Imports vLLM: read its classes through :mod:`~mcore_reshard.integrations.vllm_transfer`, which needs no vLLM itself.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from ..colocate import ColocatedTrainer, check_colocated, worker_colocated
from ..core.executor import ReshardError
from ..core.planner import DEFAULT_BUDGET, DEFAULT_WINDOW
from .protocol import join_group, join_refit, leave_group, timed_refit
from .vllm_refit_modes import check_mode
from .vllm_transfer import BACKEND, plan_kwargs


@dataclass
class McoreReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer side: ``rank`` is this trainer rank's rank in the shared group (``[0, T)``);
    ``rank_offset`` (default ``T``) is where the engine's workers start.  ``refit_mode`` /
    ``window_bytes``: how the engine receives (``"stream"``, default: no second copy of the weights,
    window by window; ``"shadow"``: into a persistent copy while it keeps generating; see
    :mod:`~mcore_reshard.integrations.vllm_refit_modes`), sent to the workers with the rest.

    Colocated (:mod:`mcore_reshard.colocate`; every value from one
    :class:`~mcore_reshard.core.devices.DeviceMap` ``d`` and ``s = pair_specs(d, dir)``):
    ``colocated=s["trainer"][i]`` on trainer rank ``i``: when not None this rank shares its device
    with an engine worker and joins no group -- it hands its weights to that worker
    (:class:`~mcore_reshard.colocate.ColocatedTrainer`; ``rank`` is then unused); otherwise
    ``rank=d.trainer_group_rank(i)``.  ``engine_colocated=s["engine"]`` (the workers' ``colocated``),
    ``rank_offset=d.rank_offset``, ``world_size=d.group_size``::

        DeviceMap(["a", "b"], ["a"]):  trainer 0: colocated=pair-0 | trainer 1: rank=0 | worker: group rank 1"""
    backend = BACKEND
    init_method: str = ""
    world_size: int = 0
    trainer_ranks: int = 1
    rank_offset: int | None = None
    timeout_s: float = 600.0
    group_backend: str | None = None
    layout: dict | None = None
    ignore_params: list = field(default_factory=list)
    budget_bytes: int = DEFAULT_BUDGET
    allow_cast: bool | str = "loader"
    ignore_unused: bool = True
    verify: bool = False
    post_load: str = "reprocess"
    refit_mode: str = "stream"
    window_bytes: int = DEFAULT_WINDOW
    colocated: dict | None = None
    engine_colocated: list | dict | None = None

    def worker_info(self) -> dict:
        off = self.trainer_ranks if self.rank_offset is None else self.rank_offset
        return {"init_method": self.init_method, "world_size": self.world_size, "rank_offset": off,
                "timeout_s": self.timeout_s, "group_backend": self.group_backend, "layout": self.layout,
                "ignore_params": list(self.ignore_params), "post_load": self.post_load,
                "refit_mode": self.refit_mode, "window_bytes": self.window_bytes, "colocated": self.engine_colocated,
                **plan_kwargs(vars(self))}


class MegatronSource(WeightSource):
    """A trainer rank's live Megatron-Core chunks as a vLLM ``WeightSource``: ``metadata`` names
    the canonical (HF) tensors this rank holds part of, with their full shapes (no transfer; the
    ``mcore_reshard`` engines plan from the layouts, not from it); the shards themselves go
    through :func:`~mcore_reshard.integrations.protocol.megatron_source`.  ``layout`` /
    ``tensors`` may be given directly instead of ``chunks`` (e.g. an HF export on one rank)."""

    def __init__(self, chunks=None, rank: int = 0, *, layout=None, tensors=None, **kw):
        if layout is None:
            from .protocol import megatron_source
            layout, tensors = megatron_source(chunks, rank, **kw)
        self.layout, self.tensors, self.rank = layout, dict(tensors or {}), rank

    @cached_property
    def metadata(self) -> list:
        from ..core.executor import torch_dtype
        return [ParamMeta(m.name, torch_dtype(m.dtype), tuple(m.shape)) for m in self.layout.tensors.values()]


class McoreReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    init_info_cls = McoreReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ReshardError("the mcore_reshard trainer engine needs a source (MegatronSource)")
        check_mode(init_info.refit_mode)
        pair = check_colocated(init_info.colocated, "colocated")
        workers = init_info.engine_colocated      # each worker reads its own entry; all are checked here first
        if workers is not None:                   # (worker_colocated checks every entry, whichever it returns)
            worker_colocated(workers, 0, len(workers) if isinstance(workers, (list, tuple)) else 1, "engine_colocated")
        self = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        self.info = init_info
        self.resharders: dict[str, Any] = {}
        self.version = 0
        self.group = self.colocated = None
        if pair is not None:              # proxied by the engine worker on this device: no group
            local = lambda: setattr(self, "colocated", ColocatedTrainer(
                source.layout, source.tensors, channel=pair["channel"], device=pair["device"], rank=source.rank,
                timeout=init_info.timeout_s))
        else:
            local = lambda: setattr(self, "group", join_group(init_info.init_method, init_info.world_size,
                                                              init_info.rank, backend=init_info.group_backend,
                                                              timeout_s=init_info.timeout_s))
        self._call(lambda: client.init_weight_transfer_engine(init_info.worker_info()), local)
        return self

    def _call(self, rpc, local):
        """``rpc`` (the sender's blocking client call) in a thread while ``local`` runs here."""
        if not self.is_sender:
            return local()
        err: list = []

        def run():
            try:
                rpc()
            except BaseException as e:  # noqa: BLE001
                err.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            return local()
        finally:
            t.join()
            if err:
                raise err[0]

    def _refit(self, key: str, version: int):
        if self.colocated is not None:    # returns once the worker has read this rank's weights
            return {"rank": self.info.rank, "colocated": self.colocated.refit(version)}
        if key not in self.resharders:
            # the workers ask for the windows of their refit mode (join_refit: the plan follows them)
            self.resharders[key] = join_refit(self.group, src=self.source.layout, src_tensors=self.source.tensors,
                                              timeout=self.info.timeout_s, **plan_kwargs(vars(self.info)))
        return timed_refit(self.resharders[key], self.info.rank, version)

    def send_weights(self, draft: bool = False, version: int | None = None) -> dict:
        """One refit of the engine's model (``draft=True``: its MTP draft model), every trainer rank.

        After the main model's update the sender asks the engine to drop its prefix (KV) cache,
        computed with the old weights, through ``client.reset_prefix_cache()`` when the client has
        it (vLLM's ``LLM`` / ``AsyncLLM`` do; the scheduler, not the workers, owns that cache);
        ``rep["prefix_cache_reset"]`` says whether it did (if not, the caller must)."""
        self.version = self.version + 1 if version is None else int(version)
        v, c = self.version, self.client
        if self.is_sender:
            start = getattr(c, "start_draft_weight_update", None) if draft else c.start_weight_update
            if start is None:
                raise ReshardError(f"{type(c).__name__} has no start_draft_weight_update: the draft update "
                                   "needs a client that exposes it (vLLM's AsyncLLM does)")
            start()
        t0 = time.monotonic()
        rep = self._call(lambda: c.update_weights({"version": v}), lambda: self._refit("draft" if draft else "main", v))
        if self.is_sender:
            c.finish_weight_update()
            reset = None if draft else getattr(c, "reset_prefix_cache", None)
            if reset is not None:
                reset()
            rep["prefix_cache_reset"] = reset is not None
        rep["seconds_total"] = round(time.monotonic() - t0, 4)
        return rep

    def shutdown(self) -> None:
        if getattr(self, "group", None) is not None:
            leave_group(self.group)
            self.group = None
        if getattr(self, "colocated", None) is not None:
            self.colocated.close()
            self.colocated = None
