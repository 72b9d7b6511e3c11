"""vLLM worker extension: refit a running vLLM engine from the trainer, shard to shard, in place.

Importing this module never imports vLLM; the methods use vLLM only to read the worker's TP/PP
ranks (``vllm.distributed.parallel_state``) and fall back to the worker's own fields without it.

Wiring (see ``examples/vllm_refit.py`` and ``docs/engines.md``)::

    llm = LLM(model=..., tensor_parallel_size=tp,
              worker_extension_cls="mcore_reshard.integrations.vllm_worker.McoreReshardWorkerExtension")

    # driver (trainer rank 0's process or a controller) -- each call returns one result per worker;
    # every call below is collective with the trainer ranks, so the driver issues it from a thread
    # while the trainer ranks run their side (join_group / join_refit / refit):
    llm.collective_rpc("mcore_reshard_join", args=(init_method, world_size, rank_offset, 600.0))
    llm.collective_rpc("mcore_reshard_prepare")               # plan + bind, once (refit_mode="stream")
    llm.collective_rpc("mcore_reshard_refit", args=(step,))   # after every optimizer step
    llm.reset_prefix_cache()                                  # the V1 scheduler owns the prefix cache

    # refit_mode="shadow" (a loader-format copy of the weights): the transfer overlaps generation
    llm.collective_rpc("mcore_reshard_refit_start", args=(step,))   # returns at once; keep generating
    llm.collective_rpc("mcore_reshard_refit_finish")                # waits, swaps: the only pause

Ranks of the shared group: trainer ranks ``[0, T)``; worker ``(dp_rank, pp_rank, tp_rank)`` is
``rank_offset + (dp_rank * pp + pp_rank) * tp + tp_rank`` (``rank_offset + dp_rank * tp + tp_rank``
without PP), the numbering of :func:`mcore_reshard.targets.vllm_layout`; ``world_size`` counts
trainer ranks and every worker.  With one ``LLM`` per DP replica give each its own ``rank_offset``.

What ``mcore_reshard_prepare`` checks before anything moves: the worker's live
``model_runner.model.named_parameters()`` (runtime names, existing storage; plus the MTP drafter's
under ``mtp.`` when there is one) must equal, name for name, shape for shape, the buffers
``vllm_layout(<the engine's config>)`` gives this rank.  Any mismatch is reported by every rank of
the group (trainer included) as one :class:`~mcore_reshard.core.executor.ReshardError`.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping

import torch

from ..colocate import try_accept, worker_colocated
from ..core.executor import ReshardError, dtype_name
from ..core.planner import DEFAULT_BUDGET, DEFAULT_WINDOW
from ..core.planner.windows import check_window_bytes
from .hooks import run_post_refit
from .protocol import (
    check_join_args,
    engine_destination,
    engine_identity,
    engine_rank,
    join_group,
    layout_spec,
    leave_group,
)
from .vllm_postload import PostLoad
from .vllm_refit import guard_of, join_engine
from .vllm_refit_modes import check_mode

MTP_PREFIX = "mtp."


def vllm_coords(worker) -> dict:
    """This worker's ``tp, pp, dp`` sizes and ``tp_rank, pp_rank, dp_rank``.

    Sizes and ``dp_rank`` come from ``worker.vllm_config.parallel_config``; TP/PP ranks from
    ``vllm.distributed.parallel_state`` when vLLM is importable, else from ``worker.rank`` (vLLM's
    world rank inside one DP engine is ``pp_rank * tp + tp_rank``)."""
    pc = worker.vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dp, dp_rank = int(getattr(pc, "data_parallel_size", 1) or 1), int(getattr(pc, "data_parallel_rank", 0) or 0)
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except ImportError:
        local = int(worker.rank)
        tp_rank, pp_rank = local % tp, (local // tp) % pp
    return {"tp": tp, "pp": pp, "dp": dp, "tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": dp_rank}


def worker_index(c: dict) -> tuple[int, int]:
    """(this worker's index among the deployment's workers, how many there are) from its
    :func:`vllm_coords`: ``(dp_rank * pp + pp_rank) * tp + tp_rank`` of ``dp * pp * tp``."""
    return (c["dp_rank"] * c["pp"] + c["pp_rank"]) * c["tp"] + c["tp_rank"], c["dp"] * c["pp"] * c["tp"]


def vllm_spec(worker, rank_offset: int, *, names: str = "auto", mtp: bool = False, layout: Mapping | None = None) -> dict:
    """The :func:`~mcore_reshard.integrations.protocol.layout_spec` of the whole vLLM deployment this
    worker belongs to, from its engine config (``layout`` overrides ``vllm_layout`` kwargs)."""
    from ..targets import from_hf_config
    vc = worker.vllm_config
    mc, pc = vc.model_config, vc.parallel_config
    if getattr(mc, "quantization", None):
        raise NotImplementedError(f"quantized model ({mc.quantization}): FP8 block-scale refit is not supported yet")
    if getattr(pc, "enable_eplb", False):
        raise NotImplementedError("EPLB (redundant expert replicas) is not modelled yet")
    cfg = from_hf_config(mc.hf_config)
    c = vllm_coords(worker)
    kw: dict[str, Any] = {"tp": c["tp"], "dp": c["dp"], "pp": c["pp"], "rank_offset": int(rank_offset),
                          "enable_expert_parallel": bool(getattr(pc, "enable_expert_parallel", False)),
                          "dtype": dtype_name(mc.dtype) if isinstance(mc.dtype, torch.dtype) else str(mc.dtype),
                          "names": names, "mtp": bool(mtp)}
    placement = getattr(pc, "expert_placement_strategy", None)
    if placement in ("linear", "round_robin"):
        kw["expert_placement"] = placement      # vllm_layout applies vLLM's fallbacks to linear
    backend = getattr(pc, "all2all_backend", None)
    if isinstance(backend, str):
        kw["all2all_backend"] = backend
    part = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if part and c["pp"] > 1:
        kw["pp_layer_partition"] = [int(x) for x in part.split(",")]
    kw.update(layout or {})
    return layout_spec("vllm", cfg, **kw)


def _names_vote(live) -> str | None:
    if any(".routed_experts." in n for n in live):
        return "current"
    if any(".mlp.experts.w13_weight" in n or ".mlp.experts.w2_weight" in n for n in live):
        return "legacy"
    return None


def vllm_names(worker, live) -> str:
    """``"current"`` / ``"legacy"`` expert parameter names, the same on every worker of the engine.

    A worker's own parameters decide when it holds experts; a pipeline stage without MoE layers
    cannot tell, so the stages agree over vLLM's PP group (collective over it when ``pp > 1``)."""
    vote = _names_vote(live)
    if vllm_coords(worker)["pp"] > 1:
        try:
            from vllm.distributed.parallel_state import get_pp_group
            votes: list = [None] * get_pp_group().world_size
            import torch.distributed as dist
            dist.all_gather_object(votes, vote, group=get_pp_group().cpu_group)
        except ImportError:
            votes = [vote]
        known = {v for v in votes if v is not None}
        if len(known) > 1:
            raise ReshardError(f"pipeline stages disagree on vLLM's expert parameter names: {votes}")
        vote = known.pop() if known else None
    return vote or "current"


def _worker_device(worker):
    dev = getattr(worker, "device", None) or getattr(getattr(worker, "model_runner", None), "device", None)
    return dev if dev is not None else torch.device("cpu")


def _runner_identity(runner, mtp: bool, tensors, rank: int):
    """The models a worker's refit writes, as the runner holds them (a model the engine replaced on its
    runner, or a module inside it, is refused at the next refit: :func:`~.protocol.engine_identity`)."""
    roots = {"": (runner, "model")}
    if mtp:
        roots[MTP_PREFIX] = (runner.drafter, "model")
    return engine_identity(roots, tensors, rank)


def _join_pair(spec: dict | None, rank: int, timeout: float) -> dict:
    """``colocated``: one entry per worker (``None``, or ``{"channel": socket path, "device": key}``; a
    dict alone for a one-worker engine; :func:`~mcore_reshard.colocate.pair_specs`).  A worker with
    one accepts the trainer rank on its device (another process, in no group with it), maps its
    weights and holds its source part (:mod:`mcore_reshard.colocate`); a failed accept is refused by
    every rank at prepare."""
    peer, error = try_accept(spec, rank=rank, timeout=timeout)
    return {"peer": peer, "peer_error": error}


def _leave(st: dict) -> None:
    if st.get("group") is not None:
        leave_group(st["group"])
    if st.get("peer") is not None:
        st["peer"].close()
    st.clear()


class McoreReshardWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); every public method is reachable
    through ``LLM.collective_rpc`` and returns a small picklable dict.

    State lives on the worker as ``self._mcore_reshard`` (group, spec, resharder, last reports).
    """

    # ------------------------------------------------------------------ helpers (not RPC targets)
    def _mr(self) -> dict:
        st = getattr(self, "_mcore_reshard", None)
        if st is None:
            st = self._mcore_reshard = {}
        return st

    def _mr_models(self, mtp: bool) -> dict:
        runner = self.model_runner
        models = {"": runner.model}
        if mtp:
            draft = getattr(getattr(runner, "drafter", None), "model", None)
            if draft is None:
                raise ReshardError("mtp=True but this worker's model_runner has no drafter.model (MTP draft model)")
            models[MTP_PREFIX] = draft
        return models

    def _mr_has_drafter(self) -> bool:
        return getattr(getattr(getattr(self, "model_runner", None), "drafter", None), "model", None) is not None

    # ------------------------------------------------------------------ RPC methods
    def mcore_reshard_join(self, init_method: str, world_size: int, rank_offset: int, timeout_s: float = 600.0,
                           backend: str | None = None, colocated: Mapping | list | None = None) -> dict:
        """Join the shared group (collective with the trainer ranks and every other worker) as
        ``rank_offset + (dp_rank * pp + pp_rank) * tp + tp_rank``.  Joining again (a new group, e.g.
        after a trainer died) leaves the old group; prepare again after it.  ``colocated``: one entry
        per worker, :func:`_join_pair` (``McoreReshardInitInfo.colocated``)."""
        c = vllm_coords(self)
        local, workers = worker_index(c)
        rank = engine_rank(rank_offset, local, world_size, f"worker ({c})")
        check_join_args(init_method, world_size, rank, timeout_s, backend)
        pair = worker_colocated(colocated, local, workers)   # refused before any rendezvous
        st = self._mr()
        if st.get("refit") is not None and st["refit"].in_flight:
            raise ReshardError("mcore_reshard_join while a shadow transfer is in flight: mcore_reshard_refit_finish first")
        _leave(st)
        group = join_group(init_method, int(world_size), rank, backend=backend, timeout_s=float(timeout_s))
        st.update(group=group, rank=rank, world_size=int(world_size), rank_offset=int(rank_offset),
                  timeout_s=float(timeout_s), refit=None, **_join_pair(pair, rank, float(timeout_s)))
        return {"rank": rank, "world_size": int(world_size), **c, "colocated_error": st["peer_error"]}

    def mcore_reshard_prepare(self, spec: Mapping | None = None, *, layout: Mapping | None = None, names: str = "auto",
                              mtp: bool | str = "auto", budget_bytes: int = DEFAULT_BUDGET, allow_cast: bool | str = "loader",
                              ignore_unused: bool = False, verify: bool = False, ignore_params: tuple = (),
                              post_load: str = "reprocess", refit_mode: str = "stream",
                              window_bytes: int = DEFAULT_WINDOW) -> dict:
        """Plan and bind (collective with the trainer ranks' :func:`join_refit`; once, or again after
        the deployment changes).

        ``spec``: the destination :func:`layout_spec` (default: :func:`vllm_spec` of the engine
        config, ``layout`` overriding its kwargs).  ``names``: ``"current"`` / ``"legacy"`` expert
        names, ``"auto"`` from the live names.  ``mtp``: include the MTP drafter (``"auto"``: when
        there is one).  ``post_load``: ``"reprocess"`` (vLLM's loader format, its post-load
        processing re-run: :class:`PostLoad`) or ``"none"`` (weights nothing processed).
        ``refit_mode`` / ``window_bytes``: :mod:`~mcore_reshard.integrations.vllm_refit_modes`.  Plan
        options must match the trainer's (the mode's windows need no trainer option).  A live parameter that does not match this
        rank's part of the layout makes every rank raise :class:`ReshardError` before anything moves."""
        st = self._mr()
        if st.get("group") is None:
            raise ReshardError("mcore_reshard_prepare before mcore_reshard_join")
        check_mode(refit_mode)
        check_window_bytes(window_bytes)
        rank, mtp_on, post = st["rank"], False, None
        try:
            mtp_on = self._mr_has_drafter() if mtp == "auto" else bool(mtp)
            post = PostLoad(self._mr_models(mtp_on), self.vllm_config.model_config, _worker_device(self),
                            post_load=post_load)
            live, aliases = post.tensors, post.aliases
            if spec is None:
                if names == "auto":
                    names = vllm_names(self, live)
                spec = vllm_spec(self, st["rank_offset"], names=names, mtp=mtp_on, layout=layout)
            dst, tensors, error = engine_destination(rank, spec, live, aliases, what="vLLM parameters (loader format)",
                                                     ignore=ignore_params)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the join
            error, dst, tensors = f"rank {rank}: {type(e).__name__}: {e}", None, {}
        error = error or st.get("peer_error")
        t0 = time.monotonic()
        models = list(self._mr_models(mtp_on).values()) if error is None else [self.model_runner.model]
        ident = _runner_identity(self.model_runner, mtp_on, tensors, rank) if error is None else None
        r = join_engine(st["group"], rank, post if error is None else None, dst, tensors if error is None else {},
                        error, mode=refit_mode, window_bytes=window_bytes, models=models, timeout=st["timeout_s"],
                        budget_bytes=budget_bytes, allow_cast=allow_cast, ignore_unused=ignore_unused, verify=verify,
                        identity=ident, colocated=st.get("peer"))
        st.update(refit=r, spec=spec, mtp=mtp_on, written=sorted(tensors), postload=post)
        plan = r.resharder.plan
        return {"rank": rank, "buffers": len(tensors), "plan_hash": plan.hash[:16], "rounds": plan.rounds,
                "staging_bytes": r.resharder.staging_bytes, "seconds": round(time.monotonic() - t0, 3),
                "post_load": post.report() if post is not None else None, "refit_mode": refit_mode,
                "windows": len(getattr(plan, "windows", ())) or None}

    def _mr_refit(self):
        r = self._mr().get("refit")
        if r is None:
            raise ReshardError("mcore_reshard_refit before mcore_reshard_prepare")
        return r

    def _mr_hooks(self, post_refit: bool):
        if not post_refit:
            return None
        return lambda rep: self.mcore_reshard_post_refit(
            skip=("mla_absorb",) if rep.get("post_load", {}).get("attention") else ())

    def mcore_reshard_refit(self, version: int | None = None, post_refit: bool = True) -> dict:
        """One refit (collective with the trainer's ``refit()``), the engine paused throughout (mode
        ``stream``: window after window, each processed as it lands; ``shadow``: the copy, then the
        swap), then (``post_refit``) :meth:`mcore_reshard_post_refit`.  A parameter replaced since
        prepare makes every rank refuse before a byte moves; a refit that fails after bytes moved
        leaves the engine refusing to generate until one succeeds (:meth:`mcore_reshard_state`)."""
        return self._mr_refit().refit(version, self._mr_hooks(post_refit))

    def mcore_reshard_refit_start(self, version: int | None = None) -> dict:
        """Mode ``shadow``: start the transfer (collective with the trainer) in a background thread and
        return; the engine keeps generating with the previous weights until
        :meth:`mcore_reshard_refit_finish`.  (Mode ``stream``: the whole transfer, paused.)"""
        return self._mr_refit().transfer(version)

    def mcore_reshard_refit_finish(self, post_refit: bool = True) -> dict:
        """Complete the refit :meth:`mcore_reshard_refit_start` began: wait for its transfer, swap
        (the only pause), then (``post_refit``) :meth:`mcore_reshard_post_refit`."""
        return self._mr_refit().complete(self._mr_hooks(post_refit))

    def mcore_reshard_transfer_done(self) -> bool:
        return self._mr_refit().transfer_done()     # mode shadow: the background transfer ended

    def mcore_reshard_post_refit(self, strict: bool = True, skip: tuple = ()) -> dict:
        """The vLLM post-refit hooks (:data:`mcore_reshard.integrations.hooks.POST_REFIT` ``["vllm"]``):
        FP8 guard, MLA ``W_UK_T``/``W_UV`` (nothing for views -- bf16, detected by ``data_ptr`` --,
        ``copy_`` for copies), prefix-cache reset on the worker or its model runner if either has
        ``reset_prefix_cache`` (else the report says to call ``llm.reset_prefix_cache()``)."""
        st = self._mr()
        models = list(self._mr_models(bool(st.get("mtp"))).values())
        rep = run_post_refit("vllm", models, owners=[self, getattr(self, "model_runner", None)], strict=strict,
                             skip=skip)
        st["post_refit"] = rep
        return rep

    def mcore_reshard_state(self) -> dict:
        """The refit's state (versions, interruption), ``serving`` (``refusing``: why not), ``held_bytes``."""
        st = self._mr()
        r = st.get("refit")
        guard = guard_of(self.model_runner.model)
        return {"rank": st.get("rank"), "prepared": r is not None, "serving": guard.serving, "refusing": guard.reason,
                **(r.state() if r is not None else {})}

    def mcore_reshard_leave(self) -> dict:
        """Destroy the shared group (collective); a colocated trainer's mappings are dropped."""
        _leave(self._mr())
        return {"left": True}


__all__ = ["MTP_PREFIX", "McoreReshardWorkerExtension", "vllm_coords", "vllm_names", "vllm_spec", "worker_index"]
