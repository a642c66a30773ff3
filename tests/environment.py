"""pytest plugin loaded by every run (`-p tests.environment` in pyproject.toml's addopts), before
Django reads its settings.

The suite runs with DATABASE_URL set and DEBUG off, where the settings fail closed: no SECRET_KEY
or ALLOWED_HOSTS, no start (docs/adr/0017-a-clone-that-stands-alone.md). The suite sets both when
the caller has not; the processes tests start inherit them.
"""

from __future__ import annotations

import os
import secrets

os.environ.setdefault("SECRET_KEY", f"tests-only-{secrets.token_urlsafe(40)}")
os.environ.setdefault("ALLOWED_HOSTS", "*")
