"""Writes on requests and generations, one module per operation (create_text, create_chat, pop,
submit, progress, cancel, sweeps, front_lease). Every kudos movement commits in the transaction
that stores what it pays for.

The package names the operations the native text routes call (chat/api/views.py reads them as
`services.<name>`); everything else imports the operation's own module.
"""

from chat.services.create_text import TextRequestInput, horde_modes_set, request_cancel, text_request_create

__all__ = ["TextRequestInput", "horde_modes_set", "request_cancel", "text_request_create"]
