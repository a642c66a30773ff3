"""kombu's filesystem transport (the embedded default's Celery broker), each message written whole.

kombu writes a message into the folder the worker reads under its final name, then fills it; a
worker polling at that moment takes the empty file, fails to decode it and stops
("Unrecoverable error: JSONDecodeError", kombu issue 1551). Beat publishes the sweeps while the
worker polls, so on the embedded default this stopped the worker now and then. Here a message is
written under a name the reader skips and renamed into place once complete (a rename within one
folder is atomic). A new exchange table kombu creates empty and then fills under its lock: a
publisher that reads it in between reads it again (get_table). Everything else is kombu's, through
the extension points of its virtual transport (Channel._put, Channel.get_table, Transport.Channel,
Transport.default_connection_params)."""

from __future__ import annotations

import os
import time
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

# Reads of an exchange table caught between its creation and its first write (5 ms apart).
TABLE_READ_ATTEMPTS = 200


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # The reader takes names of the form "<id>.<queue>.msg"; ".<name>.part" is not one.
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def get_table(self, exchange):
        for _ in range(TABLE_READ_ATTEMPTS - 1):
            try:
                return super().get_table(exchange)
            except ValueError:  # "" from a table being created: its binder fills it at once
                time.sleep(0.005)
        return super().get_table(exchange)


class Transport(filesystem.Transport):
    Channel = Channel

    @property
    def default_connection_params(self) -> dict:
        # Folders, not a host: with the virtual transport's default host, kombu logged "No hostname
        # was supplied. Reverting to default 'localhost'" at every start of the worker and beat.
        return {}
