"""The overlapped (gloo) round's receive loop, in process with a stand-in for ``torch.distributed``
(no process group): every receive is unpacked once, into its own destination, and the loop polls
each peer's oldest pending receive only -- O(receives + peers) ``is_completed`` calls, not one per
pending receive per step (BENCHMARKS.md C.3: ~500 receives per rank made that quadratic)."""
from __future__ import annotations

import pytest
import torch

from mcore_reshard.core.box import Box
from mcore_reshard.core.executor import binding, rounds
from mcore_reshard.core.executor.transfer import Channel, Refit
from mcore_reshard.core.planner import Copy, Message


class Work:
    """Completes when waited for, or when the stand-in lands it early (out of order across peers)."""
    polls = 0

    def __init__(self, dst: torch.Tensor, src: torch.Tensor | None):
        self.dst, self.src, self.done = dst, src, False

    def is_completed(self) -> bool:
        Work.polls += 1
        return self.done

    def land(self) -> None:
        if not self.done and self.src is not None:
            self.dst.copy_(self.src)      # the bytes "arrive" in the wire buffer
        self.done = True

    def wait(self, *a) -> None:
        self.land()


class Dist:
    """What round_overlapped calls of torch.distributed: P2POp, batch_isend_irecv, isend."""

    def __init__(self, payload: dict, arrive_early: list):
        self.payload, self.arrive_early, self.works = payload, arrive_early, []

    irecv, isend = "irecv", "isend"

    def P2POp(self, op, t, group=None, group_peer=None):     # noqa: N802 - torch's name
        return (op, t, group_peer)

    def batch_isend_irecv(self, ops):
        self.works = [Work(t, self.payload.get(id(t))) if op == "irecv" else Work(t, None) for op, t, _ in ops]
        for k in self.arrive_early:    # these landed before the loop starts polling
            self.works[k].land()
        return self.works


@pytest.mark.parametrize("arrive_early", [[], [5, 1, 190, 7]])
def test_overlapped_round_unpacks_every_receive_once_polling_heads_only(monkeypatch, arrive_early):
    peers, n = 3, 192
    torch.manual_seed(0)
    recvs, payload, dests, expect = [], {}, [], []
    for k in range(n):
        peer = 1 + k % peers
        wire = torch.zeros(8, dtype=torch.uint8)          # the staging view a message lands in
        dst = torch.zeros(2, dtype=torch.int32)           # its destination view
        src = torch.randint(0, 255, (8,), dtype=torch.uint8)
        payload[id(wire)] = src
        dests.append(dst)
        expect.append(src.view(torch.int32).clone())
        box = Box((0,), (2,))
        c = Copy(tensor=f"w{k}", box=box, src=peer, src_buffer=f"w{k}", src_local=box, dst=0, dst_buffer=f"w{k}",
                 dst_local=box, nbytes=8, offset=0)
        m = Message(round=1, src=peer, dst=0, nbytes=8, entries=(c,))
        stage = wire.view(torch.int32)                     # the staging view, typed as the destination
        pair = binding.Pair(stage, dst)
        recvs.append(binding.BoundMessage(peer, wire, [pair], m, [binding.Part(wire, [pair])]))
    fake = Dist(payload, arrive_early)
    monkeypatch.setattr(rounds, "dist", fake)
    rnd = binding.Round([], recvs, [], list(range(1, peers + 1)))
    r = Refit(rank=0, verify=False, confirm=True, digest="", dst_names=[],
              channel=Channel(group=None, world=peers + 1, timeout_s=30.0, waits_block=True))
    r.swap(binding.Binding(src={}, dst={}, local=[], padding=[], staging=torch.empty(0, dtype=torch.uint8),
                           rounds=[rnd], round_numbers=[1], first_stage={}, last_stage={}))
    Work.polls = 0
    problems, bad = [], set()
    rounds.round_overlapped(r, 1, 0, rnd, problems, bad)
    assert not problems and not bad
    for k in range(n):      # every destination holds its own message's bytes, so each was unpacked
        assert torch.equal(dests[k], expect[k]), k
    assert all(w.done for w in fake.works)
    # heads only: at most one poll per receive landed plus one per peer and step (the quadratic loop
    # polled ~n^2 / 2 = 18k times here)
    assert Work.polls <= 2 * n + peers * (n + 1), Work.polls
