"""ModuleIdentity (mcore_reshard.util.identity): what a refit bound, module by module, re-checked at
every refit -- followed when a replaced module has the same parameters, refused otherwise.  In
process, plain torch modules (the multi-rank cases live in the Megatron and integration launches)."""
from __future__ import annotations

import copy

import torch

from mcore_reshard.util.identity import ModuleIdentity, TrackedTensors, identity_of, tracked


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)))


def bound(m: torch.nn.Module) -> dict:
    return {n: p for n, p in m.named_parameters()}


def test_nothing_changed_is_quiet():
    m = model()
    ident = ModuleIdentity([(m, None, "")], {n: n for n in bound(m)}, side="src", rank=3)
    assert ident.check() == ([], {})
    m[1][0].weight.data = torch.ones(8)          # param.data: the executor's storage check, not this one
    assert ident.check() == ([], {})


def test_replaced_module_with_same_parameters_is_followed():
    m = model()
    ident = ModuleIdentity([(m, None, "")], {n: n for n in bound(m)}, side="dst", rank=1)
    new = copy.deepcopy(m[1])
    m[1] = new
    problems, followed = ident.check()
    assert problems == []
    assert set(followed) == {"1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"}
    assert followed["1.1.weight"] is new[1].weight
    assert ident.check() == ([], {})             # recorded: quiet again


def test_replaced_parameter_object_is_followed():
    m = model()
    ident = ModuleIdentity([(m, None, "")], {n: n for n in bound(m)}, side="src", rank=0)
    w = torch.nn.Parameter(torch.zeros(8, 4))
    m[0].weight = w
    assert ident.check() == ([], {"0.weight": w})


def test_replaced_module_with_other_parameters_is_refused_by_name():
    m = model()
    ident = ModuleIdentity([(m, None, "")], {n: n for n in bound(m)}, side="src", rank=2)
    lora = copy.deepcopy(m[1][1])
    lora.lora_A = torch.nn.Parameter(torch.zeros(2, 8))
    m[1][1] = lora
    problems, followed = ident.check()
    assert followed == {}
    assert len(problems) == 1 and problems[0].startswith("rank 2: src module model: 1.1 (Linear) was replaced"), problems
    assert "new lora_A [2, 8]" in problems[0]
    m[1][1] = torch.nn.Linear(8, 3)                 # other shapes
    assert "weight [2, 8] float32 -> [3, 8] float32" in ident.check()[0][0]
    del m[1][1]                                     # removed
    assert "1.1" in ident.check()[0][0]


def test_chunk_replaced_in_its_list_and_refuse_only_mode():
    chunks = [model(), model()]
    names = {f"vpp{c}.{n}": n for c in range(2) for n in bound(chunks[c])}
    ident = ModuleIdentity([(chunks, c, f"vpp{c}.") for c in range(2)], names, side="src", rank=0)
    chunks[1] = copy.deepcopy(chunks[1])
    problems, followed = ident.check()
    assert problems == [] and set(followed) == {n for n in names if n.startswith("vpp1.")}
    strict = ModuleIdentity([(chunks, c, f"vpp{c}.") for c in range(2)], names, side="dst", rank=5, follow=False,
                            leaves=False)
    chunks[0][0] = torch.nn.Linear(4, 8)
    problems, followed = strict.check()
    assert followed == {} and "rank 5: dst module [0]: 0 (Linear) was replaced" in problems[0], problems
    assert "cannot follow" in problems[0]


def test_holder_attribute_root_replaced():
    runner = type("Runner", (), {})()
    runner.model = model()
    ident = tracked({"": (runner, "model")}, dict.fromkeys(bound(runner.model)), rank=0, follow=False, leaves=False).identity
    assert ident.check() == ([], {})
    runner.model = model()
    assert "model chunk model" in ident.check()[0][0] and "cannot follow" in ident.check()[0][0]


def test_tracked_tensors_carry_their_identity_through_subset():
    m = model()
    tensors = tracked({"": m}, {n: p.detach() for n, p in m.named_parameters()}, rank=4)
    assert isinstance(tensors, TrackedTensors)
    sub = tensors.subset(["0.weight", "1.1.bias"])
    ident = identity_of(sub, "dst", rank=7)
    assert set(ident.names) == {"0.weight", "1.1.bias"} and ident.side == "dst" and ident.rank == 7
    assert identity_of({"x": torch.zeros(1)}, "src") is None     # a plain dict: tensor-level checks only
    m[1] = copy.deepcopy(m[1])
    assert set(ident.check()[1]) == {"1.1.bias"}


def test_check_follow_false_refuses_and_keeps_the_record():
    """check(follow=False) (dtensor_reshard: it writes the tensors it is given): a followable
    replacement is a problem, and stays one at the next check."""
    m = model()
    ident = ModuleIdentity([(m, None, "")], {n: n for n in bound(m)}, side="dst", rank=0)
    m[1] = copy.deepcopy(m[1])
    for _ in range(2):
        problems, followed = ident.check(follow=False)
        assert followed == {} and "dst module model: 1 (Sequential) was replaced" in problems[0], problems
    assert set(ident.check()[1]) == {"1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"}   # followed now
