from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api.callers import requester
from accounts.selectors import user_details


class FindUserView(APIView):
    """GET /api/v2/find_user: the account of the caller's key."""

    class OutputSerializer(serializers.Serializer):
        username = serializers.CharField()
        id = serializers.IntegerField()
        kudos = serializers.FloatField()
        trusted = serializers.BooleanField()
        moderator = serializers.BooleanField()
        concurrency = serializers.IntegerField()
        worker_count = serializers.IntegerField()
        worker_ids = serializers.ListField(child=serializers.CharField())

    @extend_schema(responses=OutputSerializer)
    def get(self, request):
        # The caller's identity may come from the process's key cache; user_details re-reads the row.
        return Response(self.OutputSerializer(user_details(requester(request))).data)
