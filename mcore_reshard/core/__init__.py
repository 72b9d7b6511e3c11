"""Layers 1, 3 and 4, model-agnostic: layout descriptors, the planner and the executor.

* :mod:`.box`, :mod:`.mesh`, :mod:`.layout` -- which box of which logical tensor each rank holds (pure);
* :mod:`.dtensor` -- the same layouts as ``torch.distributed.tensor`` meshes and placements;
* :mod:`.planner` -- pure planning on two layouts (never imports ``torch.distributed``);
* :mod:`.executor` -- the one module that moves bytes (``torch.distributed`` P2P, local ``copy_``).

Imports nothing else of the package.
"""
