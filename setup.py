"""Only the C extension lives here (everything else is in pyproject.toml): the planner's first fit
(mcore_reshard/core/planner/fastfit.py).  Optional: where it does not build (no C compiler), the
package installs all the same and plans with the Python reference, the same plans, slower."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("mcore_reshard.core.planner._cfit", ["mcore_reshard/core/planner/_cfit.c"],
                             optional=True)])
