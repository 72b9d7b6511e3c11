"""export_hf scenarios, run inside spawned gloo processes (tests/integrations/test_hf_export.py).

Every rank builds the Megatron model of a case, computes Megatron's own logits and, for the
reference, the digest of every tensor the Hugging Face checkpoint must hold, under the checkpoint's
names, written out by hand from the full tensors that ``megatron_refit_worker.reference_full``
gathers from the parameters' own TP attributes (independent of ``layouts/*.toml``, the planner and
``sharded_state_dict``).  Then all ranks call ``export_hf``; the test loads the directory with
``from_pretrained`` in its own process.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
from hf_refit_worker import HAND_MAP as RENAMES  # Megatron -> HF name pieces, written by hand
from hf_refit_worker import _split_qkv
from megatron_refit_worker import _build, _digest, perturb_replicated, reference_full

from mcore_reshard.testing import megatron_cpu as mcore_cpu
from mcore_reshard.testing import tiny_models

GQA_RENAMES = [("self_attention.q_layernorm", "self_attn.q_norm"), ("self_attention.k_layernorm", "self_attn.k_norm")]


def _mtp_name(name: str, num_layers: int) -> str:
    """``mtp.layers.0.enorm.weight`` -> ``decoder.layers.{num_layers}.enorm.weight`` (the checkpoint's layer)."""
    k, rest = name[len("mtp.layers."):].split(".", 1)
    layer = num_layers + int(k)
    rest = rest.replace("mtp_model_layer.", "").replace("final_layernorm", "shared_head.norm")
    return f"decoder.layers.{layer}.{rest}"


def checkpoint_expected(full: dict, cfg, kind: str) -> dict:
    """HF checkpoint name -> digest of every tensor export_hf must write, from Megatron's full tensors."""
    out = {}
    for name, t in full.items():
        if name.startswith("mtp."):
            name = _mtp_name(name, cfg.num_layers)
        for a, b in (GQA_RENAMES if kind != "dsv3" else []) + RENAMES:
            name = name.replace(a, b)
        if ".mlp.experts.experts." in name:
            layer, rest = name.split(".mlp.experts.experts.")
            e, which = rest.split(".", 1)
            base = f"{layer}.mlp.experts.{e}."
            if "linear_fc1" in which:
                gate, up = t.chunk(2, dim=0)
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = _digest(gate), _digest(up)
            else:
                out[base + "down_proj.weight"] = _digest(t)
        elif name.endswith("linear_fc1.weight"):      # dense MLP or shared expert: [gate; up]
            gate, up = t.chunk(2, dim=0)
            base = name[:-len("linear_fc1.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = _digest(gate), _digest(up)
        elif name.endswith("self_attention.linear_qkv.weight"):
            q, k, v = _split_qkv(t, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels)
            base = name[:-len("self_attention.linear_qkv.weight")] + "self_attn."
            out.update({base + "q_proj.weight": _digest(q), base + "k_proj.weight": _digest(k),
                        base + "v_proj.weight": _digest(v)})
        else:
            out[name] = _digest(t)
    for k in range(getattr(cfg, "mtp_num_layers", None) or 0):   # DeepSeek's checkpoint copies them per MTP layer
        layer = f"model.layers.{cfg.num_layers + k}."
        if "embedding.word_embeddings.weight" in full:
            out[layer + "embed_tokens.weight"] = _digest(full["embedding.word_embeddings.weight"])
        if "output_layer.weight" in full:
            out[layer + "shared_head.head.weight"] = _digest(full["output_layer.weight"])
    return out


def export_scenarios(rank: int, world: int, cases: list, out_root: str) -> list:
    from mcore_reshard import export_hf
    mcore_cpu.install_cpu_shims()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for case in cases:
        padded, vocab = case.get("padded_vocab"), case.get("vocab_size")
        old_vocab = tiny_models.VOCAB
        tiny_models.VOCAB = padded or old_vocab      # Megatron's embedding and head padded past the real vocab
        try:
            chunks = _build(case["model"], case["src"], torch.float32, case.get("kw", {}))
        finally:
            tiny_models.VOCAB = old_vocab
        perturb_replicated(chunks)
        full = reference_full(chunks)
        if vocab:   # the checkpoint holds the real rows only
            full = {k: (t[:vocab] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else t)
                    for k, t in full.items()}
        res = {"expected": checkpoint_expected(full, chunks[0].config, case["model"])}
        out_dir = os.path.join(out_root, case["id"])
        if case.get("concurrent"):
            results.append(_concurrent_exports(rank, chunks, out_dir, tokens))
            mcore_cpu.destroy_megatron()
            continue
        if case.get("block_shard") and rank == case.get("on_rank", 0):
            _previous_contents(out_dir)
        blocked = _blocking_shard(case["block_shard"]) if case.get("block_shard") and rank == case.get("on_rank", 0) \
            else contextlib.nullcontext()
        if not case.get("refused"):
            res["logits"] = mcore_cpu.forward_logits(chunks, tokens)[..., :vocab]   # Megatron's own, every rank
            res["tokens"] = tokens
        if case.get("hidden"):      # a setting no transformers config expresses: refused ...
            res["error"] = _export_error(chunks, out_dir + "_refused")
            _hide(chunks, case["hidden"])   # ... and what the export wrote when the mapping dropped it
        try:
            with blocked:
                res["stats"] = export_hf(chunks, out_dir, on_rank=case.get("on_rank", 0), vocab_size=vocab,
                                         memory_bytes=case.get("memory_bytes", 1 << 30),
                                         budget_bytes=case.get("budget_bytes", 256 << 20), timeout=120)
        except Exception as e:  # noqa: BLE001 - the refusal cases report what every rank raised
            if not case.get("refused"):
                raise
            res["error"] = f"{type(e).__name__}: {e}"
        results.append(res)
        mcore_cpu.destroy_megatron()
    return results


def _previous_contents(out_dir: str) -> None:
    """What an earlier export and the user left in ``out_dir`` (an export that fails must not change it)."""
    os.makedirs(out_dir, exist_ok=True)
    for name, text in (("config.json", '{"previous": true}'), ("model.safetensors.index.json", '{"weight_map": {}}'),
                       ("tokenizer.json", '{"user": "file"}')):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)


@contextlib.contextmanager
def _blocking_shard(k: int):
    """Writing shard ``k`` fails as if a directory were in its way (injected around safetensors' writer)."""
    import safetensors.torch
    orig = safetensors.torch.save_file

    def save_file(tensors, filename, *a, **kw):
        if os.path.basename(filename).startswith(f"model-{k:05d}-of-"):
            raise IsADirectoryError(21, "Is a directory", filename)
        return orig(tensors, filename, *a, **kw)
    safetensors.torch.save_file = save_file
    try:
        yield
    finally:
        safetensors.torch.save_file = orig


def _wait_for(path: str, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.05)


def _listing(out_dir: str) -> dict:
    """Every file of the directory: its shard dtypes (safetensors) or its text."""
    from safetensors import safe_open
    out = {}
    for f in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, f)
        if f.endswith(".safetensors"):
            with safe_open(path, "pt") as st:
                out[f] = sorted({str(st.get_slice(k).get_dtype()) for k in st.keys()})
        else:
            out[f] = open(path).read()
    return out


def _concurrent_exports(rank: int, chunks, out_dir: str, tokens) -> dict:
    """Two process groups export into one directory (issue 37): ranks 0-1 (one TP-2 replica) in float32, ranks
    2-3 (the other) in bfloat16.  Export A (ranks 0-1) writes its first shard, then waits; meanwhile export B
    (ranks 2-3) into the same directory must be refused on both of its ranks, naming the directory and A's
    writer.  A then completes.  Then B runs again, alone, and replaces A as a whole (a user's file carried
    over).  Each rank reports what it saw; the directory after A and after B is listed (dtypes per shard)."""
    import torch.distributed as dist

    from mcore_reshard import export_hf
    pids = [None] * 4
    dist.all_gather_object(pids, os.getpid())
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    first, second = out_dir + ".first_shard_written", out_dir + ".second_export_done"
    out: dict = {"pids": pids, "logits": mcore_cpu.forward_logits(chunks, tokens), "tokens": tokens}
    if rank == 0:
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
            f.write('{"user": "file"}')
    dist.barrier()
    if rank < 2:
        import safetensors.torch
        orig, calls = safetensors.torch.save_file, [0]

        def save_file(*a, **kw):
            r = orig(*a, **kw)
            calls[0] += 1
            if calls[0] == 1:       # A holds the directory, half written: let B try now
                open(first, "w").close()
                _wait_for(second)
            return r
        safetensors.torch.save_file = save_file
        try:
            out["a"] = export_hf(chunks, out_dir, mine, memory_bytes=16 << 10, timeout=120, progress=False)["files"]
        finally:
            safetensors.torch.save_file = orig
        if rank == 0:
            out["after_a"] = _listing(out_dir)
    else:
        _wait_for(first)
        try:
            export_hf(chunks, out_dir, mine, dtype=torch.bfloat16, memory_bytes=16 << 10, timeout=120, progress=False)
            out["b_refused"] = "accepted"
        except Exception as e:  # noqa: BLE001 - the test judges it
            out["b_refused"] = f"{type(e).__name__}: {e}"
        dist.barrier(group=mine)
        if rank == 2:
            open(second, "w").close()
    dist.barrier()
    if rank >= 2:
        out["b"] = export_hf(chunks, out_dir, mine, dtype=torch.bfloat16, memory_bytes=16 << 10, timeout=120,
                             progress=False)["files"]
    dist.barrier()
    if rank == 0:
        out["after_b"] = _listing(out_dir)
        parent, name = os.path.split(out_dir)
        out["leftovers"] = sorted(f for f in os.listdir(parent) if f.startswith(f".{name}."))
    return out


def _export_error(chunks, out_dir: str) -> str:
    from mcore_reshard import export_hf
    try:
        export_hf(chunks, out_dir, timeout=120, progress=False)
    except Exception as e:  # noqa: BLE001 - the test judges it
        return f"{type(e).__name__}: {e}"
    return "accepted"


def _hide(chunks, field: str) -> None:
    """Set ``field`` back to its default on the model's config after the model was built with another
    value: the export then sees what a mapping that ignores the field saw (the modules keep computing
    with the value they were built with)."""
    import dataclasses
    cfg = chunks[0].config
    f = next(f for f in dataclasses.fields(cfg) if f.name == field)
    for c in chunks:
        setattr(c.config, field, f.default)


# ------------------------------------------------------------------ an HF process that holds no Megatron shard

def disaggregated_member(member: int, tmp: str) -> dict:
    """Members 0, 1: a TP2 Megatron trainer whose default world is its own (2 ranks, as Megatron wants);
    member 2: a process with a transformers model and no Megatron shard (no default group at first).

    1. all call ``join_group`` while member 2 has no default group: refused on every member, fast;
    2. the documented recipe: member 2 makes a default group of its own (a world of 1), all join;
    3. member 2 reads its layout with its *global* rank (0): refused, naming the rank argument;
    4. with ``dist.get_rank(group)``: refit into the live HF model, logits compared on member 2;
    5. ``export_hf(..., group=g, on_rank=2)``: member 2 writes the directory."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from mcore_reshard import export_hf
    from mcore_reshard.core.executor import all_gather_json
    from mcore_reshard.core.layout import Layout
    from mcore_reshard.integrations.protocol import join_group
    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.sources.hf_config import hf_config_dict, megatron_facts, to_transformers
    from mcore_reshard.sources.hf_model import read_hf_layout
    trainer = member < 2
    out: dict = {}
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    chunks, logits = [], None
    if trainer:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/trainer_world", rank=member, world_size=2,
                                timeout=timedelta(seconds=120))
        mcore_cpu.init_megatron(tp=2)
        chunks = mcore_cpu.build_dsv3_tiny(mtp=True, topk=4)
        perturb_replicated(chunks)
        logits = mcore_cpu.forward_logits(chunks, tokens)
    # 1. one side with a default group, one without
    t0 = time.monotonic()
    try:
        join_group(f"file://{tmp}/mixed", 3, member, timeout_s=120)
        out["mixed"] = "joined"
    except RuntimeError as e:
        out["mixed"] = str(e)
    out["mixed_seconds"] = time.monotonic() - t0
    # 2. the recipe
    if not trainer:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/hf_world", rank=0, world_size=1)
    g = join_group(f"file://{tmp}/refit", 3, member, timeout_s=120)
    out["group_rank"] = dist.get_rank(g)
    cfgs = all_gather_json(hf_config_dict(megatron_facts(chunks)) if trainer else None, g)
    model = None
    if not trainer:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(to_transformers(cfgs[0])).eval()
    # 3. the global rank instead of the group rank
    try:
        MegatronRefit(chunks, group=g, target=read_hf_layout(model, dist.get_rank()) if model else (Layout(), {}),
                      ignore_unused=True)
        out["wrong_rank"] = "accepted"
    except Exception as e:  # noqa: BLE001
        out["wrong_rank"] = f"{type(e).__name__}: {e}"
    # 4. right
    refit = MegatronRefit(chunks, group=g, target=read_hf_layout(model, dist.get_rank(g)) if model else (Layout(), {}),
                          ignore_unused=True)
    refit.refit()
    want = torch.zeros(2, 12, 128) if logits is None else logits
    dist.broadcast(want, group=g, group_src=0)   # group ranks: global ids differ between the members
    if model is not None:
        with torch.no_grad():
            got = model(tokens).logits.float()
        out["refit_logits_max_diff"] = float((got - want).abs().max())
        out["refit_same_argmax"] = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
    # 5. export, written by the process that holds no shard
    out["export"] = export_hf(chunks, os.path.join(tmp, "export"), group=g, on_rank=2, timeout=120)
    out["logits"], out["tokens"] = want, tokens
    if trainer:
        mcore_cpu.destroy_megatron()
    dist.barrier(group=g)
    return out


def _member_main(member: int, fn, tmp: str, env: dict) -> None:
    import traceback
    os.environ.update(env)
    torch.set_num_threads(1)
    mcore_cpu.install_cpu_shims()
    try:
        torch.save(fn(member, tmp), os.path.join(tmp, f"member_{member}.pt"))
    except BaseException:
        with open(os.path.join(tmp, f"member_{member}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def launch_members(fn, n: int, tmp: str, timeout: float = 300.0) -> list:
    """``fn(member, tmp)`` in ``n`` fresh processes that share no process group (each makes its own)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(mcore_cpu.FORKSERVER_PRELOAD)
    env = {"CUDA_VISIBLE_DEVICES": "", "GLOO_SOCKET_IFNAME": "lo", "TORCH_GLOO_LAZY_INIT": "1"}
    procs = [ctx.Process(target=_member_main, args=(m, fn, tmp, env)) for m in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".err")]
    if errors or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"members failed (exit codes {[p.exitcode for p in procs]}):\n" + "\n".join(errors))
    return [torch.load(os.path.join(tmp, f"member_{m}.pt"), weights_only=False) for m in range(n)]
