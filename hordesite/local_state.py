"""The folders local state lives in, created by the processes that write there when they start:
manage.py the SQLite file's (the embedded default's database), the Celery worker and beat the
filesystem broker's, beat its schedule file's (hordesite/celery.py). Importing the settings
creates nothing."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings


def make_database_dir() -> None:
    database = settings.DATABASES["default"]
    name = str(database.get("NAME") or "")
    if database["ENGINE"] == "django.db.backends.sqlite3" and name and not name.startswith(("file:", ":memory:")):
        Path(name).parent.mkdir(parents=True, exist_ok=True)


def make_broker_dirs() -> None:
    """kombu's filesystem transport reads and writes its folders but does not create them."""
    if settings.CELERY_BROKER_URL != "filesystem://":
        return
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None) or {}
    for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
        if options.get(key):
            Path(options[key]).mkdir(parents=True, exist_ok=True)
