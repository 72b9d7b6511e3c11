"""The vLLM weight-transfer backend's trainer side, colocated (``McoreReshardTrainerInitInfo(colocated=,
engine_colocated=)``), over stand-in vLLM base classes: a proxied trainer rank joins no group, sends the
workers their ``colocated`` entries, and each ``send_weights`` returns only after its worker (here the
client's ``update_weights``: the worker side of :mod:`mcore_reshard.colocate`) has read the weights from
the mapped memory.  The whole engine, colocated: tests/engines/test_vllm_engine.py."""
from __future__ import annotations

import types

import colocated_workers as cw
import integration_contract_cases as ic
import torch

from mcore_reshard.colocate import accept_trainer, pair_specs
from mcore_reshard.core.devices import DeviceMap
from mcore_reshard.integrations.protocol import rank_part


class Worker:
    """A stand-in client whose RPCs run the colocated worker's side in the calling thread."""

    def __init__(self):
        self.dst = cw.rank_tensors(1, 0, None)
        self.calls: list = []

    def init_weight_transfer_engine(self, info):
        self.calls.append("init")
        self.info = info
        spec = info["colocated"][0]
        self.peer = accept_trainer(spec["channel"], device=spec["device"], rank=info["rank_offset"], timeout=60)

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update):
        def refit():
            problems, _ = self.peer.check()          # waits for the trainer's "ready"
            assert not problems, problems
            for n, t in self.dst.items():
                t.copy_(self.peer.tensors[n])
            return {"version": update["version"]}
        self.calls.append("update")
        self.peer.run(refit)

    def finish_weight_update(self):
        self.calls.append("finish")


def test_proxied_trainer_rank_gates_on_its_worker(tmp_path):
    mod = ic.trainer_module()
    d = DeviceMap(["cpu:0"], ["cpu:0"])
    s = pair_specs(d, str(tmp_path))
    layout = rank_part(cw.split_layout(1), 0)
    tensors = cw.rank_tensors(1, 0, 0)
    info = mod.McoreReshardTrainerInitInfo(init_method=f"file://{tmp_path}/never", world_size=d.group_size, rank=0,
                                           rank_offset=d.rank_offset, colocated=s["trainer"][0],
                                           engine_colocated=s["engine"], timeout_s=60)
    w = Worker()
    eng = mod.McoreReshardTrainerWeightTransferEngine.trainer_init(
        info, client=w, source=types.SimpleNamespace(layout=layout, tensors=tensors, rank=0))
    assert eng.group is None and eng.colocated is not None          # no process group at all
    assert w.info["colocated"] == s["engine"] and w.info["rank_offset"] == 0 and w.info["world_size"] == 1
    for v in (1, 2, 3):
        cw.write(tensors, 1, 0, v)                                   # the optimizer step, in place
        rep = eng.send_weights(version=v)
        assert rep["colocated"]["version"] == v and rep["colocated"]["device"] == "cpu:0", rep
        for n, t in w.dst.items():                                   # read when send_weights returned
            assert torch.equal(t, cw.expected(n, v)), (n, v)
    assert w.calls == ["init"] + ["start", "update", "finish"] * 3
    eng.shutdown()
    w.peer.close()


def test_a_failed_accept_becomes_the_join_error(tmp_path):
    """A worker whose trainer never comes, or declares another device, gets an error (not an
    exception) that the engines pass into the protocol's join, so that every rank refuses."""
    from concurrent.futures import ThreadPoolExecutor

    from mcore_reshard.colocate import ColocatedTrainer, try_accept
    assert try_accept(None, rank=3, timeout=1.0) == (None, None)
    peer, err = try_accept({"channel": f"{tmp_path}/never.sock", "device": "cpu:5"}, rank=3, timeout=1.0)
    assert peer is None and "rank 3" in err and "'cpu:5'" in err, err
    layout, tensors = rank_part(cw.split_layout(1), 0), cw.rank_tensors(1, 0, 0)
    with ThreadPoolExecutor(1) as pool:
        worker = pool.submit(try_accept, {"channel": f"{tmp_path}/p.sock", "device": "cpu:0"}, rank=1, timeout=30)
        try:
            ColocatedTrainer(layout, tensors, channel=f"{tmp_path}/p.sock", device="cpu:1", rank=0, timeout=30)
            trainer_error = None
        except Exception as e:  # noqa: BLE001 - judged below
            trainer_error = str(e)
        peer, err = worker.result()
    assert peer is None and "a colocated pair is one device" in err and "'cpu:1'" in err, err
    assert trainer_error is not None and "refused the binding" in trainer_error, trainer_error
