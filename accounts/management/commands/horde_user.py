"""`python manage.py horde_user create NAME [--kudos N] [--trusted] [--moderator]`.

Creates a horde user and prints its API key alone on the last line of the output; only the key's
hash is stored, so the key cannot be shown again.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.models import HordeUser
from accounts.services import user_create

_USERNAME_MAX = HordeUser._meta.get_field("username").max_length


def _kudos(value: str) -> Decimal:
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise CommandError(f"--kudos must be a number, not {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise CommandError("--kudos must be a finite number of at least 0")
    return amount


class Command(BaseCommand):
    help = "Manage horde users. `create NAME` makes one and prints its API key on the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        create = actions.add_parser("create", help="create a user and print its new API key")
        create.add_argument("name", metavar="NAME", help="the user name (the horde shows it as NAME#ID)")
        create.add_argument("--kudos", default="0", metavar="N", help="starting kudos (default 0)")
        create.add_argument("--trusted", action="store_true", help="mark the user trusted")
        create.add_argument("--moderator", action="store_true", help="make the user a moderator")

    def handle(self, *args: object, **options: object) -> None:
        if options["action"] == "create":
            self._create(options)

    def _create(self, options: dict) -> None:
        name = str(options["name"]).strip()
        if not name:
            raise CommandError("NAME must not be empty")
        if _USERNAME_MAX and len(name) > _USERNAME_MAX:
            raise CommandError(f"NAME must be at most {_USERNAME_MAX} characters")
        kudos = _kudos(str(options["kudos"]))
        user, api_key = user_create(
            username=name,
            kudos=kudos,
            trusted=bool(options["trusted"]),
            moderator=bool(options["moderator"]),
        )
        roles = [role for role in ("trusted", "moderator") if getattr(user, role)]
        self.stdout.write(
            f"Created user {user.unique_alias} with {user.kudos} kudos"
            + (f" ({', '.join(roles)})" if roles else "")
            + ". Its API key (shown once, stored hashed):"
        )
        self.stdout.write(api_key)
