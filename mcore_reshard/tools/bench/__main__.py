"""``python -m mcore_reshard.tools.bench``."""
import sys

from .cli import main

sys.exit(main())
