"""The ``[fp8]`` table of a model family (``layouts/<family>.toml``): which canonical tensors a
block-FP8 checkpoint quantizes, and the block (pure: no torch).  Family knowledge, read by
:mod:`mcore_reshard.mapper.family`; the FP8 layouts and plans (:mod:`mcore_reshard.fp8`) use it."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ..core.layout import LayoutError, TensorMeta

DEFAULT_BLOCK = (128, 128)


def check_block(block: Sequence[int]) -> tuple[int, int]:
    b = tuple(int(x) for x in block)
    if len(b) != 2 or min(b) < 1:
        raise LayoutError(f"FP8 block must be two positive sizes, not {block!r}")
    return b  # type: ignore[return-value]


@dataclass(frozen=True)
class Fp8Rules:
    """Model-family knowledge (``[fp8]`` of ``layouts/<family>.toml``): which canonical tensors the
    checkpoint keeps in high precision, and which are ``[a; b]`` halves along dim -2 quantized
    separately (a block must not straddle them)."""
    not_quantized: tuple[str, ...] = ()
    halves: tuple[str, ...] = ()
    min_ndim: int = 2
    block: tuple[int, int] = DEFAULT_BLOCK

    @staticmethod
    def from_table(obj: Mapping | None) -> "Fp8Rules | None":
        if obj is None:
            return None
        return Fp8Rules(tuple(obj.get("not_quantized", ())), tuple(obj.get("halves", ())), int(obj.get("min_ndim", 2)),
                        check_block(obj.get("block", DEFAULT_BLOCK)))

    def quantized(self, tensors: Iterable[TensorMeta], block: Sequence[int] | None = None) -> set[str]:
        """Names of the tensors quantized to FP8; raises if a ``halves`` tensor's halves are not
        multiples of the block (``gate_up_proj`` with ``I % B0 != 0``)."""
        b = check_block(block or self.block)
        out = set()
        for m in tensors:
            if len(m.shape) < self.min_ndim or any(re.search(p, m.name) for p in self.not_quantized):
                continue
            if any(re.search(p, m.name) for p in self.halves) and (m.shape[-2] % 2 or (m.shape[-2] // 2) % b[0]):
                raise LayoutError(f"tensor {m.name} {list(m.shape)} is [gate; up] along dim -2: each half "
                                  f"({m.shape[-2] // 2} rows) must be a multiple of the {b[0]}-row FP8 block "
                                  "(the checkpoint quantizes gate and up separately)")
            out.add(m.name)
        return out
