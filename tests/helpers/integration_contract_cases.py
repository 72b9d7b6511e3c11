"""The integration-level contract cases (tests/integrations/test_contract_integrations.py), as a table: each
public argument of ``hf_config`` / ``hf_config_dict`` / ``megatron_facts`` / ``to_transformers``,
``integrations.protocol``, the vLLM worker extension and weight-transfer engine (their own
validation, on a stand-in worker: no vLLM needed), the SGLang loader, and the CLI, x each class of
bad value that applies.

A case is ``Case(api, argument, kind, must_refuse, run)``; ``run()`` calls the API once.  The judge
(:func:`judge`): ``refused`` -- an error of the library's own types (by class: a subclass of
ReshardError, PlanError, LayoutError, ...) or a ValueError / TypeError whose message names the
argument; ``ok`` -- a result, where the value is one the contract accepts (``must_refuse`` False);
``silent`` -- a result for a value the contract rejects; ``DEFECT`` -- any other exception (a raw
KeyError / IndexError / AttributeError, a torch error, a message naming nothing).
"""
from __future__ import annotations

import contextlib
import io
import math
import types
from typing import Callable, NamedTuple

import torch

OWN = ("ReshardError", "TransferError", "PlanError", "LayoutError", "FamilyError", "PostRefitError")


class Case(NamedTuple):
    api: str
    argument: str
    kind: str
    must_refuse: bool
    run: Callable[[], object]
    strict: bool = False      # a refusal must name the argument even when it is the library's own error
    must_accept: bool = False  # a value the contract accepts: a refusal is a defect (over-refusal)


def record(fn) -> dict:
    try:
        return {"type": None, "mro": [], "error": "", "result": fn()}
    except Exception as e:  # noqa: BLE001 - the judge decides
        return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "error": str(e)[:800]}


def judge(o: dict, argument: str, must_refuse: bool, strict: bool = False, must_accept: bool = False) -> str:
    """``strict``: the library's own error counts only if it names the argument too; ``must_accept``: any
    error is a defect (the value is one the contract accepts)."""
    if o["type"] is None:
        return "silent" if must_refuse else "ok"
    own = any(n in OWN for n in o["mro"]) and (not strict or argument in o["error"])
    named = any(n in ("ValueError", "TypeError") for n in o["mro"]) and argument in o["error"]
    return "refused" if (own or named) and not must_accept else "DEFECT"


NUMBERS = {"nan": math.nan, "inf": math.inf, "negative": -1, "zero": 0, "string": "8", "bool": True,
           "float": 1.5, "huge": 1 << 70, "none_list": [1]}


# ------------------------------------------------------------------------------ hf_config

def _transformer_config():
    from megatron.core.transformer import TransformerConfig
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
                             add_bias_linear=False, activation_func=torch.nn.functional.silu)


def hf_config_cases() -> list[Case]:
    from mcore_reshard.sources.hf_config import hf_config, hf_config_dict, megatron_facts, to_transformers
    cfg = _transformer_config()
    facts = megatron_facts(cfg, vocab_size=128, rotary_base=10000.0)
    good = hf_config_dict(facts)
    out = []
    for kind, v in {"none": None, "string": "facts", "list": [1], "empty": {}, "int": 3}.items():
        out.append(Case("hf_config_dict", "facts", kind, True, lambda v=v: hf_config_dict(v)))
    for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        for kind, val in (("missing", None), ("nan", math.nan), ("negative", -4), ("string", "64")):
            f = dict(facts)
            if kind == "missing":
                del f[key]
            else:
                f[key] = val
            out.append(Case("hf_config_dict", f"facts[{key}]", kind, True, lambda f=f: hf_config_dict(f)))
    for kind, v in {"unknown": "nosuchfamily", "int": 3, "none": None, "empty": "", "path": "../pyproject"}.items():
        out.append(Case("hf_config_dict", "family", kind, True, lambda v=v: hf_config_dict(facts, v)))
    for kind, v in {"none": None, "string": "model", "empty_list": [], "int": 3, "dict": {}}.items():
        out.append(Case("megatron_facts", "model", kind, True, lambda v=v: megatron_facts(v, vocab_size=128)))
    for arg in ("vocab_size", "max_position_embeddings", "rotary_base"):
        for kind in ("nan", "inf", "negative", "zero", "string", "bool", "none_list"):
            v = NUMBERS[kind]
            out.append(Case("megatron_facts", arg, kind, True,
                            lambda arg=arg, v=v: megatron_facts(cfg, **{"vocab_size": 128, arg: v})))
    out.append(Case("megatron_facts", "tie_word_embeddings", "string", True,
                    lambda: megatron_facts(cfg, vocab_size=128, tie_word_embeddings="no")))
    out.append(Case("hf_config", "not_a_fact", "unknown_keyword", True, lambda: hf_config(cfg, vocab_size=128, not_a_fact=1)))
    out.append(Case("hf_config", "model", "none", True, lambda: hf_config(None)))
    for kind, v in {"none": None, "string": "config", "empty": {}, "unknown_type": {**good, "model_type": "nosuch"},
                    "no_model_type": {k: x for k, x in good.items() if k != "model_type"}}.items():
        out.append(Case("to_transformers", "config", kind, True, lambda v=v: to_transformers(v)))
    for kind, v in {"missing": None, "string": "glu_linear_offset=1.0", "list_of_ints": [1]}.items():
        f = dict(facts)
        if kind == "missing":
            del f["unexpressed"]
        else:
            f["unexpressed"] = v
        out.append(Case("hf_config_dict", "facts[unexpressed]", kind, True, lambda f=f: hf_config_dict(f)))
    return out + megatron_setting_cases()


# ------------------------------------------------------------------------------ closed world: every Megatron setting

SAMPLES = {"softmax_type": "learnable", "moe_router_load_balancing_type": "sinkhorn"}   # else _other_value


def _other_value(default):
    """A value other than ``default`` (the config is not re-validated: the mapping reads what the object holds)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, str):
        return default + "_other"
    if isinstance(default, (list, tuple)):
        return [1]
    return 1 if default is None else "other"


def _mla_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    return MLATransformerConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, layernorm_epsilon=1e-6,
        q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, kv_channels=16,
        rope_type="rope", qk_layernorm=True, num_moe_experts=8, moe_router_topk=4, moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1, 1], moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_pre_softmax=True, mtp_num_layers=1)


def megatron_setting_cases() -> list[Case]:
    """Every field of TransformerConfig (and MLATransformerConfig's own) that the closed-world table
    (mcore_reshard/sources/megatron_settings.py) does not just read, set to a value other than its default on a
    config ``hf_config`` accepts: ``refused`` settings must be refused naming the field (strict), ``irrelevant``
    ones (and ``dormant`` ones, their switch off) must give the same transformers config; a field the table does not
    know (a newer Megatron-Core) must be refused naming it."""
    import copy
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_reshard.sources.hf_config import hf_config_dict, megatron_facts
    from mcore_reshard.sources.megatron_settings import SETTINGS
    out = []
    gqa, mla = _transformer_config(), _mla_config()
    plain = {id(c): hf_config_dict(megatron_facts(c, vocab_size=128, rotary_base=10000.0)) for c in (gqa, mla)}
    gqa_fields = {f.name for f in dataclasses.fields(TransformerConfig)}

    def run(base, field, value):
        def go():
            cfg = copy.copy(base)
            object.__setattr__(cfg, field, value)
            got = hf_config_dict(megatron_facts(cfg, vocab_size=128, rotary_base=10000.0))
            if got != plain[id(base)]:
                raise AssertionError(f"{field}={value!r} changed the transformers config")
            return got
        return go
    for f in dataclasses.fields(type(mla)):
        s = SETTINGS.get(f.name)
        if s is None or s.kind == "expressed":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = SAMPLES.get(f.name, _other_value(default))
        refuse = s.kind == "refused" or (s.values is not None and value not in s.values)
        kind = "refused_setting" if refuse else ("dormant_setting" if s.dormant else "irrelevant_setting")
        base = gqa if f.name in gqa_fields else mla
        out.append(Case("hf_config (every setting)", f"model[{f.name}]", kind, refuse, run(base, f.name, value),
                        strict=True, must_accept=not refuse))

    @dataclasses.dataclass
    class NewerConfig(TransformerConfig):
        attention_sink_tokens: int = 0
    newer = NewerConfig(**{f.name: getattr(gqa, f.name) for f in dataclasses.fields(TransformerConfig)
                           if f.init and not f.name.startswith("_")})
    plain[id(newer)] = plain[id(gqa)]
    out.append(Case("hf_config (every setting)", "model[attention_sink_tokens]", "unknown_setting_default", False,
                    run(newer, "attention_sink_tokens", 0), strict=True, must_accept=True))
    out.append(Case("hf_config (every setting)", "model[attention_sink_tokens]", "unknown_setting", True,
                    run(newer, "attention_sink_tokens", 4), strict=True))
    return out


HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "deepseek_v3", "deepseek_v2")
HF_BAD = {"mlp_bias": True, "attention_bias": True, "quantization_config": {"quant_method": "fp8"},
          "compression_config": {"format": "int4"}, "topk_method": "random", "qk_head_dim": 999}


def hf_field_cases() -> list[Case]:
    """``targets.from_hf_config`` (the layouts' reader of engine / checkpoint configs), closed-world: for each model
    type, every field of transformers' default config that the reader does not read set to another value (``ok``,
    the same ModelConfig: names, tokens, engine math), every required value violated and a field transformers does
    not know (refused naming the field, strict)."""
    import transformers

    from mcore_reshard.targets import from_hf_config
    from mcore_reshard.targets.config import FAMILY_OF_MODEL_TYPE
    from mcore_reshard.targets.hf_fields import ENGINE_MATH, METADATA, READ, REQUIRE
    out = []
    for mt in HF_MODEL_TYPES:
        default = transformers.AutoConfig.for_model(mt).to_dict()
        plain = from_hf_config(default)
        fam = FAMILY_OF_MODEL_TYPE[mt]
        requires = {**REQUIRE["*"], **REQUIRE.get(mt, {})}

        def same(d, plain=plain):
            def go():
                got = from_hf_config(d)
                if got != plain:
                    raise AssertionError("another ModelConfig")
                return got
            return go
        for key, value in default.items():
            if key in READ[fam] or key in requires or key == "model_type" or key.startswith("_"):
                continue
            known = key in METADATA or key in ENGINE_MATH      # else a class field the tables do not know: refused
            out.append(Case(f"from_hf_config {mt}", f"config[{key}]", "unread_field" if known else "unknown_class_field",
                            not known, same({**default, key: _other_value(value)}), strict=True, must_accept=known))
        for key in requires:
            if key == "attention_bias" and mt == "qwen2":
                continue
            out.append(Case(f"from_hf_config {mt}", f"config[{key}]", "required_value", True,
                            same({**default, key: HF_BAD[key]}), strict=True))
        out.append(Case(f"from_hf_config {mt}", "config[shared_expert_gate_size]", "unknown_field", True,
                        same({**default, "shared_expert_gate_size": 8}), strict=True))
    return out


# ------------------------------------------------------------------------------ protocol

def _model_config():
    from mcore_reshard import targets
    return targets.gqa_tiny()


def protocol_cases(tmp: str) -> list[Case]:
    from mcore_reshard.integrations import protocol as P
    mc = _model_config()
    spec = P.layout_spec("vllm", mc, tp=1)
    lay = P.build_layout(spec)
    name = sorted(lay.buffers[0])[0]
    buf = lay.buffers[0][name]
    right = {n: torch.zeros(b.shape, dtype=getattr(torch, b.dtype)) for n, b in lay.buffers[0].items()}
    out = []
    for kind, v in {"unknown": "tensorrt", "int": 3, "none": None}.items():
        out.append(Case("layout_spec", "engine", kind, True, lambda v=v: P.layout_spec(v, mc)))
    for kind, v in {"none": None, "string": "config", "int": 3}.items():
        out.append(Case("layout_spec", "config", kind, True, lambda v=v: P.build_layout(P.layout_spec("vllm", v))))
    out.append(Case("layout_spec", "kwargs", "unknown_keyword", True,
                    lambda: P.build_layout(P.layout_spec("vllm", mc, no_such=1))))
    for kind, v in {"negative": -2, "zero": 0, "string": "2", "nan": math.nan, "indivisible": 3}.items():
        out.append(Case("layout_spec", "kwargs[tp]", kind, True, lambda v=v: P.build_layout(P.layout_spec("vllm", mc, tp=v))))
    bad_specs = {"none": None, "string": "spec", "empty": {}, "no_engine": {k: x for k, x in spec.items() if k != "engine"},
                 "no_config": {k: x for k, x in spec.items() if k != "config"}, "unknown_engine": {**spec, "engine": "x"},
                 "kwargs_string": {**spec, "kwargs": "tp=2"},
                 "config_missing_field": {**spec, "config": {k: x for k, x in spec["config"].items() if k != "hidden_size"}},
                 "config_unknown_field": {**spec, "config": {**spec["config"], "no_such": 1}},
                 "config_negative": {**spec, "config": {**spec["config"], "hidden_size": -64}},
                 "config_string": {**spec, "config": {**spec["config"], "num_hidden_layers": "2"}}}
    for kind, v in bad_specs.items():
        out.append(Case("build_layout", "spec", kind, True, lambda v=v: P.build_layout(v)))
    for kind, v in {"none": None, "string": "cfg", "empty": {}, "unknown_field": {**spec["config"], "no_such": 1}}.items():
        out.append(Case("config_from_json", "obj", kind, True, lambda v=v: P.config_from_json(v)))
    out.append(Case("spec_text", "spec", "empty", False, lambda: P.spec_text({})))
    for kind, v in {"none": None, "string": "layout", "dict": {}}.items():
        out.append(Case("rank_part", "layout", kind, True, lambda v=v: P.rank_part(v, 0)))
    for kind, v in {"negative": -1, "huge": 1 << 40, "string": "0", "nan": math.nan}.items():
        out.append(Case("rank_part", "rank", kind, kind in ("string", "nan"), lambda v=v: P.rank_part(lay, v).to_json()))
    out.append(Case("rank_part", "drop", "int", True, lambda: P.rank_part(lay, 0, drop=3)))

    def chk(tensors, rank=0, layout=lay, **kw):
        def run():
            errs = P.check_tensors(layout, rank, tensors, **kw)
            if errs:       # a checker's refusal: the errors it returns (raised here as the library would)
                from mcore_reshard.core.executor import ReshardError
                raise ReshardError(" | ".join(errs))
            return None
        return run
    with torch.inference_mode():
        inference = {n: t.clone() for n, t in right.items()}
    tensor_cases = {"none": (None, True), "list": (list(right.values()), True), "string": ("tensors", True),
                    "not_tensor": ({**right, name: [0.0]}, True), "wrong_shape": ({**right, name: torch.zeros(3)}, True),
                    "wrong_dtype": ({**right, name: right[name].to(torch.float64)}, True),
                    "extra": ({**right, "not.a.weight": torch.zeros(1)}, True),
                    "missing": ({k: t for k, t in right.items() if k != name}, True),
                    "meta_device": ({**right, name: torch.empty(buf.shape, dtype=right[name].dtype, device="meta")}, False),
                    "inference": (inference, False), "right": (right, False)}
    for kind, (v, must) in tensor_cases.items():
        out.append(Case("check_tensors", "tensors", kind, must, chk(v)))
    for kind, v in {"none": None, "string": "layout"}.items():
        out.append(Case("check_tensors", "layout", kind, True, chk(right, layout=v)))
    out.append(Case("check_tensors", "rank", "string", True, chk(right, rank="0")))
    out.append(Case("check_tensors", "ignore", "bad_regex", True, chk(right, ignore=["("])))
    out.append(Case("check_tensors", "ignore", "int", True, chk(right, ignore=3)))
    for kind, v in {"none": None, "string": "layout"}.items():
        out.append(Case("loader_casts", "src", kind, True, lambda v=v: P.loader_casts(v, lay)))
        out.append(Case("loader_casts", "dst", kind, True, lambda v=v: P.loader_casts(lay, v)))
    for kind, v in {"none": None, "list": [torch.nn.Linear(2, 2)], "not_module": {"": "model"}}.items():
        out.append(Case("live_tensors", "modules", kind, True, lambda v=v: P.live_tensors(v)))
    url = f"file://{tmp}/never"
    join_bad = [("init_method", k, dict(init_method=v)) for k, v in {"none": None, "int": 3, "no_scheme": "/tmp/x"}.items()]
    join_bad += [("world_size", k, dict(world_size=v)) for k, v in {"zero": 0, "negative": -2, "string": "2",
                                                                     "nan": math.nan, "float": 2.0, "bool": True}.items()]
    join_bad += [("rank", k, dict(rank=v)) for k, v in {"negative": -1, "too_big": 2, "string": "0", "nan": math.nan}.items()]
    join_bad += [("timeout_s", k, dict(timeout_s=v)) for k, v in {"nan": math.nan, "inf": math.inf, "negative": -1,
                                                                   "zero": 0, "string": "5", "huge": 1e308}.items()]
    join_bad += [("backend", "int", dict(backend=3))]
    for arg, kind, kw in join_bad:
        a = {"init_method": url, "world_size": 2, "rank": 0, "timeout_s": 2.0, **kw}
        out.append(Case("join_group", arg, kind, True, lambda a=a: P.join_group(a.pop("init_method"), a.pop("world_size"),
                                                                                a.pop("rank"), **a)))
    return out


# ------------------------------------------------------------------------------ engines (no engine needed)

def _fake_worker(tp=1, rank=0):
    pc = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1,
                               data_parallel_rank=0)
    return types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=pc), rank=rank,
                                 model_runner=types.SimpleNamespace(model=torch.nn.Linear(2, 2)))


def _join_args(tmp):
    return [("world_size", k, v) for k, v in {"zero": 0, "negative": -1, "string": "2", "nan": math.nan}.items()] + \
           [("rank_offset", k, v) for k, v in {"negative": -1, "too_big": 5, "string": "x", "nan": math.nan,
                                                 "float": 0.5}.items()] + \
           [("timeout_s", k, v) for k, v in {"nan": math.nan, "negative": -1, "zero": 0, "string": "x",
                                              "huge": 1e308}.items()] + \
           [("init_method", k, v) for k, v in {"none": None, "int": 3}.items()]


def _colocated_args(tmp):
    """Bad ``colocated=`` values for a one-worker engine (refused before any rendezvous or accept)."""
    sock = f"{tmp}/pair.sock"
    return {"string": sock, "int": 3, "missing_device": {"channel": sock}, "unknown_key":
            {"channel": sock, "device": "cpu:0", "nope": 1}, "empty_device": {"channel": sock, "device": ""},
            "device_int": {"channel": sock, "device": 0}, "long_channel": {"channel": "/tmp/" + "x" * 200,
                                                                            "device": "cpu:0"},
            "list_too_long": [{"channel": sock, "device": "cpu:0"}, None], "list_entry_int": [3],
            "list_entry_no_channel": [{"device": "cpu:0"}]}


def engine_cases(tmp: str) -> list[Case]:
    from mcore_reshard.integrations import sglang_loader as S
    from mcore_reshard.integrations.vllm_worker import McoreReshardWorkerExtension
    out = []
    url = f"file://{tmp}/engine_never"

    class Ext(McoreReshardWorkerExtension):
        def __init__(self):
            w = _fake_worker()
            self.vllm_config, self.rank, self.model_runner = w.vllm_config, w.rank, w.model_runner

    for arg, kind, v in _join_args(tmp):
        a = {"init_method": url, "world_size": 2, "rank_offset": 0, "timeout_s": 2.0, arg: v}
        out.append(Case("vllm worker mcore_reshard_join", arg, kind, True, lambda a=a: Ext().mcore_reshard_join(**a)))
    for kind, v in _colocated_args(tmp).items():
        a = {"init_method": url, "world_size": 2, "rank_offset": 0, "timeout_s": 2.0, "colocated": v}
        out.append(Case("vllm worker mcore_reshard_join", "colocated", kind, True,
                        lambda a=a: Ext().mcore_reshard_join(**a), strict=True))
    out.append(Case("vllm worker mcore_reshard_prepare", "-", "before_join", True, lambda: Ext().mcore_reshard_prepare()))
    out.append(Case("vllm worker mcore_reshard_refit", "-", "before_prepare", True, lambda: Ext().mcore_reshard_refit()))
    out.append(Case("vllm worker mcore_reshard_state", "-", "before_join", False, lambda: Ext().mcore_reshard_state()))
    out.append(Case("vllm worker mcore_reshard_leave", "-", "before_join", False, lambda: Ext().mcore_reshard_leave()))

    # the weight-transfer engine's own code over stand-in vLLM base classes (its validation needs no vLLM)
    class Base:
        def __init__(self, config, vllm_config, device, model):
            self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
            self._default_model = model

    @__import__("dataclasses").dataclass
    class InitBase:
        pass

    @__import__("dataclasses").dataclass
    class UpdateBase:
        pass
    eng = _engine_module_over(Base, InitBase, UpdateBase)
    Engine, Info = eng.McoreReshardWeightTransferEngine, eng.McoreReshardInitInfo
    w = _fake_worker()

    def init(**kw):
        a = {"init_method": url, "world_size": 2, "rank_offset": 0, "timeout_s": 2.0, **kw}
        return lambda: Engine(None, w.vllm_config, "cpu", w.model_runner.model).init_transfer_engine(Info(**a))
    for arg, kind, v in _join_args(tmp):
        out.append(Case("vllm backend init_transfer_engine", arg, kind, True, init(**{arg: v})))
    for kind, v in {"unknown": "fast", "none": None, "int": 1}.items():
        out.append(Case("vllm backend init_transfer_engine", "refit_mode", kind, True, init(refit_mode=v)))
    for kind, v in {"nan": math.nan, "negative": -1, "string": "8", "tiny": 16}.items():
        out.append(Case("vllm backend init_transfer_engine", "window_bytes", kind, True, init(window_bytes=v)))
    for kind, v in _colocated_args(tmp).items():
        out.append(Case("vllm backend init_transfer_engine", "colocated", kind, True, init(colocated=v), strict=True))
    out += _trainer_cases(tmp, url)
    out.append(Case("vllm backend start_weight_update", "-", "before_init", True,
                    lambda: Engine(None, w.vllm_config, "cpu", w.model_runner.model).start_weight_update()))

    sg = S.SGLangRefit()
    for arg, kind, v in _join_args(tmp):
        a = {"init_method": url, "world_size": 2, "rank_offset": 0, "timeout_s": 2.0, arg: v}
        out.append(Case("SGLangRefit.join", arg, kind, True, lambda a=a: S.SGLangRefit().join(None, **a)))
    out.append(Case("SGLangRefit.prepare", "-", "before_join", True, lambda: sg.prepare(torch.nn.Linear(2, 2))))
    out.append(Case("SGLangRefit.refit", "-", "before_prepare", True, lambda: sg.refit(torch.nn.Linear(2, 2))))
    for kind, v in {"unknown": "reload", "none": None, "int": 3}.items():
        out.append(Case("sglang command", "name", kind, True, lambda v=v: S.command(v)))
    out.append(Case("sglang command", "payload", "tensor", True, lambda: S.command("refit", version=torch.zeros(1))))
    out.append(Case("sglang command", "payload", "nan", False, lambda: S.decode(S.command("refit", version=math.nan)[1])))
    for kind, v in {"none": None, "string": "cmd", "float": torch.zeros(3), "not_json": torch.tensor([1, 2, 255], dtype=torch.uint8),
                    "json_list": torch.tensor(list(b"[1]"), dtype=torch.uint8),
                    "meta": torch.empty(3, dtype=torch.uint8, device="meta")}.items():
        out.append(Case("sglang decode", "tensor", kind, True, lambda v=v: S.decode(v)))

    def load(named):
        def run():
            s = S.session()
            s.last_error = None
            S.load(torch.nn.Linear(2, 2), named)
            if s.last_error:        # the loader's documented refusal of join / prepare: logged, kept here
                from mcore_reshard.core.executor import ReshardError
                raise ReshardError(s.last_error)
        return run
    bad_json = ("mcore_reshard.join", torch.tensor([1, 2, 255], dtype=torch.uint8))
    for kind, v in {"none": None, "int": 3, "unknown_command": [("mcore_reshard.reload", S.command("join")[1])],
                    "refit_before_prepare": [S.command("refit")], "prepare_before_join": [S.command("prepare")],
                    "join_bad_world": [S.command("join", init_method=url, world_size=-1, rank_offset=0)],
                    "join_unknown_key": [S.command("join", init_method=url, world_size=2, rank_offset=0, nope=1)],
                    "command_not_json": [bad_json]}.items():
        out.append(Case("sglang load", "named_tensors", kind, True, load(v)))
    return out


# ------------------------------------------------------------------------------ CLI (in process: exit code + stderr)

CLI_CASES = [
    ("plan", "--src", "garbage", ["plan", "--src", "tp=x"]),
    ("plan", "--src", "unknown_axis", ["plan", "--src", "zz=2"]),
    ("plan", "--src", "empty", ["plan", "--src", ""]),
    ("plan", "--dst", "indivisible", ["plan", "--dst", "tp=7"]),
    ("plan", "--dst", "negative", ["plan", "--dst", "tp=-2"]),
    ("plan", "--scale", "zero", ["plan", "--scale", "0"]),
    ("plan", "--scale", "negative", ["plan", "--scale", "-1"]),
    ("plan", "--scale", "string", ["plan", "--scale", "big"]),
    ("plan", "--budget-mib", "nan", ["plan", "--budget-mib", "nan"]),
    ("plan", "--budget-mib", "inf", ["plan", "--budget-mib", "inf"]),
    ("plan", "--budget-mib", "negative", ["plan", "--budget-mib", "-1"]),
    ("plan", "--budget-mib", "zero", ["plan", "--budget-mib", "0"]),
    ("plan", "--dtype", "unknown", ["plan", "--dtype", "int4"]),
    ("plan", "--model", "unknown", ["plan", "--model", "gpt5"]),
    ("plan", "--config", "missing_file", ["plan", "--config", "/nonexistent/config.json"]),
    ("plan", "--config", "not_json", ["plan", "--config", "__NOT_JSON__"]),
    ("plan", "--fp8", "zero", ["plan", "--model", "dsv3-tiny", "--src", "tp=2", "--dst", "tp=1", "--fp8", "0"]),
    ("plan", "--fp8", "negative", ["plan", "--model", "dsv3-tiny", "--src", "tp=2", "--dst", "tp=1", "--fp8", "-128"]),
    ("plan", "--hardware", "unknown", ["plan", "--hardware", "tpu"]),
    ("plan", "--out", "unwritable", ["plan", "--src", "tp=2", "--dst", "tp=1", "--out", "/nonexistent/dir/plan.json"]),
    ("explain", "name", "unknown_tensor", ["explain", "no.such.tensor", "--src", "tp=2", "--dst", "tp=1"]),
    ("demo", "--reps", "zero", ["demo", "--src", "tp=2", "--dst", "tp=1", "--reps", "0"]),
    ("demo", "--reps", "negative", ["demo", "--src", "tp=2", "--dst", "tp=1", "--reps", "-1"]),
    ("demo", "--timeout", "nan", ["demo", "--src", "tp=2", "--dst", "tp=1", "--reps", "1", "--timeout", "nan"]),
    ("demo", "--timeout", "negative", ["demo", "--src", "tp=2", "--dst", "tp=1", "--reps", "1", "--timeout", "-5"]),
    ("demo", "--src", "garbage", ["demo", "--src", "tp=x"]),
    ("-", "command", "unknown", ["frobnicate"]),
    ("-", "command", "missing", []),
    ("-", "--progress", "unknown", ["--progress", "sometimes", "plan"]),
]


def run_cli(argv: list[str], not_json: str) -> dict:
    """``main(argv)`` in process: exit code, stderr, and whether a traceback escaped."""
    from mcore_reshard.tools.cli import main
    argv = [not_json if a == "__NOT_JSON__" else a for a in argv]
    err, outb = io.StringIO(), io.StringIO()
    code, tb = None, None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(outb):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        except BaseException as e:  # noqa: BLE001 - a traceback would reach the user
            tb = f"{type(e).__name__}: {e}"
    return {"code": code, "stderr": err.getvalue()[-600:], "traceback": tb}


def judge_cli(o: dict, option: str) -> str:
    """``refused``: exit code 2 and a message naming the option; ``silent``: exit 0 (each case is a bad value);
    ``DEFECT``: a traceback, another exit code, or a message naming nothing."""
    if o["traceback"]:
        return "DEFECT"
    if o["code"] == 0:
        return "silent"          # every CLI case is a bad value
    name = option.lstrip("-")
    named = option in o["stderr"] or name in o["stderr"] or name.replace("-", "_") in o["stderr"]
    return "refused" if o["code"] == 2 and named else "DEFECT"


def trainer_module():
    """``integrations.vllm_transfer_trainer`` over stand-in vLLM base classes (no vLLM here)."""
    import dataclasses

    @dataclasses.dataclass
    class InitBase:
        rank: int = dataclasses.field(default=0, kw_only=True)
        is_sender: bool = dataclasses.field(default=True, kw_only=True)

    class EngineBase:
        def __init__(self, client=None, source=None, is_sender=True, rank=0):
            self.client, self.source, self.is_sender, self.rank = client, source, is_sender, rank
    names = {"TrainerInitInfo": InitBase, "TrainerWeightTransferEngine": EngineBase, "WeightSource": object,
             "ParamMeta": tuple}
    return _module_over("mcore_reshard.integrations.vllm_transfer_trainer", names)


def _trainer_cases(tmp: str, url: str) -> list[Case]:
    """The trainer engine's ``colocated`` / ``engine_colocated``: refused before the client is called
    or anything is joined."""
    mod = trainer_module()

    class Client:       # any call reaching it is a defect: the bad value was not refused first
        def __getattr__(self, name):
            raise AssertionError(f"client.{name} called with a bad value")
    source = types.SimpleNamespace(layout=None, tensors={}, rank=0)
    out = []
    for arg in ("colocated", "engine_colocated"):
        for kind, v in _colocated_args(tmp).items():
            if arg == "colocated" and kind.startswith("list"):
                v = [v]          # this rank's own pair: a dict, never a list
            if arg == "engine_colocated" and kind == "list_too_long":     # the trainer cannot count the workers
                kind, v = "list_same_device", [v[0], {"channel": f"{tmp}/other.sock", "device": "cpu:0"}]
            info = mod.McoreReshardTrainerInitInfo(init_method=url, world_size=2, rank=0, **{arg: v})
            out.append(Case("vllm trainer trainer_init", arg, kind, True,
                            lambda info=info: mod.McoreReshardTrainerWeightTransferEngine.trainer_init(
                                info, client=Client(), source=source), strict=True))
    return out


def _module_over(name: str, stand_ins: dict):
    """Module ``name`` imported over stand-ins for ``vllm.distributed.weight_transfer.base``'s classes
    (vLLM is not installed here), then forgotten again so that no other test sees them."""
    import importlib
    import sys
    fake = types.ModuleType("vllm.distributed.weight_transfer.base")
    for k, v in stand_ins.items():
        setattr(fake, k, v)
    parents = ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer")
    saved = {n: sys.modules.get(n) for n in (*parents, fake.__name__, name)}
    sys.modules.update({n: types.ModuleType(n) for n in parents if n not in sys.modules})
    sys.modules[fake.__name__] = fake
    sys.modules.pop(name, None)
    try:
        return importlib.import_module(name)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _engine_module_over(Base, InitBase, UpdateBase):
    """``integrations.vllm_transfer_engine`` imported over stand-in vLLM base classes (:func:`_module_over`)."""
    return _module_over("mcore_reshard.integrations.vllm_transfer_engine",
                        {"WeightTransferEngine": Base, "WeightTransferInitInfo": InitBase,
                         "WeightTransferUpdateInfo": UpdateBase})
