"""python -m moe_l2.cli: the moe-l2 command."""

import sys

from moe_l2.cli import main

sys.exit(main())
