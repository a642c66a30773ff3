"""How a front tells the horde whose request it forwards (upstream's limiter, horde/apis/request_utils.py).

A front many users share calls the horde from one address. With `Proxy-Authorization` holding a
passkey the horde knows, the horde counts the address in `Proxied-For` instead of the front's for its
per-address rate limits; with an unknown or no passkey it ignores `Proxied-For`.
"""

from __future__ import annotations

PROXY_PASSKEY_HEADER = "Proxy-Authorization"
PROXIED_FOR_HEADER = "Proxied-For"
