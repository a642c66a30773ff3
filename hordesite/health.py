"""/healthz: the web process answers, the database answers, and beat's sweeps keep running;
503 when the database is unreachable or a sweep is late (hordesite.sweep_health)."""

from __future__ import annotations

from django.http import JsonResponse

from hordesite.sweep_health import sweep_health


def healthz(request) -> JsonResponse:
    healthy, body = sweep_health()
    return JsonResponse(body, status=200 if healthy else 503)
