"""Megatron-Core -> a Hugging Face directory in one collective call: ``export_hf(chunks, out_dir)``.

Every rank of ``group`` calls it with its own model chunks (``[]`` on a rank that holds none); the
rank ``on_rank`` of the group writes ``out_dir``: ``config.json`` (derived by
:mod:`mcore_reshard.sources.hf_config`, never written by hand), ``model-0000i-of-0000n.safetensors``
shards under the names of Hugging Face checkpoints (per-expert ``mlp.experts.{e}.gate_proj.weight``
..., DeepSeek's MTP layer as ``model.layers.{num_layers}.*`` with its copies of the embedding and the
head), and ``model.safetensors.index.json``.  ``AutoModelForCausalLM.from_pretrained(out_dir)``
then loads a model with Megatron's logits.  Nothing relies on transformers' ``save_pretrained``
(which writes nothing on a process whose global rank is not 0).

Streaming under a memory budget: the destination tensors are cut into groups of at most
``memory_bytes`` (one shard file each; a tensor larger than that is a group of its own).  For each
group, every rank plans the transfer of just those tensors into whole tensors on ``on_rank``
(:func:`mcore_reshard.targets.hf_layout`, pure planning, identical on every rank), the
:class:`~mcore_reshard.core.executor.Resharder` moves them (sources are read in place, staging stays
under ``budget_bytes``), ``on_rank`` writes the shard, frees it, and goes on with the next group.
So ``on_rank`` never holds more than one group plus staging, and a model larger than its memory
exports.  Example, the tiny DeepSeek-V3 (4 layers + MTP, 8 experts, fp32) at ``memory_bytes=128 KiB``::

    group  tensors (canonical)                                     file
    0      model.embed_tokens.weight [128, 64], layer 0 ...          model-00001-of-00009.safetensors
    1      model.layers.1.* (experts as 8 x gate/up/down_proj) ...   model-00002-of-00009.safetensors
    ...
    8      model.layers.4.* (MTP) + its embed_tokens/shared_head copies, model.norm, lm_head

Refused before a byte moves, on every rank: a Megatron setting transformers cannot express (the
:class:`~mcore_reshard.sources.hf_config.HFConfigError` names it and the fix), ranks that disagree on
the architecture, a derived config whose tensors differ from the model's, an ``on_rank`` outside
the group, an ``out_dir`` another export is writing (the error names the directory and that
writer: pid, host, since when).  A shard that cannot be written makes every rank raise too.

The export owns ``out_dir`` while it runs and leaves it complete or as it was
(:class:`~mcore_reshard.util.owned_dir.OwnedDirectory`): the writer takes a lock beside it
(``.<name>.lock``, released by the kernel if the writer dies), writes every file into a staging
directory beside it, and only once the last file is written swaps that directory into place with a
rename.  A failed, interrupted or killed export leaves ``out_dir`` as it was (the previous export, or
absent); files of ``out_dir`` that are not the export's (a tokenizer) are carried over.

    writer                        out_dir as another process sees it
    export A returned             A (complete)
    export B streaming shards     A; a second export C now is refused naming B's writer
    export B killed (SIGKILL)     A (B's staging directory is removed by the next export)
    export B returned             B (complete), A's tokenizer.json carried over
"""
from __future__ import annotations

import json
import numbers
import os
import re
import time
from typing import Sequence

import torch
import torch.distributed as dist

from .core.executor import GatherChecked, Resharder, ReshardError, all_gather_json, all_or_none, dtype_name, torch_dtype
from .core.layout import Buffer, Layout, merge_layouts
from .core.planner import DEFAULT_BUDGET, PlanError, check_budget, make_plan
from .mapper.family import canonicalize, load_family
from .refit import agreed_config
from .sources.megatron_model import family_for, model_config, read_layout
from .util.memstat import peak_bytes, reset_peak, rss_bytes
from .util.owned_dir import OwnedDirectory
from .util.progress import bar

INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def _dst_layout(src: Layout, hf_cfg: dict, on_rank: int, dtype: str | None) -> Layout:
    """Every canonical tensor whole on ``on_rank`` under the checkpoint's names, in ``dtype`` (None:
    the source's; tensors HF keeps in float32, like DeepSeek's router bias, stay float32)."""
    from .targets import from_hf_config, hf_layout
    mc = from_hf_config(hf_cfg)
    ref = hf_layout(mc, on_rank, dtype="bfloat16", fused_experts=False, mtp_copies=bool(mc.mtp_layers))
    want = {n: ("float32" if m.dtype == "float32" else dtype) or (src.tensors[n].dtype if n in src.tensors else m.dtype)
            for n, m in ref.tensors.items()}
    missing, extra = sorted(set(ref.tensors) - set(src.tensors)), sorted(set(src.tensors) - set(ref.tensors))
    if missing or extra:
        raise ReshardError(f"the derived {hf_cfg['model_type']} config does not describe this model's tensors: "
                           f"{len(missing)} it expects are not in the Megatron model ({', '.join(missing[:6])}), "
                           f"{len(extra)} of the model are not in it ({', '.join(extra[:6])})")
    bad = [f"{n} {list(src.tensors[n].shape)} vs {list(m.shape)}" for n, m in ref.tensors.items()
           if src.tensors[n].shape != m.shape]
    if bad:
        raise ReshardError(f"the derived {hf_cfg['model_type']} config gives other shapes than the model "
                           f"(Megatron vs config): {'; '.join(bad[:6])}")
    out = Layout()
    for n, m in ref.tensors.items():
        out.add_tensor(n, m.shape, want[n])
    for b in ref.buffers.get(on_rank, {}).values():
        out.add_buffer(on_rank, Buffer(b.name, b.shape, want[b.pieces[0].tensor], b.pieces))
    return out


def shard_groups(dst: Layout, rank: int, memory_bytes: int) -> list[list[str]]:
    """Destination buffer names in order, cut into groups of at most ``memory_bytes`` (a buffer
    larger than that alone)."""
    groups, cur, size = [], [], 0
    for name, b in dst.buffers.get(rank, {}).items():
        n = torch.Size(b.shape).numel() * torch_dtype(b.dtype).itemsize
        if cur and size + n > memory_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        groups.append(cur)
    return groups


def _sub_layout(lay: Layout, tensors: set[str], ranks_buffers: dict[int, list[str]]) -> Layout:
    """The part of ``lay`` that holds ``tensors``: their metas, and the buffers ``ranks_buffers``
    names, with only their pieces of ``tensors``."""
    out = Layout()
    for n in sorted(tensors):
        m = lay.tensors[n]
        out.add_tensor(n, m.shape, m.dtype)
    for r, bufs in lay.buffers.items():
        for name in ranks_buffers.get(r, ()):
            b = bufs[name]
            pieces = tuple(p for p in b.pieces if p.tensor in tensors)
            if pieces:
                out.add_buffer(r, Buffer(b.name, b.shape, b.dtype, pieces))
    return out


def _is_export_file(name: str) -> bool:
    """Files of an export (an earlier one's are replaced as a whole; other files of ``out_dir`` -- a
    tokenizer, a README -- are carried over into the new directory)."""
    return bool(_SHARD.match(name)) or name in (INDEX, "config.json")


def export_hf(model_chunks: Sequence[torch.nn.Module], out_dir: str, group=None, *, on_rank: int = 0,
              dtype: torch.dtype | str | None = None, family: str = "auto", vocab_size: int | None = None,
              memory_bytes: int = 1 << 30, budget_bytes: int = DEFAULT_BUDGET, timeout: float | None = None,
              progress: bool = True) -> dict:
    """Collective over ``group``: write the Megatron model as a Hugging Face directory on ``on_rank``.

    ``model_chunks``: this rank's chunks (``[]`` where it holds none).  ``on_rank``: the writer's
    rank *in* ``group`` (it may hold no chunks: an extra process that joined the group).  ``dtype``:
    the stored dtype (default: Megatron's own per tensor).  ``vocab_size``: the real vocabulary when
    the embedding is padded.  ``memory_bytes``: the most the writer holds of the model at once (and
    the largest shard file), any integer >= 1: a tensor larger than that is a group, and a shard
    file, of its own (``1``: one shard per tensor).  ``budget_bytes``: staging per rank per transfer round.  ``timeout``:
    seconds any rank waits for a peer before raising.  ``progress``: a bar per shard on the writer.

    Returns ``{"config": config.json dict, "files": [...], "tensors": n, "total_bytes": b,
    "max_group_bytes": g, "network_bytes": ..., "writer_peak_added_bytes": m, "stream_seconds": s,
    "seconds": t}`` (``m``: on the writer, how much its resident memory grew at most while streaming,
    Linux; else None; ``s``: the transfers and shard writes, ``t``: the whole call)."""
    from .sources.hf_config import hf_config_dict, megatron_facts

    budget_bytes = check_budget(budget_bytes)
    memory_bytes = _check_memory_bytes(memory_bytes)
    t0 = time.perf_counter()
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    src_t = {}
    want_dtype = None
    with GatherChecked(group, "export_hf: reading the model", timeout=timeout) as g:
        if isinstance(on_rank, bool) or not isinstance(on_rank, int) or not 0 <= on_rank < world:
            raise ValueError(f"on_rank={on_rank!r} is not a rank of the group of {world} (pass the rank in the group)")
        want_dtype = _export_dtype(dtype)
        if not isinstance(out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir={out_dir!r}: must be a path")
        if not isinstance(family, str):
            raise TypeError(f"family={family!r}: must be a family name or 'auto'")
        if rank == on_rank:
            import safetensors.torch  # noqa: F401 - the writer needs it (it comes with transformers)
        src_l, src_t = read_layout(model_chunks, rank)
        hf_cfg = None
        if model_chunks:
            hf_cfg = hf_config_dict(megatron_facts(model_chunks, vocab_size=vocab_size), family)
            if want_dtype is not None:
                hf_cfg["dtype"] = want_dtype
        g.payload.update(src=src_l.to_json(), cfg=model_config(model_chunks), hf=hf_cfg)
    parts = g.parts
    with all_or_none(group, timeout=timeout):
        config = dict(agreed_config([p["cfg"] for p in parts], "source"))
        if not config:
            raise ReshardError("export_hf: no rank of the group passed model chunks")
        if vocab_size is not None:
            config["vocab_size"] = vocab_size
        hf_cfgs = [p["hf"] for p in parts if p["hf"] is not None]
        if any(c != hf_cfgs[0] for c in hf_cfgs[1:]):
            raise ReshardError("export_hf: ranks derive different transformers configs from their chunks")
        hf_cfg = hf_cfgs[0]
        fam = load_family(family_for(config) if family == "auto" else family)
        src = canonicalize(merge_layouts([p["src"] for p in parts]), fam, config)
        dst = _dst_layout(src, hf_cfg, on_rank, want_dtype)
        groups = shard_groups(dst, on_rank, memory_bytes)
        n = len(groups)
        files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        by_tensor: dict[str, dict[int, list[str]]] = {}
        for r, bufs in src.buffers.items():
            for bname, b in bufs.items():
                for p in b.pieces:
                    names = by_tensor.setdefault(p.tensor, {}).setdefault(r, [])
                    if not names or names[-1] != bname:
                        names.append(bname)
        owned = None
        if rank == on_rank:   # this export owns out_dir until it returns: a second writer is refused
            owned = OwnedDirectory(out_dir, owned=_is_export_file,
                                   what=f"export_hf writing rank {on_rank} of a group of {world}").acquire()
    try:
        return _stream_and_commit(group, rank, on_rank, owned, out_dir, groups, files, dst, src, src_t, by_tensor,
                                  hf_cfg, budget_bytes, timeout, progress, t0)
    except BaseException:
        if owned is not None:
            owned.abort()      # out_dir keeps what it held before (or stays absent)
        raise


def _stream_and_commit(group, rank, on_rank, owned, out_dir, groups, files, dst, src, src_t, by_tensor, hf_cfg,
                       budget_bytes, timeout, progress, t0) -> dict:
    """The shards, group by group, into the writer's staging directory; then the index and config,
    and the staging directory swapped into place (:meth:`OwnedDirectory.commit`)."""
    n = len(groups)
    staging = owned.staging if owned is not None else None
    weight_map, total, biggest, net = {}, 0, 0, 0
    measured = rank == on_rank and reset_peak()    # the writer's resident memory while it streams
    before = rss_bytes() if measured else 0
    t_stream = time.perf_counter()
    pbar = bar(total=n, desc="export_hf", unit="shard") if rank == on_rank and progress else None
    for gi, names in enumerate(groups):
        bufs = dst.buffers[on_rank]
        tensors = {p.tensor for name in names for p in bufs[name].pieces}
        src_buffers: dict[int, list[str]] = {}
        for t in sorted(tensors):
            for r, bnames in by_tensor.get(t, {}).items():
                have = src_buffers.setdefault(r, [])
                have.extend(b for b in bnames if b not in have)
        src_g = _sub_layout(src, tensors, src_buffers)
        dst_g = _sub_layout(dst, tensors, {on_rank: names})
        plan = make_plan(src_g, dst_g, budget_bytes=budget_bytes, allow_cast=True)   # dtypes chosen in _dst_layout
        mine_src = {b: src_t[b] for b in src_g.buffers.get(rank, {})}
        out, error = {}, None
        if rank == on_rank:
            out = {name: torch.empty(bufs[name].shape, dtype=torch_dtype(bufs[name].dtype)) for name in names}
        Resharder(plan, mine_src, out, group, timeout=timeout).refit()
        net += plan.stats["network_bytes"]
        if rank == on_rank:
            size = sum(t.numel() * t.element_size() for t in out.values())
            biggest, total = max(biggest, size), total + size
            try:
                from safetensors.torch import save_file
                save_file(out, os.path.join(staging, files[gi]), metadata={"format": "pt"})   # as transformers writes
                weight_map.update({name: files[gi] for name in names})
            except Exception as e:  # noqa: BLE001 - every rank must hear about it
                error = f"rank {rank}: writing {os.path.join(out_dir, files[gi])} failed: {type(e).__name__}: {e}"
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix_str(f"{total / 2**20:.1f} MiB")
        del out
        _all_written(group, error, timeout, pbar)
    if pbar is not None:
        pbar.close()
    peak_added = peak_bytes() - before if measured else None
    stream_s = time.perf_counter() - t_stream
    error = None
    if rank == on_rank:
        try:
            with open(os.path.join(staging, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
            with open(os.path.join(staging, "config.json"), "w") as f:
                json.dump(_config_json(hf_cfg), f, indent=2, sort_keys=True)
            owned.commit()     # the complete directory replaces out_dir in one rename
        except Exception as e:  # noqa: BLE001
            error = f"rank {rank}: writing {out_dir} failed: {type(e).__name__}: {e}"
    _all_written(group, error, timeout, None)   # every rank returns only once the directory is complete
    return {"config": hf_cfg, "files": files + [INDEX, "config.json"], "tensors": len(dst.tensors),
            "buffers": len(dst.buffers.get(on_rank, {})), "total_bytes": total, "max_group_bytes": biggest,
            "network_bytes": net, "writer_peak_added_bytes": peak_added, "stream_seconds": stream_s,
            "seconds": time.perf_counter() - t0}


def _check_memory_bytes(value) -> int:
    """``memory_bytes`` as an integer >= 1 (``1``: every tensor a group, and a shard file, of its own);
    :class:`PlanError` naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlanError(f"memory_bytes={value!r}: must be an integer number of bytes >= 1, not {type(value).__name__}")
    if value < 1:
        raise PlanError(f"memory_bytes={int(value)}: must be >= 1 (1: every tensor a shard of its own)")
    return int(value)


def _export_dtype(dtype) -> str | None:
    """The stored dtype's name: None (Megatron's own) or a floating-point dtype (an export to an
    integer or bool dtype would destroy the weights); ValueError naming ``dtype`` otherwise."""
    if dtype is None:
        return None
    try:
        name = dtype_name(dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"dtype={dtype!r}: not a dtype (float32, bfloat16, float16 or a torch.dtype)") from None
    if not torch_dtype(name).is_floating_point:
        raise ValueError(f"dtype={dtype!r}: weights are stored in a floating-point dtype")
    return name


def _all_written(group, error: str | None, timeout: float | None, pbar) -> None:
    """Collective: raise on every rank if the writer could not write (the shards written so far stay,
    with no index: ``from_pretrained`` does not mistake them for a model)."""
    errors = [e for e in all_gather_json(error, group, timeout=timeout) if e]
    if errors:
        if pbar is not None:
            pbar.close()
        raise ReshardError("export_hf: " + " | ".join(errors))


def _config_json(hf_cfg: dict) -> dict:
    """``config.json`` as transformers writes it (its defaults filled in), or the derived fields alone
    (which transformers reads the same) on a writer without transformers."""
    from .sources.hf_config import to_transformers
    try:
        return to_transformers(hf_cfg).to_dict()
    except ImportError:
        return dict(hf_cfg)


__all__ = ["INDEX", "export_hf", "shard_groups"]
