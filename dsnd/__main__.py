"""``python -m dsnd`` (how launchers start each rank)."""

import sys

from dsnd.cli import main

sys.exit(main())
