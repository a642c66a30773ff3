"""The folders local state lives in (the embedded default's SQLite file, kombu's filesystem broker,
beat's schedule file), created by the processes that use them when they start: manage.py, the
Celery worker and beat (hordesite/celery.py). Importing the settings creates nothing."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings


def local_state_dirs() -> list[Path]:
    """The folders the configured settings write to on this machine."""
    dirs: list[Path] = []
    database = settings.DATABASES["default"]
    name = str(database.get("NAME") or "")
    if database["ENGINE"] == "django.db.backends.sqlite3" and name and not name.startswith(("file:", ":memory:")):
        dirs.append(Path(name).parent)
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None) or {}
    if settings.CELERY_BROKER_URL == "filesystem://":
        for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
            if options.get(key):
                dirs.append(Path(options[key]))
    dirs.append(Path(settings.CELERY_BEAT_SCHEDULE_FILENAME).parent)
    return dirs


def make_local_state_dirs() -> None:
    for folder in local_state_dirs():
        folder.mkdir(parents=True, exist_ok=True)
