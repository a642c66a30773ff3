from django.apps import AppConfig
from django.db.models.signals import pre_delete


class ChatConfig(AppConfig):
    name = "chat"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from chat.models import GenerationRequest
        from chat.object_store import delete_objects_with_request

        # A request's images and messages object go with its row, whatever deletes it.
        pre_delete.connect(delete_objects_with_request, sender=GenerationRequest, dispatch_uid="chat-objects")
