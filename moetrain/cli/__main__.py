"""``python -m moetrain.cli ...`` (what torchrun runs on every rank): the ``moetrain`` command."""

import sys

from moetrain.cli import main

sys.exit(main())
