"""Kudos transfers between users (POST /api/v2/kudos/transfer): their log, with the claim of each
client Idempotency-Key (unique per sender while set) and an index for the check of a transfer sent
straight back; the ledger gains the kind `transfer`. The reverse drops the table and the kind."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0003_shared_keys'),
    ]

    operations = [
        migrations.AlterField(
            model_name='kudostransaction',
            name='kind',
            field=models.CharField(choices=[('horde_tax', 'Horde Tax'), ('generation_charge', 'Generation Charge'), ('generation_reward', 'Generation Reward'), ('grant', 'Grant'), ('transfer', 'Transfer')], max_length=32),
        ),
        migrations.CreateModel(
            name='KudosTransfer',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('target', models.CharField(max_length=255)),
                ('shared_key_id', models.UUIDField(blank=True, null=True)),
                ('amount', models.DecimalField(decimal_places=2, max_digits=18)),
                ('idempotency_key', models.CharField(blank=True, max_length=255, null=True)),
                ('created', models.DateTimeField(auto_now_add=True)),
                ('dest', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='kudos_received', to='accounts.hordeuser')),
                ('source', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='kudos_sent', to='accounts.hordeuser')),
            ],
            options={
                'db_table': 'horde_kudos_transfers',
                'indexes': [models.Index(fields=['source', 'dest', 'created'], name='kudos_transfer_pair_created')],
                'constraints': [models.UniqueConstraint(condition=models.Q(('idempotency_key__isnull', False)), fields=('source', 'idempotency_key'), name='kudos_transfer_idempotency_key')],
            },
        ),
    ]
