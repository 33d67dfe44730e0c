"""``python -m gradalg.cli``: the ``gradalg`` command."""
import sys

from . import main

sys.exit(main())
