"""`make bench` entry point: the text queue benchmark (bench/text_queue.py); arguments pass through."""

from __future__ import annotations

import sys

from text_queue import main

if __name__ == "__main__":
    sys.exit(main())
