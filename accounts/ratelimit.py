"""Fixed-window rate limits per client address, in Redis when configured, else in process.

Limits use upstream's notation: "2/second", "90/minute". A Redis failure lets the request through:
limits protect the horde, they must not take it down with Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import lru_cache

import redis
from django.conf import settings
from django.utils.module_loading import import_string

from contract.errors import HordeError

log = logging.getLogger(__name__)

PERIODS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


def parse_limit(text: str) -> tuple[int, int]:
    """'90/minute' -> (90, 60)."""
    count, _, period = text.strip().partition("/")
    period = period.strip().lower().rstrip("s") or "second"
    if period not in PERIODS or not count.strip().isdigit():
        raise ValueError(f"bad rate limit {text!r}: use N/second, N/minute, N/hour or N/day")
    return int(count), PERIODS[period]


@lru_cache(maxsize=1)
def _redis_client() -> redis.Redis | None:
    if not settings.REDIS_URL:
        return None
    # Short timeouts, and refused at once while this Redis is marked unavailable (hordesite/redis_guard.py).
    pool = import_string(settings.HORDE_REDIS_POOL_CLASS).from_url(settings.REDIS_URL, **settings.HORDE_REDIS_POOL_KWARGS)
    return redis.Redis(connection_pool=pool)


_local: dict[str, tuple[int, float]] = {}
_local_lock = threading.Lock()


def _hit(key: str, period: int) -> int:
    client = _redis_client()
    if client is not None:
        try:
            pipe = client.pipeline()
            pipe.incr(key)
            pipe.expire(key, period, nx=True)
            return int(pipe.execute()[0])
        except redis.RedisError:
            log.warning("rate limit store unreachable; letting %s through", key)
            return 0
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


def reset_local_counts() -> None:
    """Forget the in-process counts (the no-Redis store)."""
    with _local_lock:
        _local.clear()


def check_rate_limits(*, scope: str, client: str, limits: list[str]) -> None:
    """Count one hit against every limit; raise 429 when any is exceeded."""
    for text in limits:
        allowed, period = parse_limit(text)
        window = int(time.time() // period)
        if _hit(f"horde:rl:{scope}:{allowed}/{period}:{client}:{window}", period) > allowed:
            error = HordeError("RateLimited", f"Rate limit exceeded: {text} per client address.", status=429)
            error.headers["Retry-After"] = str(period - int(time.time()) % period or 1)
            raise error


def client_address(request) -> str:
    """The client's address: the socket peer, or X-Forwarded-For behind trusted proxies."""
    hops = settings.HORDE_TRUSTED_PROXY_COUNT
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if hops and forwarded:
        chain = [part.strip() for part in forwarded.split(",") if part.strip()]
        if chain:
            return chain[max(len(chain) - hops, 0)]
    return request.META.get("REMOTE_ADDR", "") or "unknown"
