"""Colocated scenarios: trainer and engine processes launched with no common process group
(``launch(..., world=False)``); the group of a refit is built by :func:`join_group` over the device
map's group ranks only, so a colocated pair shares none.

Tensors: ``W`` [rows, 6] float32 and ``b`` [rows] bfloat16; the trainer holds them split in rows over
its ranks (``TP``), every engine worker holds its own split over the workers.  Values are a function
of (tensor, element, version), so every rank knows the expected bytes independently of the library."""
from __future__ import annotations

import gc
import os
import time

import torch

from mcore_reshard.colocate import ColocatedTrainer, accept_trainer
from mcore_reshard.core.box import Box
from mcore_reshard.core.devices import DeviceMap
from mcore_reshard.core.executor import Resharder
from mcore_reshard.core.layout import Buffer, Layout, Piece
from mcore_reshard.core.planner import make_plan
from mcore_reshard.integrations.protocol import join_group

ROWS = 12
SHAPES = {"W": ((ROWS, 6), torch.float32), "b": ((ROWS,), torch.bfloat16)}


def expected(name: str, version: int) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = 1
    for s in shape:
        n *= s
    base = 1000 * (1 + list(SHAPES).index(name)) + version * 7
    return (torch.arange(n, dtype=torch.float64) + base).reshape(shape).to(dtype)


def split_layout(world: int, offset: int = 0) -> Layout:
    lay = Layout()
    for name, (shape, dtype) in SHAPES.items():
        lay.add_tensor(name, shape, str(dtype).removeprefix("torch."))
    rows = ROWS // world
    for r in range(world):
        for name, (shape, dtype) in SHAPES.items():
            local = (rows, *shape[1:])
            box = Box((r * rows,) + (0,) * (len(shape) - 1), local)
            lbox = Box.full(local)
            lay.add_buffer(offset + r, Buffer(name, local, str(dtype).removeprefix("torch."),
                                              [Piece(name, box, lbox)]))
    return lay


def rank_tensors(world: int, r: int, version: int | None, fill: float = -1.0) -> dict:
    rows = ROWS // world
    out = {}
    for name in SHAPES:
        if version is None:
            shape, dtype = SHAPES[name]
            out[name] = torch.full((rows, *shape[1:]), fill, dtype=dtype)
        else:
            out[name] = expected(name, version)[r * rows:(r + 1) * rows].clone()
    return out


def write(tensors: dict, world: int, r: int, version: int) -> None:
    for name, t in tensors.items():
        t.copy_(rank_tensors(world, r, version)[name])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mapped_regions() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm" in line or "torch_" in line or "(deleted)" in line)


def scenario(rank: int, nproc: int, trainer_devices: list, engine_devices: list, refits: int, fault: str | None,
             timeout: float) -> dict:
    """Process ``rank``: trainer rank ``rank`` when ``rank < len(trainer_devices)``, else engine worker
    ``rank - len(trainer_devices)``.  ``fault``: None, "trainer_dies" (the proxied trainer exits before
    refit 2), "trainer_silent" (it never calls refit 2), "moved" (it rebinds ``param.data`` before
    refit 2: followed), "reshaped" (rebinds to another shape: refused), "worker_dies" (worker 0 exits
    in refit 2), "worker_stalls" (worker 0 stalls in refit 2 after its copies, past the timeout)."""
    dmap = DeviceMap(trainer_devices, engine_devices)
    T, E = len(dmap.trainer), len(dmap.engine)
    tmp = os.environ["MCORE_RESHARD_LAUNCH_DIR"]
    init = f"file://{tmp}/group"
    chan = {k: f"{tmp}/chan-{i}.sock" for i, k in enumerate(engine_devices)}
    src_layout, dst_layout = split_layout(T), split_layout(E, dmap.rank_offset)
    out = {"role": None, "versions": [], "errors": [], "fds": [], "maps": []}
    if rank < T:
        out["role"] = "trainer"
        tensors = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in rank_tensors(T, rank, 0).items()}
        grank = dmap.trainer_group_rank(rank)
        if grank is None:                         # proxied: talk to the worker only
            from mcore_reshard.integrations.protocol import rank_part
            dev = dmap.trainer[rank]
            t = ColocatedTrainer(rank_part(src_layout, rank), tensors, channel=chan[dev], device=dev, rank=rank,
                                 timeout=timeout)
            out["pair"] = True
            for v in range(1, refits + 1):
                if not (fault == "reshaped" and v > 2):
                    write(tensors, T, rank, v)
                if v == 2 and fault == "trainer_dies":
                    os._exit(0)
                if v == 2 and fault == "trainer_silent":
                    time.sleep(timeout * 2)
                    continue
                if v == 2 and fault == "moved":
                    tensors["W"].data = tensors["W"].detach().clone()
                if v == 2 and fault == "reshaped":
                    tensors["W"].data = torch.zeros(ROWS // T, 7)
                try:
                    out["versions"].append(t.refit(v)["version"])
                except Exception as e:  # noqa: BLE001 - reported
                    out["errors"].append(f"{type(e).__name__}: {e}")
                out["fds"].append(open_fds())
            t.close()
            return out
        g = join_group(init, dmap.group_size, grank, backend="gloo", timeout_s=timeout)
        part = _own(src_layout, rank)
        r = Resharder(make_plan(_relabel_src(src_layout, dmap), dst_layout), {n: tensors[n] for n in part}, {}, g,
                      timeout=timeout)
        for v in range(1, refits + 1):
            write(tensors, T, rank, v)
            if v == 2 and fault == "trainer_silent":
                time.sleep(0.1)
            try:
                out["versions"].append(r.refit(v)["version"])
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"{type(e).__name__}: {e}")
                if "rebind" in str(e) or "interrupt" in str(e):
                    break
        return out
    out["role"] = "engine"
    j = rank - T
    grank = dmap.engine_group_rank(j)
    proxied = dmap.proxied_by(j)
    g = join_group(init, dmap.group_size, grank, backend="gloo", timeout_s=timeout)
    dst = {n: t for n, t in rank_tensors(E, j, None).items()}
    src, peer = {}, None
    if proxied is not None:
        peer = accept_trainer(chan[dmap.engine[j]], device=dmap.engine[j], rank=grank, timeout=timeout)
        src = peer.tensors
        out["mapped_bytes"] = peer.mapped_bytes
    r = Resharder(make_plan(_relabel_src(src_layout, dmap), dst_layout), src, dst, g, timeout=timeout)
    if peer is not None:
        r.watch("src", peer.check)
    recv = sum(c.nbytes for m in r.plan.messages if m.dst == grank for c in m.entries)
    for v in range(1, refits + 1):
        if v == 2 and fault == "worker_dies" and j == 0:
            os._exit(0)
        try:
            stall = v == 2 and fault == "worker_stalls" and j == 0    # read, then silent past the timeout
            res = (peer.run(lambda: (r.refit(v), time.sleep(2 * timeout if stall else 0))[0]) if peer is not None
                   else r.refit(v))
            out["versions"].append(res["version"])
            out.setdefault("recv_bytes", []).append(recv)
            ok = all(torch.equal(dst[n], rank_tensors(E, j, v)[n]) for n in dst)
            out.setdefault("equal", []).append(ok)
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"{type(e).__name__}: {e}")
            out.setdefault("equal", []).append(None)
        if v % 50 == 0:
            gc.collect()
        out["fds"].append(open_fds())
        out["maps"].append(mapped_regions())
    if peer is not None:
        peer.close()
    return out


def _own(layout: Layout, rank: int) -> list:
    return sorted(layout.buffers.get(rank, {}))


def _relabel_src(src: Layout, dmap: DeviceMap) -> Layout:
    """The trainer's layout on group ranks: a proxied trainer rank's buffers on its worker's group rank."""
    out = Layout(dict(src.tensors), {})
    for r, bufs in src.buffers.items():
        g = dmap.trainer_group_rank(r)
        out.buffers[dmap.engine_group_rank(dmap.proxies[r]) if g is None else g] = dict(bufs)
    return out


def megatron_scenario(rank: int, nproc: int, trainer: dict, engine: dict, dmap_json: dict, refits: int,
                      timeout: float) -> dict:
    """Megatron-Core -> Megatron-Core, colocated: processes ``[0, T)`` train (their own gloo world and
    Megatron groups, sizes ``trainer``), ``[T, nproc)`` hold the destination model (their own world,
    sizes ``engine``); the refit's group is built over the device map's group ranks only.  Between
    refits the trainer changes its weights in place (refit 2) and moves one parameter to new storage
    (refit 3: ``param.data = ...``, followed), replaces a module by one with the same parameters (refit 4:
    followed).  Reports the reference digests of full tensors
    (gathered over each side's own Megatron groups: independent of the library) after each refit,
    and the processes of every group this process is in."""
    import megatron_refit_worker as mrw
    import torch.distributed as dist

    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    dmap = DeviceMap.from_json(dmap_json)
    T = len(dmap.trainer)
    tmp = os.environ["MCORE_RESHARD_LAUNCH_DIR"]
    is_trainer = rank < T
    side_rank = rank if is_trainer else rank - T
    dist.init_process_group("gloo", init_method=f"file://{tmp}/{'trainer' if is_trainer else 'engine'}",
                            rank=side_rank, world_size=T if is_trainer else nproc - T)
    mcore_cpu.install_cpu_shims()
    sizes = trainer if is_trainer else engine
    mcore_cpu.init_megatron(sizes.get("tp", 1), ep=sizes.get("ep", 1), etp=sizes.get("etp"))
    chunks = mcore_cpu.build_dsv3_tiny(dtype=torch.float32, mtp=False, num_layers=2)
    if is_trainer:
        mrw.perturb_replicated(chunks)
    out = {"trainer": is_trainer, "digests": [], "groups": {"side": sorted(range(T) if is_trainer else range(T, nproc))},
           "errors": [], "versions": []}
    grank = dmap.trainer_group_rank(side_rank) if is_trainer else dmap.engine_group_rank(side_rank)
    chan = {k: f"{tmp}/chan-{i}.sock" for i, k in enumerate(dmap.engine)}
    refit, pair = None, None
    if is_trainer and grank is None:
        pair = ColocatedTrainer.megatron(chunks, side_rank, channel=chan[dmap.trainer[side_rank]],
                                         device=dmap.trainer[side_rank], timeout=timeout)
    else:
        g = join_group(f"file://{tmp}/group", dmap.group_size, grank, backend="gloo", timeout_s=timeout)
        out["groups"]["refit"] = sorted(dist.get_process_group_ranks(g)) and [grank]
        proxied = None if is_trainer else dmap.proxied_by(side_rank)
        colocated = None if proxied is None else {"channel": chan[dmap.engine[side_rank]],
                                                  "device": dmap.engine[side_rank]}
        refit = MegatronRefit(chunks if is_trainer else [], [] if is_trainer else chunks, group=g,
                              timeout=timeout, colocated=colocated)
        out["network_bytes"] = refit.plan.stats["network_bytes"]
        out["local_bytes"] = refit.plan.stats["local_bytes"]
        out["lower_bound_bytes"] = refit.plan.stats["lower_bound_bytes"]
        out["mapped_bytes"] = refit.colocated.mapped_bytes if refit.colocated else 0
    for v in range(1, refits + 1):
        if is_trainer and v == 2:
            with torch.no_grad():
                for c in chunks:
                    for p in c.parameters():
                        p.add_(0.5)
        if is_trainer and v == 3:
            p = dict(chunks[0].named_parameters())["decoder.layers.0.self_attention.linear_proj.weight"]
            p.data = p.detach().clone() - 0.25
        if is_trainer and v == 4:               # a module replaced (a LoRA merge): followed
            layer = chunks[0].decoder.layers[0]
            layer.mlp = mrw.clone_module(layer.mlp, add=0.125)
        try:
            res = pair.refit(v) if pair is not None else refit.refit(v)
            out["versions"].append(res["version"])
        except Exception as e:  # noqa: BLE001 - reported
            out["errors"].append(f"{type(e).__name__}: {e}")
        out["digests"].append(mrw.reference_digests(chunks))
    out["pid"] = os.getpid()
    if pair is not None:
        pair.close()
    if refit is not None:
        refit.close()
    mcore_cpu.destroy_megatron()
    return out


def hf_scenario(rank: int, nproc: int, timeout: float) -> dict:
    """Megatron-Core TP2 (processes 0, 1 on devices a, b; their own world) -> a whole transformers
    DeepseekV3ForCausalLM in process 2 on device a, through ``MegatronRefit(target=..., colocated=...)``:
    the refit's group is {trainer rank 1, the HF process}; trainer rank 0 is proxied.  Returns the
    HF digests (fused tensors cut by hand) / the trainer's reference digests and logits."""
    import hf_refit_worker as hfw
    import megatron_refit_worker as mrw
    import torch.distributed as dist

    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.sources.hf_model import read_hf_layout
    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    dmap = DeviceMap(["a", "b"], ["a"])
    tmp = os.environ["MCORE_RESHARD_LAUNCH_DIR"]
    is_trainer = rank < 2
    dist.init_process_group("gloo", init_method=f"file://{tmp}/{'trainer' if is_trainer else 'hf'}",
                            rank=rank if is_trainer else 0, world_size=2 if is_trainer else 1)
    mcore_cpu.install_cpu_shims()
    mcore_cpu.init_megatron(2 if is_trainer else 1)
    # top-4 of 4 groups' top-2: the group scoring both libraries share (tests/targets/test_hf_target.py)
    chunks = mcore_cpu.build_dsv3_tiny(dtype=torch.float32, mtp=False, num_layers=2, topk=4)
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    chan = f"{tmp}/chan-a.sock"
    out = {}
    if is_trainer:
        mrw.perturb_replicated(chunks)
        out["logits"] = mcore_cpu.forward_logits(chunks, tokens).tolist()
        out["ref"] = hfw.megatron_to_hf_digests(mrw.reference_digests(chunks))
        if dmap.trainer_group_rank(rank) is None:
            with ColocatedTrainer.megatron(chunks, rank, channel=chan, device="a", timeout=timeout) as pair:
                out["version"] = pair.refit()["version"]
        else:
            g = join_group(f"file://{tmp}/group", dmap.group_size, dmap.trainer_group_rank(rank), backend="gloo",
                           timeout_s=timeout)
            refit = MegatronRefit(chunks, group=g, target=(Layout(), {}), ignore_unused=True, timeout=timeout)
            out["version"] = refit.refit()["version"]
        mcore_cpu.destroy_megatron()
        return out
    from transformers import DeepseekV3ForCausalLM
    grank = dmap.engine_group_rank(0)
    g = join_group(f"file://{tmp}/group", dmap.group_size, grank, backend="gloo", timeout_s=timeout)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hfw.hf_config(chunks[0].config, chunks[0].vocab_size)).float().eval()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    mcore_cpu.destroy_megatron()
    refit = MegatronRefit([], group=g, target=read_hf_layout(model, grank), ignore_unused=True, timeout=timeout,
                          colocated={"channel": chan, "device": "a"})
    out["version"] = refit.refit()["version"]
    out["network_bytes"] = refit.plan.stats["network_bytes"]
    out["mapped_bytes"] = refit.colocated.mapped_bytes
    out["dst"] = hfw.hf_digests(model)
    with torch.no_grad():
        out["logits"] = model(tokens).logits.float().tolist()
    refit.close()
    return out
