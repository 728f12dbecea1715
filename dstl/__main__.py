"""``python -m dstl ...`` runs the operator CLI (see :mod:`dstl.cli`)."""

import sys

from dstl.cli import main

sys.exit(main())
