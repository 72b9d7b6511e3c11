"""The worker side of the vLLM weight-transfer backend ``mcore_reshard``: vLLM creates
:class:`McoreReshardWeightTransferEngine` in every worker from ``WeightTransferConfig(backend="mcore_reshard")``
(after :func:`mcore_reshard.integrations.vllm_transfer.register`) and calls ``init_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.  See
:mod:`mcore_reshard.integrations.vllm_transfer` for the whole backend.

Imports vLLM: read its classes through :mod:`~mcore_reshard.integrations.vllm_transfer`, which needs no vLLM itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from ..colocate import try_accept, worker_colocated
from ..core.executor import ReshardError
from ..core.planner import DEFAULT_BUDGET, DEFAULT_WINDOW
from ..core.planner.windows import check_window_bytes
from .hooks import run_post_refit
from .protocol import (
    build_layout,
    check_join_args,
    check_tensors,
    engine_identity,
    engine_rank,
    join_group,
    leave_group,
    rank_part,
    spec_text,
)
from .vllm_postload import PostLoad
from .vllm_refit import EngineRefit, guard_of, join_engine
from .vllm_refit_modes import check_mode
from .vllm_transfer import REPORTS_KEPT, plan_kwargs
from .vllm_worker import MTP_PREFIX, vllm_coords, vllm_names, vllm_spec, worker_index


class _WorkerView:
    """What :func:`vllm_spec` / :func:`vllm_coords` read of a vLLM worker."""

    def __init__(self, vllm_config, model, rank: int = 0):
        from types import SimpleNamespace
        self.vllm_config, self.rank = vllm_config, rank
        self.model_runner = SimpleNamespace(model=model)


@dataclass
class McoreReshardInitInfo(WeightTransferInitInfo):
    """Worker side of the rendezvous (sent by the trainer's sender through the client).

    ``refit_mode``: ``"stream"`` (default: no second copy of the weights; the engine pauses for the
    transfer, window by window of ``window_bytes``) or ``"shadow"`` (a persistent loader-format
    copy: ``update_weights`` starts the transfer and returns, the engine keeps generating on the
    previous weights, ``finish_weight_update`` waits for it and swaps); see
    :mod:`~mcore_reshard.integrations.vllm_refit_modes`.

    ``colocated``: workers that share their device with a trainer rank in another process (no
    process group between the two): ``None``, or one entry per worker (``None``, or ``{"channel":
    socket path, "device": key}``; a dict alone for a one-worker engine; :func:`~mcore_reshard.colocate.pair_specs`).
    Such a worker maps its trainer rank's weights and holds its source part in the group
    (:mod:`mcore_reshard.colocate`); ``rank_offset`` / ``world_size`` then follow the device map
    (:mod:`mcore_reshard.core.devices`)."""
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
    refit_mode: str = "stream"
    window_bytes: int = DEFAULT_WINDOW
    colocated: dict | list | None = None


@dataclass
class McoreReshardUpdateInfo(WeightTransferUpdateInfo):
    version: int | None = None


class McoreReshardWeightTransferEngine(WeightTransferEngine):
    """Worker side: joins the shared group at ``init_transfer_engine``; the first update of the
    main model (and of the draft) plans and binds once (:func:`~.vllm_refit.join_engine`), every
    update then writes its shards in place (collective with the trainer's ``send_weights``).
    ``init_transfer_engine`` again (a new group, e.g. after a trainer died) leaves the old group
    and binds anew at the next update."""
    init_info_cls = McoreReshardInitInfo
    update_info_cls = McoreReshardUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.info: McoreReshardInitInfo | None = None
        self.rank = -1
        self.refits: dict[str, EngineRefit] = {}
        self.reports: list[dict] = []
        self.peer, self.peer_error = None, None

    # -------------------------------------------------------------- helpers
    def _view(self):
        return _WorkerView(self.vllm_config, self._default_model)

    def _is_draft(self) -> bool:
        return self.model is not self._default_model

    def _key(self) -> str:
        return "draft" if self._is_draft() else "main"

    def _report(self, rep: dict) -> None:
        self.reports.append(rep)
        del self.reports[:-REPORTS_KEPT]

    def _destination(self, draft: bool):
        """(dst part, tensors, PostLoad, error) for the main model or the draft (``mtp.`` buffers only).

        The tensors are the model's parameters in vLLM's *loader* format (:class:`PostLoad`):
        the live parameter where post-load processing leaves it alone, the loader format's
        metadata where processing repacks or replaces it (the refit mode places it)."""
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
        except Exception as e:  # noqa: BLE001 - reported to every rank by the join
            return None, {}, None, f"rank {rank}: {type(e).__name__}: {e}"

    def _refit(self, draft: bool) -> EngineRefit:
        key = "draft" if draft else "main"
        if key not in self.refits:
            dst, tensors, post, error = self._destination(draft)
            info = self.info
            models = [self.model] if draft else [self._default_model]
            error = error or self.peer_error
            self.refits[key] = join_engine(self.group, self.rank, post, dst, tensors, error, mode=info.refit_mode,
                                           window_bytes=info.window_bytes, models=models, timeout=info.timeout_s,
                                           identity=engine_identity({MTP_PREFIX if draft else "": models[0]}, tensors,
                                                                    self.rank),
                                           colocated=self.peer, **plan_kwargs(vars(info)))
        return self.refits[key]

    # -------------------------------------------------------------- vLLM API
    def init_transfer_engine(self, init_info) -> None:
        c = vllm_coords(self._view())
        local, workers = worker_index(c)
        rank = engine_rank(init_info.rank_offset, local, init_info.world_size, f"worker ({c})")
        pair = worker_colocated(getattr(init_info, "colocated", None), local, workers)
        check_join_args(init_info.init_method, init_info.world_size, rank, init_info.timeout_s,
                        init_info.group_backend)
        check_mode(init_info.refit_mode)
        check_window_bytes(init_info.window_bytes)
        if any(r.in_flight for r in self.refits.values()):
            raise ReshardError("init_weight_transfer_engine while a shadow transfer is in flight: finish it first")
        self.shutdown()                   # a new group (the old one may be broken): leave it first
        self.info, self.rank = init_info, rank
        self.group = join_group(init_info.init_method, int(init_info.world_size), self.rank,
                                backend=init_info.group_backend, timeout_s=float(init_info.timeout_s))
        # a failed accept is refused by every rank at the first update's join
        self.peer, self.peer_error = try_accept(pair, rank=rank, timeout=float(init_info.timeout_s))

    def start_weight_update(self) -> None:
        """Opens an update (nothing moves yet)."""
        if self.group is None:
            raise ReshardError("start_weight_update before init_weight_transfer_engine")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info) -> None:
        """Mode ``stream``: the whole transfer, each window processed as it lands.  Mode ``shadow``:
        starts the transfer in the background and returns."""
        self._report(self._refit(self._is_draft()).transfer(update_info.version))

    def finish_weight_update(self) -> None:
        """Completes the update (:meth:`~.vllm_refit.EngineRefit.complete`: shadow: waits for the
        transfer and swaps), then the post-refit hooks (FP8 guard; MLA ``W_UK_T``/``W_UV`` when
        processing did not redo them)."""
        key = self._key()
        r = self.refits.get(key)
        if r is None:
            return

        def hooks(rep: dict) -> dict:
            skip = ("mla_absorb",) if rep.get("post_load", {}).get("attention") else ()
            return run_post_refit("vllm", [self.model], owners=[], strict=True, skip=skip)
        self._report(r.complete(hooks))

    def state(self) -> dict:
        """What a client reads (``collective_rpc`` on the worker): per model, whether the engine
        serves (``serving``, and why not: ``refusing``) and the refit state."""
        out = {"rank": self.rank, "serving": guard_of(self._default_model).serving,
               "refusing": guard_of(self._default_model).reason}
        for key, r in self.refits.items():
            out[key] = r.state()
        return out

    def shutdown(self) -> None:
        if self.group is not None:
            leave_group(self.group)
        if self.peer is not None:
            self.peer.close()
        self.group, self.refits, self.peer, self.peer_error = None, {}, None, None
