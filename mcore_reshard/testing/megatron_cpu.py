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
import copy
import dataclasses
import functools
import os
import shutil
import tempfile
import time
import traceback
import types
from datetime import timedelta
from typing import Callable, Optional, Sequence

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


def _ps_sizes() -> dict:
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
    )


# ----------------------------------------------------------------------------------------------
# spec tweaks
# ----------------------------------------------------------------------------------------------


def _cpu_norm(config, hidden_size: int, eps: float = 1e-5, **_unused):
    """torch RMSNorm/LayerNorm builder that, unlike ``WrappedTorchNorm``, accepts sequence
    parallelism (it only marks the weights, as Megatron's fused norms do)."""
    if config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
    else:
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


_CPU_CORE_ATTENTION = None


def _cpu_core_attention_cls():
    """Local ``DotProductAttention`` that accepts (and drops) MLA's ``k_channels``/``v_channels``
    (valid while ``kv_channels == v_head_dim``)."""
    global _CPU_CORE_ATTENTION
    if _CPU_CORE_ATTENTION is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class CpuDotProductAttention(DotProductAttention):
            def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
                super().__init__(*args, **kwargs)

        _CPU_CORE_ATTENTION = CpuDotProductAttention
    return _CPU_CORE_ATTENTION


def _swap_modules(obj, mapping: dict):
    """Copy of a spec tree (ModuleSpec / submodule dataclasses / partials / lists) with the classes
    in ``mapping`` replaced."""
    try:
        if obj in mapping:
            return mapping[obj]
    except TypeError:  # unhashable
        pass
    if isinstance(obj, functools.partial):
        return functools.partial(_swap_modules(obj.func, mapping),
                                 *[_swap_modules(a, mapping) for a in obj.args],
                                 **{k: _swap_modules(v, mapping) for k, v in obj.keywords.items()})
    if isinstance(obj, list):
        return [_swap_modules(x, mapping) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_swap_modules(x, mapping) for x in obj)
    if isinstance(obj, dict):
        return {k: _swap_modules(v, mapping) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _swap_modules(getattr(obj, f.name), mapping))
        return new
    return obj


def _cpu_spec(spec):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return _swap_modules(spec, {WrappedTorchNorm: _cpu_norm, DotProductAttention: _cpu_core_attention_cls()})


# ----------------------------------------------------------------------------------------------
# model builders
# ----------------------------------------------------------------------------------------------

VOCAB = 128
MAX_SEQ = 64


def _base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                        pipeline_layout) -> dict:
    import torch.nn.functional as F

    s = _ps_sizes()
    if vpp is None:
        vpp = s["vpp"]
    kw = dict(
        tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
        context_parallel_size=s["cp"], expert_model_parallel_size=s["ep"],
        expert_tensor_parallel_size=s["etp"], virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel and s["tp"] > 1,
        use_cpu_initialization=True, params_dtype=dtype, bf16=(dtype == torch.bfloat16),
        fp16=(dtype == torch.float16), pipeline_dtype=dtype,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
    )
    if pipeline_layout is not None:
        kw["pipeline_model_parallel_layout"] = pipeline_layout
    if first_stage_layers is not None:
        kw["num_layers_in_first_pipeline_stage"] = first_stage_layers
    if last_stage_layers is not None:
        kw["num_layers_in_last_pipeline_stage"] = last_stage_layers
    return kw


def _moe_kwargs(dispatcher: str, load_balancing: str) -> dict:
    return dict(moe_router_dtype="fp32", moe_grouped_gemm=False, moe_token_dispatcher_type=dispatcher,
                moe_aux_loss_coeff=0.0, moe_router_load_balancing_type=load_balancing)


def _build_chunks(config, vocab_size: int, share_embeddings: bool, mtp: bool) -> list:
    """One GPTModel per virtual pipeline stage of this rank (a single one without VPP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for v in range(vpp or 1):
        vp_stage = v if vpp else None
        spec = _cpu_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                    normalization=config.normalization, vp_stage=vp_stage))
        mtp_spec = None
        if mtp:
            mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
            mtp_spec = _cpu_spec(mtp_spec) if mtp_spec is not None else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=MAX_SEQ,
                         pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=share_embeddings,
                         position_embedding_type="rope", mtp_block_spec=mtp_spec, vp_stage=vp_stage)
        model.eval()
        chunks.append(model)
    return chunks


def build_dsv3_tiny(dtype: torch.dtype = torch.float32, mtp: bool = True, num_layers: int = 4,
                    sequence_parallel: bool = False, vpp: Optional[int] = None,
                    first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None,
                    pipeline_layout: Optional[str] = None, dispatcher: str = "alltoall",
                    num_experts: int = 8, topk: int = 2, rope_type: str = "rope",
                    yarn: Optional[dict] = None, widths: Optional[dict] = None) -> list:
    """Tiny DeepSeek-V3-style model: MLA (q_lora 32, kv_lora 16, nope 16, rope 8, v 16, 4 heads,
    hidden 64), first layer dense (ffn 128), the rest MoE with ``num_experts`` routed experts
    (ffn 32, top-2, sigmoid scores, expert bias, 4 groups / top-2 groups, scaling 2.5) plus one
    shared expert (ffn 32); RMSNorm, q/kv layernorms, untied embeddings, vocab 128.

    ``mtp=True`` adds one MTP layer (works with PP=1, PP>1 and VPP; it sits on the last stage).
    ``vpp=None`` takes the virtual pipeline size from ``parallel_state``. Uneven PP: pass
    ``first_stage_layers``/``last_stage_layers`` or a Megatron ``pipeline_layout`` string such as
    ``"Et|ttt,mL"`` (PP2) or ``"Et|t|t|tmL"`` (PP2 x VPP2). ``sequence_parallel`` is ignored when
    TP=1. ``dispatcher``: ``"alltoall"`` or ``"allgather"``. Returns this rank's chunks (one per
    virtual stage), in eval mode.

    ``rope_type="yarn"`` uses YaRN RoPE; ``yarn`` overrides its MLATransformerConfig fields
    (``rotary_scaling_factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
    ``mscale``, ``mscale_all_dim``; default here: factor 4 over 16 original positions, so that the
    ramp between interpolated and extrapolated frequencies falls inside the 4 rope frequencies, and
    DeepSeek-V3's mscale 1 / mscale_all_dim 0.707, so that both the softmax scale and the cos/sin
    factor differ from 1).

    ``widths`` overrides the sizes (``hidden_size``, ``ffn_hidden_size``, ``num_attention_heads``,
    ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim`` (=
    ``kv_channels``), ``moe_ffn_hidden_size`` (= the shared expert's), and ``vocab``) for a larger model.

    The other builders take the same layout keywords.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    sizes = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, q_lora_rank=32, kv_lora_rank=16,
                 qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, moe_ffn_hidden_size=32, vocab=VOCAB)
    sizes.update(widths or {})
    vocab = sizes.pop("vocab")
    sizes.update(kv_channels=sizes["v_head_dim"], moe_shared_expert_intermediate_size=sizes["moe_ffn_hidden_size"])

    kw = _base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                             pipeline_layout)
    config = MLATransformerConfig(
        num_layers=num_layers, **sizes, rope_type=rope_type, qk_layernorm=True, layernorm_epsilon=1e-6,
        num_moe_experts=num_experts, moe_router_topk=topk, moe_layer_freq=[0] + [1] * (num_layers - 1),
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_pre_softmax=True, mtp_num_layers=1 if mtp else None,
        **_moe_kwargs(dispatcher, "seq_aux_loss"), **kw, **_yarn_kwargs(rope_type, yarn))
    return _build_chunks(config, vocab, share_embeddings=False, mtp=mtp)


def _yarn_kwargs(rope_type: str, yarn: Optional[dict]) -> dict:
    if rope_type != "yarn":
        return dict(yarn or {})
    out = dict(rotary_scaling_factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
               mscale=1.0, mscale_all_dim=0.707)
    out.update(yarn or {})
    return out


def build_gqa_dense_tiny(dtype: torch.dtype = torch.float32, num_layers: int = 4,
                         num_query_groups: int = 4, tied_embeddings: bool = False,
                         qkv_bias: bool = False, sequence_parallel: bool = False,
                         vpp: Optional[int] = None, first_stage_layers: Optional[int] = None,
                         last_stage_layers: Optional[int] = None,
                         pipeline_layout: Optional[str] = None) -> list:
    """Tiny Llama/Qwen2-style dense model: hidden 64, 8 heads of 8, ``num_query_groups`` KV groups
    (GQA; must be divisible by TP), SwiGLU ffn 128, RMSNorm, rope, optional qkv bias (Qwen2) and
    tied embeddings, vocab 128."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = _base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                             pipeline_layout)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=8, num_query_groups=num_query_groups,
        kv_channels=8, ffn_hidden_size=128, add_qkv_bias=qkv_bias, layernorm_epsilon=1e-6, **kw)
    return _build_chunks(config, VOCAB, share_embeddings=tied_embeddings, mtp=False)


def build_qwen3_moe_tiny(dtype: torch.dtype = torch.float32, num_layers: int = 4,
                         num_query_groups: int = 4, num_experts: int = 8,
                         sequence_parallel: bool = False, vpp: Optional[int] = None,
                         first_stage_layers: Optional[int] = None,
                         last_stage_layers: Optional[int] = None,
                         pipeline_layout: Optional[str] = None, dispatcher: str = "alltoall") -> list:
    """Tiny Qwen3-MoE-style model: hidden 64, 8 heads of 16 (q width 128 != hidden, as in Qwen3),
    ``num_query_groups`` KV groups, qk_layernorm, every layer MoE with ``num_experts`` experts
    (ffn 32, softmax router, top-2, renormalised, no shared expert, no expert bias), RMSNorm,
    untied embeddings, vocab 128."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = _base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                             pipeline_layout)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=8, num_query_groups=num_query_groups,
        kv_channels=16, ffn_hidden_size=128, qk_layernorm=True, layernorm_epsilon=1e-6,
        num_moe_experts=num_experts, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_router_score_function="softmax", moe_router_pre_softmax=False,
        **_moe_kwargs(dispatcher, "aux_loss"), **kw)
    return _build_chunks(config, VOCAB, share_embeddings=False, mtp=False)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's bool attention mask ``[1, 1, s, s]``: True = masked (future positions)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


@torch.no_grad()
def forward_logits(chunks: Sequence[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """Forward ``tokens [b, s]`` through the model and return full-vocab fp32 logits ``[b, s, V]``
    on every rank.

    Pipeline stages (and virtual stages) run one after another in a manual loop: each global
    virtual stage receives ``[s(/tp with SP), b, h]`` from the previous one over the PP group
    (``dist.send/recv``) and feeds it with ``set_input_tensor``; Megatron's PP schedule is not used
    (it allocates CUDA tensors). The last stage gathers the vocab-parallel logits over TP, then
    broadcasts them over the PP group. Needs CP=1 and the same ``tokens`` on every rank.
    """
    from megatron.core import parallel_state as ps

    assert ps.get_context_parallel_world_size() == 1, "forward_logits supports CP=1 only"
    tokens = tokens.long()
    b, s = tokens.shape
    position_ids = torch.arange(s, dtype=torch.long)[None].expand(b, s).contiguous()
    mask = causal_mask(s)
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else [dist.get_rank()]
    n_chunks = len(chunks)
    config = chunks[0].config
    tp = ps.get_tensor_model_parallel_world_size()
    act_seq = s // tp if config.sequence_parallel else s
    act_shape = (act_seq, b, config.hidden_size)
    act_dtype = config.pipeline_dtype or config.params_dtype

    logits_local = None
    for v, model in enumerate(chunks):
        stage = v * pp + pp_rank  # global virtual stage index
        if stage > 0:
            buf = torch.empty(act_shape, dtype=act_dtype)
            dist.recv(buf, src=pp_ranks[(stage - 1) % pp], group=pp_group)
            model.set_input_tensor(buf)
        else:
            model.set_input_tensor(None)
        out = model(tokens, position_ids, mask)
        if stage < n_chunks * pp - 1:
            dist.send(out.contiguous().to(act_dtype), dst=pp_ranks[(stage + 1) % pp], group=pp_group)
        else:
            logits_local = out  # [b, s, V/tp]

    vocab = None
    if logits_local is not None:
        logits_local = logits_local.float().contiguous()
        if tp > 1:
            parts = [torch.empty_like(logits_local) for _ in range(tp)]
            dist.all_gather(parts, logits_local, group=ps.get_tensor_model_parallel_group())
            logits_local = torch.cat(parts, dim=-1)
        vocab = logits_local.shape[-1]
    if pp == 1:
        return logits_local
    # broadcast from the last stage to the rest of the pipeline group
    vocab_t = torch.tensor([vocab if vocab is not None else 0], dtype=torch.long)
    dist.broadcast(vocab_t, src=pp_ranks[-1], group=pp_group)
    if logits_local is None:
        logits_local = torch.empty((b, s, int(vocab_t.item())), dtype=torch.float32)
    dist.broadcast(logits_local, src=pp_ranks[-1], group=pp_group)
    return logits_local


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


_FORKSERVER_PRELOAD = [
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
        mp.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
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
