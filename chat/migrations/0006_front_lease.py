"""The front lease (docs/adr/0020-front-lease.md): horde_requests.front_lease_expires_at, nullable,
so adding it does not rewrite the table, and a partial index over the leased rows for the sweep.

On PostgreSQL the index is built CONCURRENTLY, which cannot run in a transaction, so this migration
is not atomic; a failed build leaves an INVALID index, which IF NOT EXISTS would keep: drop it first.
Reversible: the index is dropped, then the column.
"""

from django.db import migrations, models

INDEX = "request_front_lease"
COLUMNS = "horde_requests (front_lease_expires_at) WHERE front_lease_expires_at IS NOT NULL"


def create_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"CREATE INDEX {concurrently}IF NOT EXISTS {INDEX} ON {COLUMNS}")


def drop_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("chat", "0005_sweep_runs")]
    operations = [
        migrations.AddField(
            model_name="generationrequest",
            name="front_lease_expires_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create_index, drop_index)],
            state_operations=[
                migrations.AddIndex(
                    model_name="generationrequest",
                    index=models.Index(
                        condition=models.Q(front_lease_expires_at__isnull=False),
                        fields=["front_lease_expires_at"],
                        name=INDEX,
                    ),
                )
            ],
        ),
    ]
