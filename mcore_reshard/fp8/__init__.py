"""FP8 in transit (DeepSeek-V3's block-FP8 serving format), modules in the layers they extend:

* :mod:`.quant_layout` -- FP8 target layouts: weight + ``*_scale_inv`` buffers (layer 2, next to targets; pure);
* :mod:`.quant_plan` (with :mod:`.regions`, :mod:`.groups`, :mod:`.shared`) -- who quantizes which 128x128
  block, and the assembly / FP8 plans (layer 3, planner; pure);
* :mod:`.quant_resharder` -- ``Fp8Resharder``: assemble, quantize, send e4m3 + scales (layer 4, executor).

Imports :mod:`mcore_reshard.core` and :mod:`mcore_reshard.mapper`.  See ``docs/fp8.md``.
"""
