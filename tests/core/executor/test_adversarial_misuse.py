"""Trust under misuse (issue #13): items 1, 3-11 and more misuse, on real gloo processes.

One 2-rank launch (``adversarial_workers.misuse``) runs every case in turn on the same group;
each asserts the documented outcome: refused before any byte moved (destinations and sources
keep their exact bytes) on every rank, or bit-exact success.  Pure checks (numbers, shapes,
placements, the NCCL host-side wait) run in-process.
"""
from __future__ import annotations

import math

import adversarial_workers
import pytest
from partial_launch import spawn_ok

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def misuse():
    return spawn_ok(adversarial_workers.misuse, 2, timeout=300, pg_timeout=60)


def _refused(res, case, *, kind="ReshardError", text=None):
    for rank, r in enumerate(res):
        o = r[case]
        assert o["type"] == kind, (rank, case, o)
        assert o["dst_untouched"] and o["src_untouched"], (rank, case, o)
        if text:
            assert text in o["error"], (rank, case, o["error"])


def test_item1_two_resharders_refit_in_different_orders(misuse):
    for rank, r in enumerate(misuse):
        for k in ("cross_1", "cross_2"):
            assert r[k]["type"] == "ReshardError", (rank, r[k])
            assert "ranks refit different Resharders" in r[k]["error"], r[k]["error"]
        assert r["cross_untouched"], rank              # not one destination byte written
        assert r["cross_states"] == [0, 0, False, False], r["cross_states"]
        assert r["cross_after_exact"], rank             # same order afterwards: both bit-exact


def test_item3_interrupted_right_after_the_confirmation_recovers(misuse):
    for rank, r in enumerate(misuse):
        attempts = r["after_confirm"]["attempts"]
        assert len(attempts) == 4
        for k, a in enumerate(attempts):
            assert a["first"] == ("KeyboardInterrupt" if rank == 1 else "ok"), a
            if rank == 1:
                assert a["state_after"]["interrupted"], a
            # the same group is refused on every rank (operations may be pending): rebind first
            assert a["same_group"]["type"] == "ReshardError" and "call rebind(new_group)" in a["same_group"]["error"], a
            # rebind + refit() converges without version=: the highest proposal wins
            assert a["recovered"]["type"] is None, a
            assert a["recovered"]["result"] == 3 + 2 * k, a   # rank 0 confirmed 2 + 2k, the recovery is the next
            assert a["state"]["version"] == 3 + 2 * k and not a["state"]["interrupted"] and not a["state"]["incomplete"], a
            assert a["exact"], a


def test_item4_tampered_plans_and_foreign_layouts_refused(misuse):
    _refused(misuse, "plan_reshaped_box", text="differ in shape")
    _refused(misuse, "plan_dtype_relabelled", text="src_dtype int32")
    _refused(misuse, "plan_of_other_layouts", text="layout")
    _refused(misuse, "plan_float_offsets", text="must be integers")


def test_item5_parameters(misuse):
    for rank, r in enumerate(misuse):
        o = r["parameters"]
        assert o["type"] is None, o
        assert o["exact"] and o["still_parameters"], o


def test_item6_staging_aliasing_refused(misuse):
    _refused(misuse, "staging_aliases_src", text="overwrite the source weights")
    _refused(misuse, "staging_aliases_dst", text="share memory")
    _refused(misuse, "staging_not_uint8", text="uint8")


def test_item7_meta_device_refused(misuse):
    _refused(misuse, "meta_dst", text="meta device")
    _refused(misuse, "meta_src", text="meta device")


@pytest.mark.parametrize("kind", list(adversarial_workers._kinds()) + ["fake/followed"])
def test_tensor_kinds_without_strided_storage_refused_everywhere(misuse, kind):
    """Sparse (every layout), nested, quantized, functional, fake and unknown subclasses, given on
    rank 1 only as a source or a destination: every rank raises ReshardError in the handshake, naming
    rank 1, the tensor and its kind; no byte moved.  (A sparse source used to crash rank 1 with a raw
    RuntimeError while rank 0 waited out the timeout.)  A destination whose ``param.data`` became a
    FakeTensor (a meta tensor: no storage) after binding is refused at the next refit, not followed."""
    sides = ["followed"] if kind == "fake/followed" else ["src", "dst"]
    words = "on meta" if kind == "fake/followed" else adversarial_workers._kinds()[kind][1]
    for side in sides:
        case = kind if side == "followed" else f"{kind}/{side}"
        for rank, r in enumerate(misuse):
            o = r["kinds"][case]
            assert o["type"] == "ReshardError", (rank, case, o)
            assert o["dst_untouched"] and o["src_untouched"], (rank, case, o)
            assert f"rank 1: {'dst' if side == 'followed' else side} tensor {o['name']}" in o["error"], (rank, case, o["error"])
            assert words in o["error"], (rank, case, o["error"])


def test_item8_options_and_threads(misuse):
    _refused(misuse, "overlap_differs", text="options differ between ranks")
    _refused(misuse, "overlap_env_differs", text="overlap=0")
    for rank, r in enumerate(misuse):
        o = r["overlap_env_changed"]
        assert o["type"] == "ReshardError" and "options differ between ranks" in o["error"] and o["dst_untouched"], o
        assert r["overlap_env_restored"]["type"] is None and r["overlap_env_restored"]["result"] == 1
        th = r["threads"]
        assert th["alive"] == [False, False], th
        kinds = sorted(str(th[t]["type"]) for t in ("t1", "t2"))
        assert "ReshardError" in kinds, th          # at least one thread refused, clearly; no abort
        for t in ("t1", "t2"):
            if th[t]["type"]:
                assert th[t]["type"] == "ReshardError", th[t]
                assert ("same process group" in th[t]["error"] or "ranks refit different Resharders" in th[t]["error"]), th[t]
        assert th["claims_exact"], th


@pytest.mark.parametrize("case", [f"timeout={bad!r}" for bad in (0, -1, float("nan"), float("inf"), "5", True)]
                         + ["version=-1", "version=1.5"])
def test_item9_numbers_refused(misuse, case):
    _refused(misuse, case, kind="ValueError", text=case.split("=")[0] + "=")


def test_item11_source_written_during_refit_detected_with_verify(misuse):
    for rank, r in enumerate(misuse):
        o = r["source_written"]
        assert o["type"] == "TransferError", o
        assert "changed during refit 1" in o["error"] and "must not write the sources" in o["error"], o["error"]
        # no buffer claims the mixed refit
        assert 1 not in o["state"]["buffers"].values(), o["state"]


def test_rebind_misuse(misuse):
    for r in misuse:
        assert r["rebind_same_ok"]["type"] is None and r["rebind_same_ok"]["result"] == 2
        assert r["rebind_different"]["type"] == "ReshardError" and "different Resharders" in r["rebind_different"]["error"]
        # wrong order (a refit on one rank meets a rebind on the other): refused on both, then fine
        assert r["wrong_order"]["type"] == "ReshardError", r["wrong_order"]
        assert "different protocol steps" in r["wrong_order"]["error"], r["wrong_order"]["error"]
        assert r["wrong_order_then"]["type"] is None and r["wrong_order"] and r["wrong_order_exact"], r["wrong_order_then"]


def test_every_dtype_and_shape_bit_exact(misuse):
    for rank, r in enumerate(misuse):
        assert len(r["dtypes"]) == 6
        for k, o in r["dtypes"].items():
            assert o["exact"], (rank, k, o["mismatched"])


def test_item10_missing_peer_named():
    out = spawn_ok(adversarial_workers.missing_peer, 2, timeout=120, pg_timeout=60)
    o = out[0]
    assert o["type"] == "ReshardError", o
    assert "ranks [1] did not answer" in o["error"], o["error"]
    assert o["seconds"] < 4 * 2.0, o


# --------------------------------------------------------------------------------- in-process


def _shape(shape):
    from mcore_reshard.core.layout import Layout
    Layout().add_tensor("w", shape, "float32")


def _dtype():
    from mcore_reshard.core.layout import Layout
    Layout().add_tensor("w", (2, 2), "float33")


def _placement():
    from mcore_reshard.core.layout import shard_box
    from mcore_reshard.core.mesh import Mesh
    shard_box((4, 4), Mesh.of({"tp": 2}), 0, [("tp", 2)])


def _dtensor_dim():
    from torch.distributed.tensor import Shard

    from mcore_reshard.core.dtensor import local_intervals
    local_intervals((4, 4), [2], [0], [Shard(3)])


def _box(box):
    from mcore_reshard.core.box import Box
    Box(*box)


def _timeout(bad):
    from mcore_reshard.core.executor.common import check_timeout
    check_timeout(bad)


def _budget(bad):
    from mcore_reshard.refit import MegatronRefit
    MegatronRefit([], [], budget_bytes=bad)


# (id, call, error type, message match), each a refusal before anything is exchanged
IN_PROCESS_REFUSALS = (
    [(f"shape={v!r}", lambda v=v: _shape(v), "LayoutError", "shape") for v in ((2.5, 4), (-1, 4), ("8", 4), (True, 4), 7)]
    + [("dtype=float33", _dtype, "LayoutError", "unknown dtype"),
       ("placement-dim-2-of-2", _placement, "LayoutError", "out of range"),
       ("dtensor-Shard(3)-of-2-dims", _dtensor_dim, "ValueError", "out of range")]
    + [(f"box={v!r}", lambda v=v: _box(v), "ValueError", "integers") for v in (((0.5, 0), (2, 2)), ((0, 0), (2.0, 2)))]
    + [(f"timeout={v!r}", lambda v=v: _timeout(v), "ValueError", "timeout=")
       for v in (0, -1, math.nan, math.inf, "5", True, [1])]
    + [(f"budget_bytes={v!r}", lambda v=v: _budget(v), "ValueError", "budget_bytes=")
       for v in (math.nan, math.inf, "4096", 100, 4096.0)])


@pytest.mark.parametrize("case", IN_PROCESS_REFUSALS, ids=[c[0] for c in IN_PROCESS_REFUSALS])
def test_item9_shapes_placements_and_plans_refused_in_process(case):
    from mcore_reshard.core.layout import LayoutError
    _, call, error, match = case
    with pytest.raises({"LayoutError": LayoutError, "ValueError": ValueError}[error], match=match):
        call()


def test_item9_good_timeouts_accepted_in_process():
    from mcore_reshard.core.executor.common import check_timeout
    assert check_timeout(None) is None and check_timeout(2) == 2.0


def test_nccl_host_side_deadline_and_abort(monkeypatch):
    """NCCL's Work.wait does not block the host: bounded_wait polls is_completed() against the
    deadline and aborts the communicator (here a fake work and group: no GPU)."""
    import time

    import mcore_reshard.core.executor.common as common

    class NeverDone:
        waited = 0

        def is_completed(self):
            return False

        def wait(self, *a):
            NeverDone.waited += 1      # would return at once on NCCL: must not be relied on

    aborted = []
    monkeypatch.setattr(common, "waits_block", lambda g: False)
    monkeypatch.setattr(common, "abort_group", lambda g: aborted.append(g))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="communicator aborted"):
        common.bounded_wait(NeverDone(), 0.3, group="fake-nccl-group")
    took = time.monotonic() - t0
    assert 0.3 <= took < 1.5, took
    assert aborted == ["fake-nccl-group"] and NeverDone.waited == 0

    class DoneLater:
        def __init__(self):
            self.t = time.monotonic() + 0.1
            self.waited = 0

        def is_completed(self):
            return time.monotonic() > self.t

        def wait(self, *a):
            self.waited += 1

    w = DoneLater()
    common.bounded_wait(w, 5.0, group="fake-nccl-group")
    assert w.waited == 1 and len(aborted) == 1
    # the same, told by the caller (a Resharder looks the backend up once per group): never blocks
    # on the fake group's wait, whatever waits_block would say
    monkeypatch.setattr(common, "waits_block", lambda g: True)
    with pytest.raises(TimeoutError, match="communicator aborted"):
        common.bounded_wait(NeverDone(), 0.2, group="fake-nccl-group", blocking=False)
    assert NeverDone.waited == 0 and len(aborted) == 2
    # a timeout error is classified as such by the round error text
    from mcore_reshard.core.executor.errors import is_timeout
    assert is_timeout(TimeoutError("Timed out waiting 300ms (host-side deadline; communicator aborted)"))


def test_group_guard_released_after_an_interrupt_inside_it(monkeypatch):
    """A KeyboardInterrupt right after the per-group lock was taken (before the body) used to leave it
    held: every later refit / rebind over that group in the process was refused ('thread None is
    running a refit').  In process: the interrupt lands in the guard's own bookkeeping."""
    import threading
    import types

    from mcore_reshard.core.executor import ReshardError, handshake
    group = object()

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(handshake, "threading", types.SimpleNamespace(Lock=threading.Lock, current_thread=interrupted))
    with pytest.raises(KeyboardInterrupt):
        with handshake.group_guard(group, 0, "refit"):
            pass
    monkeypatch.undo()
    with handshake.group_guard(group, 0, "refit"):       # free again
        with pytest.raises(ReshardError, match="same process group"):
            with handshake.group_guard(group, 0, "refit"):
                pass


def test_group_guard_never_left_claimed_by_a_sigint():
    """A KeyboardInterrupt at each point of entering and leaving a guarded block where CPython runs a
    SIGINT's handler (calls, function starts, after a ``yield``: ``OpcodeTrap(signal_points=True)``),
    one point per try: the group is free afterwards.  It used to stay claimed when the interrupt
    surfaced right after the per-group lock was taken, before the guard recorded it ('thread None is
    running a refit': every later refit / rebind over that group in the process refused)."""
    from sigint_workers import OpcodeTrap

    from mcore_reshard.core.executor import ReshardError, handshake
    groups = [object()]

    def guarded():
        with handshake.group_guard(groups[-1], 0, "refit"):
            return 1

    count = OpcodeTrap(signal_points=True)
    count.run(guarded)
    assert count.n >= 5, count.n
    left_claimed = []
    for at in range(1, count.n + 1):
        groups.append(object())
        trap = OpcodeTrap(at, signal_points=True)
        with pytest.raises(KeyboardInterrupt):
            trap.run(guarded)
        try:
            with handshake.group_guard(groups[-1], 0, "refit"):
                pass
        except ReshardError as e:
            left_claimed.append((at, trap.fired, str(e)[:120]))
    assert not left_claimed, left_claimed
    with handshake.group_guard(groups[-1], 0, "refit"):     # a second operation is still refused
        with pytest.raises(ReshardError, match="same process group"):
            with handshake.group_guard(groups[-1], 0, "refit"):
                pass
