"""`python manage.py worker_owner_key NAME [--owner-username USERNAME]`.

Gives the owner of the worker NAME a new API key and prints it alone on the last line: the way back
for a worker whose owner's key is lost (only hashes are stored), since a worker's name belongs to
its owner and a new user's pops under that name are refused. The old key stops authenticating.
Exits NO_SUCH_WORKER (3) when no worker has that name, and refuses an owner of another username.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.services import user_api_key_replace
from workers.models import Worker

NO_SUCH_WORKER = 3


class Command(BaseCommand):
    help = "Give the owner of a worker a new API key (printed on the last line); the old key stops working."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", metavar="NAME", help="the worker's name")
        parser.add_argument(
            "--owner-username", metavar="USERNAME", default=None,
            help="refuse unless the worker's owner has this username (a guard against a name clash)",
        )

    def handle(self, *args: object, **options: object) -> None:
        name = str(options["name"])
        worker = Worker.objects.select_related("owner").filter(name=name).first()
        if worker is None:
            raise CommandError(f"no worker is named {name!r}", returncode=NO_SUCH_WORKER)
        expected = options["owner_username"]
        if expected is not None and worker.owner.username != expected:
            raise CommandError(
                f"the worker {name!r} belongs to {worker.owner.unique_alias}, not to a user named {expected!r}"
            )
        api_key = user_api_key_replace(user_id=worker.owner_id)
        self.stdout.write(f"A new API key for {worker.owner.unique_alias}, the owner of the worker {name!r}:")
        self.stdout.write(api_key)
