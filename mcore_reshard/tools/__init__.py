"""Tools around the library, never imported by it: the ``mcore-reshard`` command line (:mod:`.cli`),
the demo and its synthetic model (:mod:`.demo`, :mod:`.synthetic`), layout strings
(:mod:`.layout_strings`), benchmarks and the cost model (:mod:`.bench`,
:mod:`.costmodel`), local multi-process launch (:mod:`.launch`), progress bars and memory readings
(:mod:`.progress`, :mod:`.memstat`).
"""
