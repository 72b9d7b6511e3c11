"""SGLang integration: a custom weight loader that refits a running SGLang engine in place.

Importing this module never imports SGLang; SGLang is used only to read the TP rank and the server
arguments, with fallbacks (the default ``torch.distributed`` rank; ``layout=`` kwargs in the command).

Wiring (see ``examples/sglang_refit.py`` and ``docs/engines.md``): start SGLang with
``--custom-weight-loader mcore_reshard.integrations.sglang_loader.load`` (``Engine(custom_weight_loader=
[LOAD_FORMAT])``), then drive every TP worker with *commands* -- a named tensor whose name starts with
``mcore_reshard.`` and whose bytes are JSON -- through ``update_weights_from_tensor``::

    engine.update_weights_from_tensor([command("join", init_method=..., world_size=W, rank_offset=T)],
                                      load_format=LOAD_FORMAT)
    engine.update_weights_from_tensor([command("prepare", layout={...})], load_format=LOAD_FORMAT)
    engine.update_weights_from_tensor([command("refit", version=step)], load_format=LOAD_FORMAT)
    # SGLang's scheduler flushes the radix cache after update_weights_from_tensor (flush_cache=True)

Each call is collective with the trainer ranks (which run ``join_group`` / ``join_refit`` /
``refit()``), so the driver issues it from a thread while the trainer ranks run their side.  Every
TP worker of the engine is group rank ``rank_offset + tp_rank`` (DP attention lives inside the TP
group; plain DP replicas are separate engines with their own ``rank_offset``).

SGLang calls a custom loader as ``f(model, named_tensors)`` with the runner's model; with a NextN
(MTP) draft model it calls it for the draft model first and for the target second, with the same
tensors: the loader records the draft model and acts on the target call (the draft's parameters go
under ``mtp.``, as in :func:`mcore_reshard.targets.sglang_layout` with ``mtp=True``).  Tensors whose
names are not commands are ordinary weights and go to ``model.load_weights`` (HF semantics).

Outside SGLang's loader path (e.g. a custom scheduler hook holding the ``ModelRunner``), use an
:class:`SGLangRefit` session directly: ``s.join(model, ...)``, ``s.prepare(model, ...)``,
``s.refit(model, version, owners=[scheduler])`` (``flush_cache`` is then called on an owner).
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from ..core.executor import ReshardError, dtype_name
from ..core.planner import DEFAULT_BUDGET
from .hooks import run_post_refit
from .protocol import (
    check_join_args,
    engine_destination,
    engine_rank,
    join_group,
    join_refit,
    layout_spec,
    leave_group,
    live_tensors,
    timed_refit,
)

LOAD_FORMAT = "mcore_reshard.integrations.sglang_loader.load"
COMMAND_PREFIX = "mcore_reshard."
MTP_PREFIX = "mtp."
COMMANDS = ("join", "prepare", "refit", "post_refit", "leave")
log = logging.getLogger(__name__)


def command(name: str, **payload) -> tuple[str, torch.Tensor]:
    """A loader command as a named tensor (uint8 JSON bytes) for ``update_weights_from_tensor``."""
    if name not in COMMANDS:
        raise ValueError(f"name={name!r}: unknown command; known: {COMMANDS}")
    try:
        data = json.dumps(payload, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"payload of command {name!r}: every value must be plain JSON (no tensors, NaN or inf): {e}") from None
    return COMMAND_PREFIX + name, torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode(tensor: torch.Tensor) -> dict:
    """A command tensor's payload (``{}`` for an empty one); ReshardError unless uint8 JSON bytes of a dict."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.device.type == "meta":
        what = f"{tensor.dtype} on {tensor.device}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ReshardError(f"command tensor: expected uint8 JSON bytes (command() makes them), got {what}")
    if not tensor.numel():
        return {}
    try:
        payload = json.loads(bytes(tensor.detach().cpu().reshape(-1).tolist()).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ReshardError(f"command tensor: not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise ReshardError(f"command tensor: the payload must be a JSON object, not {type(payload).__name__}")
    return payload


def is_draft(model: torch.nn.Module) -> bool:
    """SGLang's NextN (MTP) draft models: ``...ForCausalLMNextN`` with ``model.decoder``."""
    return type(model).__name__.endswith("NextN") or hasattr(getattr(model, "model", None), "decoder")


def sglang_tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except ImportError:
        return dist.get_rank() if dist.is_initialized() else 0


def _raw_server_args():
    """SGLang's server arguments object, whichever release: 0.5.23+ ``runtime_context.get_server_args()``
    (``get_global_server_args()`` there raises ``RuntimeError: ... retired``), older
    ``server_args.get_global_server_args()``, oldest ``global_server_args_dict``.  None if unreadable
    (SGLang missing or nothing published in this process)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        try:
            sa = get_server_args()
            if sa is not None:
                return sa
        except Exception:  # noqa: BLE001 - not published in this process
            pass
    except ImportError:
        pass
    try:
        from sglang.srt.server_args import get_global_server_args
        return get_global_server_args()
    except (ImportError, RuntimeError, ValueError, AttributeError):
        pass
    try:
        from sglang.srt.managers.schedule_batch import global_server_args_dict
        return global_server_args_dict
    except ImportError:
        return None


def _server_args() -> dict:
    """Layout-relevant SGLang server arguments, when SGLang is importable."""
    sa = _raw_server_args()
    if sa is None:
        return {}
    get = (lambda k, d=None: sa.get(k, d)) if isinstance(sa, Mapping) else (lambda k, d=None: getattr(sa, k, d))
    out = {"tp": get("tp_size"), "dp": get("dp_size"), "ep": get("ep_size"),
           "enable_dp_attention": get("enable_dp_attention"), "moe_a2a_backend": get("moe_a2a_backend"),
           "moe_dense_tp_size": get("moe_dense_tp_size"), "enable_dp_lm_head": get("enable_dp_lm_head")}
    out = {k: v for k, v in out.items() if v is not None}
    if str(os.environ.get("SGLANG_ENABLE_EMBED_REPLICATION", "")).lower() in ("1", "true", "yes"):
        out["embed_replicated"] = True
    return out


def sglang_spec(model: torch.nn.Module, rank_offset: int, *, layout: Mapping | None = None, mtp: bool = False) -> dict:
    """The layout spec of the SGLang deployment ``model`` belongs to: its HF config, the server
    arguments (when SGLang is importable), the parameter dtype and whether the shared expert is
    fused (``model.num_fused_shared_experts``); ``layout`` overrides any ``sglang_layout`` kwarg."""
    from ..targets import from_hf_config
    cfg = from_hf_config(model.config)
    kw: dict[str, Any] = _server_args()
    kw["moe_a2a_backend"] = str(kw.get("moe_a2a_backend") or "none")
    dtypes = Counter(p.dtype for _, p in model.named_parameters())
    if dtypes:
        kw["dtype"] = dtype_name(dtypes.most_common(1)[0][0])
    fused = getattr(model, "num_fused_shared_experts", None)
    if fused is not None:
        kw["fuse_shared_expert"] = bool(fused)
    kw.update(layout or {})
    if "tp" not in kw:
        raise ReshardError("SGLang server arguments are not readable here: pass layout={'tp': ..., 'dp': ..., "
                           "'enable_dp_attention': ...} in the prepare command")
    kw["rank_offset"] = int(rank_offset)
    kw["mtp"] = bool(mtp)
    return layout_spec("sglang", cfg, **kw)


class SGLangRefit:
    """One process's refit session (the loader keeps one per process: :func:`session`)."""

    def __init__(self):
        self.group = None
        self.rank: int | None = None
        self.rank_offset = 0
        self.world_size = 0
        self.timeout_s = 600.0
        self.draft: torch.nn.Module | None = None
        self.resharder = None
        self.spec: dict | None = None
        self.written: list[str] = []
        self.last_error: str | None = None
        self.reports: list[dict] = []

    def models(self, model) -> dict:
        return {"": model, MTP_PREFIX: self.draft} if self.draft is not None else {"": model}

    def join(self, model, init_method: str, world_size: int, rank_offset: int, timeout_s: float = 600.0,
             backend: str | None = None) -> dict:
        """Join the shared group as ``rank_offset + tp_rank`` (collective)."""
        rank = engine_rank(rank_offset, sglang_tp_rank(), world_size, "SGLang worker")
        check_join_args(init_method, world_size, rank, timeout_s, backend)
        self.group = join_group(init_method, int(world_size), rank, backend=backend, timeout_s=float(timeout_s))
        self.rank, self.world_size, self.rank_offset, self.timeout_s = rank, int(world_size), int(rank_offset), float(timeout_s)
        self.resharder = None
        return {"rank": rank}

    def prepare(self, model, spec: Mapping | None = None, *, layout: Mapping | None = None, mtp: bool | str = "auto",
                budget_bytes: int = DEFAULT_BUDGET, allow_cast: bool | str = "loader", ignore_unused: bool = False,
                verify: bool = False, ignore_params: Iterable[str] = ()) -> dict:
        """Check the live parameters against this rank's part of the layout, then plan and bind
        (collective with the trainer's :func:`join_refit`; plan options must match it)."""
        if self.group is None:
            raise ReshardError("prepare before join")
        rank = self.rank
        try:
            mtp_on = self.draft is not None if mtp == "auto" else bool(mtp)
            if mtp_on and self.draft is None:
                raise ReshardError("mtp=True but the loader has not seen a NextN draft model")
            live, aliases = live_tensors(self.models(model) if mtp_on else {"": model})
            if spec is None:
                spec = sglang_spec(model, self.rank_offset, layout=layout, mtp=mtp_on)
            dst, tensors, error = engine_destination(rank, spec, live, aliases, what="SGLang parameters",
                                                     ignore=ignore_params)
        except Exception as e:  # noqa: BLE001 - reported to every rank by join_refit
            error, dst, tensors = f"rank {rank}: {type(e).__name__}: {e}", None, {}
        r = join_refit(self.group, dst=dst if error is None else None, dst_tensors=tensors if error is None else {},
                       error=error, budget_bytes=budget_bytes, allow_cast=allow_cast, ignore_unused=ignore_unused,
                       timeout=self.timeout_s, verify=verify)
        self.resharder, self.spec, self.written = r, dict(spec), sorted(tensors)
        return {"rank": rank, "buffers": len(tensors), "plan_hash": r.plan.hash[:16]}

    def refit(self, model, version: int | None = None, *, post_refit: bool = True, owners: Iterable[Any] = ()) -> dict:
        """One refit (collective): ``copy_`` into the existing parameters, then the post-refit hooks."""
        if self.resharder is None:
            raise ReshardError("refit before prepare")
        out = timed_refit(self.resharder, self.rank, version)
        if post_refit:
            out["post_refit"] = self.post_refit(model, owners=owners)
        return out

    def post_refit(self, model, *, owners: Iterable[Any] = (), strict: bool = True) -> dict:
        """SGLang's post-refit hooks: FP8 guard, ``post_load_weights`` for the written ``kv_b_proj``
        (target and draft), ``flush_cache`` on an owner if one is given."""
        models = [model] + ([self.draft] if self.draft is not None and any(n.startswith(MTP_PREFIX) for n in self.written) else [])
        rep = run_post_refit("sglang", models, owners=list(owners), changed=self.written, strict=strict)
        self.reports.append(rep)
        return rep

    def leave(self, model=None) -> dict:
        if self.group is not None:
            leave_group(self.group)
        self.__init__()
        return {"left": True}


_SESSION = SGLangRefit()


def session() -> SGLangRefit:
    """This process's loader session."""
    return _SESSION


def load(model: torch.nn.Module, named_tensors) -> None:
    """SGLang custom weight loader (``--custom-weight-loader`` / ``load_format``).

    Runs the ``mcore_reshard.*`` commands in order (see the module doc); other tensors go to
    ``model.load_weights``.  A refused ``join``/``prepare`` (nothing moved; the trainer ranks
    raise the same error) is logged and kept in ``session().last_error``; a failed ``refit``
    re-raises (parameters may be partly written) unless the command says ``"raise": false``."""
    s = _SESSION
    if isinstance(named_tensors, (str, bytes, Mapping)) or not isinstance(named_tensors, Iterable):
        raise TypeError(f"named_tensors: must be an iterable of (name, tensor) pairs, not {type(named_tensors).__name__}")
    named = list(named_tensors)
    weights = [(n, t) for n, t in named if not n.startswith(COMMAND_PREFIX)]
    if weights:
        model.load_weights(weights)
    if is_draft(model):
        s.draft = model       # SGLang calls the loader for the draft first, then for the target
        return
    for name, tensor in named:
        if not name.startswith(COMMAND_PREFIX):
            continue
        cmd = name[len(COMMAND_PREFIX):]
        raise_errors = cmd in ("refit", "post_refit")
        try:
            payload = decode(tensor)
            raise_errors = bool(payload.pop("raise", raise_errors))
            if cmd not in COMMANDS:
                raise ReshardError(f"unknown mcore_reshard command {cmd!r}; known: {COMMANDS}")
            s.last_error = None
            getattr(s, cmd)(model, **payload)
        except Exception as e:  # noqa: BLE001
            s.last_error = f"{cmd}: {type(e).__name__}: {e}"
            log.error("mcore_reshard %s failed on rank %s: %s", cmd, s.rank, e)
            if raise_errors:
                raise


__all__ = ["COMMANDS", "COMMAND_PREFIX", "LOAD_FORMAT", "SGLangRefit", "command", "decode", "is_draft", "load",
           "session", "sglang_spec", "sglang_tp_rank"]
