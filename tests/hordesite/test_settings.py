"""The settings fail closed outside the embedded default, create nothing when imported, and read
variables by the same rules as the OpenAI front."""

from __future__ import annotations

import json
import runpy

import pytest
from django.core.exceptions import ImproperlyConfigured

from oai.settings import SECONDS_ABOVE_ZERO, load_settings
from tests.hordesite.clone import ROOT, clean_env, clone_like_copy, run_python
from tests.ports import free_port

DEPLOYED_DATABASE = "postgres://horde:secret@db.invalid:5432/horde"
# The web process's launcher, as `make run` and the systemd unit start it.
LAUNCH = ["scripts/run.py", "web"]
STRONG_KEY = "k" * 10 + "3xq9-VzL2_pW8mRt5yN0aB7cD4eF6gH1jK!sU@oI#"

SHOW_SETTINGS = (
    "import json, django; django.setup(); from django.conf import settings as s; "
    "print(json.dumps({'key': s.SECRET_KEY, 'hosts': s.ALLOWED_HOSTS, "
    "'secure_cookies': [s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE], "
    "'booleans': {name: getattr(s, name) for name in %r}}))"
)
# The horde's boolean settings with no effect on reading the others.
HORDE_BOOLEANS = [
    "HORDE_ALLOW_ANONYMOUS",
    "HORDE_MAINTENANCE",
    "HORDE_UPFRONT_KUDOS_ON_WORKERLIST",
    "HORDE_CHAT_ADMISSION_ENABLED",
    "CELERY_TASK_ALWAYS_EAGER",
    "DEBUG",
]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    return clone_like_copy(tmp_path_factory.mktemp("settings") / "clone")


def _settings(clone, **env) -> dict:
    shown = run_python(clone, clean_env(DJANGO_SETTINGS_MODULE="hordesite.settings", **env), "-c", SHOW_SETTINGS % HORDE_BOOLEANS)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout.strip().splitlines()[-1])


def _refusal(clone, **env) -> str:
    shown = run_python(clone, clean_env(DJANGO_SETTINGS_MODULE="hordesite.settings", **env), "-c", SHOW_SETTINGS % HORDE_BOOLEANS)
    assert shown.returncode != 0, shown.stdout
    return shown.stderr.strip().splitlines()[-1]


def test_a_deployment_without_secret_key_or_allowed_hosts_does_not_start(clone):
    assert _refusal(clone, DATABASE_URL=DEPLOYED_DATABASE) == (
        "django.core.exceptions.ImproperlyConfigured: Set SECRET_KEY and ALLOWED_HOSTS: "
        "required when DATABASE_URL is set and DEBUG is off (docs/configuration.md)"
    )
    assert "Set ALLOWED_HOSTS:" in _refusal(clone, DATABASE_URL=DEPLOYED_DATABASE, SECRET_KEY=STRONG_KEY)
    assert "Set SECRET_KEY:" in _refusal(clone, DATABASE_URL=DEPLOYED_DATABASE, ALLOWED_HOSTS="horde.example")
    public_key = _refusal(
        clone,
        DATABASE_URL=DEPLOYED_DATABASE,
        ALLOWED_HOSTS="horde.example",
        SECRET_KEY="dev-only-insecure-secret-key-change-me-in-production",
    )
    assert "SECRET_KEY is the public development key" in public_key
    # Blank entries name no host: Django would answer every request 400 (DisallowedHost).
    for blank in (" ", ",", " , "):
        assert _refusal(clone, DATABASE_URL=DEPLOYED_DATABASE, SECRET_KEY=STRONG_KEY, ALLOWED_HOSTS=blank) == (
            "django.core.exceptions.ImproperlyConfigured: ALLOWED_HOSTS names no host: list the names the horde "
            "is reached at, separated by commas"
        )


def test_the_hosts_a_deployment_names_are_read_trimmed(clone):
    shown = _settings(clone, DATABASE_URL=DEPLOYED_DATABASE, SECRET_KEY=STRONG_KEY, ALLOWED_HOSTS=" horde.example , ")
    assert shown["hosts"] == ["horde.example"]


def test_a_deployment_uses_what_it_names_with_secure_cookies(clone):
    shown = _settings(
        clone, DATABASE_URL=DEPLOYED_DATABASE, SECRET_KEY=STRONG_KEY, ALLOWED_HOSTS="horde.example,api.horde.example"
    )
    assert shown["key"] == STRONG_KEY
    assert shown["hosts"] == ["horde.example", "api.horde.example"]
    assert shown["secure_cookies"] == [True, True]


def test_the_embedded_default_and_debug_fall_back_to_development_values(clone):
    embedded = _settings(clone)
    assert embedded["key"] == "dev-only-insecure-secret-key-change-me-in-production"
    assert embedded["hosts"] == ["*"]
    debug = _settings(clone, DATABASE_URL=DEPLOYED_DATABASE, DEBUG="true")
    assert debug["hosts"] == ["*"]


def test_an_empty_database_url_is_the_embedded_default(clone):
    """`DATABASE_URL=` (an .env copied with the value left blank) is unset, as the fail-closed rule
    already reads it: the embedded SQLite file, not a traceback."""
    show = (
        "import django; django.setup(); from django.conf import settings as s; "
        "d = s.DATABASES['default']; print(d['ENGINE'], d['NAME'])"
    )
    shown = run_python(clone, clean_env(DJANGO_SETTINGS_MODULE="hordesite.settings", DATABASE_URL=""), "-c", show)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == ["django.db.backends.sqlite3", str(clone / "var" / "horde.sqlite3")]
    assert _settings(clone, DATABASE_URL="")["hosts"] == ["*"]


def test_a_negative_dropped_jobs_bound_does_not_start(clone):
    """0 turns the automatic maintenance off; a negative bound is a mistake, not another way to say so."""
    assert _refusal(clone, HORDE_WORKER_DROPPED_JOBS_PER_HOUR="-1") == (
        "django.core.exceptions.ImproperlyConfigured: HORDE_WORKER_DROPPED_JOBS_PER_HOUR must be 0 (off) or more"
    )
    assert _settings(clone, HORDE_WORKER_DROPPED_JOBS_PER_HOUR="0")


def test_an_unreadable_image_network_does_not_start(clone):
    """A mistyped operator network stops the process at its start, as a mistyped rate limit does,
    rather than answering 500 to every chat request with a URL image."""
    assert _refusal(clone, HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS="10.0.0.0/8,images.internal") == (
        "django.core.exceptions.ImproperlyConfigured: HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS: "
        "'images.internal' does not appear to be an IPv4 or IPv6 network"
    )
    assert _settings(clone, HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS="10.0.0.0/8,fd00::/8")
    # Written as a list is often written, with a space after each comma.
    assert _settings(clone, HORDE_CHAT_IMAGE_FETCH_ALLOWED_NETWORKS="10.0.0.0/8, 192.168.0.0/16 ,")


@pytest.mark.parametrize("name", SECONDS_ABOVE_ZERO)
def test_the_front_refuses_an_interval_that_would_spin_its_loop(name):
    """A keepalive, poll or retry interval of 0 or less would send keepalives or reads as fast as
    the process runs, and a native call's or a cancel's bound of 0 would send it with no time to
    answer: the front does not start on it."""
    for value in ("0", "-1", "nan"):
        with pytest.raises(ImproperlyConfigured, match=rf"^{name} must be a number of seconds above 0$"):
            load_settings({name: value})
    assert load_settings({name: "0.05"})


def test_importing_the_settings_creates_no_directory(clone):
    _settings(clone)
    _settings(clone, DATABASE_URL=DEPLOYED_DATABASE, SECRET_KEY=STRONG_KEY, ALLOWED_HOSTS="horde.example")
    assert not (clone / "var").exists()


def test_check_deploy_is_clean_with_a_production_environment(clone):
    env = clean_env(
        DATABASE_URL=DEPLOYED_DATABASE,
        REDIS_URL="redis://redis.invalid:6379/0",
        SECRET_KEY=STRONG_KEY,
        ALLOWED_HOSTS="horde.example",
    )
    checked = run_python(clone, env, "manage.py", "check", "--deploy", "--fail-level", "WARNING")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "System check identified no issues" in checked.stdout


BOOLEAN_VALUES = ["true", "True", "on", "ok", "y", "yes", "1", "2", "false", "0", "no", "off", "", "flase"]


def test_the_front_reads_a_boolean_as_the_horde_does(clone):
    for start in range(0, len(BOOLEAN_VALUES), len(HORDE_BOOLEANS)):
        values = dict(zip(HORDE_BOOLEANS, BOOLEAN_VALUES[start:], strict=False))
        horde = _settings(clone, **values)["booleans"]
        for name, value in values.items():
            front = load_settings({"HORDE_OAI_ALLOW_ANONYMOUS": value}).allow_anonymous
            assert (value, front) == (value, horde[name])
            assert horde[name] is (value.lower() in {"true", "on", "ok", "y", "yes", "1", "2"})


def test_a_decimal_that_is_not_one_is_not_read_as_another(clone):
    """A decimal setting reads as Python reads a number: a typo ("1,000", "ten5") stops the process
    rather than running it on another value (django-environ drops what is not a digit: 1.0, 5.0)."""
    assert _refusal(clone, HORDE_SWEEP_INTERVAL_SECONDS="ten5") == (
        "django.core.exceptions.ImproperlyConfigured: HORDE_SWEEP_INTERVAL_SECONDS='ten5' cannot be read: "
        "could not convert string to float: 'ten5'"
    )
    for typo in ("1,000", "2O"):
        with pytest.raises(ImproperlyConfigured, match=rf"^HORDE_OAI_POLL_SECONDS='{typo}' cannot be read"):
            load_settings({"HORDE_OAI_POLL_SECONDS": typo})
    assert load_settings({"HORDE_OAI_POLL_SECONDS": "1e-3"}).poll_seconds == 0.001
    assert _settings(clone, HORDE_SWEEP_INTERVAL_SECONDS="0.5")  # a decimal still starts


def test_the_front_reads_numbers_and_lists_as_the_horde_does(clone):
    """One reader (django-environ's) on both sides: a number that is not one stops both with an
    error naming the variable, a list is split on commas alike."""
    assert _refusal(clone, HORDE_DEFAULT_CONCURRENCY="") == (
        "django.core.exceptions.ImproperlyConfigured: HORDE_DEFAULT_CONCURRENCY='' cannot be read: "
        "invalid literal for int() with base 10: ''"
    )
    assert _refusal(clone, HORDE_TEXT_JOB_LEASE_SECONDS="ten") == (
        "django.core.exceptions.ImproperlyConfigured: HORDE_TEXT_JOB_LEASE_SECONDS='ten' cannot be read: "
        "invalid literal for int() with base 10: 'ten'"
    )
    with pytest.raises(ImproperlyConfigured, match=r"^HORDE_OAI_MAX_INFLIGHT='' cannot be read: invalid literal for int\(\) with base 10: ''$"):
        load_settings({"HORDE_OAI_MAX_INFLIGHT": ""})
    with pytest.raises(ImproperlyConfigured, match=r"^HORDE_OAI_POLL_SECONDS='one' cannot be read: could not convert"):
        load_settings({"HORDE_OAI_POLL_SECONDS": "one"})
    roots = load_settings({"HORDE_OAI_NATIVE_ROOTS": "http://horde-a:8000/api/v2/, http://horde-b:8000/api/v2,"})
    assert roots.native_roots == ["http://horde-a:8000/api/v2", "http://horde-b:8000/api/v2"]
    # An empty list of roots is the default root, as unset (the front has no other way to reach the horde).
    assert load_settings({"HORDE_OAI_NATIVE_ROOTS": "", "PORT": "9000"}).native_roots == ["http://127.0.0.1:9000/api/v2"]


PRESIGN = (
    "import json, django; django.setup(); from chat.object_store import chat_object_url as url; "
    "print(json.dumps([url(k, seconds=s, base_url='https://horde.example') for k, s in "
    "[('0b0cce35-3bfe-4fc9-bdcf-a6d08b6de16d_chat_0.jpg', 600), "
    "('0b0cce35-3bfe-4fc9-bdcf-a6d08b6de16d_chat_messages.json', 120)]]))"
)


@pytest.mark.parametrize(("messages_bucket", "expected"), [(None, "source-images"), ("chat-messages", "chat-messages")])
def test_a_bucket_presigns_chat_objects_in_sigv4_for_their_own_bucket(clone, messages_bucket, expected):
    """STORAGE_BACKEND=s3: a worker's image URL is presigned (SigV4, as R2 requires) into the source
    image bucket, the messages object's into R2_CHAT_MESSAGES_BUCKET, which defaults to it."""
    from urllib.parse import parse_qs, urlsplit

    env = {
        "STORAGE_BACKEND": "s3",
        "AWS_STORAGE_BUCKET_NAME": "media",
        "R2_SOURCE_IMAGE_BUCKET": "source-images",
        "AWS_S3_ENDPOINT_URL": "https://account.r2.example",
        "AWS_ACCESS_KEY_ID": "test-access-key",
        "AWS_SECRET_ACCESS_KEY": "test-secret-key",
    }
    if messages_bucket:
        env["R2_CHAT_MESSAGES_BUCKET"] = messages_bucket
    shown = run_python(clone, clean_env(DJANGO_SETTINGS_MODULE="hordesite.settings", **env), "-c", PRESIGN)
    assert shown.returncode == 0, shown.stderr
    image, messages = (urlsplit(u) for u in json.loads(shown.stdout.strip().splitlines()[-1]))
    assert (image.hostname, image.path) == ("account.r2.example", "/source-images/0b0cce35-3bfe-4fc9-bdcf-a6d08b6de16d_chat_0.jpg")
    assert messages.path == f"/{expected}/0b0cce35-3bfe-4fc9-bdcf-a6d08b6de16d_chat_messages.json"
    for url, seconds in ((image, "600"), (messages, "120")):
        query = parse_qs(url.query)
        assert query["X-Amz-Algorithm"] == ["AWS4-HMAC-SHA256"] and query["X-Amz-Expires"] == [seconds]
        assert query["X-Amz-Credential"][0].startswith("test-access-key/") and "/auto/s3/" in query["X-Amz-Credential"][0]


# A number the horde cannot run on stops it at its start, naming the variable and its bound, instead
# of starting a process that then fails or hangs its requests (0 threads: the native API never
# answers; -1 proxy hops: every request with X-Forwarded-For answers 500; a 0 sweep interval: beat
# sends sweeps as fast as it runs). Each: (variable, a value refused, its message, a value taken).
HORDE_BOUNDS = [
    ("HORDE_WEB_THREADS", "0", "must be at least 1, not 0", "1"),
    ("HORDE_TRUSTED_PROXY_COUNT", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_TEXT_JOB_LEASE_SECONDS", "0", "must be at least 1, not 0", "1"),
    ("HORDE_TEXT_REQUEST_TTL_SECONDS", "-5", "must be at least 1, not -5", "1"),
    ("HORDE_SWEEP_INTERVAL_SECONDS", "0", "must be above 0, not 0", "0.5"),
    ("HORDE_SWEEP_LATE_SECONDS", "-60", "must be above 0, not -60", "1"),
    ("HORDE_CHAT_ORPHAN_SWEEP_SECONDS", "0", "must be above 0, not 0", "60"),
    ("HORDE_POP_WAIT_RECHECK_SECONDS", "0", "must be above 0, not 0", "0.1"),
    ("HORDE_REDIS_SOCKET_TIMEOUT", "0", "must be above 0, not 0", "0.1"),
    ("HORDE_REDIS_CONNECT_TIMEOUT", "nan", "must be above 0, not nan", "0.1"),
    ("HORDE_REDIS_UNAVAILABLE_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_DATABASE_UNAVAILABLE_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_API_KEY_CACHE_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_WORKER_CACHE_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_EMPTY_POP_CACHE_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_DEFAULT_CONCURRENCY", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_TEXT_FREE_OUTPUT_FLOOR", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_TEXT_FREE_OUTPUT_CEILING", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_TEXT_FREE_OUTPUT_WAIT_FULL_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_TEXT_FREE_OUTPUT_WAIT_FLOOR_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_CHAT_MESSAGES_OFFLOAD_BYTES", "-1", "must be at least 0, not -1", "0"),
    ("DATABASE_POOL_MIN_SIZE", "-1", "must be at least 0, not -1", "0"),
    ("DATABASE_POOL_MAX_SIZE", "0", "must be at least 1, not 0", "2"),
    ("DATABASE_POOL_MAX_SIZE", "1", "must be at least DATABASE_POOL_MIN_SIZE (2), not 1", "2"),
    ("DATABASE_POOL_TIMEOUT", "0", "must be at least 1, not 0", "1"),
]


@pytest.mark.parametrize(("name", "refused", "message", "taken"), HORDE_BOUNDS)
def test_a_number_outside_its_bounds_does_not_start_the_horde(monkeypatch, name, refused, message, taken):
    """The settings module as a process runs it, on a deployment's PostgreSQL URL (the pool's
    variables are read for PostgreSQL only)."""
    for variable, value in {"DATABASE_URL": DEPLOYED_DATABASE, "SECRET_KEY": STRONG_KEY, "ALLOWED_HOSTS": "horde.example"}.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv(name, refused)
    with pytest.raises(ImproperlyConfigured) as refusal:
        runpy.run_path(str(ROOT / "hordesite" / "settings.py"))
    assert str(refusal.value) == f"{name} {message}"
    monkeypatch.setenv(name, taken)
    runpy.run_path(str(ROOT / "hordesite" / "settings.py"))


# The front's: (variable, a value refused, its message, a value taken).
FRONT_BOUNDS = [
    ("HORDE_OAI_NATIVE_MAX_CONNECTIONS", "0", "must be at least 1, not 0", "1"),
    ("HORDE_OAI_CANCEL_MAX_CONNECTIONS", "0", "must be at least 1, not 0", "1"),
    ("HORDE_OAI_MAX_INFLIGHT", "0", "must be at least 1, not 0", "1"),
    ("HORDE_OAI_MAX_INFLIGHT_PER_SOURCE", "-1", "must be at least 1, not -1", "1"),
    ("HORDE_OAI_MAX_BODY_BYTES", "0", "must be at least 1, not 0", "1"),
    ("HORDE_OAI_STREAM_REDIS_DB", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_OAI_NONSTREAM_TIMEOUT_SECONDS", "0", "must be above 0, not 0", "0.5"),
    ("HORDE_OAI_STREAM_TIMEOUT_SECONDS", "-1", "must be above 0, not -1", "0.5"),
    ("HORDE_OAI_BODY_READ_TIMEOUT_SECONDS", "0", "must be above 0, not 0", "0.5"),
    ("HORDE_OAI_FAIL_FAST_GRACE_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_OAI_RESPONSE_ITEMS_SECONDS", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_OAI_FRONT_LEASE_SECONDS", "-1", "must be 0 (no lease) to 600, not -1", "0"),
    ("HORDE_OAI_FRONT_LEASE_SECONDS", "601", "must be 0 (no lease) to 600, not 601", "600"),
    ("HORDE_OAI_TRUSTED_PROXY_COUNT", "-1", "must be at least 0, not -1", "0"),
    ("HORDE_OAI_RATE_LIMIT_WAIT_SECONDS", "-1", "must be at least 0, not -1", "0"),
]


@pytest.mark.parametrize(("name", "refused", "message", "taken"), FRONT_BOUNDS)
def test_a_number_outside_its_bounds_does_not_start_the_front(name, refused, message, taken):
    with pytest.raises(ImproperlyConfigured) as refusal:
        load_settings({name: refused})
    assert str(refusal.value) == f"{name} {message}"
    assert load_settings({name: taken})


def test_the_web_process_does_not_start_on_a_front_value_it_cannot_use(clone):
    """The front mounted at /v1/ reads its variables when the web process starts, as `python -m oai`
    does: one it cannot use stops the launcher with the message (exit 2), and plain daphne's import of
    the application, rather than a process that answers every /v1/ request 500."""
    for name, value, message in (
        ("HORDE_OAI_POLL_SECONDS", "one", "HORDE_OAI_POLL_SECONDS='one' cannot be read: could not convert string to float: 'one'"),
        ("HORDE_OAI_MAX_INFLIGHT", "0", "HORDE_OAI_MAX_INFLIGHT must be at least 1, not 0"),
    ):
        env = clean_env(**{name: value})
        started = run_python(
            clone, env, *LAUNCH, "-b", "127.0.0.1", "-p", str(free_port()), "hordesite.asgi:application", timeout=60
        )
        assert (started.returncode, started.stderr.strip().splitlines()[-1]) == (2, f"[web] {message}")
        imported = run_python(clone, env, "-c", "import hordesite.asgi")
        assert imported.returncode != 0
        assert imported.stderr.strip().splitlines()[-1] == f"django.core.exceptions.ImproperlyConfigured: {message}"


def test_the_launcher_refuses_a_switch_interval_it_cannot_use(clone):
    for value, message in (("fast", "'fast' is not a number"), ("0", "must be above 0, not 0")):
        started = run_python(
            clone, clean_env(HORDE_GIL_SWITCH_INTERVAL_MS=value),
            *LAUNCH, "-b", "127.0.0.1", "-p", str(free_port()), "hordesite.asgi:application", timeout=60,
        )
        assert (started.returncode, started.stderr.strip().splitlines()[-1]) == (
            2, f"[web] HORDE_GIL_SWITCH_INTERVAL_MS {message} (milliseconds)"
        )


def test_a_storage_backend_it_does_not_know_or_a_bucket_left_out_does_not_start(clone):
    """`STORAGE_BACKEND=S3` (or any other spelling) ran on the local folder without a word, so a
    deployment meant for a bucket kept its chat images on the web host's disk; `s3` without a bucket
    started with nowhere to store them."""
    assert _refusal(clone, STORAGE_BACKEND="S3") == (
        "django.core.exceptions.ImproperlyConfigured: STORAGE_BACKEND must be local or s3, not 'S3'"
    )
    assert _refusal(clone, STORAGE_BACKEND="s3") == (
        "django.core.exceptions.ImproperlyConfigured: STORAGE_BACKEND=s3 needs AWS_STORAGE_BUCKET_NAME"
    )
    assert _settings(clone, STORAGE_BACKEND="local")
    assert _settings(clone, STORAGE_BACKEND="s3", AWS_STORAGE_BUCKET_NAME="media")


def test_a_database_url_that_is_not_postgres_or_sqlite_does_not_start(clone):
    """A typo (`postgres//...`, no colon) stopped the settings with a bare KeyError: 'ENGINE', and a
    MySQL URL with "Did you install mysqlclient?": the message names the variable and what it takes,
    without echoing the URL (it may hold a password)."""
    expected = (
        "django.core.exceptions.ImproperlyConfigured: DATABASE_URL is not a PostgreSQL or SQLite URL: "
        "postgres://USER:PASSWORD@HOST:5432/NAME or sqlite:///ABSOLUTE/PATH"
    )
    for url in ("postgres//horde:secret@db.invalid/horde", "mysql://horde:secret@db.invalid/horde", "horde"):
        assert _refusal(clone, DATABASE_URL=url, DEBUG="true") == expected
    assert _settings(clone, DATABASE_URL="postgresql://horde:secret@db.invalid:5432/horde", DEBUG="true")
