"""FP8 in transit (DeepSeek-V3's block-FP8 serving format), one module per layer it extends:

* :mod:`.layout` -- FP8 target layouts: weight + ``*_scale_inv`` buffers (layout level, pure);
* :mod:`.plan` -- who quantizes which 128x128 block, and the assembly / FP8 plans (planner level, pure);
* :mod:`.refit` -- ``Fp8Resharder``: assemble, quantize, send e4m3 + scales (executor level).

Imports :mod:`mcore_reshard.core` and :mod:`mcore_reshard.mapper`.  See ``docs/fp8.md``.
"""
