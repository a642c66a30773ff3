from django.contrib import admin

from accounts.models import HordeUser, KudosTransaction, KudosTransfer, SharedKey


class KudosTransactionInline(admin.TabularInline):
    model = KudosTransaction
    extra = 0
    can_delete = False
    readonly_fields = ("created", "kind", "amount", "request_id", "generation_id")
    ordering = ("-created",)
    max_num = 0


@admin.register(HordeUser)
class HordeUserAdmin(admin.ModelAdmin):
    list_display = ("id", "username", "kudos", "kudos_held", "trusted", "moderator", "concurrency", "created")
    list_filter = ("trusted", "moderator", "is_anonymous")
    search_fields = ("username",)
    readonly_fields = ("api_key_hash", "kudos", "kudos_held", "created")
    inlines = [KudosTransactionInline]


@admin.register(KudosTransaction)
class KudosTransactionAdmin(admin.ModelAdmin):
    list_display = ("created", "user", "kind", "amount", "request_id")
    list_filter = ("kind",)
    list_select_related = ("user",)
    readonly_fields = ("user", "amount", "kind", "request_id", "generation_id", "created")


@admin.register(SharedKey)
class SharedKeyAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "user", "kudos", "utilized", "expiry", "max_text_tokens", "created")
    list_select_related = ("user",)
    search_fields = ("name", "user__username")
    readonly_fields = ("utilized", "created")


@admin.register(KudosTransfer)
class KudosTransferAdmin(admin.ModelAdmin):
    list_display = ("created", "source", "dest", "amount", "shared_key_id")
    list_select_related = ("source", "dest")
    search_fields = ("source__username", "dest__username")
    readonly_fields = ("source", "dest", "shared_key_id", "amount", "idempotency_key", "created")
