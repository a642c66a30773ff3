"""GET /api/v2/chat_images/<key>: a chat job's image from the local store, for the URL its worker
received (chat.image_store.chat_image_url). A bucket serves its own presigned URLs instead."""

from __future__ import annotations

import re

from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_safe

from chat.image_store import chat_image_storage, local_image_url_valid

# A stored image's key: a request id, then _chat_<n>.jpg (chat.image_store.chat_image_key).
_CHAT_IMAGE_KEY = re.compile(r"^[0-9a-f-]{36}_chat_\d{1,3}\.jpg$")


@require_safe
def chat_image_download(request: HttpRequest, key: str) -> HttpResponse:
    if not _CHAT_IMAGE_KEY.match(key) or not local_image_url_valid(
        key, request.GET.get("expires"), request.GET.get("signature")
    ):
        return JsonResponse(
            {"message": "The image URL is not valid or has expired.", "rc": "InvalidImageURL"}, status=403
        )
    storage = chat_image_storage()
    try:
        stored = storage.open(key, "rb")
    except FileNotFoundError:
        return JsonResponse({"message": "The image is no longer stored.", "rc": "NotFound"}, status=404)
    response = FileResponse(stored, content_type="image/jpeg")
    response["Cache-Control"] = "private, no-transform"
    return response
