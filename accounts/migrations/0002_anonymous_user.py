"""The anonymous user (key 0000000000, as upstream) that every keyless request runs as."""

import hashlib

from django.db import migrations

ANONYMOUS_KEY = "0000000000"


def create_anonymous(apps, schema_editor):
    HordeUser = apps.get_model("accounts", "HordeUser")
    HordeUser.objects.get_or_create(
        api_key_hash=hashlib.sha256(ANONYMOUS_KEY.encode()).hexdigest(),
        defaults={"username": "Anonymous", "is_anonymous": True, "concurrency": 30},
    )


def delete_anonymous(apps, schema_editor):
    apps.get_model("accounts", "HordeUser").objects.filter(is_anonymous=True).delete()


class Migration(migrations.Migration):
    dependencies = [("accounts", "0001_initial")]
    operations = [migrations.RunPython(create_anonymous, delete_anonymous)]
