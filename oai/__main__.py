"""`python -m oai`: the front alone, as its own ASGI process (daphne) against the configured native
roots, with its telemetry set-up (oai.telemetry) and /healthz. Settings: oai.settings (docs/configuration.md)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from oai import telemetry
from oai.settings import FrontSettings, load_settings
from oai.telemetry import FRONT_SERVICE_NAME

log = logging.getLogger("oai")


def configure_telemetry(settings: FrontSettings) -> bool:
    """The front's telemetry (oai.telemetry, shared with the web process and the Celery worker):
    the service name horde-oai unless OTEL_SERVICE_NAME sets another. Returns whether
    OpenTelemetry is on."""
    return telemetry.configure_telemetry(settings.telemetry, default_service_name=FRONT_SERVICE_NAME)


def build_application() -> Any:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "oai.django_settings")
    from django.core.asgi import get_asgi_application

    from oai.asgi import FrontASGI

    return FrontASGI(get_asgi_application(), serve_healthz=True)


def main(argv: list[str] | None = None) -> int:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level)
    telemetry_on = configure_telemetry(settings)
    from oai import state as front_state

    front_state.configure_front(propagate=telemetry_on)
    application = build_application()
    # At a stop the requests waiting end answered, then the open and failed cancels are sent
    # (oai.server.FrontServer, docs/adr/0076).
    from oai.server import FrontServer

    log.info(
        "OpenAI front on http://%s:%s/v1/ over %s",
        settings.host,
        settings.port,
        ", ".join(settings.native_roots),
    )
    try:
        FrontServer(application=application, endpoints=[f"tcp:port={settings.port}:interface={settings.host}"]).run()
    finally:
        telemetry.shutdown_telemetry()  # the last metrics and spans, after the drain
    return 0


if __name__ == "__main__":
    sys.exit(main())
