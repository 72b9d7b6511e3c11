"""The worker side of the vLLM weight-transfer backend ``mcore_reshard``: vLLM creates
:class:`McoreReshardWeightTransferEngine` in every worker from ``WeightTransferConfig(backend="mcore_reshard")``
(after :func:`mcore_reshard.integrations.vllm_transfer.register`) and calls ``init_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.  See
:mod:`mcore_reshard.integrations.vllm_transfer` for the whole backend.

Imports vLLM: read its classes through :mod:`~mcore_reshard.integrations.vllm_transfer`, which needs no vLLM itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from ..core.executor import ReshardError
from ..core.planner import DEFAULT_BUDGET
from .hooks import run_post_refit
from .protocol import (
    build_layout,
    check_join_args,
    check_tensors,
    engine_identity,
    engine_rank,
    join_group,
    join_refit,
    leave_group,
    rank_part,
    spec_text,
    timed_refit,
)
from .vllm_postload import PostLoad
from .vllm_transfer import REPORTS_KEPT, plan_kwargs
from .vllm_worker import MTP_PREFIX, vllm_coords, vllm_names, vllm_spec


class _WorkerView:
    """What :func:`vllm_spec` / :func:`vllm_coords` read of a vLLM worker."""

    def __init__(self, vllm_config, model, rank: int = 0):
        from types import SimpleNamespace
        self.vllm_config, self.rank = vllm_config, rank
        self.model_runner = SimpleNamespace(model=model)


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
        self.identities: dict[str, Any] = {}
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
                                              timeout=info.timeout_s, **plan_kwargs(vars(info)))
            self.postload[key] = post
            # mcore_reshard: the modules holding what the refit writes (a module replaced later: refused)
            self.identities[key] = engine_identity({MTP_PREFIX if draft else "": self.model if draft else
                                                    self._default_model}, tensors, self.rank)
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
        self.identities: dict[str, Any] = {}

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
        refusal += self.identities[key].check()[0] if key in self.identities else []   # mcore_reshard: replaced modules
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
