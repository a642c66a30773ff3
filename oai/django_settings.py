"""Django settings of the standalone front (`python -m oai`): no database, no sessions, no admin;
DRF with the front's views only. The front's own settings come from oai.settings.load_settings."""

from __future__ import annotations

from contract.env import SettingsEnv

env = SettingsEnv()  # the reader hordesite/settings.py and oai.settings use

SECRET_KEY = env.str("SECRET_KEY", default="") or "oai-front-has-no-sessions"
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = ["rest_framework", "drf_spectacular"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "oai.standalone_urls"
DATABASES: dict = {}
# Django sets the process's TZ from TIME_ZONE (its default is America/Chicago): the log lines' times
# are UTC, as the horde's (hordesite/settings.py).
TIME_ZONE = "UTC"
USE_TZ = True
REST_FRAMEWORK = {
    # The front's views set their own authentication and exception handler (oai.views).
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "AI Horde OpenAI-compatible front",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # A line logged while a /v1/ request is served ends with its x_request_id (oai.request_ids).
    "formatters": {
        "plain": {
            "class": "oai.request_ids.RequestIdFormatter",
            "format": "%(asctime)s [%(process)d] %(levelname)s %(name)s %(message)s",
        }
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}
