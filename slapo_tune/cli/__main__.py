"""``python -m slapo_tune.cli``: the command line."""

import sys

from . import main

sys.exit(main())
