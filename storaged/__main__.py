"""`python -m storaged`: the same as the `storaged` console script."""

import sys

from storaged.cli import main

sys.exit(main())
