"""Reads on requests: status bodies, availability, queue and matching, the model list, and the
per-process snapshots and caches the status polls read. No selector imports chat.services.

The package names the reads the native text routes call (chat/api/views.py reads them as
`selectors.<name>`); everything else imports the read's own module.
"""

from chat.selectors.models import horde_performance, models_status
from chat.selectors.modes import horde_modes
from chat.selectors.status import request_get, request_status, text_status_body
from chat.selectors.text_stats import text_stats_models, text_stats_totals

__all__ = ["horde_modes", "horde_performance", "models_status", "request_get", "request_status", "text_stats_models", "text_stats_totals",
           "text_status_body"]
