"""Fixed-window rate limits of the generate routes, in Redis when configured, else in process.

Limits use upstream's (flask-limiter's) notation: "2/second", "90/minute". Each route counts apart
(its scope), per client address and per API key, as upstream's limiter does (spec chat_requests.md,
Rate limits; docs/adr/0015-rate-limits-behind-a-front.md). A Redis failure lets the request through:
limits protect the horde, they must not take it down with Redis.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import threading
import time
from dataclasses import dataclass
from functools import lru_cache

import redis
from django.conf import settings
from django.utils.module_loading import import_string

from accounts.models import shared_key_id_of
from contract.errors import HordeError
from contract.rate_limits import PROXIED_FOR_HEADER, PROXY_PASSKEY_HEADER
from contract.text import ANONYMOUS_API_KEY

log = logging.getLogger(__name__)

# flask-limiter's granularities (its `limits` library counts a month as 30 days, a year as 12 months).
PERIODS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "month": 2_592_000, "year": 31_104_000}
# One limit in flask-limiter notation: "5/second", "5 per second", "10/2 minutes", "1 per 3 hours".
_LIMIT = re.compile(r"\s*(\d+)\s*(?:/|\s+per\s+)\s*(\d+)?\s*(second|minute|hour|day|month|year)s?\s*", re.IGNORECASE)
_PROXY_PASSKEY_META = "HTTP_" + PROXY_PASSKEY_HEADER.upper().replace("-", "_")
_PROXIED_FOR_META = "HTTP_" + PROXIED_FOR_HEADER.upper().replace("-", "_")


def parse_limit(text: str) -> tuple[int, int]:
    """A flask-limiter limit as (allowed, window seconds): '90/minute' -> (90, 60), '10 per 2 hours'
    -> (10, 7200)."""
    match = _LIMIT.fullmatch(text)
    if match is None or int(match[2] or 1) == 0:
        raise ValueError(
            f"bad rate limit {text!r}: use flask-limiter notation, N/second, N per minute or N/M hours "
            "(second, minute, hour, day, month, year)"
        )
    return int(match[1]), int(match[2] or 1) * PERIODS[match[3].lower()]


def _redis_client() -> redis.Redis | None:
    return _client(settings.REDIS_URL) if settings.REDIS_URL else None


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    # Short timeouts, and refused at once while this Redis is marked unavailable (hordesite/redis_guard.py).
    pool = import_string(settings.HORDE_REDIS_POOL_CLASS).from_url(url, **settings.HORDE_REDIS_POOL_KWARGS)
    return redis.Redis(connection_pool=pool)


# Every window of one check counted in one round trip: each key's INCR in order (its expiry set
# once, NX), stopping at the first over its allowance, as counting them one call at a time did.
# Returns that window's position (1-based), 0 when none is over.
_COUNT_WINDOWS_SCRIPT = """
for i, key in ipairs(KEYS) do
  local count = redis.call('INCR', key)
  redis.call('EXPIRE', key, ARGV[2 * i - 1], 'NX')
  if count > tonumber(ARGV[2 * i]) then
    return i
  end
end
return 0
"""


@lru_cache(maxsize=1)
def _count_windows_script(client: redis.Redis):
    return client.register_script(_COUNT_WINDOWS_SCRIPT)


@dataclass(frozen=True, slots=True)
class _Window:
    """One limit's current fixed window for one client."""

    key: str
    allowed: int
    period: int
    text: str
    per: str


def _windows(*, scope: str, client: str, limits: list[str], per: str) -> list[_Window]:
    windows = []
    for text in limits:
        allowed, period = parse_limit(text)
        window = int(time.time() // period)
        windows.append(_Window(f"horde:rl:{scope}:{allowed}/{period}:{client}:{window}", allowed, period, text, per))
    return windows


_local: dict[str, tuple[int, float]] = {}
_local_lock = threading.Lock()


def _local_hit(key: str, period: int) -> int:
    now = time.monotonic()
    with _local_lock:
        count, expires = _local.get(key, (0, now + period))
        if now >= expires:
            count, expires = 0, now + period
        count += 1
        _local[key] = (count, expires)
        if len(_local) > 100_000:
            for stale in [k for k, (_, exp) in _local.items() if exp <= now]:
                del _local[stale]
        return count


def _first_exceeded(windows: list[_Window]) -> _Window | None:
    """Count one hit in each window, in order, up to the first over its allowance (returned)."""
    if not windows:
        return None
    client = _redis_client()
    if client is None:
        return next((w for w in windows if _local_hit(w.key, w.period) > w.allowed), None)
    args: list[int] = []
    for window in windows:
        args += [window.period, window.allowed]
    try:
        position = int(_count_windows_script(client)(keys=[w.key for w in windows], args=args))
    except redis.RedisError:
        log.warning("rate limit store unreachable; letting %s through", windows[0].key)
        return None
    return windows[position - 1] if position else None


def reset_local_counts() -> None:
    """Forget the in-process counts (the no-Redis store)."""
    with _local_lock:
        _local.clear()


def _refuse(window: _Window) -> None:
    error = HordeError("RateLimited", f"Rate limit exceeded: {window.text} per {window.per}.", status=429)
    error.headers["Retry-After"] = str(window.period - int(time.time()) % window.period or 1)
    raise error


# --- who is counted --------------------------------------------------------------------------------

# Passkeys this process made for the front mounted in it (hordesite/asgi.py): its in-process calls
# never leave the process, so no operator has to configure one for them.
_process_passkeys: set[str] = set()


def trust_process_passkey(passkey: str) -> None:
    """Know `passkey` in this process, as if it were listed in HORDE_PROXY_PASSKEYS."""
    if passkey:
        _process_passkeys.add(passkey)


def is_known_proxy_passkey(passkey: str) -> bool:
    known = [*settings.HORDE_PROXY_PASSKEYS, *_process_passkeys]
    return any(hmac.compare_digest(passkey.encode(), key.encode()) for key in known if key)


def _normalised_address(value: str) -> str | None:
    try:
        return ipaddress.ip_address(value.strip()).compressed
    except ValueError:
        return None


def peer_address(request) -> str:
    """The socket peer, or X-Forwarded-For behind HORDE_TRUSTED_PROXY_COUNT trusted proxies."""
    hops = settings.HORDE_TRUSTED_PROXY_COUNT
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if hops and forwarded:
        chain = [part.strip() for part in forwarded.split(",") if part.strip()]
        if chain:
            return chain[max(len(chain) - hops, 0)]
    return request.META.get("REMOTE_ADDR", "") or "unknown"


def client_address(request) -> str:
    """The address the rate limits count: the `Proxied-For` address of a request carrying a known
    proxy passkey, else the peer address. An unknown passkey, or none, leaves `Proxied-For` unread."""
    peer = peer_address(request)
    passkey = request.META.get(_PROXY_PASSKEY_META, "").strip()
    if not passkey:
        return peer
    if not is_known_proxy_passkey(passkey):
        log.info("unknown proxy passkey from %s: %s ignored", peer, PROXIED_FOR_HEADER)
        return peer
    forwarded = request.META.get(_PROXIED_FOR_META, "")
    address = _normalised_address(forwarded) if forwarded else None
    if address is None:
        if forwarded:
            log.info("known proxy %s forwarded %r, not an address: counted as itself", peer, forwarded[:64])
        return peer
    return address


@lru_cache(maxsize=8)
def _networks(entries: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries if entry.strip())


def is_whitelisted_service(address: str) -> bool:
    """Whether HORDE_WHITELISTED_SERVICE_IPS lists `address` (an address or a network)."""
    networks = _networks(tuple(settings.HORDE_WHITELISTED_SERVICE_IPS))
    if not networks:
        return False
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(parsed in network for network in networks)


# --- the generate routes' limits -------------------------------------------------------------------


def _shortest_and_longest(limits: list[str]) -> list[str]:
    if not limits:
        return []
    ordered = sorted(limits, key=lambda text: parse_limit(text)[1])
    return [ordered[0]] if len(ordered) == 1 else [ordered[0], ordered[-1]]


def chat_request_limits_per_ip() -> list[str]:
    """HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP and HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP; an unset one
    follows the text submit limit it stands beside (the short window the shortest of
    HORDE_TEXT_ASYNC_RATE_LIMITS, the long window the longest)."""
    short, long = (_shortest_and_longest(settings.HORDE_TEXT_ASYNC_RATE_LIMITS) + [None, None])[:2]
    long = long or short
    chosen = [
        settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP or short,
        settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP or long,
    ]
    return list(dict.fromkeys(text for text in chosen if text))


# The prefix an IPv6 client is counted by: a home or a cloud host is given a /64 of its own, so
# counting single addresses would give it 2**64 fresh allowances.
RATE_LIMIT_IPV6_PREFIX = 64


def rate_limit_subject(address: str) -> str:
    """What a client address is counted as: an IPv4 address itself (also written IPv4-mapped), an
    IPv6 address its /64 network, anything else as given."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped.compressed
    if isinstance(parsed, ipaddress.IPv6Address):
        return ipaddress.ip_network(f"{parsed}/{RATE_LIMIT_IPV6_PREFIX}", strict=False).compressed
    return parsed.compressed


def check_submit_rate_limits(request, *, scope: str, limits_per_ip: list[str]) -> str:
    """Count one submit of a generate route (its own scope): per client address (a whitelisted
    service address gets HORDE_WHITELISTED_SERVICE_RATE_LIMITS instead) and per API key (the
    anonymous key has its own, higher limit, since everyone without a key shares it). Raises 429;
    returns the counted client address."""
    address = client_address(request)
    if is_whitelisted_service(address):
        limits_per_ip = settings.HORDE_WHITELISTED_SERVICE_RATE_LIMITS
    key = request.META.get("HTTP_APIKEY", "").strip() or ANONYMOUS_API_KEY
    key_limits = (
        settings.HORDE_ANONYMOUS_KEY_RATE_LIMITS
        if key == ANONYMOUS_API_KEY
        else settings.HORDE_API_KEY_RATE_LIMITS
    )
    # A shared key is counted by its id: each spelling of it would otherwise have its own allowance.
    shared_key_id = shared_key_id_of(key)
    digest = hashlib.sha256((str(shared_key_id) if shared_key_id else key).encode()).hexdigest()
    # The address's windows, then the key's, in one round trip: a refusal by the address's limits
    # counts nothing against the key's, as when they were counted one call at a time.
    exceeded = _first_exceeded(
        _windows(scope=scope, client=rate_limit_subject(address), limits=limits_per_ip, per="client address")
        + _windows(scope=f"{scope}:key", client=digest, limits=key_limits, per="API key")
    )
    if exceeded is not None:
        _refuse(exceeded)
    return address


def validate_rate_limit_settings() -> None:
    """Refuse to start on a limit or whitelist entry that cannot be read."""
    from django.core.exceptions import ImproperlyConfigured

    limits = {
        "HORDE_TEXT_ASYNC_RATE_LIMITS": settings.HORDE_TEXT_ASYNC_RATE_LIMITS,
        "HORDE_SHARED_KEY_CREATE_RATE_LIMITS": settings.HORDE_SHARED_KEY_CREATE_RATE_LIMITS,
        "HORDE_KUDOS_TRANSFER_RATE_LIMITS": settings.HORDE_KUDOS_TRANSFER_RATE_LIMITS,
        "HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP": [settings.HORDE_CHAT_REQUEST_2SEC_LIMIT_PER_IP or "1/second"],
        "HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP": [
            settings.HORDE_CHAT_REQUEST_90MIN_LIMIT_PER_IP or "1/second"
        ],
        "HORDE_WHITELISTED_SERVICE_RATE_LIMITS": settings.HORDE_WHITELISTED_SERVICE_RATE_LIMITS,
        "HORDE_API_KEY_RATE_LIMITS": settings.HORDE_API_KEY_RATE_LIMITS,
        "HORDE_ANONYMOUS_KEY_RATE_LIMITS": settings.HORDE_ANONYMOUS_KEY_RATE_LIMITS,
    }
    try:
        for name, texts in limits.items():
            for text in texts:
                try:
                    parse_limit(text)
                except ValueError as error:
                    raise ImproperlyConfigured(f"{name}: {error}") from None
        _networks(tuple(settings.HORDE_WHITELISTED_SERVICE_IPS))
    except ValueError as error:
        raise ImproperlyConfigured(f"HORDE_WHITELISTED_SERVICE_IPS: {error}") from None
