from django.contrib import admin

from chat.models import Generation, GenerationRequest


class GenerationInline(admin.TabularInline):
    model = Generation
    extra = 0
    can_delete = False
    fields = ("id", "worker", "model", "state", "kudos", "created", "lease_expires_at", "finished_at", "text")
    readonly_fields = fields
    max_num = 0


@admin.register(GenerationRequest)
class GenerationRequestAdmin(admin.ModelAdmin):
    list_display = ("id", "user", "is_chat", "n", "jobs_waiting", "max_length", "faulted", "cancelled",
                    "consumed_kudos", "created", "expires_at")
    list_filter = ("is_chat", "faulted", "cancelled")
    list_select_related = ("user",)
    search_fields = ("id",)
    readonly_fields = ("id", "user", "priority", "queue_score", "kudos_quote", "kudos_held", "consumed_kudos",
                       "created", "expires_at")
    inlines = [GenerationInline]
