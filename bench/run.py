"""`make bench` entry point: the text queue benchmark (bench/text_queue.py); arguments pass through."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from text_queue import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
