"""A queue list per model (docs/adr/0050-a-queue-list-per-model.md): horde_queue_entries holds a
waiting request once under each of its models (under "" for a text request that named none), in
queue order, so the pop walks only the lists of the models its worker serves (and, first, the same
lists of its owner's and priority users' requests).

On PostgreSQL the database keeps the rows itself: triggers on horde_requests add a request's rows
when it starts waiting (created with a job waiting, or a job handed back) and remove them when it
stops (its last job handed out, faulted, cancelled, deleted). The waiting requests already queued
are listed here. Elsewhere (SQLite, the embedded default) the table stays empty: the pop there
walks the queue in the ORM. Reversible: the triggers, their function and the table are dropped.
"""

from django.db import migrations, models

# A request waits while it has a job to hand out and is neither faulted nor cancelled: the
# condition of the queue index request_queue_order, and of the pop's walk.
WAITING = "({row}.jobs_waiting > 0 AND NOT {row}.faulted AND NOT {row}.cancelled)"

# The list columns of a request: a change to any of them while it waits rewrites its rows.
LISTED = "({row}.user_id, {row}.is_chat, {row}.queue_score, {row}.created, {row}.requested_models, {row}.any_model)"

CREATE = f"""
CREATE FUNCTION horde_request_listed_models(requested_models jsonb, any_model boolean) RETURNS SETOF text
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_array_elements_text(
        CASE WHEN jsonb_typeof(requested_models) = 'array' THEN requested_models ELSE '[]' END)
    UNION SELECT '' WHERE any_model
$$;

CREATE FUNCTION horde_queue_entries_follow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM horde_queue_entries WHERE request_id = OLD.id;
    END IF;
    IF TG_OP <> 'DELETE' AND {WAITING.format(row="NEW")} THEN
        INSERT INTO horde_queue_entries (request_id, is_chat, model, user_id, queue_score, created)
        SELECT NEW.id, NEW.is_chat, listed.model, NEW.user_id, NEW.queue_score, NEW.created
        FROM horde_request_listed_models(NEW.requested_models, NEW.any_model) AS listed(model);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER horde_queue_entries_on_insert AFTER INSERT ON horde_requests
    FOR EACH ROW WHEN {WAITING.format(row="NEW")} EXECUTE FUNCTION horde_queue_entries_follow();

CREATE TRIGGER horde_queue_entries_on_update
    AFTER UPDATE OF jobs_waiting, faulted, cancelled, user_id, is_chat, queue_score, created, requested_models, any_model
    ON horde_requests FOR EACH ROW WHEN (
        {WAITING.format(row="OLD")} IS DISTINCT FROM {WAITING.format(row="NEW")}
        OR ({WAITING.format(row="NEW")} AND {LISTED.format(row="OLD")} IS DISTINCT FROM {LISTED.format(row="NEW")})
    ) EXECUTE FUNCTION horde_queue_entries_follow();

CREATE TRIGGER horde_queue_entries_on_delete AFTER DELETE ON horde_requests
    FOR EACH ROW WHEN {WAITING.format(row="OLD")} EXECUTE FUNCTION horde_queue_entries_follow();

INSERT INTO horde_queue_entries (request_id, is_chat, model, user_id, queue_score, created)
SELECT r.id, r.is_chat, listed.model, r.user_id, r.queue_score, r.created
FROM horde_requests AS r
CROSS JOIN LATERAL horde_request_listed_models(r.requested_models, r.any_model) AS listed(model)
WHERE {WAITING.format(row="r")};
"""

DROP = """
DROP TRIGGER IF EXISTS horde_queue_entries_on_delete ON horde_requests;
DROP TRIGGER IF EXISTS horde_queue_entries_on_update ON horde_requests;
DROP TRIGGER IF EXISTS horde_queue_entries_on_insert ON horde_requests;
DROP FUNCTION IF EXISTS horde_queue_entries_follow();
DROP FUNCTION IF EXISTS horde_request_listed_models(jsonb, boolean);
"""


def _on_postgresql(sql: str):
    def run(apps, schema_editor) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("chat", "0008_front_id")]
    operations = [
        migrations.CreateModel(
            name="QueueEntry",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "request_id", "is_chat", "model", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("is_chat", models.BooleanField()),
                ("model", models.TextField()),
                ("user_id", models.BigIntegerField()),
                ("queue_score", models.BigIntegerField()),
                ("created", models.DateTimeField()),
                (
                    "request",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=models.DO_NOTHING,
                        related_name="+",
                        to="chat.generationrequest",
                    ),
                ),
            ],
            options={
                "db_table": "horde_queue_entries",
                "indexes": [
                    models.Index(fields=["is_chat", "model", "-queue_score", "created"], name="queue_entry_order"),
                    models.Index(
                        fields=["user_id", "is_chat", "model", "-queue_score", "created"], name="queue_entry_user_order"
                    ),
                ],
            },
        ),
        migrations.RunPython(_on_postgresql(CREATE), _on_postgresql(DROP), elidable=False),
    ]
