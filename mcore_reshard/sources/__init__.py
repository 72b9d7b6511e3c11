"""Layouts read from live models (layer 1, layout descriptors, model-specific): what each rank of a
training job holds.

* :mod:`.megatron_model` -- ``read_layout(chunks)`` from Megatron-Core's own ``sharded_state_dict()``;
* :mod:`.megatron_spec` -- the same layout from dims and parallel sizes, no model needed (full-size plans);
* :mod:`.hf_model` -- ``read_hf_layout(model, rank)`` for a transformers model, whole or sharded by its TP/EP plans;
* :mod:`.hf_config` (layer 2: it reads the mapper's family tables) -- a Megatron model's transformers config;
* :mod:`.megatron_dtensor` (layer 5: it gathers over the world through the executor) --
  ``export_dtensors(chunks)``: real DTensors over Megatron's global tensors.

The layer-1 modules import only layer 1 of :mod:`mcore_reshard.core` (box, mesh, layout, dtensor).
"""
