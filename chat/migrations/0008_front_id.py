"""The front's process on its lease (docs/adr/0028-dead-front-requests.md): horde_requests.front_id,
nullable, so adding it does not rewrite the table. The sweep reads it over the leased rows, which
the partial index of migration 0006 already selects. Reversible: the column is dropped."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("chat", "0007_price_at_pop")]
    operations = [
        migrations.AddField(
            model_name="generationrequest",
            name="front_id",
            field=models.CharField(blank=True, max_length=320, null=True),
        ),
    ]
