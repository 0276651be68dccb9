"""``python -m zerotrain.cli``: the console script without depending on PATH."""

import sys

from zerotrain.cli import main

sys.exit(main())
