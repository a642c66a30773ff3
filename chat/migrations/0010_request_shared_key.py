"""The shared key a request was made with (a plain id, nullable: added without rewriting the table)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('chat', '0009_queue_entries'),
    ]

    operations = [
        migrations.AddField(
            model_name='generationrequest',
            name='shared_key_id',
            field=models.UUIDField(blank=True, null=True),
        ),
    ]
