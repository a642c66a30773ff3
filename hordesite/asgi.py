"""ASGI entry point: daphne serves every HTTP route through Channels' protocol router."""

from __future__ import annotations

import gc
import os
import sys

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs the app registry ready)
from django.conf import settings  # noqa: E402
from django.core.cache import caches  # noqa: E402
from django.core.handlers.wsgi import WSGIHandler  # noqa: E402
from django.db.backends.signals import connection_created  # noqa: E402

from accounts.ratelimit import trust_process_passkey  # noqa: E402
from hordesite.body_limits import BodyLimitMiddleware, body_limit, too_large_body  # noqa: E402
from hordesite.daphne_requests import use_requests_without_form_parsing  # noqa: E402
from hordesite.db_guard import DatabaseGuardASGI, install_statement_counter, retrying_wsgi  # noqa: E402
from hordesite.hot_routes import HotRoutesASGI  # noqa: E402
from oai.asgi import FrontASGI, front_django_handler  # noqa: E402
from oai.horde_client import IN_PROCESS_PROXY_PASSKEY, mount_native_app  # noqa: E402


def native_in_process_app(app):
    """The native API as the mounted front calls it in process: this process's Django application
    (WSGI, each call start to end on one of the front's threads) behind the same declared-length
    body bound as BodyLimitMiddleware (the front always declares the length)."""

    def guarded(environ, start_response):
        limit = body_limit(environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", ""))
        declared = environ.get("CONTENT_LENGTH") or ""
        if limit is not None and declared.isdigit() and int(declared) > limit:
            start_response("413 Request Entity Too Large", [("Content-Type", "application/json")])
            return [too_large_body(limit)]
        return app(environ, start_response)

    return guarded


# The front mounted here calls this process's native API in process, not back over TCP, unless
# HORDE_OAI_NATIVE_ROOTS points it elsewhere (docs/adr/0008-oai-native-calls-in-process.md).
mount_native_app(retrying_wsgi(native_in_process_app(WSGIHandler())), root_path="/api/v2")
# Its in-process submits forward their clients' addresses with this process's own passkey.
trust_process_passkey(IN_PROCESS_PROXY_PASSKEY)

# /v1/ (the OpenAI front, mounted for the one-machine default) passes the front's ASGI layer first:
# its body admission (413, 408), CORS and disconnect notice, then Django with the front's own
# middleware (none, as standalone). Pop, submit and the status polls are served by the hot
# route layer (same views, without Django's per-request thread and hops); every other path goes
# on to Django unchanged.
application = ProtocolTypeRouter(
    {
        "http": FrontASGI(
            BodyLimitMiddleware(DatabaseGuardASGI(HotRoutesASGI(django_asgi_app))), front_app=front_django_handler()
        )
    }
)

# Each request's completed statements are counted: one that lost its connection before any completed
# is run again on a fresh connection (hordesite/db_guard.py).
connection_created.connect(install_statement_counter)

# Django keeps a cache backend per context, and under ASGI each request starts from a copy of this
# module's context: a backend made here is the one every request finds (with django-redis, one Redis
# client for the process instead of a new client object for each request that reads the cache).
caches["default"]

# daphne hands bodies to the application raw: Twisted need not parse form posts first.
use_requests_without_form_parsing()

# The web process's threads mostly wait on sockets and run briefly between waits: a thread whose
# answer arrived should not wait Python's default 5 ms for the interpreter.
sys.setswitchinterval(settings.HORDE_GIL_SWITCH_INTERVAL_MS / 1000)

# Everything loaded so far lives as long as the process: keep it out of the collector's full
# passes, which otherwise walk every module, model and URL pattern again and again.
gc.freeze()
