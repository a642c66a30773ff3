from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path, register_converter
from drf_spectacular.views import SpectacularJSONAPIView

from accounts.api.views import (
    FindUserView,
    KudosTransferView,
    SharedKeyDetailView,
    SharedKeysView,
    UserDetailView,
    UsersView,
)
from chat.api import pop_views, progress_views, submit_views
from chat.api import views as chat_views
from chat.api.chat_views import ChatAsyncView, ChatStatusView
from chat.api.image_views import chat_object_download
from hordesite.converters import AnyCaseUUIDConverter
from hordesite.health import healthz
from workers.api.views import WorkerByNameView, WorkerDetailView, WorkerListView

register_converter(AnyCaseUUIDConverter, "anycase_uuid")

api_v2 = [
    path("generate/text/async", chat_views.TextAsyncView.as_view()),
    path("generate/text/status/<anycase_uuid:request_id>", chat_views.TextStatusView.as_view()),
    path("generate/chat/async", ChatAsyncView.as_view()),
    path("generate/chat/status/<anycase_uuid:request_id>", ChatStatusView.as_view()),
    path("generate/text/pop", pop_views.TextPopView.as_view()),
    path("generate/text/submit", submit_views.TextSubmitView.as_view()),
    path("generate/text/progress", progress_views.TextProgressView.as_view()),
    path("chat_images/<str:key>", chat_object_download),
    path("find_user", FindUserView.as_view()),
    path("users", UsersView.as_view()),
    path("users/<str:user_id>", UserDetailView.as_view()),
    path("kudos/transfer", KudosTransferView.as_view()),
    path("sharedkeys", SharedKeysView.as_view()),
    path("sharedkeys/<str:key_id>", SharedKeyDetailView.as_view()),
    path("workers", WorkerListView.as_view()),
    path("workers/<anycase_uuid:worker_id>", WorkerDetailView.as_view()),
    path("workers/name/<str:worker_name>", WorkerByNameView.as_view()),
    path("status/heartbeat", chat_views.HeartbeatView.as_view()),
    path("status/models", chat_views.ModelsStatusView.as_view()),
    path("status/models/<path:model_name>", chat_views.ModelStatusView.as_view()),
    path("status/performance", chat_views.PerformanceView.as_view()),
    path("status/modes", chat_views.ModesView.as_view()),
    path("stats/text/totals", chat_views.TextStatsTotalsView.as_view()),
    path("stats/text/models", chat_views.TextStatsModelsView.as_view()),
]

urlpatterns = [
    path("api/v2/", include(api_v2)),
    path("api/v2/openapi.json", SpectacularJSONAPIView.as_view(), name="openapi-schema"),
    # The OpenAI front (oai), mounted in the web process for the one-machine default.
    path("v1/", include("oai.urls")),
    path("healthz", healthz),
    path("admin/", admin.site.urls),
]


def json_not_found(request, exception=None):
    return JsonResponse({"message": "Not found", "rc": "NotFound"}, status=404)


def json_server_error(request):
    return JsonResponse({"message": "Internal server error", "rc": "InternalError"}, status=500)


handler404 = json_not_found
handler500 = json_server_error
