"""``python -m qeff_evs.cli``: the ``qeff-evs`` command."""

import sys

from qeff_evs.cli import main

sys.exit(main())
