"""Moved to :mod:`mcore_reshard.testing.megatron_cpu`; this name stays an alias of that module."""
import sys; from mcore_reshard.testing import megatron_cpu; sys.modules[__name__] = megatron_cpu  # noqa: E401,E702
