"""``python -m slapo_tune``: the command line (also what ``torchrun -m slapo_tune train`` runs)."""

import sys

from .cli import main

sys.exit(main())
