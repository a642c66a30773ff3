#!/usr/bin/env python
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hordesite.settings")
    from django.core.management import execute_from_command_line

    from hordesite.local_state import make_database_dir

    make_database_dir()  # the embedded default's SQLite file's folder, before migrate creates the file
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
