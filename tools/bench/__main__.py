"""``python -m tools.bench`` (under torchrun): see :mod:`tools.bench`."""

import sys

from tools.bench.cli import main

sys.exit(main())
