"""Which attention impls' post-load processing a vLLM refit re-runs (``vllm_postload.ATTENTION_IMPLS``):
the tensors a known impl derives are named on the derived path, an impl subclass that inherits a known
processing is known, and an unknown processing is refused with the layer, the impl and why."""
from __future__ import annotations

import pytest
import torch

from mcore_reshard.core.executor import ReshardError
from mcore_reshard.integrations.vllm_postload import ATTENTION_IMPLS, impl_derived


class AttentionImplBase:                       # vLLM's no-op base (same class name: what the table keys on)
    def process_weights_after_loading(self, act_dtype):
        pass


class CPUMLAImpl(AttentionImplBase):            # inherits the no-op: derives nothing
    pass


class AMXMLAImpl(AttentionImplBase):
    def process_weights_after_loading(self, act_dtype):
        self._w_uk_packed, self._w_uv_packed, self._w_scale = torch.ones(2, 3), torch.ones(2, 3), None


class AMXMLAImplTuned(AMXMLAImpl):             # a subclass inheriting AMX's processing
    pass


class HomeMadeImpl(AttentionImplBase):
    def process_weights_after_loading(self, act_dtype):
        self.w_packed = torch.zeros(4)


def _layer(impl) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.impl = impl
    impl.process_weights_after_loading(torch.bfloat16)
    return layer


def test_known_impls_name_what_they_derive():
    assert impl_derived(_layer(CPUMLAImpl()), "model.layers.0.attn") == []
    amx = ["model.layers.0.attn.impl._w_uk_packed", "model.layers.0.attn.impl._w_uv_packed"]   # _w_scale: None
    assert impl_derived(_layer(AMXMLAImpl()), "model.layers.0.attn") == amx
    assert impl_derived(_layer(AMXMLAImplTuned()), "model.layers.0.attn") == amx
    assert impl_derived(torch.nn.Module(), "model.layers.0.attn") == []          # no impl at all
    assert "HomeMadeImpl" not in ATTENTION_IMPLS


def test_unknown_impl_processing_is_refused():
    with pytest.raises(ReshardError) as e:
        impl_derived(_layer(HomeMadeImpl()), "model.layers.3.self_attn.attn")
    msg = str(e.value)
    assert msg.startswith("model.layers.3.self_attn.attn: ") and "HomeMadeImpl" in msg
    assert "does not know how to re-run" in msg and "AMXMLAImpl" in msg and "refused" in msg
