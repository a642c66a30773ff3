"""The hot path's prepared statements (PostgreSQL, chat/sql.py)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]
