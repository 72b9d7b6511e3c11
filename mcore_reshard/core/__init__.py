"""Layers 1, 3 and 4, model-agnostic: layout descriptors, the planner and the executor.

* layer 1: :mod:`.box`, :mod:`.mesh`, :mod:`.layout` -- which box of which logical tensor each rank
  holds (pure); :mod:`.dtensor` -- the same layouts as ``torch.distributed.tensor`` meshes and placements;
* layer 3: :mod:`.planner` -- pure planning on two layouts (never imports ``torch.distributed``);
* layer 4: :mod:`.executor` -- the one package that moves bytes (``torch.distributed`` P2P, local ``copy_``);
* under every layer: :mod:`.gcpause` (the garbage collector paused while layouts or plans are built).

Imports nothing else of the package.
"""
