"""``python -m mcore_reshard.tools.bench``."""
import sys

from .options import main

sys.exit(main())
