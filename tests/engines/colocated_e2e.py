"""The colocated groups of the whole-engine test (``vllm_engine_e2e.py``): trainer ranks and engine
workers declared on the same devices, a colocated pair in NO common process group
(:mod:`mcore_reshard.colocate`).  Each group's device map, per engine TP::

    group             | engine TP=1                         | engine TP=2
    colocated(_shadow)| trainer 0 + worker 0 on cpu:0;      | trainer 0 + worker 0 on cpu:0,
                      |  trainer 1 a group member (cpu:1)   |  trainer 1 + worker 1 on cpu:1: workers only
    mixed             | trainer 1 + worker 0 on cpu:1;      | trainer 0 + worker 0 on cpu:0; worker 1 alone
                      |  trainer 0 a group member           |  (cpu:2), trainer 1 a group member (cpu:1)

What every process records of the groups it is in (pid, group rank, group size, the pid its pair's
channel names) lets the test check membership from outside the library."""
from __future__ import annotations

import json
import os

from mcore_reshard.colocate import pair_specs
from mcore_reshard.core.devices import DeviceMap

_PAIRED = {1: (["cpu:0", "cpu:1"], ["cpu:0"]), 2: (["cpu:0", "cpu:1"], ["cpu:0", "cpu:1"])}
COLOCATED = {
    "colocated": _PAIRED,
    "colocated_shadow": _PAIRED,
    "mixed": {1: (["cpu:0", "cpu:1"], ["cpu:1"]), 2: (["cpu:0", "cpu:1"], ["cpu:0", "cpu:2"])},
}


def device_map(name: str, tp: int) -> DeviceMap:
    return DeviceMap(*COLOCATED[name][tp])


def specs(workdir: str, name: str, tp: int) -> dict:
    """The pair sockets of group ``name`` (``pair_specs``) under ``workdir``."""
    d = os.path.join(workdir, f"pairs-{name}")
    os.makedirs(d, exist_ok=True)
    return pair_specs(device_map(name, tp), d)


def group_args(workdir: str, name: str, tp: int) -> dict:
    """What the engine's workers are given: world size, rank offset, their ``colocated`` entries."""
    d = device_map(name, tp)
    return {"world_size": d.group_size, "rank_offset": d.rank_offset, "colocated": specs(workdir, name, tp)["engine"]}


class TrainerSide:
    """One trainer rank in a colocated group: a :class:`ColocatedTrainer` (proxied: no group) or a
    group member at its device-map rank; ``refit(step)`` either way; :meth:`record` for the test."""

    def __init__(self, workdir: str, name: str, tp: int, rank: int, src, tensors, join, url: str):
        import torch.distributed as dist

        from mcore_reshard.colocate import ColocatedTrainer
        from mcore_reshard.integrations.protocol import join_group
        d = device_map(name, tp)
        self.rec = {"group": name, "pid": os.getpid(), "trainer_rank": rank, "device": d.trainer[rank],
                    "group_rank": None, "size": None, "peer_pid": None, "sent": []}
        pair = specs(workdir, name, tp)["trainer"][rank]
        self.pair, self.resharder = None, None
        if pair is not None:
            self.pair = ColocatedTrainer(src, tensors, channel=pair["channel"], device=pair["device"], rank=rank,
                                         timeout=600)
            self.rec["peer_pid"] = self.pair.peer_pid
        else:
            grank = d.trainer_group_rank(rank)
            g = join_group(url, d.group_size, grank, timeout_s=600)
            self.rec.update(group_rank=dist.get_rank(g), size=dist.get_world_size(g))
            self.resharder = join(g, src=src.offset_ranks(grank - rank), src_tensors=tensors)

    def refit(self, step: int) -> None:
        if self.pair is not None:
            self.rec["sent"].append(0)           # nothing over a group: the worker reads the mapped memory
            self.pair.refit(step)
            return
        st = self.resharder.refit(step)
        self.rec["sent"].append(st.get("staged_bytes_sent", 0) + st.get("unstaged_bytes_sent", 0))

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()


def write_records(workdir: str, rank: int, sides: dict) -> None:
    with open(os.path.join(workdir, f"trainer-groups-rank{rank}.json"), "w") as f:
        json.dump({name: s.rec for name, s in sides.items()}, f)


def worker_facts(worker, path: str) -> dict:
    """An engine worker's view of its current group (``collective_rpc``): pid, group rank and size,
    the trainer its pair channel names, the bytes it maps; the plan's bytes over the group / local."""
    import torch.distributed as dist
    if path == "backend":
        e = worker.weight_transfer_engine
        g, peer, r = e.group, e.peer, e.refits.get("main")
    else:
        st = worker._mcore_reshard
        g, peer, r = st.get("group"), st.get("peer"), st.get("refit")
    stats = r.resharder.plan.stats if r is not None else {}
    return {"pid": os.getpid(), "group_rank": dist.get_rank(g), "size": dist.get_world_size(g),
            "peer_pid": peer.pid if peer is not None else None,
            "peer_trainer_rank": peer.trainer_rank if peer is not None else None,
            "mapped_bytes": peer.mapped_bytes if peer is not None else 0,
            "network_bytes": stats.get("network_bytes"), "local_bytes": stats.get("local_bytes")}
