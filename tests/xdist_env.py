"""pytest plugin that scripts/test.sh loads with `-p tests.xdist_env`, before Django reads its settings.

Under pytest-xdist every worker process (gw0, gw1, ...) gets its own Redis database, counting down
from the one in REDIS_URL (gw0: /15, gw1: /14, ...), so that the per-test flush in tests/conftest.py
never clears another worker's keys. Database CHAT_SIGNAL_DB (7) is skipped: every process keeps
the completion signal and the progress streams there, whatever REDIS_URL names. PostgreSQL needs nothing here: pytest-django already gives each
worker its own test database (test_<name>_gw0, ...). Without xdist, or without REDIS_URL, this does
nothing.
"""

from __future__ import annotations

import os
import re

from contract.chat_signal import CHAT_SIGNAL_DB

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_url = os.environ.get("REDIS_URL", "")
_match = re.fullmatch(r"(?P<base>rediss?://[^/?]*)/(?P<db>\d+)(?P<query>\?.*)?", _url)
if _worker.startswith("gw") and _match:
    _base = int(_match["db"])
    _db = _base - int(_worker[2:])
    if _db <= CHAT_SIGNAL_DB < _base:
        _db -= 1  # counted past the shared signal database
    if _db < 1:
        raise RuntimeError(f"REDIS_URL {_url!r}: too few Redis databases below it for worker {_worker}")
    os.environ["REDIS_URL"] = f"{_match['base']}/{_db}{_match['query'] or ''}"
