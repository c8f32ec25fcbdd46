"""``python -m backends.sim``."""

import sys

from backends.sim.cli import main

sys.exit(main())
