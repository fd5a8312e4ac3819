"""``python -m lmspd.cli``: the ``lmspd`` command."""

import sys

from lmspd.cli.main import main

sys.exit(main())
