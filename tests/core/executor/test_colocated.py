"""Colocated refits: trainer and engine processes on one device, no process group between a pair
(``launch(..., world=False)``: every group is built by the processes themselves, over the device
map's group ranks only).  The expected bytes are computed by each rank independently of the library
(plain tensors: a function of the element index and the version; Megatron: full tensors gathered over
each side's own Megatron groups)."""
from __future__ import annotations

import json
import os
import socket

import colocated_workers as cw
import pytest
from partial_launch import _preload

from mcore_reshard.colocate import ColocatedTrainer, accept_trainer, check_colocated
from mcore_reshard.core.devices import DeviceMap
from mcore_reshard.core.executor.errors import ReshardError
from mcore_reshard.core.executor.local_channel import ChannelBusy, Listener
from mcore_reshard.tools.launch import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]
T = 20.0          # every wait of a refit; faults are detected well within it


def _run(trainer, engine, refits=3, fault=None, timeout=T):
    n = len(trainer) + len(engine)
    out = launch(cw.scenario, n, list(trainer), list(engine), refits, fault, timeout, world=False,
                 timeout=300, start_method="forkserver", preload=_preload(), threads=1, leave_at_once=True)
    return out


def _ok(out) -> dict:
    bad = {r: (o.exitcode, o.error) for r, o in out.items() if not o.ok}
    assert not bad, bad
    return {r: o.result for r, o in out.items()}


def _engines(res):
    return [o for o in res.values() if o["role"] == "engine"]


# --------------------------------------------------------------------------- device map

def test_device_map_group_ranks_follow_the_docstring_example():
    m = DeviceMap(["a", "b", "c", "d"], ["a", "b"])
    assert m.proxies == {0: 0, 1: 1}
    assert [m.trainer_group_rank(i) for i in range(4)] == [None, None, 0, 1]
    assert [m.engine_group_rank(j) for j in range(2)] == [2, 3]
    assert m.rank_offset == 2 and m.group_size == 4
    assert [m.proxied_by(j) for j in range(2)] == [0, 1]
    mixed = DeviceMap(["a", "b"], ["a", "x"])
    assert [mixed.trainer_group_rank(i) for i in range(2)] == [None, 0]
    assert [mixed.proxied_by(j) for j in range(2)] == [0, None] and mixed.group_size == 3
    assert DeviceMap.from_json(m.to_json()) == m


@pytest.mark.parametrize("trainer,engine,kind,needle", [
    (["a", "a"], ["a"], ValueError, "both declare device 'a'"),
    (["a"], ["b", "b"], ValueError, "both declare device 'b'"),
    (["a", ""], ["a"], ValueError, "non-empty"),
    (["a", 3], ["a"], ValueError, "non-empty strings"),
    ("ab", ["a"], TypeError, "trainer="),
    ([], ["a"], ValueError, "at least one trainer"),
    (["a"], [], ValueError, "at least one trainer rank and one engine worker"),
])
def test_device_map_refuses_bad_maps(trainer, engine, kind, needle):
    with pytest.raises(kind, match=needle):
        DeviceMap(trainer, engine)


@pytest.mark.parametrize("method,arg", [("trainer_group_rank", 2), ("engine_group_rank", -1), ("proxied_by", True),
                                        ("trainer_group_rank", 0.0)])
def test_device_map_refuses_ranks_out_of_range(method, arg):
    m = DeviceMap(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="must be an integer in"):
        getattr(m, method)(arg)


@pytest.mark.parametrize("value,kind,needle", [
    ("x", TypeError, "colocated="), ({"channel": "/tmp/x"}, ValueError, "both required"),
    ({"channel": "/tmp/x", "device": "a", "gpu": 0}, ValueError, "unknown"),
    ({"channel": "", "device": "a"}, ValueError, "channel"), ({"channel": "/tmp/x", "device": 0}, ValueError, "device"),
    ({"channel": "/tmp/" + "x" * 120, "device": "a"}, ValueError, "at most 100 bytes"),
])
def test_colocated_argument_is_validated(value, kind, needle):
    with pytest.raises(kind, match=needle):
        check_colocated(value)
    assert check_colocated(None) is None


def test_a_channel_another_process_listens_on_is_refused_and_a_stale_one_replaced(tmp_path):
    path = str(tmp_path / "c.sock")
    first = Listener(path)
    try:
        with pytest.raises(ChannelBusy, match="another live process listens"):
            Listener(path)
    finally:
        first.close()
    assert not os.path.exists(path)               # removed by its owner
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)                               # a crashed process's left-over: bound, never listening
    stale.close()
    again = Listener(path)
    again.close()
    assert not os.path.exists(path)


def test_bad_trainer_arguments_are_refused_before_connecting(tmp_path):
    import torch

    lay = cw.split_layout(2)
    tensors = cw.rank_tensors(2, 0, 1)
    part = cw.Layout(dict(lay.tensors), {0: dict(lay.buffers[0])})
    kw = dict(channel=str(tmp_path / "none.sock"), device="a", rank=0, timeout=0.5)
    with pytest.raises(ValueError, match="exactly rank 0's buffers"):
        ColocatedTrainer(part, {"W": tensors["W"]}, **kw)
    with pytest.raises(ValueError, match="rank=-1"):
        ColocatedTrainer(part, tensors, **{**kw, "rank": -1})
    with pytest.raises(ValueError, match="timeout="):
        ColocatedTrainer(part, tensors, **{**kw, "timeout": 0})
    with pytest.raises(TypeError, match="layout="):
        ColocatedTrainer({}, tensors, **kw)
    sparse = dict(tensors, W=tensors["W"].to_sparse())
    with pytest.raises(ReshardError, match="only strided CPU / CUDA tensors"):
        ColocatedTrainer(part, sparse, **kw)
    with pytest.raises(ReshardError, match="was not listening"):
        ColocatedTrainer(part, tensors, **kw)
    with pytest.raises(ReshardError, match="did not connect"):
        accept_trainer(str(tmp_path / "w.sock"), device="a", rank=0, timeout=0.3)
    assert torch.equal(tensors["W"], cw.rank_tensors(2, 0, 1)["W"])


# --------------------------------------------------------------------------- plain tensors

@pytest.mark.parametrize("trainer,engine", [
    (["a", "b"], ["a"]),                 # one pair, trainer rank 1 alone in the group with the worker
    (["a", "b", "c"], ["a", "b"]),       # every worker colocated, rows cross devices both ways
    (["a", "b"], ["a", "x"]),            # mixed: worker 1 on a device of its own
    (["a"], ["a", "x", "y"]),            # more workers than trainer devices: the proxy sends from mapped memory
    (["a", "b"], ["x", "y"]),            # nothing colocated: the plain disaggregated path, same code
], ids=["one_pair", "all_pairs", "mixed", "more_workers", "none"])
def test_colocated_refits_are_bit_exact_and_only_cross_device_bytes_use_the_group(trainer, engine):
    res = _ok(_run(trainer, engine))
    dmap = DeviceMap(trainer, engine)
    for o in _engines(res):
        assert o["errors"] == [] and o["equal"] == [True, True, True], o
        assert o["versions"] == [1, 2, 3]
    for r, o in res.items():
        if o["role"] == "trainer":
            assert o["errors"] == [] and o["versions"] == [1, 2, 3], o
            assert bool(o.get("pair")) == (dmap.trainer_group_rank(r) is None)
    # what crosses the group: each worker's rows that live on another device, nothing else
    rows_e, rows_t = cw.ROWS // len(engine), cw.ROWS // len(trainer)
    row_bytes = 6 * 4 + 2
    for j, o in enumerate(_engines(res)):
        own = dmap.proxied_by(j)
        mine = set(range(j * rows_e, (j + 1) * rows_e))
        local = set(range(own * rows_t, (own + 1) * rows_t)) & mine if own is not None else set()
        assert o.get("mapped_bytes", 0) == (rows_t * row_bytes if own is not None else 0)
        sent_to_me = (len(mine) - len(local)) * row_bytes
        assert o["recv_bytes"] == [sent_to_me] * 3, (j, o["recv_bytes"], sent_to_me)


@pytest.mark.parametrize("fault,checks", [
    ("moved", "followed"), ("reshaped", "refused"), ("trainer_dies", "dead"), ("trainer_silent", "silent"),
    ("worker_dies", "worker"), ("worker_stalls", "stalled"),
])
def test_colocated_faults_are_followed_or_reported_on_every_rank(fault, checks):
    t = 8.0
    out = _run(["a", "b"], ["a"], fault=fault, timeout=t)
    res = {r: o.result for r, o in out.items() if o.ok}
    if checks == "followed":                    # param.data = clone: exported again, the worker remaps it
        o = _ok(out)[2]
        assert o["equal"] == [True, True, True] and o["errors"] == [], o
        return
    if checks == "stalled":                     # no EOF: the trainer's wait runs out, naming the worker
        trainer = res[0]
        assert trainer["versions"][0] == 1 and 2 not in trainer["versions"], trainer
        err = trainer["errors"][0]
        assert "TransferError" in err and "colocated engine worker (pid" in err and "device 'a'" in err, err
        assert "sent nothing within the timeout" in err, err
        return
    if checks == "worker":
        trainer = res[0]
        assert trainer["versions"] == [1], trainer
        assert "colocated engine worker (pid" in trainer["errors"][0] and "device 'a'" in trainer["errors"][0]
        assert res[1]["versions"] == [1] and res[1]["errors"], res[1]   # its group peer: TransferError
        return
    for r in (1, 2):                            # every group rank refuses refit 2, naming the pair
        o = res[r]
        assert o["versions"][:1] == [1], o
        err = o["errors"][0]
        assert "refused before any byte moved" in err, err
        if checks == "refused":
            assert "W is now float32[6, 7]" in err and "bound as float32[6, 6]" in err, err
        else:
            assert "colocated trainer rank 0 (pid" in err and "device 'a'" in err, err
            assert ("sent nothing within" in err) == (checks == "silent"), err
    if checks == "refused":
        assert res[2]["equal"][0] is True


def test_two_hundred_refits_hold_descriptors_and_mappings_constant():
    out = _run(["a", "b"], ["a"], refits=200)
    res = _ok(out)
    worker, trainer = res[2], res[0]
    assert worker["equal"] == [True] * 200 and worker["versions"][-1] == 200
    assert len(set(worker["maps"][5:])) == 1, worker["maps"][:10]
    assert max(worker["fds"][5:]) - min(worker["fds"][5:]) <= 1, sorted(set(worker["fds"]))   # gloo's own socket churn
    assert len(set(trainer["fds"][5:])) == 1, sorted(set(trainer["fds"]))


# --------------------------------------------------------------------------- Megatron-Core

def _megatron(engine_devices, engine_sizes):
    dm = {"trainer": ["a", "b"], "engine": engine_devices}
    n = 2 + len(engine_devices)
    out = launch(cw.megatron_scenario, n, {"tp": 2}, engine_sizes, dm, 4, 60.0, world=False, timeout=400,
                 start_method="forkserver", preload=_preload(), threads=1, leave_at_once=True)
    return _ok(out)


@pytest.mark.parametrize("engine_devices,engine_sizes", [
    (["a", "b"], {"tp": 1, "ep": 2}), (["a", "c"], {"tp": 2}),
], ids=["tp2_to_ep2_all_colocated", "tp2_to_tp2_mixed"])
def test_megatron_to_megatron_colocated(engine_devices, engine_sizes):
    """Four refits: the weights changed in place, a parameter moved to new storage, a module replaced."""
    res = _megatron(engine_devices, engine_sizes)
    trainers = [res[0], res[1]]
    engines = [res[r] for r in range(2, 2 + len(engine_devices))]
    for o in res.values():
        assert o["errors"] == [] and o["versions"] == [1, 2, 3, 4], o
    for v in range(4):   # every full tensor of the destination equals the trainer's, after every refit
        src = trainers[0]["digests"][v]
        assert trainers[1]["digests"][v] == src
        merged = {}                             # EP ranks each hold their own experts
        for e in engines:
            assert all(src.get(n) == d for n, d in e["digests"][v].items()), v
            merged.update(e["digests"][v])
        assert merged == src, v
        if v:
            assert src != trainers[0]["digests"][v - 1]     # the weights did change
    for e in engines:
        assert e["network_bytes"] == e["lower_bound_bytes"]
    dmap = DeviceMap(["a", "b"], engine_devices)
    for j, e in enumerate(engines):
        assert (e["mapped_bytes"] > 0) == (dmap.proxied_by(j) is not None)
    # no process group holds both processes of a colocated pair
    for i, j in dmap.proxies.items():
        assert "refit" not in res[i]["groups"]
        assert res[i]["groups"]["side"] == [0, 1] and 2 + j not in res[i]["groups"]["side"]
    print(json.dumps({"network_bytes": engines[0]["network_bytes"], "mapped": [e["mapped_bytes"] for e in engines]}))


def test_megatron_to_transformers_colocated():
    """``MegatronRefit(target=..., colocated=...)``: a transformers model in the process beside trainer rank 0."""
    pytest.importorskip("transformers")
    import torch
    out = launch(cw.hf_scenario, 3, 60.0, world=False, timeout=400, start_method="forkserver", preload=_preload(),
                 threads=1, leave_at_once=True)
    res = _ok(out)
    hf, trainer = res[2], res[0]
    assert {o["version"] for o in res.values()} == {1}
    assert hf["dst"] == {k: v for k, v in trainer["ref"].items() if k in hf["dst"]}
    assert set(trainer["ref"]) <= set(hf["dst"]), sorted(set(trainer["ref"]) - set(hf["dst"]))[:5]
    assert hf["mapped_bytes"] > 0 and hf["network_bytes"] > 0
    a, b = torch.tensor(hf["logits"]), torch.tensor(trainer["logits"])
    assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max()) + 1e-5
