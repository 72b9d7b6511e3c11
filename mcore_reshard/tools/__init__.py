"""Tools around the library, never imported by it: the ``mcore-reshard`` command line (:mod:`.cli`),
the demo and its synthetic model (:mod:`.demo`, :mod:`.synthetic`), layout strings
(:mod:`.layout_strings`), benchmarks and the cost model (:mod:`.bench`,
:mod:`.costmodel`), local multi-process launch (:mod:`.launch`).  Progress bars and memory readings
are in :mod:`mcore_reshard.util`.
"""
