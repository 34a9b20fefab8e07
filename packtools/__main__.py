import sys

from packtools.cli import main

sys.exit(main())
