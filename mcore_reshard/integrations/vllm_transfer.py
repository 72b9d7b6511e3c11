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

Importing this module does not import vLLM until :func:`register` (or a class) is used.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..core.executor import ReshardError
from ..core.planner import DEFAULT_BUDGET
from .hooks import run_post_refit
from .protocol import (build_layout, check_join_args, check_tensors, engine_rank, join_group, join_refit, leave_group, rank_part,
                       spec_text, timed_refit)
from .vllm_postload import PostLoad
from .vllm_worker import MTP_PREFIX, vllm_coords, vllm_names, vllm_spec

BACKEND = "mcore_reshard"
PLAN_KEYS = ("budget_bytes", "allow_cast", "ignore_unused", "verify")
REPORTS_KEPT = 64          # the worker keeps its last refits' reports (a long RL run refits thousands of times)


def _plan_kw(d: Mapping) -> dict:
    return {k: d[k] for k in PLAN_KEYS if k in d}


def register() -> None:
    """Register ``mcore_reshard`` with vLLM's ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory`` (idempotent).  Also the ``vllm.general_plugins`` entry point."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "McoreReshardWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "McoreReshardTrainerWeightTransferEngine")


def __getattr__(name: str):
    """The vLLM-derived classes are built on first use, so that importing this module needs no vLLM."""
    if name in _LAZY:
        return _classes()[name]
    raise AttributeError(name)


_LAZY = ("McoreReshardInitInfo", "McoreReshardUpdateInfo", "McoreReshardWeightTransferEngine",
         "McoreReshardTrainerInitInfo", "McoreReshardTrainerWeightTransferEngine", "MegatronSource")
_CLASSES: dict[str, Any] = {}


class _WorkerView:
    """What :func:`vllm_spec` / :func:`vllm_coords` read of a vLLM worker."""

    def __init__(self, vllm_config, model, rank: int = 0):
        from types import SimpleNamespace
        self.vllm_config, self.rank = vllm_config, rank
        self.model_runner = SimpleNamespace(model=model)


def _classes() -> dict:
    """The backend's classes, subclassing vLLM's (built on first use: importing this module never imports vLLM)."""
    if _CLASSES:
        return _CLASSES
    from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                       WeightSource, WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    _CLASSES.update(_engine_side(WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo))
    _CLASSES.update(_trainer_side(ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource))
    return _CLASSES


def _engine_side(WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo) -> dict:
    """The worker side: init / update info and ``McoreReshardWeightTransferEngine``."""
    @dataclass
    class McoreReshardInitInfo(WeightTransferInitInfo):
        """Worker side of the rendezvous (sent by the trainer's sender through the client)."""
        init_method: str
        world_size: int
        rank_offset: int
        timeout_s: float = 600.0
        group_backend: str | None = None
        layout: dict | None = None            # vllm_layout kwargs overriding the engine config's
        ignore_params: list = field(default_factory=list)
        budget_bytes: int = DEFAULT_BUDGET
        allow_cast: bool | str = "loader"
        ignore_unused: bool = True
        verify: bool = False
        post_load: str = "reprocess"          # "none": the model was never processed (a bare model class)

    @dataclass
    class McoreReshardUpdateInfo(WeightTransferUpdateInfo):
        version: int | None = None

    class McoreReshardWeightTransferEngine(WeightTransferEngine):
        """Worker side: joins the shared group at ``init_transfer_engine``; the first update of the
        main model (and of the draft) plans and binds once, every update then writes its shards
        in place (collective with the trainer's ``send_weights``)."""
        init_info_cls = McoreReshardInitInfo
        update_info_cls = McoreReshardUpdateInfo
        supports_draft_weight_update = True

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.group = None
            self.info: McoreReshardInitInfo | None = None
            self.rank = -1
            self.resharders: dict[str, Any] = {}
            self.postload: dict[str, PostLoad | None] = {}
            self.written: set[str] = set()
            self.reports: list[dict] = []

        # -------------------------------------------------------------- helpers
        def _view(self):
            return _WorkerView(self.vllm_config, self._default_model)

        def _is_draft(self) -> bool:
            return self.model is not self._default_model

        def _report(self, rep: dict) -> None:
            self.reports.append(rep)
            del self.reports[:-REPORTS_KEPT]

        def _destination(self, draft: bool):
            """(dst part, tensors, PostLoad, error) for the main model or the draft (``mtp.`` buffers only).

            The tensors are the model's parameters in vLLM's *loader* format (:class:`PostLoad`):
            the live parameter where post-load processing leaves it alone, a persistent loader-format
            buffer where processing repacks or replaces it (re-processed after every refit)."""
            info, rank = self.info, self.rank
            try:
                if draft:
                    post = PostLoad({MTP_PREFIX: self.model}, self.model_config, self.device,
                                    shared={"": self._default_model}, post_load=info.post_load)
                else:
                    post = PostLoad({"": self._default_model}, self.model_config, self.device,
                                    post_load=info.post_load)
                live, aliases = post.tensors, post.aliases
                names = vllm_names(self._view(), live)
                spec = vllm_spec(self._view(), info.rank_offset, names=names, mtp=draft, layout=info.layout)
                full = build_layout(spec)
                mine = full.buffers.get(rank, {})
                keep = (lambda n: n.startswith(MTP_PREFIX)) if draft else (lambda n: not n.startswith(MTP_PREFIX))
                part = rank_part(full, rank, drop=[n for n in mine if not keep(n)] + list(aliases))
                tensors = {n: t for n, t in live.items() if keep(n)}
                errs = check_tensors(part, rank, tensors, what="vLLM parameters (loader format)",
                                     against=spec_text(spec), ignore=info.ignore_params)
                if errs:
                    return None, {}, None, " | ".join(errs)
                return part, {n: t for n, t in tensors.items() if n in part.buffers.get(rank, {})}, post, None
            except Exception as e:  # noqa: BLE001 - reported to every rank by join_refit
                return None, {}, None, f"rank {rank}: {type(e).__name__}: {e}"

        def _resharder(self, draft: bool):
            key = "draft" if draft else "main"
            if key not in self.resharders:
                dst, tensors, post, error = self._destination(draft)
                info = self.info
                self.resharders[key] = join_refit(self.group, dst=dst, dst_tensors=tensors, error=error,
                                                  timeout=info.timeout_s, **_plan_kw(vars(info)))
                self.postload[key] = post
            return self.resharders[key]

        # -------------------------------------------------------------- vLLM API
        def init_transfer_engine(self, init_info) -> None:
            c = vllm_coords(self._view())
            rank = engine_rank(init_info.rank_offset, (c["dp_rank"] * c["pp"] + c["pp_rank"]) * c["tp"] + c["tp_rank"],
                               init_info.world_size, f"worker ({c})")
            check_join_args(init_info.init_method, init_info.world_size, rank, init_info.timeout_s,
                            init_info.group_backend)
            self.info, self.rank = init_info, rank
            self.group = join_group(init_info.init_method, int(init_info.world_size), self.rank,
                                    backend=init_info.group_backend, timeout_s=float(init_info.timeout_s))
            self.resharders, self.postload, self.written = {}, {}, set()

        def start_weight_update(self) -> None:
            """Opens an update.  The loader-format buffers persist across refits (the plan stays
            bound to them): nothing is restored into the model until :meth:`finish_weight_update`."""
            if self.group is None:
                raise ReshardError("start_weight_update before init_weight_transfer_engine")
            self.written = set()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info) -> None:
            draft = self._is_draft()
            key = "draft" if draft else "main"
            r = self._resharder(draft)
            post = self.postload.get(key)
            refusal = post.check_storage() if post is not None else []
            self._report(timed_refit(r, self.rank, update_info.version, refusal=refusal))
            self.written.add(key)

        def finish_weight_update(self) -> None:
            """vLLM's post-load processing over what the update wrote (:meth:`PostLoad.reprocess`), then
            the post-refit hooks (FP8 guard; MLA ``W_UK_T``/``W_UV`` when processing did not redo them)."""
            key = "draft" if self._is_draft() else "main"
            post = self.postload.get(key)
            rep: dict[str, Any] = {}
            if post is not None and key in self.written:
                t0 = time.monotonic()
                rep["post_load"] = {**post.reprocess(), "seconds": round(time.monotonic() - t0, 4)}
            skip = ("mla_absorb",) if rep.get("post_load", {}).get("attention") else ()
            rep["post_refit"] = run_post_refit("vllm", [self.model], owners=[], strict=True, skip=skip)
            self._report(rep)
            self.written.discard(key)

        def shutdown(self) -> None:
            if self.group is not None:
                leave_group(self.group)
            self.group, self.resharders, self.postload = None, {}, {}

    return {k: v for k, v in locals().items() if k in _LAZY}


def _trainer_side(ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource) -> dict:
    """The trainer side: init info, ``MegatronSource`` and ``McoreReshardTrainerWeightTransferEngine``."""
    from functools import cached_property

    @dataclass
    class McoreReshardTrainerInitInfo(TrainerInitInfo):
        """Trainer side: ``rank`` is this trainer rank's rank in the shared group (``[0, T)``);
        ``rank_offset`` (default ``T``) is where the engine's workers start."""
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

        def worker_info(self) -> dict:
            off = self.trainer_ranks if self.rank_offset is None else self.rank_offset
            return {"init_method": self.init_method, "world_size": self.world_size, "rank_offset": off,
                    "timeout_s": self.timeout_s, "group_backend": self.group_backend, "layout": self.layout,
                    "ignore_params": list(self.ignore_params), "post_load": self.post_load, **_plan_kw(vars(self))}

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
            self = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
            self.info = init_info
            self.resharders: dict[str, Any] = {}
            self.version = 0
            self._call(lambda: client.init_weight_transfer_engine(init_info.worker_info()),
                       lambda: setattr(self, "group", join_group(init_info.init_method, init_info.world_size,
                                                                 init_info.rank, backend=init_info.group_backend,
                                                                 timeout_s=init_info.timeout_s)))
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
            if key not in self.resharders:
                self.resharders[key] = join_refit(self.group, src=self.source.layout, src_tensors=self.source.tensors,
                                                  timeout=self.info.timeout_s, **_plan_kw(vars(self.info)))
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

    return {k: v for k, v in locals().items() if k in _LAZY}


__all__ = ["BACKEND", "register", *_LAZY]
