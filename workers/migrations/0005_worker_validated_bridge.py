"""Whether the worker's bridge_agent names a validated backend, stored beside it at check-in so the
pop's speed gate can ask which online workers a request with validated_backends accepts (rule 4 of
chat_requests.md "Eligibility" inside ADR 0041's capable-worker test). Existing rows are filled from
their bridge_agent; the reverse drops the column."""

from django.db import migrations, models


def fill_validated_bridge(apps, schema_editor):
    from contract.text import is_validated_bridge

    Worker = apps.get_model("workers", "Worker")
    validated = [
        pk for pk, agent in Worker.objects.values_list("pk", "bridge_agent").iterator() if is_validated_bridge(agent)
    ]
    Worker.objects.filter(pk__in=validated).update(validated_bridge=True)


class Migration(migrations.Migration):

    dependencies = [
        ("workers", "0004_serving_version_table"),
    ]

    operations = [
        migrations.AddField(
            model_name="worker",
            name="validated_bridge",
            field=models.BooleanField(default=False),
        ),
        migrations.RunPython(fill_validated_bridge, migrations.RunPython.noop),
    ]
