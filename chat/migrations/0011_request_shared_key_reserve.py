"""What a request made with a limited shared key reserves of its kudos per unsettled job
(docs/adr/0089). A constant default, kept in the database (db_default): PostgreSQL adds the column
without rewriting the table, and a process still running the previous code during a deploy can
still insert requests."""

from decimal import Decimal

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('chat', '0010_request_shared_key'),
    ]

    operations = [
        migrations.AddField(
            model_name='generationrequest',
            name='shared_key_reserve',
            field=models.DecimalField(decimal_places=2, default=Decimal('0'), db_default=Decimal('0'), max_digits=18),
        ),
    ]
