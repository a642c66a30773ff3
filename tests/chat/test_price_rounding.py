"""The priced submit computes its reward and the hold's share in SQL, chat.pricing and
chat.services.submit in Python (docs/adr/0026-price-at-pop.md): both round the same way, halves
included, so the two paths agree."""

from __future__ import annotations

import random
from decimal import Decimal

import pytest
from django.db import connection

from chat.pricing import kudos_amount

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]


def test_python_and_postgresql_round_kudos_alike():
    rng = random.Random(26)
    values = [0.125, 1.005, 2.675, 0.005, 0.015, 30.0, 0.1 + 0.2, 1e-9, 123456.785]
    values += [rng.uniform(0, 50) for _ in range(300)] + [rng.randint(20, 2000) * rng.uniform(0, 0.2) for _ in range(300)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT round(v::numeric, 2) FROM unnest(%s::float8[]) AS v", [values])
        rounded = [row[0] for row in cursor.fetchall()]
    assert [kudos_amount(v) for v in values] == rounded


def test_the_hold_share_rounds_up_to_the_cent_in_both_paths():
    """The priced submit's SQL and chat.services.submit.hold_share give each result the same share
    of the hold, rounded up, so n results release it whole (docs/adr/0090)."""
    from types import SimpleNamespace

    from chat.services.submit import hold_share
    from chat.sql import _ceiling_cents

    cases = [("0.05", 2), ("0.15", 2), ("10.00", 3), ("0.07", 2), ("12.34", 4), ("1.00", 8), ("4.00", 2), ("7.77", 7)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {_ceiling_cents('q / n')} FROM unnest(%s::numeric[], %s::int[]) AS t(q, n)",
            [[Decimal(q) for q, _ in cases], [n for _, n in cases]],
        )
        shares = [row[0] for row in cursor.fetchall()]
    expected = [hold_share(SimpleNamespace(kudos_quote=Decimal(q), n=n)) for q, n in cases]
    assert shares == expected
    assert expected[2] == Decimal("3.34") and expected[6] == Decimal("2.00")
    assert all(share * n >= Decimal(q) for share, (q, n) in zip(expected, cases, strict=True))
