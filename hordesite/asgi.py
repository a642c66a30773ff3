"""ASGI entry point: daphne serves every HTTP route through Channels' protocol router."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs the app registry ready)

from hordesite.body_limits import BodyLimitMiddleware  # noqa: E402
from oai.asgi import FrontASGI  # noqa: E402

# /v1/ (the OpenAI front, mounted for the one-machine default) passes the front's ASGI layer first:
# its body admission (413, 408), CORS and disconnect notice; every other path goes on unchanged.
application = ProtocolTypeRouter({"http": FrontASGI(BodyLimitMiddleware(django_asgi_app))})
