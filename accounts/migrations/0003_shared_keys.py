"""Shared keys: keys a user lends, whose requests are the owner's within the key's limits."""

import django.db.models.deletion
import uuid
from decimal import Decimal
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0002_anonymous_user'),
    ]

    operations = [
        migrations.CreateModel(
            name='SharedKey',
            fields=[
                ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ('name', models.CharField(blank=True, max_length=255, null=True)),
                ('kudos', models.DecimalField(decimal_places=2, default=Decimal('5000'), max_digits=18)),
                ('utilized', models.DecimalField(decimal_places=2, default=Decimal('0'), max_digits=18)),
                ('expiry', models.DateTimeField(blank=True, null=True)),
                ('max_image_pixels', models.IntegerField(default=-1)),
                ('max_image_steps', models.IntegerField(default=-1)),
                ('max_text_tokens', models.IntegerField(default=-1)),
                ('created', models.DateTimeField(auto_now_add=True)),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='shared_keys', to='accounts.hordeuser')),
            ],
            options={
                'db_table': 'horde_shared_keys',
            },
        ),
    ]
