"""Price at pop (docs/adr/0026-price-at-pop.md): the request's context multiplier, fixed at
creation, and on each generation what its submit prices and settles with (rate, flat amount,
max_length, the owner's trust), written by the pop. All nullable, so adding them rewrites no
table; a job popped before them has nulls and its submit reads the rows instead. Reversible: the
columns are dropped.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("chat", "0006_front_lease")]
    operations = [
        migrations.AddField(
            model_name="generationrequest", name="kudos_context", field=models.FloatField(blank=True, null=True)
        ),
        migrations.AddField(model_name="generation", name="price_rate", field=models.FloatField(blank=True, null=True)),
        migrations.AddField(model_name="generation", name="price_flat", field=models.FloatField(blank=True, null=True)),
        migrations.AddField(
            model_name="generation", name="price_max_length", field=models.IntegerField(blank=True, null=True)
        ),
        migrations.AddField(
            model_name="generation", name="price_owner_trusted", field=models.BooleanField(blank=True, null=True)
        ),
    ]
