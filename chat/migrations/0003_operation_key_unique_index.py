"""The unique partial index on (user_id, operation_key): one request per operation key and user.

On PostgreSQL it is built CONCURRENTLY, which cannot run in a transaction, so this migration is
not atomic; a failed build leaves an INVALID index, which IF NOT EXISTS would keep: drop it first.
"""

from django.db import migrations, models

INDEX = "ix_requests_user_operation_key"
COLUMNS = "horde_requests (user_id, operation_key) WHERE operation_key IS NOT NULL"


def create_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"CREATE UNIQUE INDEX {concurrently}IF NOT EXISTS {INDEX} ON {COLUMNS}")


def drop_index(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("chat", "0002_chat_request_columns")]
    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create_index, drop_index)],
            state_operations=[
                migrations.AddConstraint(
                    model_name="generationrequest",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(operation_key__isnull=False),
                        fields=("user", "operation_key"),
                        name=INDEX,
                    ),
                )
            ],
        )
    ]
