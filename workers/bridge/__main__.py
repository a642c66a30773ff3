"""`python -m workers.bridge --help`."""

from __future__ import annotations

import sys

from workers.bridge.cli import main

if __name__ == "__main__":
    sys.exit(main())
