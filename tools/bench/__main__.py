"""``python -m bench`` (with ``tools/`` on the path): run the benchmark."""

import sys

from .cli import main

sys.exit(main())
