"""Layer 2, the mapper: source names and fused buffers onto canonical (Hugging Face) tensors.

* :mod:`.family` -- ``canonicalize(layout, family)`` through the declarative tables in ``layouts/*.toml``
  (renames, ``[gate; up]`` splits, GQA-interleaved ``linear_qkv``, experts, vocab padding);
* :mod:`.fp8_rules` -- a family's ``[fp8]`` table (which tensors a block-FP8 checkpoint quantizes).

Imports only layer 1 (:mod:`mcore_reshard.core`'s box and layout); :mod:`mcore_reshard.targets`
is its sibling in layer 2 (neither imports the other).
"""
