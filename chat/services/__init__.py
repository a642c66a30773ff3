"""Writes on requests and generations, one module per operation (create_text, create_chat, pop,
submit, progress, cancel, faults, maintenance, sweeps, front_lease; admission is what both
creations share). Every kudos movement commits in the transaction
that stores what it pays for.

The package names the operations the native text routes call (chat/api/views.py reads them as
`services.<name>`); everything else imports the operation's own module.
"""

from chat.services.cancel import request_cancel
from chat.services.create_text import TextRequestInput, text_request_create
from chat.services.maintenance import horde_modes_set

__all__ = ["TextRequestInput", "horde_modes_set", "request_cancel", "text_request_create"]
