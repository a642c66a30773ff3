"""Upstream's hourly window of aborted jobs (log_aborted_job): the count since the window started
and its start, from which too many drops put a worker into maintenance (docs/adr/0083). A zero
and a null: existing rows start a fresh window at their next drop, and the reverse drops both."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('workers', '0006_worker_info_and_maintenance_message'),
    ]

    operations = [
        migrations.AddField(
            model_name='worker',
            name='aborted_in_window',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='worker',
            name='aborted_window_started_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
