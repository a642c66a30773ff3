"""GET /api/v2/chat_images/<key>: a chat job's image or offloaded messages object from the local
store, for the URL its worker received (chat.object_store.chat_object_url). A bucket serves its
own presigned URLs instead."""

from __future__ import annotations

import re

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe

from chat.object_store import (
    ChatObjectStoreUnavailable,
    chat_object_read,
    chat_object_storage,
    local_image_url_valid,
    stored_object_is_gzip,
)
from contract.chat_limits import CHAT_MESSAGES_OBJECT_SUFFIX

# A stored object's key: a request id, then _chat_<n>.jpg or _chat_messages.json.
_CHAT_OBJECT_KEY = re.compile(r"^[0-9a-f-]{36}_chat_(\d{1,3}\.jpg|messages\.json)$")


@require_safe
def chat_object_download(request: HttpRequest, key: str) -> HttpResponse:
    if not _CHAT_OBJECT_KEY.match(key) or not local_image_url_valid(
        key, request.GET.get("expires"), request.GET.get("signature")
    ):
        return JsonResponse({"message": "The URL is not valid or has expired.", "rc": "InvalidObjectURL"}, status=403)
    if not chat_object_storage(key).exists(key):
        return JsonResponse({"message": "The object is no longer stored.", "rc": "NotFound"}, status=404)
    try:
        body = chat_object_read(key)
    except ChatObjectStoreUnavailable:
        return JsonResponse({"message": "The object could not be read.", "rc": "NotFound"}, status=404)
    if key.endswith(CHAT_MESSAGES_OBJECT_SUFFIX):
        response = HttpResponse(body, content_type="application/json")
        if stored_object_is_gzip(body):  # stored gzipped: served as stored, whatever Accept-Encoding says
            response["Content-Encoding"] = "gzip"
    else:
        response = HttpResponse(body, content_type="image/jpeg")
    response["Cache-Control"] = "private, no-transform"
    return response
