"""Settings: read once from the environment (django-environ); every variable is in docs/configuration.md.

With no environment at all the horde runs on the embedded default: SQLite under ./var, no Redis
(rate limits in process memory, no completion signal), a filesystem Celery broker and local storage.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

from contract.env import SettingsEnv
from contract.text import (
    ABORTED_JOBS_PER_HOUR_LIMIT,
    STALE_GENERATION_SWEEP_SECONDS,
    TEXT_JOB_LEASE_SECONDS,
    TEXT_REQUEST_TTL_SECONDS,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

# A number outside its bounds (env.int's `minimum`, env.float's `minimum` or `above`) stops the
# process at its start with the variable's name, as a number that cannot be read does (contract/env.py).
env = SettingsEnv()
env_file = BASE_DIR / ".env"
if env_file.exists():
    environ.Env.read_env(str(env_file))

DEBUG = env.bool("DEBUG", default=False)
# Fail closed: only the embedded default (no DATABASE_URL) and DEBUG fall back to a development key
# and any host; a deployment (DATABASE_URL set, DEBUG off) must name both (docs/adr/0017).
DEPLOYED = bool(env.str("DATABASE_URL", default="")) and not DEBUG
DEV_SECRET_KEY = "dev-only-insecure-secret-key-change-me-in-production"
if DEPLOYED:
    _missing = [name for name in ("SECRET_KEY", "ALLOWED_HOSTS") if not env.str(name, default="")]
    if _missing:
        raise ImproperlyConfigured(
            f"Set {' and '.join(_missing)}: required when DATABASE_URL is set and DEBUG is off (docs/configuration.md)"
        )
    SECRET_KEY = env.str("SECRET_KEY")
    if SECRET_KEY == DEV_SECRET_KEY:
        raise ImproperlyConfigured("SECRET_KEY is the public development key: set a long random value")
    ALLOWED_HOSTS = env.list("ALLOWED_HOSTS")
    if not ALLOWED_HOSTS:  # blank entries only: every request would be 400 DisallowedHost
        raise ImproperlyConfigured(
            "ALLOWED_HOSTS names no host: list the names the horde is reached at, separated by commas"
        )
    # The admin is the one cookie user (the API authenticates by header).
    SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=True)
    CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=True)
else:
    SECRET_KEY = env.str("SECRET_KEY", default=DEV_SECRET_KEY)
    ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["*"])
# The admin's forms behind a proxy that ends TLS: the browser's Origin is https://<site>, which the
# process, seeing plain HTTP, does not take for its own (docs/adr/0092). Scheme and host, e.g.
# https://horde.example.org; empty: only the origin the process itself is reached at.
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "accounts",
    "workers",
    "chat",
]

# Security, common, session, authentication and messages run for /admin/ only (hordesite/middleware.py).
MIDDLEWARE = [
    "hordesite.middleware.CorsMiddleware",
    "hordesite.middleware.AdminOnlyMiddleware",
    "hordesite.middleware.JsonBodyMiddleware",
]
# The admin's checks look for its middleware in MIDDLEWARE; AdminOnlyMiddleware runs it for /admin/.
# So do `check --deploy`'s security, clickjacking and CSRF checks (the admin's views protect their
# own forms with csrf_protect; the API takes keys in headers, no cookies).
SILENCED_SYSTEM_CHECKS = ["admin.E408", "admin.E409", "admin.E410", "security.W001", "security.W002", "security.W003"]

ROOT_URLCONF = "hordesite.urls"
ASGI_APPLICATION = "hordesite.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# --- Database -------------------------------------------------------------------------------
# Empty counts as unset, as DEPLOYED reads it (a blank line in .env is not a URL).
_database_url = env.str("DATABASE_URL", default="") or f"sqlite:///{VAR_DIR / 'horde.sqlite3'}"
DATABASES = {"default": environ.Env.db_url_config(_database_url)}
# The horde runs on PostgreSQL or SQLite; a URL django-environ cannot place (a typo, another
# database) stops here rather than with a KeyError or a missing driver. The URL is not echoed: it
# may hold a password.
if DATABASES["default"].get("ENGINE") not in ("django.db.backends.sqlite3", "django.db.backends.postgresql"):
    raise ImproperlyConfigured(
        "DATABASE_URL is not a PostgreSQL or SQLite URL: postgres://USER:PASSWORD@HOST:5432/NAME or sqlite:///ABSOLUTE/PATH"
    )
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL and a busy timeout let the web process and the Celery worker share the file.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
    }
elif DATABASES["default"]["ENGINE"].startswith("django.db.backends.postgresql"):
    # Under ASGI every request runs its view on a fresh thread, and Django connections are per
    # thread: a pool (psycopg_pool) hands each a warm connection instead of a new one per request.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    _pool_min_size = env.int("DATABASE_POOL_MIN_SIZE", default=2, minimum=0)
    _pool_max_size = env.int("DATABASE_POOL_MAX_SIZE", default=20, minimum=1)
    if _pool_max_size < _pool_min_size:  # psycopg_pool would refuse it at the first request's connection
        raise ImproperlyConfigured(
            f"DATABASE_POOL_MAX_SIZE must be at least DATABASE_POOL_MIN_SIZE ({_pool_min_size}), not {_pool_max_size}"
        )
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": _pool_min_size,
        "max_size": _pool_max_size,
        "timeout": env.int("DATABASE_POOL_TIMEOUT", default=10, minimum=1),
    }
    # Server settings for the horde's sessions, sent at connect (`-c name=value`).
    session_settings = []
    # The hot path's statements (chat/sql.py: the pop, the submit, the status read and their
    # companions) are prepared on each connection; no other statement is (a threshold never
    # reached). Off (None) behind a transaction-mode pooler.
    if env.bool("DATABASE_PREPARED_STATEMENTS", default=True):
        DATABASES["default"]["OPTIONS"].setdefault("prepare_threshold", 2**31 - 1)
        # Those statements keep one generic plan: planning a pop cost more than running it, and
        # its plan (walk the queue index) does not depend on the values. Only prepared statements
        # read this setting, and only chat/sql.py's statements are prepared.
        session_settings.append("plan_cache_mode=force_generic_plan")
    # Every query the horde runs is short, but the planner's estimate of one with correlated
    # subqueries (a chat worker's eligibility) passes jit_above_cost, and compiling it took 0.4-0.7 s
    # for a query that runs in 0.2 ms (docs/adr/0047). JIT stays off unless asked for.
    if not env.bool("DATABASE_JIT", default=False):
        session_settings.append("jit=off")
    if session_settings:
        options = DATABASES["default"]["OPTIONS"].get("options", "")
        DATABASES["default"]["OPTIONS"]["options"] = " ".join([options, *(f"-c {setting}" for setting in session_settings)]).strip()
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
IS_POSTGRES = DATABASES["default"]["ENGINE"].startswith("django.db.backends.postgresql")

# --- Redis ----------------------------------------------------------------------------------
REDIS_URL: str | None = env.str("REDIS_URL", default="") or None

if REDIS_URL:
    CACHES: dict[str, dict[str, Any]] = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": REDIS_URL,
            "OPTIONS": {
                "SOCKET_CONNECT_TIMEOUT": 1,
                "SOCKET_TIMEOUT": 1,
                # Redis holds only derivable state: a Redis outage must not fail a request.
                "IGNORE_EXCEPTIONS": True,
            },
        }
    }
    CHANNEL_LAYERS: dict[str, dict[str, Any]] = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# --- Celery ---------------------------------------------------------------------------------
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default="") or REDIS_URL or "filesystem://"
if CELERY_BROKER_URL == "filesystem://":
    _broker_dir = VAR_DIR / "celery-broker"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "processed_folder": str(VAR_DIR / "celery-processed"),
        "control_folder": str(VAR_DIR / "celery-control"),
        "store_processed": False,
    }
    # kombu's filesystem transport expects its folders to exist: the worker and beat create them at
    # start (hordesite/local_state.py), as manage.py does for the SQLite file's folder.
    # kombu's transport, writing each message whole before the worker can see it.
    CELERY_BROKER_TRANSPORT = "hordesite.filesystem_broker:Transport"
CELERY_TASK_IGNORE_RESULT = True
# A prefork pool child whose resident memory (KiB, its peak) passed this after a task is replaced by
# a fresh child; so is one that ran this many tasks. Celery's worker_max_memory_per_child and
# worker_max_tasks_per_child, read by the worker from here (0: never). A safety net: a child that
# grows for any reason, ours or a library's, is replaced between two sweeps (docs/adr/0088).
_max_memory_per_child = env.int("CELERY_WORKER_MAX_MEMORY_PER_CHILD", default=262_144)
_max_tasks_per_child = env.int("CELERY_WORKER_MAX_TASKS_PER_CHILD", default=0)
if _max_memory_per_child < 0 or _max_tasks_per_child < 0:  # fail closed: a typo must not turn a bound off
    raise ImproperlyConfigured("CELERY_WORKER_MAX_MEMORY_PER_CHILD and CELERY_WORKER_MAX_TASKS_PER_CHILD: 0 (never) or more")
CELERY_WORKER_MAX_MEMORY_PER_CHILD = _max_memory_per_child or None
CELERY_WORKER_MAX_TASKS_PER_CHILD = _max_tasks_per_child or None
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
# Celery's Django fixup closes the database connections before and after each task, and under the
# prefork pool Django's whole connection pool with them (Celery 5.7, celery/celery#10554): a new
# pool and new sessions for every sweep. It does so only once in this many tasks (its setting for
# it): never, in effect. Each task gives its connection back to the pool instead, as a request does,
# and one that finds its connection dead runs once more on a fresh one (hordesite/celery.py). A
# fresh pool child still drops what it inherited from its parent (the fixup's worker_process_init).
CELERY_DB_REUSE_MAX = 2**62
# Beat's own record of its last runs; its folder is created when beat starts (hordesite/celery.py).
CELERY_BEAT_SCHEDULE_FILENAME = env.str("CELERY_BEAT_SCHEDULE_FILENAME", default=str(VAR_DIR / "celerybeat-schedule"))

# A popped job's lease (the pop's `ttl`), a request's time to live, and how often beat runs the
# sweeps that fault lapsed leases and delete expired requests. /healthz answers 503 when a sweep
# has not finished for HORDE_SWEEP_LATE_SECONDS (default: three intervals).
HORDE_TEXT_JOB_LEASE_SECONDS = env.int("HORDE_TEXT_JOB_LEASE_SECONDS", default=TEXT_JOB_LEASE_SECONDS, minimum=1)
HORDE_TEXT_REQUEST_TTL_SECONDS = env.int("HORDE_TEXT_REQUEST_TTL_SECONDS", default=TEXT_REQUEST_TTL_SECONDS, minimum=1)
HORDE_SWEEP_INTERVAL_SECONDS = env.float("HORDE_SWEEP_INTERVAL_SECONDS", default=STALE_GENERATION_SWEEP_SECONDS, above=0)
HORDE_SWEEP_LATE_SECONDS = env.float("HORDE_SWEEP_LATE_SECONDS", default=3 * HORDE_SWEEP_INTERVAL_SECONDS, above=0)
# More dropped jobs (faulted or lapsed) than this within an hour put a worker into maintenance,
# where it serves only its owner's requests (upstream's rule; 0: never; docs/adr/0083).
HORDE_WORKER_DROPPED_JOBS_PER_HOUR = env.int("HORDE_WORKER_DROPPED_JOBS_PER_HOUR", default=ABORTED_JOBS_PER_HOUR_LIMIT)
if HORDE_WORKER_DROPPED_JOBS_PER_HOUR < 0:  # fail closed: a typo must not turn the switch off
    raise ImproperlyConfigured("HORDE_WORKER_DROPPED_JOBS_PER_HOUR must be 0 (off) or more")
# Stored chat objects whose request row is gone are deleted this often (chat.tasks.delete_orphaned_chat_objects).
HORDE_CHAT_ORPHAN_SWEEP_SECONDS = env.float("HORDE_CHAT_ORPHAN_SWEEP_SECONDS", default=3600.0, above=0)
_FRONT_LEASE_SWEEP_SECONDS = min(10.0, HORDE_SWEEP_INTERVAL_SECONDS)


def _every(task: str, seconds: float) -> dict:
    """A sweep sent every `seconds`, each message expiring after its own interval: the next one
    supersedes it. Beat keeps sending while no worker runs (a restart, a crash), and a worker that
    comes back would otherwise run the whole backlog (expired ones are discarded as revoked)."""
    return {"task": task, "schedule": seconds, "options": {"expires": seconds}}


CELERY_BEAT_SCHEDULE = {
    "abort-stale-generations": _every("chat.tasks.abort_stale_generations", HORDE_SWEEP_INTERVAL_SECONDS),
    "expire-requests": _every("chat.tasks.expire_requests", HORDE_SWEEP_INTERVAL_SECONDS),
    # In maintenance mode, cancels the requests that raced the switch (chat_requests.md, Completion signal).
    "sweep-maintenance": _every("chat.tasks.sweep_maintenance", HORDE_SWEEP_INTERVAL_SECONDS),
    # A third of the front lease (contract.front_lease, 30 s): a dead front's requests are cancelled
    # within about 40 s of its last renewal (docs/adr/0020-front-lease.md).
    "cancel-lapsed-front-leases": _every("chat.tasks.cancel_lapsed_front_leases", _FRONT_LEASE_SWEEP_SECONDS),
    "delete-orphaned-chat-objects": _every(
        "chat.tasks.delete_orphaned_chat_objects", HORDE_CHAT_ORPHAN_SWEEP_SECONDS
    ),
}

# --- Storage --------------------------------------------------------------------------------
STORAGE_BACKEND = env.str("STORAGE_BACKEND", default="local")
MEDIA_ROOT = env.str("MEDIA_ROOT", default=str(VAR_DIR / "media"))
# Fail closed: a misspelt backend must not keep a deployment's chat objects on the local disk.
if STORAGE_BACKEND not in ("local", "s3"):
    raise ImproperlyConfigured(f"STORAGE_BACKEND must be local or s3, not {STORAGE_BACKEND!r}")
if STORAGE_BACKEND == "s3" and not env.str("AWS_STORAGE_BUCKET_NAME", default=""):
    raise ImproperlyConfigured("STORAGE_BACKEND=s3 needs AWS_STORAGE_BUCKET_NAME")
if STORAGE_BACKEND == "s3":
    _default_storage: dict[str, Any] = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": env.str("AWS_STORAGE_BUCKET_NAME", default=""),
            "endpoint_url": env.str("AWS_S3_ENDPOINT_URL", default="") or None,
            "access_key": env.str("AWS_ACCESS_KEY_ID", default=""),
            "secret_key": env.str("AWS_SECRET_ACCESS_KEY", default=""),
            # Presigned URLs in SigV4, which R2 (region "auto") and current S3 require.
            "signature_version": "s3v4",
            "region_name": env.str("AWS_S3_REGION_NAME", default="auto"),
        },
    }
    # A chat request's images (chat/object_store.py): the source image bucket, private, presigned.
    _chat_image_storage: dict[str, Any] = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            **_default_storage["OPTIONS"],
            "bucket_name": env.str("R2_SOURCE_IMAGE_BUCKET", default="") or _default_storage["OPTIONS"]["bucket_name"],
            "querystring_auth": True,
            "file_overwrite": False,
        },
    }
    # An offloaded request's messages object: its own bucket, or beside the images.
    _chat_messages_storage: dict[str, Any] = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            **_chat_image_storage["OPTIONS"],
            "bucket_name": env.str("R2_CHAT_MESSAGES_BUCKET", default="")
            or _chat_image_storage["OPTIONS"]["bucket_name"],
        },
    }
else:
    _default_storage = {"BACKEND": "django.core.files.storage.FileSystemStorage"}
    _chat_image_storage = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(Path(MEDIA_ROOT) / "chat-images")},
    }
    _chat_messages_storage = _chat_image_storage
STORAGES = {
    "default": _default_storage,
    "chat_images": _chat_image_storage,
    "chat_messages": _chat_messages_storage,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
# The horde's own address, for the image URLs of the local store; empty: the pop request's host.
HORDE_PUBLIC_URL = env.str("HORDE_PUBLIC_URL", default="")
# Networks an image URL may point into although they are private (CIDRs, comma separated): an
# operator's own image host. Empty: every private, loopback and link-local address is refused.
HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS = env.list("HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS", default=[])
for _network in HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS:  # fail closed: a typo must not 500 every image fetch
    try:
        ipaddress.ip_network(_network, strict=False)
    except ValueError as error:
        raise ImproperlyConfigured(f"HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS: {error}") from None
# Messages offload (chat_requests.md): a request whose messages, as a base64 worker receives them,
# pass HORDE_CHAT_MESSAGES_OFFLOAD_BYTES is also stored as one JSON object, which a worker that
# declares messages_url fetches instead of receiving the messages in its pop.
HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED = env.bool("HORDE_CHAT_MESSAGES_OFFLOAD_ENABLED", default=False)
HORDE_CHAT_MESSAGES_OFFLOAD_BYTES = env.int("HORDE_CHAT_MESSAGES_OFFLOAD_BYTES", default=262144, minimum=0)
HORDE_CHAT_MESSAGES_OFFLOAD_GZIP = env.bool("HORDE_CHAT_MESSAGES_OFFLOAD_GZIP", default=False)
STATIC_URL = "static/"
STATIC_ROOT = str(VAR_DIR / "static")

# --- DRF ------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["accounts.api.authentication.ApiKeyAuthentication"],
    # Views decide who may act (a request without a key is the anonymous user's); AllowAny, not an
    # empty list, so that the schema documents the key as optional (ADR 0114).
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "UNAUTHENTICATED_USER": None,
    # DRF's, escaping a lone surrogate an answer echoes (hordesite/renderers.py).
    "DEFAULT_RENDERER_CLASSES": ["hordesite.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "hordesite.negotiation.CommonAcceptNegotiation",
    "EXCEPTION_HANDLER": "hordesite.errors.horde_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "AI Horde (text and chat)",
    "VERSION": "2.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Two choice sets of fields named "type" (a tool's, a response format's): name the tool's.
    "ENUM_NAME_OVERRIDES": {"FunctionTypeEnum": ["function"]},
    # The ids in paths are UUIDs in either case (hordesite/converters.py).
    "PATH_CONVERTER_OVERRIDES": {"anycase_uuid": {"type": "string", "format": "uuid"}},
    # drf-spectacular's enum hook, then the refusals every native route answers (ADR 0085).
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "accounts.api.openapi_errors.document_native_refusals",
    ],
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

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
    # A 4xx warning names the path; a shared key's id in it is a credential (hordesite/log_redaction.py).
    "filters": {"secret_paths": {"()": "hordesite.log_redaction.RedactSecretPaths"}},
    "loggers": {"django.request": {"filters": ["secret_paths"]}},
}

# --- Horde behaviour (HORDE_*) ----------------------------------------------------------------
# Text model reference: a path or an http(s) URL; the default is the small reference shipped here.
HORDE_TEXT_MODEL_REFERENCE = env.str(
    "HORDE_TEXT_MODEL_REFERENCE", default=str(BASE_DIR / "hordesite" / "data" / "text_model_reference.json")
)
HORDE_MAINTENANCE = env.bool("HORDE_MAINTENANCE", default=False)
HORDE_TEXT_ASYNC_RATE_LIMITS = env.list("HORDE_TEXT_ASYNC_RATE_LIMITS", default=["2/second", "90/minute"])
# Creating shared keys (PUT /api/v2/sharedkeys), per client address; upstream's 5 a minute.
HORDE_SHARED_KEY_CREATE_RATE_LIMITS = env.list("HORDE_SHARED_KEY_CREATE_RATE_LIMITS", default=["5/minute"])
HORDE_KUDOS_TRANSFER_RATE_LIMITS = env.list("HORDE_KUDOS_TRANSFER_RATE_LIMITS", default=["1/second"])
HORDE_DEFAULT_CONCURRENCY = env.int("HORDE_DEFAULT_CONCURRENCY", default=30, minimum=0)
HORDE_TEXT_FREE_OUTPUT_FLOOR = env.int("HORDE_TEXT_FREE_OUTPUT_FLOOR", default=512, minimum=0)
# The free output allowance (chat_requests.md): the ceiling while the queue ahead of a request on
# its eligible workers clears within WAIT_FULL seconds, the floor from WAIT_FLOOR, linear between.
HORDE_TEXT_FREE_OUTPUT_CEILING = env.int("HORDE_TEXT_FREE_OUTPUT_CEILING", default=4096, minimum=0)
HORDE_TEXT_FREE_OUTPUT_WAIT_FULL_SECONDS = env.float("HORDE_TEXT_FREE_OUTPUT_WAIT_FULL_SECONDS", default=60, minimum=0)
HORDE_TEXT_FREE_OUTPUT_WAIT_FLOOR_SECONDS = env.float("HORDE_TEXT_FREE_OUTPUT_WAIT_FLOOR_SECONDS", default=300, minimum=0)
HORDE_UPFRONT_KUDOS_ON_WORKERLIST = env.bool("HORDE_UPFRONT_KUDOS_ON_WORKERLIST", default=False)
HORDE_ALLOW_ANONYMOUS = env.bool("HORDE_ALLOW_ANONYMOUS", default=True)
# Seconds a process reuses the user row it read for an API key (0: read it on every request).
HORDE_API_KEY_CACHE_SECONDS = env.float("HORDE_API_KEY_CACHE_SECONDS", default=5.0, minimum=0)
# Seconds a process reuses the worker row its pop read (0: read it on every pop).
HORDE_WORKER_CACHE_SECONDS = env.float("HORDE_WORKER_CACHE_SECONDS", default=5.0, minimum=0)
# A worker's empty pop is answered from memory until the queue grows (chat/services/pop_cache.py).
HORDE_EMPTY_POP_CACHE_SECONDS = env.float("HORDE_EMPTY_POP_CACHE_SECONDS", default=10.0, minimum=0)
# Threads of the web process serving the native API through Django's WSGI handler (hordesite/wsgi_pool.py).
HORDE_WEB_THREADS = env.int("HORDE_WEB_THREADS", default=4, minimum=1)
# Chat requests of a process that load their images at once (fetch URL images, check and re-encode
# every image: each holds a thread, a fetch up to its bound of 15 s); another is answered 503
# ChatImagesBusy, so image work cannot take every thread (docs/adr/0092). Default: half the
# threads, at least one.
HORDE_CHAT_IMAGE_CONCURRENCY = env.int("HORDE_CHAT_IMAGE_CONCURRENCY", default=max(1, HORDE_WEB_THREADS // 2))
if HORDE_CHAT_IMAGE_CONCURRENCY < 1:
    raise ImproperlyConfigured("HORDE_CHAT_IMAGE_CONCURRENCY must be at least 1")
# Web processes the launcher serves one port with (scripts/run.py web, docs/adr/0046). Processes
# learn of each other's writes through PostgreSQL and Redis only (queue signals, wakes, rate limits),
# so more than one needs both.
HORDE_WEB_PROCESSES = env.int("HORDE_WEB_PROCESSES", default=1)
if HORDE_WEB_PROCESSES < 1:
    raise ImproperlyConfigured("HORDE_WEB_PROCESSES must be at least 1")
if HORDE_WEB_PROCESSES > 1 and not (IS_POSTGRES and REDIS_URL):
    raise ImproperlyConfigured(
        "HORDE_WEB_PROCESSES above 1 needs DATABASE_URL (PostgreSQL) and REDIS_URL: the web processes "
        "share the queue's signals, wakes and rate limits through them"
    )
# A long-polling pop (`wait`) re-checks the queue this often besides the queue's signal (chat/services/pop_wait.py).
HORDE_POP_WAIT_RECHECK_SECONDS = env.float("HORDE_POP_WAIT_RECHECK_SECONDS", default=1.0, above=0)
# Proxy hops whose X-Forwarded-For may be trusted for the client address (0: use the socket peer).
HORDE_TRUSTED_PROXY_COUNT = env.int("HORDE_TRUSTED_PROXY_COUNT", default=0, minimum=0)

# --- Chat requests --------------------------------------------------------------------------
HORDE_CHAT_ADMISSION_ENABLED = env.bool("HORDE_CHAT_ADMISSION_ENABLED", default=True)
# Unset, each follows the text submit limit (spec: Rate limits; accounts.ratelimit.chat_request_limits_per_ip).
HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP = env.str("HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP", default="") or None
HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP = env.str("HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP", default="") or None
# The completion signal's Redis (default: REDIS_URL); tests point it elsewhere to show Redis down.
HORDE_CHAT_SIGNAL_REDIS_URL = env.str("HORDE_CHAT_SIGNAL_REDIS_URL", default="") or None

# --- Rate limits of the generate routes (accounts/ratelimit.py; docs/adr/0015) ----------------
# Passkeys of the fronts whose Proxied-For address counts instead of their own (Proxy-Authorization).
HORDE_PROXY_PASSKEYS = env.list("HORDE_PROXY_PASSKEYS", default=[])
# Service addresses (or networks) with the whitelisted per-address limits, as upstream's
# WHITELISTED_SERVICE_IPS.
HORDE_WHITELISTED_SERVICE_IPS = env.list("HORDE_WHITELISTED_SERVICE_IPS", default=[])
HORDE_WHITELISTED_SERVICE_RATE_LIMITS = env.list(
    "HORDE_WHITELISTED_SERVICE_RATE_LIMITS", default=["10/second", "300/minute"]
)
# Per API key and route; the anonymous key, which everyone without a key shares, has its own.
HORDE_API_KEY_RATE_LIMITS = env.list("HORDE_API_KEY_RATE_LIMITS", default=["2/second"])
HORDE_ANONYMOUS_KEY_RATE_LIMITS = env.list("HORDE_ANONYMOUS_KEY_RATE_LIMITS", default=["60/second"])

# --- Failure bounds: a hung Redis, a lost or unreachable PostgreSQL (docs/adr/0018) ------------
# Every Redis call on a request path waits at most these seconds, and a timeout or lost connection
# marks that Redis unavailable in the process for HORDE_REDIS_UNAVAILABLE_SECONDS: its calls then
# fail at once into the no-Redis fallbacks (hordesite/redis_guard.py).
HORDE_REDIS_SOCKET_TIMEOUT = env.float("HORDE_REDIS_SOCKET_TIMEOUT", default=0.5, above=0)
HORDE_REDIS_CONNECT_TIMEOUT = env.float("HORDE_REDIS_CONNECT_TIMEOUT", default=0.5, above=0)
HORDE_REDIS_UNAVAILABLE_SECONDS = env.float("HORDE_REDIS_UNAVAILABLE_SECONDS", default=5.0, minimum=0)
# What the project's own Redis clients are built with: redis.ConnectionPool.from_url(url, **...).
HORDE_REDIS_POOL_CLASS = "hordesite.redis_guard.GuardedConnectionPool"
HORDE_REDIS_POOL_KWARGS = {
    "socket_timeout": HORDE_REDIS_SOCKET_TIMEOUT,
    "socket_connect_timeout": HORDE_REDIS_CONNECT_TIMEOUT,
}
if REDIS_URL:
    CACHES["default"]["OPTIONS"].update(
        {
            "CONNECTION_POOL_CLASS": HORDE_REDIS_POOL_CLASS,
            "SOCKET_TIMEOUT": HORDE_REDIS_SOCKET_TIMEOUT,
            "SOCKET_CONNECT_TIMEOUT": HORDE_REDIS_CONNECT_TIMEOUT,
        }
    )
    CHANNEL_LAYERS["default"]["CONFIG"]["hosts"] = [{"address": REDIS_URL, **HORDE_REDIS_POOL_KWARGS}]
# A connection attempt to PostgreSQL gives up after this many seconds (libpq's connect_timeout,
# whole seconds, at least 2); a request whose connection was lost or could not be had answers 503
# DatabaseUnavailable with Retry-After, and for HORDE_DATABASE_UNAVAILABLE_SECONDS after a failed
# probe every request does so at once (hordesite/db_guard.py).
HORDE_DATABASE_CONNECT_TIMEOUT = env.int("DATABASE_CONNECT_TIMEOUT", default=2)
HORDE_DATABASE_UNAVAILABLE_SECONDS = env.float("HORDE_DATABASE_UNAVAILABLE_SECONDS", default=2.0, minimum=0)
if IS_POSTGRES:
    DATABASES["default"]["OPTIONS"].setdefault("connect_timeout", max(2, HORDE_DATABASE_CONNECT_TIMEOUT))
