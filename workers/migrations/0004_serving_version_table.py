"""The workers' serving version moves from a Redis counter (and, without Redis, the latest
serving_changed_at) to one database row, which the status poll reads in its request's statement
(docs/adr/0044-serving-version-in-the-database.md). The row is written by the first change."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("workers", "0003_serving_changed_at"),
    ]

    operations = [
        migrations.CreateModel(
            name="ServingVersion",
            fields=[
                ("id", models.PositiveSmallIntegerField(primary_key=True, serialize=False)),
                ("version", models.BigIntegerField()),
            ],
            options={"db_table": "horde_serving_version"},
        ),
    ]
