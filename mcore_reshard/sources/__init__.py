"""Layouts read from live models (layer 1, model-specific): what each rank of a training job holds.

* :mod:`.megatron_model` -- ``read_layout(chunks)`` from Megatron-Core's own ``sharded_state_dict()``;
* :mod:`.megatron_spec` -- the same layout from dims and parallel sizes, no model needed (full-size plans);
* :mod:`.megatron_dtensor` -- ``export_dtensors(chunks)``: real DTensors over Megatron's global tensors;
* :mod:`.hf_model` -- ``read_hf_layout(model, rank)`` for a transformers model, whole or sharded by its TP/EP plans.

Imports :mod:`mcore_reshard.core` and :mod:`mcore_reshard.mapper`.
"""
