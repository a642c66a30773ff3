"""ASGI entry point: daphne serves every HTTP route through Channels' protocol router."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs the app registry ready)

from hordesite.body_limits import BodyLimitMiddleware  # noqa: E402

application = ProtocolTypeRouter({"http": BodyLimitMiddleware(django_asgi_app)})
