from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts import services
from accounts.api.callers import registered_caller, requester, shared_key_of
from accounts.api.openapi_errors import refusals
from accounts.api.query_params import whole_number_parameter, whole_number_query
from accounts.models import (
    KUDOS_TRANSFER_DEFAULT_AMOUNT,
    KUDOS_TRANSFER_IDEMPOTENCY_KEY_MAX_LENGTH,
    SHARED_KEY_DEFAULT_KUDOS,
    SHARED_KEY_MAX_EXPIRY_DAYS,
    SHARED_KEY_MAX_KUDOS,
    SHARED_KEY_UNLIMITED,
    HordeUser,
    SharedKey,
)
from accounts.ratelimit import check_submit_rate_limits
from accounts.selectors import (
    shared_key_details,
    shared_key_get,
    user_details,
    user_get_by_id,
    users_page,
)
from contract.errors import HordeError
from contract.text import TEXT_MAX_LENGTH_RANGE, USER_ID_DIGITS


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
        account_age = serializers.IntegerField(help_text="seconds since the account was made")
        # The owner's own key only: a shared key sees neither list.
        worker_ids = serializers.ListField(child=serializers.CharField(), required=False)
        sharedkey_ids = serializers.ListField(child=serializers.CharField(), required=False)

    @extend_schema(responses=OutputSerializer)
    def get(self, request):
        # The caller's identity may come from the process's key cache; user_details re-reads the row.
        details = user_details(requester(request), shared_key=shared_key_of(request))
        return Response(self.OutputSerializer(details).data)


class UsersView(APIView):
    """GET /api/v2/users?page=&sort=kudos|age: every user's public details, 25 a page, as upstream's
    (KoboldAI Lite's kudos ranking reads it)."""

    @extend_schema(
        parameters=[
            whole_number_parameter("page", description="From 1 (a page below 1 is the first); 25 users a page"),
            OpenApiParameter("sort", str, enum=["kudos", "age"]),
        ],
        responses={200: FindUserView.OutputSerializer(many=True), **refusals(s400=["BadRequest (page)"])},
    )
    def get(self, request):
        page = whole_number_query(request, "page")
        sort = request.query_params.get("sort", "kudos")
        # Upstream's reading: an unknown sort is kudos, a page below 1 is the first.
        return Response(users_page(sort="age" if sort == "age" else "kudos", page=max(page or 1, 1)))


class UserDetailView(APIView):
    """GET /api/v2/users/{user_id}: a user's details by the numeric part of their alias; their
    workers' and shared keys' ids only to themselves and to moderators, as upstream's."""

    @extend_schema(responses={200: FindUserView.OutputSerializer, **refusals(s404=["UserNotFound"])})
    def get(self, request, user_id: str):
        if not (user_id.isascii() and user_id.isdigit()):
            raise HordeError(
                "UserNotFound", "Please use only the numerical part of the userID. E.g. the '1' in 'db0#1'"
            )
        user = user_get_by_id(int(user_id)) if USER_ID_DIGITS.fullmatch(user_id) else None  # past a bigint: no one
        if user is None:
            raise HordeError("UserNotFound", f"User with ID '{user_id}' not found.")
        # A public route, as upstream's: a key only widens what the caller sees.
        caller = request.user if isinstance(request.user, HordeUser) else None
        private = (
            caller is not None
            and shared_key_of(request) is None
            and not caller.is_anonymous
            and (caller.pk == user.pk or caller.moderator)
        )
        return Response(FindUserView.OutputSerializer(user_details(user, private=private)).data)


class KudosTransferView(APIView):
    """POST /api/v2/kudos/transfer: the caller gives kudos to a user named by alias ("name#id", the
    id decides) or to a shared key by its id (its owner is paid, the key holds more), as upstream's."""

    class KudosTransferInputSerializer(serializers.Serializer):
        # A blank or unknown name is the service's InvalidTargetUsername, as upstream answers it.
        username = serializers.CharField(allow_blank=True, max_length=255)
        amount = serializers.IntegerField(default=KUDOS_TRANSFER_DEFAULT_AMOUNT)

    class KudosTransferOutputSerializer(serializers.Serializer):
        transferred = serializers.FloatField()

    @extend_schema(
        request=KudosTransferInputSerializer,
        responses={
            200: KudosTransferOutputSerializer,
            **refusals(
                s400=["BadRequest", "KudosTransferFromAnon", "KudosTransferToAnon", "KudosTransferToSelf",
                      "InvalidTargetUsername", "NegativeKudosTransfer", "InvalidKudosTransferAmount",
                      "KudosTransferNotEnough", "TooFastKudosTransfers", "IdempotencyKeyConflict"],
                s429=["RateLimited"],
                s503=["KudosTransferBusy", "DatabaseUnavailable"],
            ),
        },
    )
    def post(self, request):
        check_submit_rate_limits(
            request, scope="kudos_transfer", limits_per_ip=settings.HORDE_KUDOS_TRANSFER_RATE_LIMITS
        )
        body = self.KudosTransferInputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        idempotency_key = request.headers.get("Idempotency-Key") or None
        if idempotency_key is not None and len(idempotency_key) > KUDOS_TRANSFER_IDEMPOTENCY_KEY_MAX_LENGTH:
            raise HordeError(
                "BadRequest", f"Idempotency-Key is longer than {KUDOS_TRANSFER_IDEMPOTENCY_KEY_MAX_LENGTH} characters."
            )
        transferred = services.kudos_transfer_to(
            source=registered_caller(request, rc="KudosTransferFromAnon"),
            username=body.validated_data["username"],
            amount=body.validated_data["amount"],
            idempotency_key=idempotency_key,
        )
        return Response(self.KudosTransferOutputSerializer({"transferred": transferred}).data)


class SharedKeyInputSerializer(serializers.Serializer):
    """Upstream's SharedKeyInput. Every field is optional, and null is as absent (upstream's
    reqparse): a creation takes the defaults of those left out, a change changes only those sent.
    `expiry` is days from now, -1 for never."""

    kudos = serializers.IntegerField(
        min_value=SHARED_KEY_UNLIMITED, max_value=SHARED_KEY_MAX_KUDOS, required=False, allow_null=True
    )
    expiry = serializers.IntegerField(
        min_value=SHARED_KEY_UNLIMITED, max_value=SHARED_KEY_MAX_EXPIRY_DAYS, required=False, allow_null=True
    )
    name = serializers.CharField(min_length=3, max_length=255, required=False, allow_null=True)
    max_image_pixels = serializers.IntegerField(
        min_value=SHARED_KEY_UNLIMITED, max_value=4_194_304, required=False, allow_null=True
    )
    max_image_steps = serializers.IntegerField(
        min_value=SHARED_KEY_UNLIMITED, max_value=500, required=False, allow_null=True
    )
    # Upstream caps this at 500; here it goes to the text max_length this horde accepts (ADR 0065).
    max_text_tokens = serializers.IntegerField(
        min_value=SHARED_KEY_UNLIMITED, max_value=TEXT_MAX_LENGTH_RANGE[1], required=False, allow_null=True
    )

    def validate(self, attrs: dict) -> dict:
        return {name: value for name, value in attrs.items() if value is not None}


class SharedKeyDetailsSerializer(serializers.Serializer):
    id = serializers.CharField()
    username = serializers.CharField()
    name = serializers.CharField(required=False)
    kudos = serializers.IntegerField()
    expiry = serializers.CharField(required=False, help_text="RFC 822; absent when the key never expires.")
    utilized = serializers.IntegerField()
    max_image_pixels = serializers.IntegerField()
    max_image_steps = serializers.IntegerField()
    max_text_tokens = serializers.IntegerField()


class SimpleResponseSerializer(serializers.Serializer):
    message = serializers.CharField()


def _shared_key_or_401(key_id: str) -> SharedKey:
    key = shared_key_get(key_id)
    if key is None:
        raise HordeError("InvalidAPIKey", services.SHARED_KEY_UNKNOWN_MESSAGE)
    return key


class SharedKeysView(APIView):
    """PUT /api/v2/sharedkeys: lend a new shared key (its id is the key)."""

    @extend_schema(
        request=SharedKeyInputSerializer,
        responses={
            200: SharedKeyDetailsSerializer,
            **refusals(s401=["InvalidAPIKey (a shared key)"], s403=["AnonForbidden", "Forbidden (too many keys)"],
                       s429=["RateLimited"]),
        },
    )
    def put(self, request):
        check_submit_rate_limits(
            request, scope="sharedkeys", limits_per_ip=settings.HORDE_SHARED_KEY_CREATE_RATE_LIMITS
        )
        serializer = SharedKeyInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        body = serializer.validated_data
        key = services.shared_key_create(
            user=registered_caller(request),
            kudos=body.get("kudos", SHARED_KEY_DEFAULT_KUDOS),
            expiry_days=body.get("expiry", SHARED_KEY_UNLIMITED),
            name=body.get("name"),
            max_image_pixels=body.get("max_image_pixels", SHARED_KEY_UNLIMITED),
            max_image_steps=body.get("max_image_steps", SHARED_KEY_UNLIMITED),
            max_text_tokens=body.get("max_text_tokens", SHARED_KEY_UNLIMITED),
        )
        return Response(shared_key_details(key))


class SharedKeyDetailView(APIView):
    """GET (anyone holding the id), PATCH and DELETE (its owner) /api/v2/sharedkeys/<id>."""

    def perform_authentication(self, request):
        # Lazy (DRF's documented hook): the GET reads no key, as upstream's.
        pass

    @extend_schema(responses={200: SharedKeyDetailsSerializer, **refusals(s401=["InvalidAPIKey (no such shared key)"])})
    def get(self, request, key_id):
        return Response(shared_key_details(_shared_key_or_401(key_id)))

    def _owned(self, request, key_id: str) -> SharedKey:
        key = _shared_key_or_401(key_id)
        owner = registered_caller(request)
        if key.user_id != owner.pk:
            raise HordeError(
                "Forbidden",
                f"Shared Key {key.pk} belongs to {key.user.unique_alias} and not to {owner.unique_alias}.",
                status=403,
            )
        return key

    @extend_schema(
        request=SharedKeyInputSerializer,
        responses={
            200: SharedKeyDetailsSerializer,
            **refusals(
                s400=["BadRequest", "NoSharedKeyModSelected"],
                s401=["InvalidAPIKey (no such shared key)"],
                s403=["AnonForbidden", "Forbidden (another's key)"],
            ),
        },
    )
    def patch(self, request, key_id):
        serializer = SharedKeyInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key = self._owned(request, key_id)
        if not serializer.validated_data:
            raise HordeError("NoSharedKeyModSelected", "No shared key modification selected!", status=400)
        key = services.shared_key_update(key=key, changes=dict(serializer.validated_data))
        return Response(shared_key_details(key))

    # 200 with a message, as upstream's (not drf-spectacular's 204 for a DELETE).
    @extend_schema(
        responses={
            200: SimpleResponseSerializer,
            **refusals(s401=["InvalidAPIKey (no such shared key)"], s403=["AnonForbidden", "Forbidden (another's key)"]),
        }
    )
    def delete(self, request, key_id):
        services.shared_key_delete(key=self._owned(request, key_id))
        return Response({"message": "OK"})
