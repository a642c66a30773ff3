from django.contrib import admin

from workers.models import Worker


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "threads", "max_length", "max_context_length", "speed", "maintenance",
                    "paused", "fulfilments", "last_check_in")
    list_filter = ("maintenance", "paused")
    list_select_related = ("owner",)
    search_fields = ("name", "bridge_agent")
    readonly_fields = ("id", "speed_samples", "speed", "kudos_earned", "fulfilments", "aborted_jobs",
                       "tokens_generated", "last_check_in", "created")
