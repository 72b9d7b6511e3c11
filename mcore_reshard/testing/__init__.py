"""Opt-in helpers for trying the library without a GPU (never imported by the library itself).

``mcore_reshard.testing.megatron_cpu``: run tiny Megatron-Core models on a CPU-only torch with gloo
(runtime patches of Megatron-Core's CUDA-only calls, tiny model builders, a CPU forward, a
multi-process launcher).  Importing it imports torch and, when used, megatron-core.
"""
