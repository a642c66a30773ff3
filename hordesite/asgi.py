"""ASGI entry point: daphne serves every HTTP route through Channels' protocol router.

The native API (and the admin, the schema, /healthz) is Django's WSGI handler on a bounded pool of
threads (hordesite/wsgi_pool.py, docs/adr/0025); /v1/, the OpenAI front mounted for the
one-machine default, passes the front's ASGI layer (body admission, CORS, disconnect notice) and
then Django's ASGI handler, whose async views wait on the event loop. Process-level tweaks (the
thread switch interval, gc.freeze(), the telemetry set-up: hordesite/telemetry.py) are the
launcher's (scripts/run.py), not this module's.
"""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")

django_wsgi_app = get_wsgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs the app registry ready)
from django.core.cache import caches  # noqa: E402
from django.db.backends.signals import connection_created  # noqa: E402

from accounts.ratelimit import trust_process_passkey  # noqa: E402
from chat.signals import chat_signal_in_process, signal_url  # noqa: E402
from hordesite.db_guard import install_statement_counter, retrying_wsgi  # noqa: E402
from hordesite.wsgi_pool import PooledWSGI  # noqa: E402
from oai.asgi import FrontASGI, front_django_handler  # noqa: E402
from oai.horde_client import IN_PROCESS_PROXY_PASSKEY, mount_native_app  # noqa: E402
from oai.settings import load_settings  # noqa: E402
from oai.waiter import in_process_signals  # noqa: E402

# The mounted front's variables are read at the process's start, as `python -m oai` reads them: one
# it cannot use stops the process (ImproperlyConfigured) instead of answering every /v1/ request 500
# when its first request reads them (oai.state.get_front_state reads them again, alike).
load_settings()

# The native API as every caller reaches it: Django's WSGI handler, a request that lost its
# database connection before any statement completed run once more (hordesite/db_guard.py).
native_app = retrying_wsgi(django_wsgi_app)

# The front mounted here calls this process's native API in process, not back over TCP, unless
# HORDE_OAI_NATIVE_ROOTS points it elsewhere (docs/adr/0008-oai-native-calls-in-process.md).
mount_native_app(native_app, root_path="/api/v2")
# Its in-process submits forward their clients' addresses with this process's own passkey.
trust_process_passkey(IN_PROCESS_PROXY_PASSKEY)

application = ProtocolTypeRouter(
    {"http": FrontASGI(PooledWSGI(native_app, subscribe_queue_signal=True), front_app=front_django_handler())}
)


def _wake_the_front(sender: object, *, message: dict, **kwargs: object) -> None:
    in_process_signals.publish(message)


# Without Redis the horde publishes its completion signal nowhere: the front mounted here, which
# waits on requests this process's native API serves, is woken in process instead (docs/adr/0054).
if not signal_url():
    in_process_signals.enabled = True
    chat_signal_in_process.connect(_wake_the_front)

# Each request's completed statements are counted: one that lost its connection before any completed
# is run again on a fresh connection (hordesite/db_guard.py).
connection_created.connect(install_statement_counter)

# Django keeps a cache backend per context, and each request of the front (Django's ASGI handler)
# starts from a copy of this module's context: a backend made here is the one every such request
# finds (with django-redis, one Redis client for the process instead of one per request).
caches["default"]
