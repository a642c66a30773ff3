"""The owner's note on a worker (`info`, shown in its details) and the message its pops get while
in maintenance (`maintenance_msg`), both set with PUT /api/v2/workers/{id} as upstream's; null
columns, so existing rows need no fill and the reverse drops them."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('workers', '0005_worker_validated_bridge'),
    ]

    operations = [
        migrations.AddField(
            model_name='worker',
            name='info',
            field=models.CharField(blank=True, max_length=1000, null=True),
        ),
        migrations.AddField(
            model_name='worker',
            name='maintenance_msg',
            field=models.CharField(blank=True, max_length=300, null=True),
        ),
    ]
