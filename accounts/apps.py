from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "accounts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from accounts.api import schema  # noqa: F401  (registers the OpenAPI security scheme)
        from accounts.ratelimit import validate_rate_limit_settings

        validate_rate_limit_settings()  # a mistyped limit fails at start, not as a 500 per submit
