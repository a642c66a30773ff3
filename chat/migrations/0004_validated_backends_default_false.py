"""Text requests default to validated_backends false, as upstream's request parser does (ADR 0012).
The default is Django's only (every insert names the column), so no SQL runs."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("chat", "0003_operation_key_unique_index"),
    ]

    operations = [
        migrations.AlterField(
            model_name="generationrequest",
            name="validated_backends",
            field=models.BooleanField(default=False),
        ),
    ]
