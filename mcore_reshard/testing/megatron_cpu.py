"""Run tiny Megatron-Core 0.19.2 models on a CPU-only torch with gloo (laptops, CI, the tests).

Opt-in: nothing else in ``mcore_reshard`` imports this module, and nothing in the installed packages
is edited on disk -- CUDA-only calls are monkeypatched at runtime, in this process only, by
:func:`install_cpu_shims` (which does nothing when a GPU is present).  Typical use::

    import torch.distributed as dist
    from mcore_reshard.testing import megatron_cpu
    dist.init_process_group("gloo", ...)
    megatron_cpu.init_megatron(tp=2, pp=1, ep=2)        # installs the shims, then Megatron's parallel state
    chunks = megatron_cpu.build_dsv3_tiny(topk=4)       # or your own GPTModel (local spec, use_cpu_initialization)
    logits = megatron_cpu.forward_logits(chunks, tokens)

Public API
----------
``install_cpu_shims()``
    Idempotent runtime patches for the CUDA-only calls Megatron-Core hits on a CPU-only torch
    (model build, forward with the alltoall/allgather MoE dispatchers, ``megatron.core.resharding``'s
    gloo copy service).
``init_megatron(tp=1, pp=1, ep=1, etp=None, cp=1, vpp=None, order="tp-cp-ep-dp-pp", seed=1234)``
    ``parallel_state.initialize_model_parallel`` + ``model_parallel_cuda_manual_seed`` on an already
    initialised gloo ``torch.distributed``.
``destroy_megatron(barrier=True)``
    Tear all of that down (and destroy the process groups it created) so that another layout can be
    initialised in the same process.
``build_dsv3_tiny(...)``, ``build_gqa_dense_tiny(...)``, ``build_qwen3_moe_tiny(...)``
    Build the model chunks of this rank (a list: one ``GPTModel`` per virtual pipeline stage) for the
    layout set by :func:`init_megatron`.
``forward_logits(chunks, tokens)``
    Forward on CPU (any PP, VPP, TP, EP, ETP, SP; CP=1) returning full-vocab fp32 logits
    ``[b, s, vocab]`` on every rank.
``spawn(fn, world_size, *args, timeout=300, gloo_timeout=120, start_method="forkserver", quiet=True)``
    Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with gloo initialised
    (FILE rendezvous in a new temp dir); returns the list of per-rank return values, raises on a
    child failure (with the root-cause traceback) or on timeout.
``causal_mask(seq_len)``
    The explicit bool causal mask passed to the models (``attention_mask=None`` would allocate on
    CUDA).

What works (megatron-core 0.19.2, torch 2.13, CPU, local spec)
--------------------------------------------------------------
* TP, SP, PP (even, uneven via ``first_stage_layers``/``last_stage_layers``, or an explicit
  ``pipeline_layout`` string), VPP (one chunk per virtual stage), EP, expert-TP != TP, CP groups
  (build only: the local ``DotProductAttention`` has no context-parallel forward, so
  :func:`forward_logits` requires CP=1).
* MTP (``mtp=True`` in :func:`build_dsv3_tiny`) builds and runs with PP=1, PP>1 and VPP (the MTP
  block lives on the last (virtual) pipeline stage, which then also holds a copy of the word
  embeddings, all-reduced from the first stage at build time). In forward without labels the MTP
  block runs (its loss is derived from the input ids and discarded); the returned logits are the
  main head's.
* Tied embeddings with PP/VPP (the last stage's output weight is all-reduced from the first stage).
* fp32 and bf16 (norm weights and the router expert bias stay fp32, as on GPU).

What does not
-------------
* Forward with CP>1 (groups and builds are fine).
* Megatron's own pipeline schedules (they allocate CUDA tensors): :func:`forward_logits` runs its
  own sequential send/recv loop instead. Forward only, no backward.
* Transformer-Engine specs (TE cannot be installed here): local spec only, i.e. SequentialMLP
  experts, TP-sharded MLA down-projections.
* Init is TP-invariant but not EP- or PP-invariant (fewer local experts/layers draw fewer random
  numbers): compare layouts through gathered tensors, not by rebuilding with the same seed.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
import traceback
import types
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = [
    "install_cpu_shims",
    "init_megatron",
    "destroy_megatron",
    "build_dsv3_tiny",
    "build_gqa_dense_tiny",
    "build_qwen3_moe_tiny",
    "forward_logits",
    "causal_mask",
    "spawn",
]

# ----------------------------------------------------------------------------------------------
# CPU shims
# ----------------------------------------------------------------------------------------------

_SHIMS_INSTALLED = False


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is synchronous, so every event is complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, end_event):
        return 0.0


class _FakeStream:
    """Stands in for ``torch.cuda.Stream``: one singleton, so ``current_stream() == side_stream``
    and code that only records streams for side-stream copies (``record_stream``) skips it."""

    _instance: Optional["_FakeStream"] = None

    def __new__(cls, *args, **kwargs):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _FakeEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoPinTorch(types.ModuleType):
    """``torch`` as seen by the gloo copy service: the same module except that ``empty(...,
    pin_memory=True)`` drops the pinning (pinning needs a CUDA driver)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, **kwargs)


def install_cpu_shims() -> None:
    """Monkeypatch, at runtime only, the CUDA-only calls Megatron-Core 0.19.2 makes on CPU torch.

    Safe to call many times (patches are applied once per process). Call it before building any
    model; :func:`init_megatron` and :func:`spawn` call it for you.
    """
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
        return
    if torch.cuda.is_available():  # a real GPU: nothing to emulate
        _SHIMS_INSTALLED = True
        return

    cuda = torch.cuda
    # RNG: Megatron's tracker seeds/gets/sets the *CUDA* generator; route it to the CPU generator
    # (with use_cpu_initialization the weights are drawn from the CPU RNG anyway).
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # model_parallel_cuda_manual_seed, tracker.add
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # CudaRNGStatesTracker.add
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # rerun/restore paths
    # MLA's RotaryEmbedding (and the router/rope forward) place tensors on current_device().
    cuda.current_device = lambda: "cpu"
    # Streams/events: alltoall dispatcher (dtoh stream + d2h_event), resharding execution and the
    # gloo copy service use side streams; on CPU everything is synchronous.
    cuda.Stream = _FakeStream
    cuda.Event = _FakeEvent
    cuda.current_stream = lambda device=None: _FakeStream()
    cuda.default_stream = lambda device=None: _FakeStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    # resharding.execution calls torch.cuda.synchronize() around the copy service run.
    cuda.synchronize = lambda device=None: None
    # LanguageModule.setup_embeddings_and_output_layer does weight.data.cuda() (tied embeddings or
    # MTP with PP>1) before its all-reduce: keep the tensor on CPU.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # Tensor.pin_memory() needs a CUDA driver; pinning is only a transfer optimisation.
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    from megatron.core.tensor_parallel import random as mc_random

    # CudaRNGStatesTracker.fork/add get/set the CUDA generator via these module functions.
    mc_random._get_cuda_rng_state = (
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    )
    mc_random._set_cuda_rng_state = (
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    )

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    _orig_move = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(_orig_move)
    def _maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # On GPU the split sizes become numpy arrays; on CPU the original returns them as tensors,
        # which all_to_all_single() rejects ("incompatible function arguments").
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return _orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu

    from megatron.core.tensor_parallel import mappings

    _orig_gather = mappings._gather_along_first_dim

    @functools.wraps(_orig_gather)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        # gloo's all_gather rejects unequal sizes; the alltoall dispatcher with TP>1 gathers uneven
        # token counts over TP: pad to the largest, gather, trim.
        if (output_split_sizes is not None and len(set(output_split_sizes)) > 1
                and dist.get_backend(group) == "gloo"):
            padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
            padded[: input_.shape[0]] = input_
            parts = [torch.empty_like(padded) for _ in output_split_sizes]
            dist.all_gather(parts, padded, group=group)
            return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)], dim=0)
        return _orig_gather(input_, group, output_split_sizes, use_global_buffer)

    mappings._gather_along_first_dim = _gather_along_first_dim

    try:  # megatron.core.resharding's gloo service allocates pinned staging buffers.
        from megatron.core.resharding.copy_services import gloo_copy_service

        gloo_copy_service.torch = _NoPinTorch("torch")  # pin_memory=True -> plain CPU buffers
    except ImportError:  # pragma: no cover - older megatron-core without resharding
        pass

    _SHIMS_INSTALLED = True


# ----------------------------------------------------------------------------------------------
# parallel state
# ----------------------------------------------------------------------------------------------


def init_megatron(tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None, cp: int = 1,
                  vpp: Optional[int] = None, order: str = "tp-cp-ep-dp-pp", seed: int = 1234) -> None:
    """Initialise Megatron-Core's parallel state for this layout on the live gloo world.

    ``torch.distributed`` must already be initialised (gloo). ``etp=None`` means expert-TP = TP.
    ``vpp`` is the virtual pipeline size (needs ``pp > 1``). Seeds the (CPU-routed) RNG tracker with
    ``seed``, so builds are deterministic for a given layout. Call :func:`destroy_megatron` before
    initialising another layout in the same process.
    """
    install_cpu_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    assert dist.is_initialized(), "torch.distributed must be initialised (gloo) first"
    if ps.model_parallel_is_initialized():
        destroy_megatron()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        order=order,
        create_gloo_process_groups=False,  # the default groups are gloo already
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_megatron(barrier: bool = True) -> None:
    """Undo :func:`init_megatron`: destroy every process group Megatron created and reset its
    globals, so that the next :func:`init_megatron` (any sizes) starts clean. Idempotent.

    Collective (all ranks must call it) unless ``barrier=False``: the barrier keeps a fast rank from
    aborting a gloo group while a peer is still connecting to it (seen as a flaky "Gloo
    connectFullMesh failed ... Connection closed by peer" when nothing else synchronises the ranks
    between init and destroy).
    """
    from megatron.core import parallel_state as ps

    if barrier and dist.is_initialized():
        dist.barrier()
    groups = [g for g in (ps._global_process_group_list or []) if g is not None]
    ps.destroy_model_parallel()
    # destroy_model_parallel only drops Megatron's references; free the gloo groups themselves.
    world = dist.distributed_c10d._world
    seen = set()
    for g in groups:
        if id(g) in seen or world.pg_map.get(g) is None:
            continue
        seen.add(id(g))
        try:
            dist.destroy_process_group(g)
        except Exception:  # pragma: no cover - best effort
            pass
    ps._global_process_group_list = None


# ----------------------------------------------------------------------------------------------
# multi-process launcher
# ----------------------------------------------------------------------------------------------


def _quiet() -> None:
    """Silence the per-process import/build chatter (Apex/TE fallbacks, deprecations, 'GPTModel IS
    DEPRECATED'), which would otherwise be printed once per rank and scenario."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    for name in ("megatron", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _spawn_worker(rank: int, fn: Callable, world_size: int, init_file: str, result_dir: str,
                  gloo_timeout_s: float, quiet: bool, env: dict, args: tuple) -> None:
    # forkserver children inherit the server's environment from when it started: use the caller's
    os.environ.clear()
    os.environ.update(env)
    if quiet:
        _quiet()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # gloo groups connect their pairs on first use: initialize_model_parallel creates dozens of
    # groups, most never used in a test (halves init time at world 8). Set it to 0 to opt out.
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    torch.set_num_threads(1)  # world_size processes share a few cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=gloo_timeout_s))
    try:
        install_cpu_shims()
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"result_{rank}.pt"))
    except BaseException:
        # every failing rank leaves its traceback, so the parent can show the root cause rather than
        # whichever rank died first (often a peer that only saw "Connection closed by peer").
        with open(os.path.join(result_dir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise  # no collective clean-up: peers may be dead; the process exits
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        destroy_megatron()
    dist.barrier()  # nobody tears the world down while a peer still finishes its last collective
    dist.destroy_process_group()


FORKSERVER_PRELOAD = [
    __name__,  # this module, which imports torch
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer.transformer_config",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.gpt_model",
]


_SECONDARY_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                     "Broken pipe", "KeyboardInterrupt")


def _failure_report(fn, world_size: int, tmp: str, exc: Exception) -> str:
    errors = {}
    for r in range(world_size):
        path = os.path.join(tmp, f"error_{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                errors[r] = f.read()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head = f"spawn({getattr(fn, '__name__', fn)}, world_size={world_size}) failed (first exit: {first})"
    if not errors:  # killed by a signal / os._exit before Python could report
        return f"{head}: {exc}"
    primary = [r for r, t in errors.items() if not any(m in t for m in _SECONDARY_ERRORS)] or list(errors)
    lines = [f"{head}: ranks {sorted(errors)} raised; root cause from rank {primary[0]}:", errors[primary[0]]]
    for r, t in errors.items():
        if r != primary[0]:
            lines.append(f"rank {r}: {t.strip().splitlines()[-1]}")
    return "\n".join(lines)


def spawn(fn: Callable, world_size: int, *args, timeout: float = 300.0,
          gloo_timeout: float = 120.0, start_method: str = "forkserver", quiet: bool = True) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with a gloo world
    initialised through a FILE rendezvous in a new temporary directory (``GLOO_SOCKET_IFNAME=lo``,
    one torch thread per process, CPU shims installed). Never uses a TCP port of its own.

    ``fn`` must be importable by the children (a module-level function). Returns the per-rank return
    values (which must be ``torch.save``-able), in rank order. A child exception is raised here as
    ``RuntimeError`` carrying the child's traceback text; if the children do not all finish within
    ``timeout`` seconds, they are killed and ``TimeoutError`` is raised. ``gloo_timeout`` bounds each
    collective, so a rank stuck waiting for a dead peer errors out as well. ``quiet`` silences
    warnings and megatron/torch logging below ERROR in the children.

    The children see no GPU (``CUDA_VISIBLE_DEVICES=""``) and get the caller's environment as of
    this call (plus ``TORCH_GLOO_LAZY_INIT=1`` unless set).

    ``start_method``: ``"forkserver"`` (default) starts the children from a clean single-threaded
    server process (itself started like ``spawn``) that has imported torch and megatron.core once
    (``set_forkserver_preload``): a 4-rank launch costs ~6 s the first time in a process and <1 s
    after, against ~20 s with ``"spawn"``, which re-imports megatron.core (~7 CPU-s) in every child.
    Children never share state with the caller in either mode.
    """
    import torch.multiprocessing as mp

    if start_method == "forkserver":  # no effect once this process's forkserver is running
        mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    tmp = tempfile.mkdtemp(prefix="mcore_cpu_spawn_")
    init_file = os.path.join(tmp, "rendezvous")
    # CPU-only children: GPUs hidden (also from a forkserver started now), gloo on loopback
    child_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo")
    try:
        with _temporary_env(CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo"):
            ctx = mp.start_processes(
                _spawn_worker,
                args=(fn, world_size, init_file, tmp, gloo_timeout, quiet, child_env, tuple(args)),
                nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic())), grace_period=2.0):
                if time.monotonic() >= deadline:
                    alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                    raise TimeoutError(f"spawn({getattr(fn, '__name__', fn)}, {world_size}): ranks "
                                       f"{alive} still running after {timeout:.0f} s; killed")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise RuntimeError(_failure_report(fn, world_size, tmp, e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            for path in ctx.error_files:  # torch's per-child error files (written on failure only)
                if path and os.path.exists(path):
                    os.unlink(path)
        return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False)
                for r in range(world_size)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _temporary_env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# the model builders and the forward live in tiny_models (part of this module's API)
from .tiny_models import (  # noqa: E402, F401 - re-exported
    MAX_SEQ,
    VOCAB,
    build_dsv3_tiny,
    build_gqa_dense_tiny,
    build_qwen3_moe_tiny,
    causal_mask,
    forward_logits,
)
