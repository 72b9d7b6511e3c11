"""Layer 2, the mapper: source names and fused buffers onto canonical (Hugging Face) tensors.

* :mod:`.family` -- ``canonicalize(layout, family)`` through the declarative tables in ``layouts/*.toml``
  (renames, ``[gate; up]`` splits, GQA-interleaved ``linear_qkv``, experts, vocab padding);
* :mod:`.fp8_rules` -- a family's ``[fp8]`` table (which tensors a block-FP8 checkpoint quantizes).

Imports only :mod:`mcore_reshard.core`.
"""
